"""`soak`: mixed load against `tandem serve` for a set time, with faults injected.

    python -m benchmarks soak --duration 660 --model default --concurrency 8 --max-tokens 64 \\
        --tandem-args "--max-num-seqs 4 --max-waiting-requests 2"
    python -m benchmarks soak --duration 600 --url http://127.0.0.1:8000 --no-kill

Workers send completions and chat, streamed and not, with small max_tokens. Mixed in: clients
that disconnect at a random point (mid-stream, or while waiting for a whole answer), malformed
requests (bad JSON, wrong types, token ids outside the vocabulary, lone surrogates, huge n), and,
every --kill-every seconds, a SIGKILL of the engine core (its pid from GET /v1/engine; the server
restarts it). At the end it waits for the server to be healthy and idle and prints the counts:

    sent          requests started
    completed     answered in full (200 with a finish reason; a stream ending in [DONE])
    errors        answered with an error in the OpenAI shape, or a final SSE error event
                  (expected for malformed requests, overload and while an engine restarts)
    disconnected  abandoned by the client on purpose (part of the fault mix)
    lost          none of the above within --deadline; must be 0
    failed_by_engine_death
                  errors with code engine_down: requests the server gave up on because an
                  engine died. With request resumes on (the default) it must be 0
                  (--allow-engine-failures for a server run with --max-request-resumes 0)

and checks that nothing was left behind: the frontend admits and routes nothing, the engine has
nothing running or waiting, every KV block is free and the integrity check passes. Exit status
0 only if nothing was lost or failed by engine death and those checks pass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, format_table, write_json
from benchmarks.servers import Server, context_bound, free_port, start, stop, tandem_serve_command

MALFORMED: list[tuple[str, bytes]] = [
    ("invalid-json", b'{"prompt": "hi", "max_tokens": '),
    ("not-utf8", b'{"prompt": "\xff\xfe", "max_tokens": 4}'),
    ("lone-surrogate", b'{"prompt": "\\udc80", "max_tokens": 4}'),
    ("wrong-type", b'{"prompt": "hi", "max_tokens": "many"}'),
    ("out-of-vocab", b'{"prompt": [[99999999]], "max_tokens": 4}'),
    ("huge-n", b'{"prompt": "hi", "n": 1000000, "max_tokens": 4}'),
    ("huge-max-tokens", b'{"prompt": "hi", "max_tokens": 1000000000000}'),
    ("nan", b'{"prompt": "hi", "temperature": NaN}'),
    ("empty-prompt", b'{"prompt": "", "max_tokens": 4}'),
    ("deep-nesting", b"[" * 5000),
]
COUNTS = ("sent", "completed", "errors", "disconnected", "lost", "failed_by_engine_death")


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    errors: int = 0
    disconnected: int = 0
    lost: int = 0
    failed_by_engine_death: int = 0
    engine_kills: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    lost_kinds: Counter[str] = field(default_factory=Counter)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1
        if kind.endswith(":engine_down"):
            self.failed_by_engine_death += 1

    def lose(self, kind: str) -> None:
        self.lost += 1
        self.lost_kinds[kind] += 1

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if isinstance(v, int)}

    @property
    def accounted(self) -> bool:
        return self.completed + self.errors + self.disconnected + self.lost == self.sent


# ---- one request --------------------------------------------------------------------------------


def normal_body(rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5}
    body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.5:
        return "/v1/chat/completions", body | {
            "messages": [{"role": "user", "content": f"Tell me a fact about {rng.randrange(999)}."}]
        }
    return "/v1/completions", body | {"prompt": f"Item {rng.randrange(10**6)}: the"}


def error_kind(status: int, payload: Any) -> str | None:
    """'STATUS:code' for an answer in the OpenAI error shape, else None."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return f"{status}:{payload['error'].get('code') or payload['error'].get('type')}"
    return None


def retry_after(status: int, headers: Any) -> float:
    """Seconds a well-behaved client waits before its next request after this answer."""
    try:
        return float(headers.get("Retry-After", 0)) if status == 503 else 0.0
    except ValueError:
        return 0.0


def classify_stream(events: list[str], tally: Tally) -> None:
    """Tally a finished stream's SSE lines: completed, an error event, or lost."""
    if not events or events[-1] != "data: [DONE]":
        tally.lose("stream-without-done")
        return
    chunks = [_json(e[len("data: ") :].encode()) for e in events[:-1]]
    if chunks and isinstance(chunks[-1], dict) and "error" in chunks[-1]:
        err = chunks[-1]["error"]
        tally.error(f"sse:{err.get('code') or err.get('type')}")
    elif any(ch.get("finish_reason") for c in chunks if c for ch in c.get("choices", [])):
        tally.completed += 1
    else:
        tally.lose("stream-without-finish")


