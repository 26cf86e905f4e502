"""Client processes for the load generator (`--client-processes K`).

At a few hundred HTTP streams one Python process of httpx spends as long building requests and
parsing SSE as the server spends serving them, so the client's own event loop delays the times it
stamps (a first token the server wrote at once is read late). With K client processes the parent
still builds every run's workload and reports it; each worker process sends its share (request i
goes to worker i mod K) over its own connection pool and sends back its records.

Parent and workers speak JSON lines over the workers' stdin and stdout (plain values, no pickle):

    parent -> worker   {"args": {...}}                       once: the backend's settings
    worker -> parent   {"ready": true} | {"error": "..."}
    parent -> worker   {"run": INDEX, "specs": [...]}        one per run (warm-ups included)
    worker -> parent   {"t0": T, "cpu_share": S, "records": [...]}
                       (cut by Ctrl-C: those of its requests that had ended, "positions": [...])

``t0`` is the worker's run start on CLOCK_MONOTONIC (``time.perf_counter`` on Linux, one clock for
every process on the machine), so the parent puts all records on the earliest worker's timeline.
Runs are all-at-once bursts: every worker starts its share as soon as the parent's line arrives,
within a millisecond of the others.

Ctrl-C reaches the parent alone (each worker runs in a session of its own): the parent sends each
worker still running its share one SIGINT, and each answers with the records of its requests
that had ended, as a run in one process does. A worker also ends when the parent does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from common import event_loop
from loadgen.arrival import Arrival
from loadgen.backends import Clock, open_backend
from loadgen.metrics import RequestRecord
from loadgen.runner import RunInterrupted, RunPlan, run_once
from loadgen.workload import RequestSpec

# The flags a worker's backend needs; everything else stays with the parent.
_BACKEND_ARGS = (
    "backend", "url", "address", "api_key", "model", "temperature", "ignore_eos", "pretok",
    "output_interval", "request_timeout", "connect_timeout",
)  # fmt: skip
_LINE_LIMIT = 1 << 30  # a run's specs travel as one line: room for long prompts
# After Ctrl-C, how long the parent waits for a worker's records: its in-flight requests are
# cancelled at once, so only a worker that hangs takes this long (its records are then lost).
CUT_REPLY_TIMEOUT_S = 10.0


class ClientPool:
    """K worker processes; ``run`` sends a run's specs round-robin and merges their records."""

    def __init__(self, args: argparse.Namespace, count: int) -> None:
        self.count = count
        self.settings = {name: getattr(args, name) for name in _BACKEND_ARGS}
        self.settings["num_requests"] = -(-args.num_requests // count)  # its pool size
        self._procs: list[asyncio.subprocess.Process] = []
        self.busiest_cpu_share = 0.0  # the last run's most loaded worker (CPU s / wall s)

    async def start(self) -> None:
        for _ in range(self.count):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "loadgen.workers", str(os.getpid()),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=_LINE_LIMIT, cwd=str(Path(__file__).resolve().parents[2]),
                start_new_session=True,  # a terminal's Ctrl-C reaches the parent only
            )  # fmt: skip
            self._procs.append(proc)
            await _send(proc, {"args": self.settings})
        for proc in self._procs:
            reply = await _receive(proc)
            if "error" in reply:
                raise RuntimeError(f"a client process could not start: {reply['error']}")

    async def run(self, specs: list[RequestSpec], run_index: int) -> list[RequestRecord]:
        """Send ``specs`` from all workers at once; one record per spec, in spec order."""
        shares = [specs[i :: self.count] for i in range(self.count)]
        replies: list[dict[str, Any] | None] = [None] * self.count
        try:
            for proc, share in zip(self._procs, shares, strict=True):
                payload = [dataclasses.asdict(s) for s in share]
                await _send(proc, {"run": run_index, "specs": payload})
            for w, proc in enumerate(self._procs):
                replies[w] = await _receive(proc)
        except asyncio.CancelledError:  # Ctrl-C: asyncio.Runner cancels the main task
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the run ends with RunInterrupted instead
            await self._cut(replies)
            positions, records = self._merged(replies)
            raise RunInterrupted(records, len(specs), positions) from None
        positions, records = self._merged(replies)
        assert positions == list(range(len(specs))), "a worker lost a record"
        return records

    async def _cut(self, replies: list[dict[str, Any] | None]) -> None:
        """Ctrl-C in a run: one SIGINT to each worker yet to answer, then its answer (the
        records of its requests that had ended) into ``replies``; a worker that exits or
        does not answer in time adds none."""
        waiting = [w for w, reply in enumerate(replies) if reply is None]
        for w in waiting:
            if self._procs[w].returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._procs[w].send_signal(signal.SIGINT)
        deadline = time.monotonic() + CUT_REPLY_TIMEOUT_S  # one wait for all of them
        for w in waiting:
            left = max(deadline - time.monotonic(), 0.0)
            with contextlib.suppress(RuntimeError, TimeoutError, ValueError):
                replies[w] = await asyncio.wait_for(_receive(self._procs[w]), left)

    def _merged(
        self, replies: list[dict[str, Any] | None]
    ) -> tuple[list[int], list[RequestRecord]]:
        """The workers' records on one timeline, in the run's request order, with their
        positions in it (request i went to worker i mod K)."""
        got = [reply for reply in replies if reply is not None]
        if not got:
            self.busiest_cpu_share = 0.0  # no figure for this run
            return [], []
        t0 = min(reply["t0"] for reply in got)
        placed: list[tuple[int, RequestRecord]] = []
        for w, reply in enumerate(replies):
            if reply is None:
                continue
            positions = reply.get("positions", range(len(reply["records"])))
            for j, fields in zip(positions, reply["records"], strict=True):
                placed.append((w + j * self.count, _shifted(fields, reply["t0"] - t0)))
        placed.sort(key=lambda item: item[0])
        self.busiest_cpu_share = max(reply["cpu_share"] for reply in got)
        return [i for i, _ in placed], [rec for _, rec in placed]

    async def close(self) -> None:
        for proc in self._procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self._procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def _shifted(fields: dict[str, Any], offset: float) -> RequestRecord:
    """A worker's record on the common timeline (every time ``offset`` seconds later)."""
    rec = RequestRecord(**fields)
    rec.scheduled_at += offset
    if rec.submitted_at is not None:
        rec.submitted_at += offset
    rec.chunk_times = [t + offset for t in rec.chunk_times]
    if rec.ended_at is not None:
        rec.ended_at += offset
    return rec


