"""GET /metrics: Prometheus text that prometheus-client's own parser reads, whose counters move
by exactly what a request did, and whose engine gauges follow a running request; the engine's
counters (prefix cache, preemptions, tokens per step) and per-request engine timings, on the
tiny model's server."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.messages import EngineCounts
from tests.server_fixture import (  # noqa: F401
    TINY_KV_BLOCKS,
    TINY_MAX_NUM_SEQS,
    Server,
    server,
    tiny_server,
    wait_address_idle,
)

pytestmark = pytest.mark.slow

FAMILIES = {
    "tandem_request_success": "counter",
    "tandem_prompt_tokens": "counter",
    "tandem_generation_tokens": "counter",
    "tandem_time_to_first_token_seconds": "histogram",
    "tandem_time_per_output_token_seconds": "histogram",
    "tandem_e2e_request_latency_seconds": "histogram",
    "tandem_num_requests_running": "gauge",
    "tandem_num_requests_waiting": "gauge",
    "tandem_kv_cache_usage_perc": "gauge",
    "tandem_inter_token_latency_seconds": "histogram",
    "tandem_request_queue_time_seconds": "histogram",
    "tandem_request_prefill_time_seconds": "histogram",
    "tandem_request_decode_time_seconds": "histogram",
    "tandem_prefix_cache_queries": "counter",
    "tandem_prefix_cache_hits": "counter",
    "tandem_num_preemptions": "counter",
    "tandem_iteration_tokens_total": "histogram",
}
BLOCK = 16  # the servers' default --block-size
ENGINE_TIMINGS = ("queue", "prefill", "decode")


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as (name, sorted labels without model_name) -> value, via the parser."""
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "metrics never reached the expected state"
        time.sleep(0.1)


def test_metrics_parse_and_hold_every_family(server: Server) -> None:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, name