async def send_whole(client: Any, path: str, body: dict, tally: Tally) -> float:
    r = await client.post(path, json=body)
    payload = _json(r.content)
    if r.status_code == 200 and payload and all(c.get("finish_reason") for c in payload["choices"]):
        tally.completed += 1
    elif r.status_code >= 400 and (kind := error_kind(r.status_code, payload)):
        tally.error(kind)
    else:
        tally.lose(f"bad-answer-{r.status_code}")
    return retry_after(r.status_code, r.headers)


async def send_stream(
    client: Any, path: str, body: dict, tally: Tally, hang_up_after: int | None
) -> float:
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            kind = error_kind(r.status_code, _json(await r.aread()))
            tally.error(kind) if kind else tally.lose(f"bad-status-{r.status_code}")
            return retry_after(r.status_code, r.headers)
        events: list[str] = []
        async for line in r.aiter_lines():
            if line:
                events.append(line)
            if hang_up_after is not None and len(events) > hang_up_after:
                tally.disconnected += 1
                return 0.0
    classify_stream(events, tally)
    return 0.0


async def send_malformed(client: Any, rng: random.Random, tally: Tally) -> float:
    name, raw = rng.choice(MALFORMED)
    headers = {"Content-Type": "application/json"}
    r = await client.post("/v1/completions", content=raw, headers=headers)
    kind = error_kind(r.status_code, _json(r.content))
    if kind and (400 <= r.status_code < 500 or r.status_code == 503):  # 503: engine restarting
        tally.error(kind)
    else:
        tally.lose(f"malformed-{name}-{r.status_code}")
    return retry_after(r.status_code, r.headers)


async def one_request(client: Any, rng: random.Random, args: Any, tally: Tally) -> float:
    """Send one request of the mix and tally how it ended; returns its Retry-After (or 0)."""
    import httpx

    tally.sent += 1
    roll = rng.random()
    try:
        if roll < args.malformed_rate:
            return await asyncio.wait_for(send_malformed(client, rng, tally), args.deadline)
        path, body = normal_body(rng, args.max_tokens)
        disconnect = roll < args.malformed_rate + args.disconnect_rate
        if body["stream"]:
            hang_up = rng.randrange(0, 6) if disconnect else None
            sent = send_stream(client, path, body, tally, hang_up)
            return await asyncio.wait_for(sent, args.deadline)
        if disconnect:  # give up on a whole answer after a random wait (if it is not done)
            try:
                wait = rng.uniform(0.05, 1.0)
                return await asyncio.wait_for(send_whole(client, path, body, tally), wait)
            except TimeoutError:
                tally.disconnected += 1
                return 0.0
        return await asyncio.wait_for(send_whole(client, path, body, tally), args.deadline)
    except TimeoutError:
        tally.lose("deadline")
    except httpx.HTTPError as exc:
        tally.lose(type(exc).__name__)
    return 0.0


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


# ---- load and faults ----------------------------------------------------------------------------


async def worker(client: Any, seed: int, args: Any, stop_at: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        pause = await one_request(client, rng, args, tally)
        if pause:  # 503 with Retry-After: back off as the OpenAI clients do
            await asyncio.sleep(min(pause, 5.0))


async def engine_killer(client: Any, args: Any, stop_at: float, tally: Tally) -> None:
    """SIGKILL the engine core every --kill-every seconds, once the server is healthy again."""
    while time.monotonic() + args.kill_every < stop_at:
        await asyncio.sleep(args.kill_every)
        await wait_healthy(client, 300)
        pid = (await client.get("/v1/engine")).json().get("pid")
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                tally.engine_kills += 1
                print(f"[soak] {elapsed(args)} killed engine pid {pid}", flush=True)


async def wait_healthy(client: Any, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"server not healthy within {timeout:.0f} s")


async def report_progress(args: Any, stop_at: float, tally: Tally) -> None:
    while time.monotonic() < stop_at:
        await asyncio.sleep(min(60.0, max(stop_at - time.monotonic(), 0.0)))
        print(f"[soak] {elapsed(args)} {tally.counts()}", flush=True)


def elapsed(args: Any) -> str:
    return f"t={time.monotonic() - args.started_at:.0f}s"


async def run_load(args: Any, base_url: str) -> Tally:
    import httpx

    tally = Tally()
    stop_at = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.deadline, limits=limits) as client:
        tasks = [
            worker(client, args.seed + i, args, stop_at, tally) for i in range(args.concurrency)
        ]
        if args.kill_every > 0:
            tasks.append(engine_killer(client, args, stop_at, tally))
        tasks.append(report_progress(args, stop_at, tally))
        await asyncio.gather(*tasks)
    return tally


