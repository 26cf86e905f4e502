"""GET /metrics: Prometheus text that prometheus-client's own parser reads, whose counters move
by exactly what a request did, and whose engine gauges follow a running request."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import Server, server  # noqa: F401

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
}


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