def test_counters_move_by_what_a_request_did(server: Server) -> None:
    before = scrape(server)
    body = {
        "model": "default",
        "prompt": "The capital of France is",
        "max_tokens": 3,
        "ignore_eos": True,
        "temperature": 0,
    }
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 3
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tandem_request_success_total", finished_reason="length") == 1
    assert delta("tandem_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("tandem_generation_tokens_total") == 3
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert delta(f"tandem_{hist}_seconds_count") == 1
        assert delta(f"tandem_{hist}_seconds_sum") > 0


def test_engine_gauges_follow_a_running_request(server: Server) -> None:
    body = {
        "model": "default",
        "prompt": "Count:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        lines = r.iter_lines()  # keep it: a collected iterator closes the response
        assert next(lines).startswith("data: ")  # generating
        wait_for(lambda: value(scrape(server), "tandem_num_requests_running") == 1)
        assert value(scrape(server), "tandem_kv_cache_usage_perc") > 0
    # The client left: the request is aborted, its blocks freed, and the gauges say so.
    wait_for(lambda: value(scrape(server), "tandem_num_requests_running") == 0)
    wait_for(lambda: value(scrape(server), "tandem_kv_cache_usage_perc") == 0)


# ---- engine counters and timings (tiny model) ---------------------------------------------------


def settled(server: Server) -> tuple[dict, EngineCounts]:
    """/metrics once it reflects the idle engine (a stats poll after its last step), and the
    engine's own counts then."""
    stats = wait_address_idle(server.engine_address)
    wait_for(lambda: value(scrape(server), "tandem_engine_steps") == stats.num_steps)
    return scrape(server), stats.counts


def complete(server: Server, prompt: list[int], max_tokens: int, stream: bool) -> int:
    """A greedy completion of exactly ``max_tokens``; with ``stream``, the chunks with tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    url = f"{server.base_url}/v1/completions"
    if not stream:
        r = httpx.post(url, json=body, timeout=60)
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), max_tokens)
        return 0
    chunks = 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += bool(json.loads(line[6:])["choices"])
    return chunks


def test_prefix_cache_step_tokens_and_request_timings(tiny_server: Server) -> None:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 49152) for _ in range(3 * BLOCK)]
    first = shared + [rng.randrange(3, 49152) for _ in range(5)]  # 53 tokens
    second = shared + [rng.randrange(3, 49152) for _ in range(7)]  # 55, 3 full blocks shared
    before, engine_before = settled(tiny_server)
    chunks = complete(tiny_server, first, 4, stream=True)
    complete(tiny_server, second, 4, stream=False)
    after, engine_after = settled(tiny_server)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    # One token a step; with --stream-interval 1 a chunk carries what arrived together.
    assert 1 < chunks <= 4
    assert delta("tandem_prefix_cache_queries_total") == len(first) + len(second)
    assert delta("tandem_prefix_cache_hits_total") == 3 * BLOCK
    assert delta("tandem_num_preemptions_total") == 0
    # Tokens computed: each prompt less its hits, and each output but the last.
    assert delta("tandem_iteration_tokens_total_sum") == (53 + 3) + (55 - 3 * BLOCK + 3)
    assert delta("tandem_iteration_tokens_total_count") == 8  # a prefill and 3 decodes each
    assert engine_after.step_tokens_sum - engine_before.step_tokens_sum == 66
    # One observation per request for each engine timing; (tokens - 1) inter-token latencies
    # each, one per token after the first, however the engine batched them or the outputs were
    # chunked or woken.
    for part in ENGINE_TIMINGS:
        assert delta(f"tandem_request_{part}_time_seconds_count") == 2
        assert delta(f"tandem_request_{part}_time_seconds_sum") >= 0
    assert delta("tandem_inter_token_latency_seconds_count") == (4 - 1) + (4 - 1)
    assert delta("tandem_inter_token_latency_seconds_sum") >= 0
    engine_time = sum(delta(f"tandem_request_{p}_time_seconds_sum") for p in ENGINE_TIMINGS)
    assert 0 < engine_time <= delta("tandem_e2e_request_latency_seconds_sum")


def test_preemptions_are_counted(tiny_server: Server) -> None:
    rng = random.Random(99)
    prompts = [[rng.randrange(3, 49152) for _ in range(20)] for _ in range(8)]
    max_tokens = 100  # 20 + 100 tokens = 8 blocks each: four running need 32 of 16
    assert TINY_MAX_NUM_SEQS * -(-(20 + max_tokens) // BLOCK) > TINY_KV_BLOCKS
    before, engine_before = settled(tiny_server)

    async def run_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as client:
            body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            posts = [client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts]
            return await asyncio.gather(*posts)

    assert all(r.status_code == 200 for r in asyncio.run(run_all()))
    after, engine_after = settled(tiny_server)
    preempted = engine_after.preemptions - engine_before.preemptions
    assert preempted > 0
    name = "tandem_num_preemptions_total"
    assert value(after, name) - value(before, name) == preempted


def test_step_histogram_exposes_cumulative_buckets_like_prometheus() -> None:
    """The lock-free histogram (inter-token latency) against counts worked out by hand: a value
    equal to a bound falls in that bound's bucket (le), one above every bound only in +Inf."""
    from prometheus_client import CollectorRegistry, generate_latest

    from frontend.metrics import StepHistogram

    registry = CollectorRegistry()
    hist = StepHistogram("t_seconds", "a test histogram", (0.01, 0.1, 1.0), "m")
    registry.register(hist)
    for v in (0.005, 0.01, 0.05, 0.1, 0.5, 3.0):
        hist.observe(v)
    text = generate_latest(registry).decode()
    for le, want in (("0.01", 2), ("0.1", 4), ("1.0", 5), ("+Inf", 6)):
        assert f't_seconds_bucket{{le="{le}",model_name="m"}} {float(want)}' in text
    assert 't_seconds_count{model_name="m"} 6.0' in text
    assert 't_seconds_sum{model_name="m"} 3.665' in text
