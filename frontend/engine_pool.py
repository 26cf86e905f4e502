"""Data parallelism: engine cores behind one frontend (`tandem serve --data-parallel-size N`).

Each engine core is its own process on its own private ipc address with a full copy of the model
(and, where the machine has enough GPUs, its own ``--tensor-parallel-size`` of them, through
CUDA_VISIBLE_DEVICES). The frontend holds one AsyncEngine per engine core and puts an EnginePool
in front of them, which the serving code uses exactly as it uses one engine:

- ``open()`` sends all engine requests of one HTTP request (its prompts and its n choices) to one
  engine core, the live one with the fewest unfinished engine requests (ties rotate), so they
  share that engine's prefix cache;
- an abort reaches the owning engine through that engine's RequestGroup, which ``open()`` returned;
- ``healthy`` only while every engine core answers; while some are down, new requests go to the
  others (``dead_reason`` is set only when none is left), and each engine's supervisor restarts
  its own process;
- ``stats()`` sums the engines' counters for the existing gauges, and records each engine's under
  an ``engine`` label (``tandem_engine_*{engine="i"}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from frontend.engine_client import AsyncEngine, EngineDeadError, EngineRequest, RequestGroup
from frontend.launcher import EngineProcess, die_with_parent
from protocol.messages import Ready, Stats

logger = logging.getLogger("tandem.frontend")


class EngineGauges:
    """Per-engine metric families (label ``engine``), in the server's registry."""

    def __init__(self, registry: Any, model_name: str, num_engines: int) -> None:
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.up = gauge("tandem_engine_up", "1 while this engine core answers, else 0.")
        self.running = gauge("tandem_engine_num_requests_running", "Requests running.")
        self.waiting = gauge("tandem_engine_num_requests_waiting", "Requests waiting.")
        self.kv_usage = gauge(
            "tandem_engine_kv_cache_usage_perc", "KV-cache blocks held by requests, as a fraction."
        )
        self.in_flight = gauge(
            "tandem_engine_requests_in_flight", "Engine requests routed here and not finished."
        )
        self.routed = Counter(
            "tandem_engine_requests_routed",
            "Engine requests routed here.",
            labels,
            registry=registry,
        )
        self._names = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]
        for name in self._names:  # every engine present from the first scrape
            self.routed.labels(**name)

    def record_routed(self, index: int, count: int) -> None:
        self.routed.labels(**self._names[index]).inc(count)

    def record(self, index: int, engine: AsyncEngine, stats: Stats | None) -> None:
        name = self._names[index]
        self.up.labels(**name).set(1.0 if engine.healthy else 0.0)
        self.in_flight.labels(**name).set(engine.num_requests)
        if stats is not None:
            self.running.labels(**name).set(stats.num_running)
            self.waiting.labels(**name).set(stats.num_waiting)
            used = stats.num_total_blocks - stats.num_free_blocks - stats.num_cached_blocks
            self.kv_usage.labels(**name).set(used / max(stats.num_total_blocks, 1))


