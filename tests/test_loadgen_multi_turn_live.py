"""The multi-turn chat workload against a real `tandem serve` (the tiny random model, prefix
caching on as by default): every turn's prompt, as the server counted it, holds the previous
turn's prompt, reply and a new user message; the turns of a conversation go one after another;
and the server's prefix cache (its /metrics counters) serves the shared system prompt and each
conversation's history again from turn 2 on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.cli import main as tandem_main
from tests.server_fixture import Server, start_server, stop_server, wait_address_idle

pytestmark = pytest.mark.slow

C, T, PREFIX, USER, OUT = 2, 3, 64, 16, 8  # conversations, turns, system, user, output tokens
BLOCK = 16  # the KV block size: prefix caching reuses whole blocks

# The tiny model's 512 positions; room for eight of its longest sequences.
TINY_SERVE_ARGS = ["--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("multi-turn"), model=str(tiny_model_dir),
                          args=TINY_SERVE_ARGS)  # fmt: skip
    yield server
    stop_server(server)


def prefix_cache_hits(server: Server) -> float:
    """The engine's prefix-cache hits (tokens) from /metrics, once /metrics has caught up with
    the idle engine's own count (the frontend polls it about once a second)."""
    engine = wait_address_idle(server.engine_address).counts.prefix_cache_hits
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        hits = sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tandem_prefix_cache_hits_total"
        )
        if hits == engine:
            return hits
        assert time.monotonic() < deadline, f"/metrics says {hits} hits, the engine {engine}"
        time.sleep(0.2)


def run_conversations(server: Server, out: Path) -> dict[str, Any]:
    argv = ["bench", "--backend", "openai-chat", "--url", server.base_url, "--no-progress",
            "--conversations", str(C), "--turns", str(T), "--shared-prefix-len", str(PREFIX),
            "--input-len", str(USER), "--output-len", str(OUT), "--ignore-eos",
            "--result-json", str(out)]  # fmt: skip
    assert tandem_main(argv) == 0
    return json.loads(out.read_text())


def test_turns_grow_by_the_history_and_hit_the_prefix_cache(tiny: Server, tmp_path: Path) -> None:
    before = prefix_cache_hits(tiny)
    doc = run_conversations(tiny, tmp_path / "turns.json")
    hits = prefix_cache_hits(tiny) - before
    (run,) = doc["runs"]
    records = run["requests"]
    assert run["summary"]["completed"] == C * T
    for c in range(C):
        turns = [r for r in records if r["conversation"] == c]
        assert [r["turn"] for r in turns] == list(range(T))
        for prev, turn in zip(turns, turns[1:], strict=False):
            assert turn["submitted_at"] >= prev["ended_at"]  # one after another
            assert prev["output_tokens"] == OUT
            # The server's count: the previous prompt, then the reply (its text encoded again)
            # and a new user message, each inside the chat template's role markers.
            grown = turn["prompt_len"] - prev["prompt_len"]
            assert grown >= USER + OUT // 2, (prev["prompt_len"], turn["prompt_len"])
    # Every turn from the second on finds at least its conversation's system prompt (PREFIX
    # tokens, whole blocks of them, behind the template's few opening tokens) in the cache.
    at_least = C * (T - 1) * (PREFIX // BLOCK) * BLOCK
    assert hits >= at_least, (hits, at_least)
