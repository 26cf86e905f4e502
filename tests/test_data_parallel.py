"""`tandem serve --data-parallel-size 2`: two engine cores behind one frontend.

A mixed load (completions and chat, streaming and not, n=2, prompts of mixed lengths) must
complete every request with exactly the tokens it asked for, reach both engines, leave every KV
block of both engines free afterwards (STATS over each engine's own address), and give identical
greedy answers whichever engine served them. A client that disconnects has its request aborted
in the engine that owns it. /health and /metrics speak for every engine.
"""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.client import EngineClient
from protocol.messages import ControlKind, Stats
from tests.server_fixture import Server, pid_alive, start_server, stop_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
SERVE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
              "--max-num-seqs", "8"]  # fmt: skip
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hum"]  # fmt: skip
SAME_PROMPT = "Every engine must answer this one the same way:"


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("serve-dp"),
        model=str(tiny_model_dir),
        args=SERVE_ARGS,
        extra=["--data-parallel-size", "2"],
    )
    engines = srv.engine_info()["engines"]
    try:
        yield srv
    finally:
        stop_server(srv)  # exits 0 and engine 0 is gone
        assert not any(pid_alive(e["pid"]) for e in engines), "an engine core outlived serve"


def engine_addresses(srv: Server) -> list[str]:
    return [e["address"] for e in srv.engine_info()["engines"]]


def engine_stats(address: str) -> Stats:
    with EngineClient(address) as client:
        client.connect(timeout=30)
        return client.control(ControlKind.STATS).stats


def wait_all_free(address: str, timeout: float = 30.0) -> Stats:
    """Poll one engine until nothing runs or waits and every KV block is free; check integrity."""
    with EngineClient(address) as client:
        client.connect(timeout=30)
        deadline = time.monotonic() + timeout
        while True:
            stats = client.control(ControlKind.STATS).stats
            free = stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
            if stats.num_running == 0 and stats.num_waiting == 0 and free:
                break
            assert time.monotonic() < deadline, f"{address} not idle: {stats}"
            time.sleep(0.1)
        assert client.control(ControlKind.CHECK_INTEGRITY).ok
        return stats


def scrape(srv: Server) -> dict[tuple[str, str], float]:
    """Per-engine samples as (name, engine label) -> value."""
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    return {
        (s.name, s.labels["engine"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "engine" in s.labels
    }


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


def test_mixed_load_completes_on_both_engines_and_frees_every_block(
    dp_server: Server, tiny_model_dir: Path
) -> None:
    addresses = engine_addresses(dp_server)
    assert len(addresses) == 2 and addresses[0] != addresses[1]
    steps_before = [engine_stats(a).num_steps for a in addresses]
    load = make_load(str(tiny_model_dir))
    results = asyncio.run(run_load(dp_server.base_url, load))

    for body, (texts, completion_tokens) in zip(load, results, strict=True):
        assert len(texts) == body["n"]
        assert completion_tokens == body["max_tokens"] * body["n"], body
    same = [texts[0] for body, (texts, _) in zip(load, results, strict=True)
            if body.get("prompt") == SAME_PROMPT]  # fmt: skip
    assert len(same) == 4 and len(set(same)) == 1, same

    metrics = scrape(dp_server)
    routed = [metrics[("tandem_engine_requests_routed_total", str(i))] for i in range(2)]
    assert sum(routed) == sum(body["n"] for body in load)
    for i, address in enumerate(addresses):
        stats = wait_all_free(address)
        assert routed[i] > 0 and stats.num_steps > steps_before[i], f"engine {i} got no work"

    assert httpx.get(f"{dp_server.base_url}/health", timeout=10).status_code == 200
    assert [metrics[("tandem_engine_up", str(i))] for i in range(2)] == [1.0, 1.0]


def test_a_disconnect_aborts_in_the_owning_engine(dp_server: Server, tiny_model_dir: Path) -> None:
    """Read two chunks of a long stream and hang up: the engine that owns the request stops it
    (far fewer steps than its max_tokens) and frees its blocks."""
    addresses = engine_addresses(dp_server)
    for address in addresses:
        wait_all_free(address)
    before = [engine_stats(a).num_steps for a in addresses]
    max_tokens = MAX_MODEL_LEN - 16
    body = {"model": str(tiny_model_dir), "prompt": "Go on and on", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{dp_server.base_url}/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break
    after = [wait_all_free(a).num_steps for a in addresses]
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(d > 0 for d in deltas) == 1, f"one engine ran it: {deltas}"
    assert max(deltas) < max_tokens // 2, f"the abort never reached its engine: {deltas}"


def test_an_engine_core_is_one_of_the_data_parallel_engines() -> None:
    """--data-parallel-size belongs to `tandem serve`; an engine core refuses it, before loading."""
    from engine_core.config import EngineConfig
    from engine_core.core import EngineCore

    with pytest.raises(ValueError, match="data_parallel_size is for `tandem serve`"):
        EngineCore(EngineConfig(model="/nonexistent", data_parallel_size=2))