class EnginePool:
    """Several engine connections behind AsyncEngine's interface (see the module docstring)."""

    def __init__(self, engines: Sequence[AsyncEngine]) -> None:
        self.engines = list(engines)
        self.gauges: EngineGauges | None = None
        self._next = 0  # where the next tie-break starts

    # ---- state --------------------------------------------------------------------------------

    @property
    def ready(self) -> Ready:
        """One engine's handshake, with the pool's capacity: the sums of KV blocks and of
        running sequences, and the smallest max_model_len."""
        readies = [e.ready for e in self.engines if e.ready is not None]
        return dataclasses.replace(
            readies[0],
            max_model_len=min(r.max_model_len for r in readies),
            num_kv_blocks=sum(r.num_kv_blocks for r in readies),
            max_num_seqs=sum(r.max_num_seqs for r in readies),
        )

    @property
    def healthy(self) -> bool:
        return all(e.healthy for e in self.engines)

    @property
    def dead_reason(self) -> str | None:
        """Set only when no engine core can take a request."""
        if any(e.dead_reason is None for e in self.engines):
            return None
        return "; ".join(f"engine {i}: {e.dead_reason}" for i, e in enumerate(self.engines))

    @property
    def num_requests(self) -> int:
        return sum(e.num_requests for e in self.engines)

    # ---- routing ------------------------------------------------------------------------------

    def pick(self) -> int:
        """The live engine with the fewest unfinished requests; ties rotate."""
        n = len(self.engines)
        live = [i for i, e in enumerate(self.engines) if e.dead_reason is None] or list(range(n))
        best = min(live, key=lambda i: (self.engines[i].num_requests, (i - self._next) % n))
        self._next = (best + 1) % n
        return best

    def open(self, requests: Sequence[EngineRequest]) -> RequestGroup:
        """The requests go to one engine (see ``pick``); its group aborts them there."""
        index = self.pick()
        if self.gauges is not None:
            self.gauges.record_routed(index, len(requests))
        return self.engines[index].open(requests)

    # ---- control ------------------------------------------------------------------------------

    async def stats(self, timeout: float = 2.0) -> Stats | None:
        """Every live engine's counters, summed; each is also recorded under its label."""
        live = [i for i, e in enumerate(self.engines) if e.dead_reason is None]
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core")
        replies = await asyncio.gather(
            *(self.engines[i].stats(timeout) for i in live), return_exceptions=True
        )
        got: list[Stats] = []
        for i, reply in zip(live, replies, strict=True):
            stats = reply if isinstance(reply, Stats) else None
            if self.gauges is not None:
                self.gauges.record(i, self.engines[i], stats)
            if stats is not None:
                got.append(stats)
        if not got:
            failure = next((r for r in replies if isinstance(r, BaseException)), None)
            raise failure or EngineDeadError("no engine core answered")
        return Stats(*(sum(getattr(s, f.name) for s in got) for f in dataclasses.fields(Stats)))

    async def close(self, reason: str = "the frontend is shutting down") -> None:
        await asyncio.gather(*(e.close(reason) for e in self.engines))


class EngineSlot:
    """What EngineSupervisor needs of a serving context (``engine`` and ``metrics``), for one
    engine of a pool: a restart swaps that engine's connection only."""

    def __init__(self, pool: EnginePool, index: int, metrics: Any) -> None:
        self.pool, self.index, self.metrics = pool, index, metrics

    @property
    def engine(self) -> AsyncEngine:
        return self.pool.engines[self.index]

    @engine.setter
    def engine(self, engine: AsyncEngine) -> None:
        self.pool.engines[self.index] = engine


class SlicedEngineProcess(EngineProcess):
    """An engine process that sees only its own GPUs (CUDA_VISIBLE_DEVICES), restarts included."""

    def __init__(self, *args: Any, visible_devices: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_devices}

    def start(self) -> None:
        logger.info("starting an engine core on GPUs %s", self.env["CUDA_VISIBLE_DEVICES"])
        self.process = subprocess.Popen(self.argv, preexec_fn=die_with_parent(), env=self.env)


def gpu_slices(num_engines: int, per_engine: int, device: str) -> list[str] | None:
    """Each engine's CUDA_VISIBLE_DEVICES, or None where there are too few GPUs to give each its
    own (then they share what the frontend sees)."""
    if device == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())] if device != "cpu" else []
    if not ids:
        return None
    if len(ids) < num_engines * per_engine:
        logger.warning(
            "%d engine cores x %d GPUs each need %d GPUs, %d visible: they share them",
            num_engines, per_engine, num_engines * per_engine, len(ids),
        )  # fmt: skip
        return None
    return [",".join(ids[i * per_engine : (i + 1) * per_engine]) for i in range(num_engines)]


def without_flag(flags: list[str], flag: str) -> list[str]:
    """``flags`` less ``flag`` and its value."""
    out, skip = [], False
    for item in flags:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        else:
            out.append(item)
    return out


# ---- `tandem serve --data-parallel-size N` ----------------------------------------------------


def engine_processes(args: argparse.Namespace, engine_model: str) -> list[EngineProcess]:
    """The --data-parallel-size engine cores, each on its own private ipc address and, where
    there are enough GPUs, its own slice of them; not started yet."""
    from frontend.launcher import engine_flags
    from protocol.address import private_ipc_address

    n = args.data_parallel_size
    # Each engine core is one of the N: it runs with the default data_parallel_size of 1.
    flags = without_flag(engine_flags(args), "--data-parallel-size")
    slices = gpu_slices(n, args.tensor_parallel_size, args.device)
    procs: list[EngineProcess] = []
    for i in range(n):
        address = private_ipc_address(f"engine{i}")
        common = (engine_model, flags, address, args.log_level, True)
        if slices is None:
            procs.append(EngineProcess(*common))
        else:
            procs.append(SlicedEngineProcess(*common, visible_devices=slices[i]))
    return procs