async def _send(proc: asyncio.subprocess.Process, message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    await proc.stdin.drain()


async def _receive(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a client process exited (status {await proc.wait()})")
    return json.loads(line)


# ---- the worker process -------------------------------------------------------------------------


async def serve_runs() -> None:
    """Read settings, open the backend, then answer each run with its records until EOF."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    settings = json.loads(await reader.readline())["args"]
    args = argparse.Namespace(**settings, max_concurrency=None, sweep=None, conversations=None)
    clock = Clock()
    try:
        backend = await open_backend(args, clock)
    except Exception as exc:  # reported to the parent, which stops the benchmark
        _reply({"error": f"{type(exc).__name__}: {exc}"})
        return
    _reply({"ready": True})
    plan = RunPlan(Arrival("burst"), None, args.request_timeout, progress=False)
    try:
        while line := await reader.readline():
            message = json.loads(line)
            specs = [RequestSpec(**s) for s in message["specs"]]
            cpu, wall = time.process_time(), time.perf_counter()
            answer: dict[str, Any] = {}
            try:
                records = await run_once(backend, specs, plan, message["run"])
            except RunInterrupted as stop:  # the parent's SIGINT
                records, answer["positions"] = stop.finished, stop.positions
            cpu_share = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
            answer["t0"], answer["cpu_share"] = clock.origin, cpu_share
            answer["records"] = [dataclasses.asdict(r) for r in records]
            _reply(answer)
    finally:
        await backend.close()


def end_with_parent(parent: int) -> None:
    """Have the kernel stop this worker when its parent (pid ``parent``, the load generator that
    started it) exits (Linux): a parent stopped at once (a second Ctrl-C, a kill) would
    otherwise leave it sending its share to the end."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before the call
        sys.exit(1)


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    end_with_parent(int(sys.argv[1]))
    # The parent's SIGINT is how a cut run ends here, whatever this process inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):  # a SIGINT between runs: end quietly
        event_loop.run(serve_runs())
