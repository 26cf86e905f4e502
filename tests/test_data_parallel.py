"""`tandem serve --data-parallel-size 2`: two engine cores behind one API process, and behind
two (--api-servers 2, each routing over both engines).

A mixed load (completions and chat, streaming and not, n=2, prompts of mixed lengths) must
complete every request with exactly the tokens it asked for, reach both engines, leave every KV
block of both engines free afterwards (STATS over each engine's own address), and give identical
greedy answers whichever engine served them. A client that disconnects has its request aborted
in the engine that owns it. /health and /metrics speak for every engine; the API processes'
routing counters add up to the requests sent. An engine core killed under two API processes is
restarted, both take it back, and SIGTERM leaves no process behind.
"""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.client import EngineClient
from protocol.messages import ControlKind, SchedulingPolicy, Stats
from tests.server_fixture import (
    Server,
    descendants,
    pid_alive,
    start_server,
    stop_server,
    wait_address_idle,
)

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
SERVE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
              "--max-num-seqs", "8"]  # fmt: skip
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hum"]  # fmt: skip
SAME_PROMPT = "Every engine must answer this one the same way:"


HEADER = "x-tandem-api-server"
IDLE_TIMEOUT_S = 30.0  # for an engine to finish and free its blocks after a load


@dataclass
class Deployment:
    server: Server
    api_processes: int


@pytest.fixture(scope="module", params=[1, 2], ids=["one-api-process", "two-api-processes"])
def dp_server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    api_processes = request.param
    extra = ["--data-parallel-size", "2", "--api-servers", str(api_processes)]
    extra += ["--scheduling-policy", "priority"]  # every engine ranks; all-0 requests as FCFS
    srv = start_server(
        tmp_path_factory.mktemp("serve-dp"), model=str(tiny_model_dir), args=SERVE_ARGS, extra=extra
    )
    family = descendants(srv.process.pid)  # the engine cores and any API processes
    try:
        yield Deployment(srv, api_processes)
    finally:
        family |= descendants(srv.process.pid)  # with the engines that tests had restarted
        stop_server(srv)  # exits 0 and engine 0 is gone
        left = {pid for pid in family if pid_alive(pid)}
        assert not left, f"processes outlived serve: {left}"


def engine_addresses(srv: Server) -> list[str]:
    return [e["address"] for e in srv.engine_info()["engines"]]


def engine_stats(address: str) -> Stats:
    with EngineClient(address) as client:
        client.connect(timeout=30)
        return client.control(ControlKind.STATS).stats


def each_api_process(
    deployment: Deployment, path: str, ready: Callable[[httpx.Response], bool] = lambda r: True
) -> dict[str, httpx.Response]:
    """API process index -> its answer to GET ``path``, once every process gave one that is
    ``ready``. Each GET is a new connection, which the kernel routes to an API process by a hash
    of its source port, so every process is reached after a few."""
    seen: dict[str, httpx.Response] = {}
    deadline = time.monotonic() + 120
    while len(seen) < deployment.api_processes:
        assert time.monotonic() < deadline, f"API processes ready: {sorted(seen)}"
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(deployment.server.base_url + path, timeout=10)
            if ready(r):
                seen[r.headers.get(HEADER, "0")] = r
        time.sleep(0.05)
    return seen


def scrape(deployment: Deployment) -> dict[str, dict[tuple[str, str], float]]:
    """Each API process's per-engine samples as (name, engine label) -> value."""
    return {
        index: {
            (s.name, s.labels["engine"]): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
            if "engine" in s.labels
        }
        for index, r in each_api_process(deployment, "/metrics").items()
    }


class HealthWatch:
    """GET /health every 50 ms on a thread until ``stop``: (status code, body status) each."""

    def __init__(self, base_url: str) -> None:
        self.seen: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self._thread.start()

    def _run(self, base_url: str) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{base_url}/health", timeout=10)
                status = r.json().get("status", "") if r.status_code == 200 else ""
                self.seen.append((r.status_code, status))
            time.sleep(0.05)

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.seen