# ---- the end state ------------------------------------------------------------------------------


def check_end_state(base_url: str, timeout: float = 300.0) -> dict[str, Any]:
    """Healthy, and no state left in the frontend or the engine (when its address is local)."""
    import httpx

    deadline = time.monotonic() + timeout
    if not wait_until(lambda: _healthy(base_url), deadline):
        return {"healthy": False}
    gauges: dict[str, float] = {}
    frontend_idle = wait_until(lambda: _frontend_idle(base_url, gauges), deadline)
    info = httpx.get(f"{base_url}/v1/engine", timeout=10).json()
    out = {"healthy": True, "frontend_idle": frontend_idle}
    out["engine_restarts"] = gauges.get("restarts", 0.0)
    return out | engine_state(info["address"], deadline)


def wait_until(ready: Any, deadline: float) -> bool:
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _healthy(base_url: str) -> bool:
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    return False


def _frontend_idle(base_url: str, seen: dict[str, float]) -> bool:
    """Whether the API process admits and routes nothing; ``seen["restarts"]`` gets the
    engine restarts it counted."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("tandem_")
        for s in family.samples
    }
    seen["restarts"] = values.get("tandem_engine_restarts_total", 0.0)
    admitted = values.get("tandem_frontend_sequences_admitted", 0)
    return admitted == 0 and values.get("tandem_frontend_engine_requests", 0) == 0


def engine_state(address: str, deadline: float) -> dict[str, Any]:
    from protocol.client import EngineClient
    from protocol.messages import ControlKind

    if not address.startswith("ipc://"):
        return {}
    with EngineClient(address) as client:
        client.connect(timeout=60)
        state: dict[str, Any] = {}

        def idle_and_free() -> bool:
            s = client.control(ControlKind.STATS).stats
            state["engine_idle"] = s.num_running == 0 and s.num_waiting == 0
            used = s.num_total_blocks - s.num_free_blocks - s.num_cached_blocks
            state["kv_all_free"] = used == 0
            return state["engine_idle"] and state["kv_all_free"]

        wait_until(idle_and_free, deadline)
        state["kv_integrity"] = client.control(ControlKind.CHECK_INTEGRITY).ok
    return state


# ---- the command --------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--model", default="default", help="model of the server started here")
    p.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens sent")
    p.add_argument("--kill-every", type=float, default=60.0, help="0: never kill the engine")
    p.add_argument("--no-kill", dest="kill_every", action="store_const", const=0.0)
    p.add_argument("--disconnect-rate", type=float, default=0.15)
    p.add_argument("--malformed-rate", type=float, default=0.10)
    p.add_argument("--deadline", type=float, default=180.0, help="seconds before 'lost'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the provenance and the result here")
    p.add_argument(
        "--allow-engine-failures", action="store_true",
        help="do not fail on requests failed by an engine's death (a server run with "
        "--max-request-resumes 0 fails them by design)",
    )  # fmt: skip


def passed(tally: Tally, end: dict[str, Any], code: int | None, allow_failures: bool) -> bool:
    """Nothing lost, every count accounted for, a clean end state and a clean exit."""
    clean = all(v for k, v in end.items() if k != "engine_restarts")
    deaths_ok = tally.failed_by_engine_death == 0 or allow_failures
    return tally.lost == 0 and clean and deaths_ok and tally.accounted and code in (None, 0)


def run(args: argparse.Namespace) -> int:
    args.started_at = time.monotonic()
    server = None
    if args.url is None:
        port = free_port()
        extra = ["--log-level", "WARNING", *shlex.split(args.tandem_args)]
        command = tandem_serve_command(args.model, port, context_bound(args.model, 2048), extra)
        server = Server("tandem", command, port)
        start(server, Path(tempfile.mkdtemp(prefix="tandem-soak-")) / "tandem-server.log")
    base = args.url or server.url
    try:
        tally = asyncio.run(run_load(args, base))
        end = check_end_state(base)
    finally:
        code = stop(server) if server is not None else None
    result = {"counts": tally.counts(), "error_kinds": dict(tally.error_kinds.most_common())}
    result |= {"lost_kinds": dict(tally.lost_kinds), "end_state": end, "server_exit_code": code}
    provenance = Provenance.here(args.argv)
    print(f"\n{provenance.format()}")
    if server is not None:
        print(f"server: {server.shown()}")
    counts = tally.counts()
    row = [str(counts[k]) for k in COUNTS] + [str(tally.engine_kills)]
    print(format_table([*COUNTS, "engine_kills"], [row]))
    print(json.dumps({k: v for k, v in result.items() if k != "counts"}, indent=2))
    if args.json:
        write_json(args.json, provenance, result)
    return 0 if passed(tally, end, code, args.allow_engine_failures) else 1