def run(args: argparse.Namespace) -> int:
    """`tandem serve` with --data-parallel-size > 1 (called by frontend/serve.py)."""
    from engine_core.loader import resolve_for_serving
    from frontend.serve import _exit_on_signal

    engine_model, model_dir = resolve_for_serving(args.model)
    procs = engine_processes(args, engine_model)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so the finally below runs on SIGTERM too
    try:
        for proc in procs:
            proc.start()
        asyncio.run(serve(args, model_dir, procs))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, TimeoutError) as exc:
        logger.error("an engine core did not come up: %s", exc)
        return 1
    finally:
        for proc in procs:
            proc.stop()
        logger.info("stopped")
    return 0


async def serve(args: argparse.Namespace, model_dir: Path, procs: list[EngineProcess]) -> None:
    """Handshake with every engine core, then run uvicorn over the pool until a signal."""
    import uvicorn

    from frontend.launcher import connect_engine
    from frontend.serve import build, load_tokenizer
    from frontend.server import build_app

    loop = asyncio.get_running_loop()
    tokenizer = loop.run_in_executor(None, load_tokenizer, model_dir)  # while the engines load
    pool = EnginePool([])
    supervisors: list[asyncio.Task[None]] = []
    try:
        for proc in procs:  # they load in parallel; the handshakes just wait for each in turn
            pool.engines.append(
                await connect_engine(proc, args.engine_start_timeout, args.engine_timeout)
            )
        state = build(args, model_dir, procs[0].address, procs[0], pool, await tokenizer)
        engines_info = describe_pool(
            state, pool, [p.address for p in procs], [p.pid for p in procs]
        )
        if args.restart_engine:
            supervisors = start_supervisors(args, pool, procs, state.serving.metrics, engines_info)
        config = uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.access_log,
            timeout_graceful_shutdown=5,
        )
        announce(args, pool, procs)
        await uvicorn.Server(config).serve()
    finally:
        for task in supervisors:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await pool.close()


def describe_pool(
    state: Any, pool: EnginePool, addresses: Sequence[Any], pids: Sequence[int | None]
) -> list[dict[str, Any]]:
    """Give the server's /metrics the pool's per-engine gauges and /v1/engine the list of its
    engine cores (returned: the supervisors keep each entry's pid current)."""
    serving = state.serving
    pool.gauges = EngineGauges(serving.metrics.registry, serving.served_model, len(pool.engines))
    engines_info = [{"address": str(a), "pid": pid} for a, pid in zip(addresses, pids, strict=True)]
    state.engine_info["engines"] = engines_info
    return engines_info


def start_supervisors(
    args: argparse.Namespace,
    pool: EnginePool,
    procs: list[EngineProcess],
    metrics: Any,
    engines_info: list[dict[str, Any]],
) -> list[asyncio.Task[None]]:
    from frontend.launcher import EngineSupervisor

    tasks = []
    for i, proc in enumerate(procs):
        slot = EngineSlot(pool, i, metrics)
        # The slot stands in for the serving context: the supervisor swaps this engine only.
        ctx: Any = slot
        supervisor = EngineSupervisor(
            proc, ctx, engines_info[i], args.engine_start_timeout, args.engine_timeout
        )
        tasks.append(asyncio.ensure_future(supervisor.run()))
    return tasks


def announce(args: argparse.Namespace, pool: EnginePool, procs: list[EngineProcess]) -> None:
    ready = pool.ready
    host = f"[{args.host}]" if ":" in args.host else args.host
    engines = "\n".join(
        f"  engine core {i}: {p.address} (pid {p.pid}); raw client: "
        f"tandem client --address {p.address}"
        for i, p in enumerate(procs)
    )
    print(
        f"tandem serve: model {args.served_model_name or args.model}, {len(procs)} engine cores "
        f"(max_model_len {ready.max_model_len}, {ready.num_kv_blocks} KV blocks in all)\n"
        f"  OpenAI API:  http://{host}:{args.port}/v1\n{engines}",
        flush=True,
    )