def restarts(exposition: str) -> float | None:
    """One API process's tandem_engine_restarts_total."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "tandem_engine_restarts_total":
                return sample.value
    return None


def routed(metrics: dict[tuple[str, str], float]) -> list[float]:
    """Engine requests one API process routed to engine 0 and to engine 1."""
    return [metrics[("tandem_engine_requests_routed_total", str(i))] for i in range(2)]


# ---- the load ---------------------------------------------------------------------------------


def make_load(model: str) -> list[dict[str, Any]]:
    """16 requests: both routes, streaming or not, prompts of 1 to ~150 words, 1 to 24 tokens."""
    load = []
    for i in range(12):
        words = " ".join(WORDS[j % len(WORDS)] for j in range(1 + (i * 37) % 150))
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": 1 + (i * 7) % 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 2 == 1,
            "n": 2 if i % 5 == 0 else 1,
        }
        if i % 3 == 0:
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = words
        load.append(body)
    for _ in range(4):  # the same greedy request four times: spread over both engines
        body = {"model": model, "prompt": SAME_PROMPT, "max_tokens": 12, "temperature": 0}
        load.append({**body, "ignore_eos": True, "stream": False, "n": 1})
    return load


async def send(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[str], int]:
    """(each choice's text, completion tokens from usage) for one request."""
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        r = await http.post(route, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        texts = [c["text"] if "text" in c else c["message"]["content"] for c in data["choices"]]
        assert all(c["finish_reason"] == "length" for c in data["choices"])
        return texts, data["usage"]["completion_tokens"]
    stream_body = {**body, "stream_options": {"include_usage": True}}
    texts = [""] * body["n"]
    usage = None
    async with http.stream("POST", route, json=stream_body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                texts[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage") or usage
    assert usage is not None
    return texts, usage["completion_tokens"]


async def run_load(base_url: str, load: list[dict[str, Any]]) -> list[tuple[list[str], int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        return await asyncio.gather(*(send(http, body) for body in load))


def check_results(load: list[dict[str, Any]], results: list[tuple[list[str], int]]) -> None:
    """Every request got its n choices and exactly the tokens it asked for, and the one greedy
    prompt sent four times got one answer, whichever engine served it."""
    for body, (texts, completion_tokens) in zip(load, results, strict=True):
        assert len(texts) == body["n"]
        assert completion_tokens == body["max_tokens"] * body["n"], body
    same = [texts[0] for body, (texts, _) in zip(load, results, strict=True)
            if body.get("prompt") == SAME_PROMPT]  # fmt: skip
    assert len(same) == 4 and len(set(same)) == 1, same


def test_mixed_load_completes_on_both_engines_and_frees_every_block(
    dp_server: Deployment, tiny_model_dir: Path
) -> None:
    srv = dp_server.server
    addresses = engine_addresses(srv)
    assert len(addresses) == 2 and addresses[0] != addresses[1]
    steps_before = [engine_stats(a).num_steps for a in addresses]
    routed_before = {i: routed(m) for i, m in scrape(dp_server).items()}
    load = make_load(str(tiny_model_dir))
    check_results(load, asyncio.run(run_load(srv.base_url, load)))

    metrics = scrape(dp_server)
    # Engine requests each API process routed during the load, [to engine 0, to engine 1].
    sent = {i: [a - b for a, b in zip(routed(m), routed_before[i], strict=True)]
            for i, m in metrics.items()}  # fmt: skip
    assert sum(map(sum, sent.values())) == sum(body["n"] for body in load), sent
    assert all(sum(s) > 0 for s in sent.values()), f"an API process served nothing: {sent}"
    for i, address in enumerate(addresses):
        stats = wait_address_idle(address, IDLE_TIMEOUT_S)
        to_engine = sum(s[i] for s in sent.values())
        assert to_engine > 0 and stats.num_steps > steps_before[i], f"engine {i} got no work"

    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
    for m in metrics.values():
        assert [m[("tandem_engine_up", str(i))] for i in range(2)] == [1.0, 1.0]


def test_loadgen_over_zmq_drives_every_engine_behind_the_url(
    dp_server: Deployment, tmp_path: Path
) -> None:
    """`python -m loadgen --backend zmq --url` reads every engine's address from /v1/engine
    and spreads its requests over them: all complete, and each engine core looked up the
    prompts of some of them (their prefix-cache queries, tokens at admissions, grew by whole
    prompts, together all of them)."""
    srv = dp_server.server
    addresses = engine_addresses(srv)
    for address in addresses:
        wait_address_idle(address, IDLE_TIMEOUT_S)
    before = [engine_stats(a).counts.prefix_cache_queries for a in addresses]
    out, requests, prompt = tmp_path / "zmq.json", 12, 8
    cmd = [sys.executable, "-m", "loadgen", "--backend", "zmq", "--url", srv.base_url,
           "-n", str(requests), "--input-len", str(prompt), "--output-len", "4", "--ignore-eos",
           "--result-json", str(out), "--no-progress"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (result,) = json.loads(out.read_text())["runs"]
    assert result["summary"]["completed"] == requests, result["summary"]["errors"]
    looked_up = [
        wait_address_idle(a, IDLE_TIMEOUT_S).counts.prefix_cache_queries - b
        for a, b in zip(addresses, before, strict=True)
    ]
    assert all(n > 0 and n % prompt == 0 for n in looked_up), looked_up
    assert sum(looked_up) == requests * prompt, looked_up


def test_every_engine_ranks_requests_and_every_api_process_takes_a_priority(
    dp_server: Deployment,
) -> None:
    """--scheduling-policy reaches each engine core (their Ready says so), and each API process
    sends a request's priority on, whichever engine it picks."""
    for address in engine_addresses(dp_server.server):
        with EngineClient(address) as client:
            assert client.connect(timeout=30).scheduling_policy == SchedulingPolicy.PRIORITY
    url = f"{dp_server.server.base_url}/v1/completions"
    for priority in (-3, 0, 2**63 - 1, -(2**63)):
        body = {"prompt": "Hi", "max_tokens": 2, "priority": priority}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
    for address in engine_addresses(dp_server.server):
        wait_address_idle(address, IDLE_TIMEOUT_S)


def test_a_disconnect_aborts_in_the_owning_engine(
    dp_server: Deployment, tiny_model_dir: Path
) -> None:
    """Read two chunks of a long stream and hang up: the engine that owns the request stops it
    (far fewer steps than its max_tokens) and frees its blocks."""
    srv = dp_server.server
    addresses = engine_addresses(srv)
    for address in addresses:
        wait_address_idle(address, IDLE_TIMEOUT_S)
    before = [engine_stats(a).num_steps for a in addresses]
    max_tokens = MAX_MODEL_LEN - 16
    body = {"model": str(tiny_model_dir), "prompt": "Go on and on", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break
    after = [wait_address_idle(a, IDLE_TIMEOUT_S).num_steps for a in addresses]
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(d > 0 for d in deltas) == 1, f"one engine ran it: {deltas}"
    assert max(deltas) < max_tokens // 2, f"the abort never reached its engine: {deltas}"


def test_a_killed_engine_core_is_restarted_and_every_api_process_takes_it_back(
    dp_server: Deployment, tiny_model_dir: Path
) -> None:
    """SIGKILL engine 1: the server starts a new one on the same address; every API process
    publishes its new pid, answers healthy, and routes requests to it that complete."""
    srv = dp_server.server
    old_pid = srv.engine_info()["engines"][1]["pid"]
    health = HealthWatch(srv.base_url)
    os.kill(old_pid, signal.SIGKILL)

    def took_it_back(r: httpx.Response) -> bool:
        info = r.json()
        new_pid = info["engines"][1]["pid"]
        return info["healthy"] and new_pid != old_pid and pid_alive(new_pid)

    views = each_api_process(dp_server, "/v1/engine", took_it_back)
    # Engine 0 served all along: /health never said 503, and said which engine was down.
    seen = health.stop()
    assert all(code == 200 for code, _ in seen), seen
    assert any(status == "degraded" for _, status in seen), seen
    new_pids = {r.json()["engines"][1]["pid"] for r in views.values()}
    assert len(new_pids) == 1, f"API processes disagree on engine 1: {new_pids}"
    before = {i: routed(m) for i, m in scrape(dp_server).items()}
    load = make_load(str(tiny_model_dir))
    check_results(load, asyncio.run(run_load(srv.base_url, load)))
    for i, m in scrape(dp_server).items():
        assert routed(m)[1] > before[i][1], f"API process {i} sent nothing to the new engine 1"
    assert engine_stats(engine_addresses(srv)[1]).num_steps > 0
    # Each API process counts the restart it saw (the new engine's run), once.
    each_api_process(dp_server, "/metrics", lambda r: restarts(r.text) == 1)
    for address in engine_addresses(srv):
        wait_address_idle(address, IDLE_TIMEOUT_S)


def test_constraints_are_honoured_on_every_engine(dp_server: Deployment) -> None:
    """Structured outputs under data parallelism: each engine core compiles the constraint of
    the requests routed to it; eight at once spread over both, all valid."""
    import json

    body = {"prompt": "Pick:", "max_tokens": 16, "temperature": 1.0, "n": 2,
            "guided_choice": ["alpha", "beta", "gamma"]}  # fmt: skip

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=dp_server.server.base_url, timeout=120) as http:
            return await asyncio.gather(
                *(http.post("/v1/completions", json=body | {"seed": i}) for i in range(8))
            )

    for r in asyncio.run(send_all()):
        assert r.status_code == 200, r.text
        assert all(c["text"] in body["guided_choice"] for c in r.json()["choices"]), r.text
    bad = httpx.post(f"{dp_server.server.base_url}/v1/completions",
                     json=body | {"guided_choice": []}, timeout=60)  # fmt: skip
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["param"] == "guided_choice"


def test_an_engine_core_is_one_of_the_data_parallel_engines() -> None:
    """--data-parallel-size belongs to `tandem serve`; an engine core refuses it, before loading."""
    from engine_core.config import EngineConfig
    from engine_core.core import EngineCore

    with pytest.raises(ValueError, match="data_parallel_size is for `tandem serve`"):
        EngineCore(EngineConfig(model="/nonexistent", data_parallel_size=2))


@pytest.mark.parametrize("command", ["engine", "generate"])
def test_only_serves_help_lists_data_parallel_size(command: str) -> None:
    """`tandem engine` and `tandem generate` parse --data-parallel-size only to refuse it, so
    their --help leaves it out; `tandem serve`'s lists it."""

    def help_of(name: str) -> str:
        cli = [sys.executable, "-m", "frontend.cli", name, "--help"]
        return subprocess.run(cli, capture_output=True, text=True, check=True).stdout

    assert "--data-parallel-size" not in help_of(command)
    assert "--data-parallel-size" in help_of("serve")
