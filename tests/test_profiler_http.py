"""POST /start_profile and /stop_profile (vLLM's routes) on a real `tandem serve`: torch.profiler
runs in the engine core between them and writes a trace that a viewer can read, with the work
the requests in between did; without --profile-dir, and out of order, they are refused (400, the
reason named) and the server serves on."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.attention import read_steps, replay_steps
from engine_core.attention.base import SHARED_PREFIX_MIN_ROWS
from tests.server_fixture import (  # noqa: F401
    TINY_ARGS,
    Server,
    start_server,
    stop_server,
    tiny_server,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow

TOKENS = 6  # a completion's tokens: its prefill step and 5 decode steps
LAYERS = 2  # the tiny model's (tests/conftest.py tiny_model_dir)
ATTENTION_OP = "aten::scaled_dot_product_attention"  # the CPU backend's, once a layer a step


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "engine"  # created by the first start


@pytest.fixture(scope="module")
def profiled(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, traces: Path
) -> Iterator[Server]:
    # Room for SHARED_PREFIX_MIN_ROWS sequences over a shared prompt (the last flags win).
    room = ["--max-num-seqs", str(SHARED_PREFIX_MIN_ROWS), "--num-kv-blocks", "256"]
    srv = start_server(
        tmp_path_factory.mktemp("serve-profiled"),
        model=str(tiny_model_dir),
        args=[*TINY_ARGS, *room, "--profile-dir", str(traces)],
    )
    yield srv
    stop_server(srv)


def post(srv: Server, route: str) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/{route}", headers=srv.headers, timeout=120)


def complete(srv: Server) -> int:
    """One completion of TOKENS tokens; its prompt's length in tokens."""
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt="The profiler sees",
        max_tokens=TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == TOKENS
    return out.usage.prompt_tokens


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_a_trace_holds_the_work_between_start_and_stop(profiled: Server) -> None:
    refused = post(profiled, "stop_profile")
    assert refused.status_code == 400, refused.text
    assert "not running" in refused.json()["error"]["message"]

    started = post(profiled, "start_profile")
    assert started.status_code == 200, started.text
    (directory,) = started.json()["directories"]
    again = post(profiled, "start_profile")
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    prompt = complete(profiled)
    stopped = post(profiled, "stop_profile")
    assert stopped.status_code == 200, stopped.text
    trace, top, steps = (Path(p) for p in stopped.json()["files"])
    assert trace.parent == top.parent == steps.parent == Path(directory)
    assert trace.name.endswith(".trace.json.gz") and top.name.endswith(".top.txt")
    # The steps the completion took, as attention saw them: its prompt, then a token a step
    # over a context one longer each time (the one whose token ends it is never planned); on
    # the CPU no graph, and one sequence shares no prefix.
    engine, shapes = read_steps(steps)
    assert engine["block_size"] == 16 and engine["plain_attention"]
    assert engine["kv_cache_dtype"] == "float32"  # the CPU's
    assert engine["heads"] % engine["kv_heads"] == 0
    assert shapes == [{"new": [prompt], "lens": [prompt], "graph_rows": 0, "shared": 0}] + [
        {"new": [1], "lens": [prompt + i], "graph_rows": 0, "shared": 0} for i in range(1, TOKENS)
    ]
    # What `benchmarks attention --replay` runs again of them: the decode steps.
    replayed = replay_steps(shapes, 0)
    assert [(r.line, r.padded) for r in replayed] == [
        (i + 1, [prompt + i]) for i in range(1, TOKENS)
    ]
    # Each layer of each forward the completion took attended once (the CPU's attention op).
    attended = [e for e in trace_events(trace) if e.get("name") == ATTENTION_OP]
    assert len(attended) >= LAYERS * TOKENS and len(attended) % LAYERS == 0, len(attended)
    assert "Self CPU" in top.read_text()

    # A second trace is numbered apart; with no request in between, no layer attended.
    assert post(profiled, "start_profile").status_code == 200
    second = post(profiled, "stop_profile")
    assert second.status_code == 200, second.text
    trace2, _, steps2 = (Path(p) for p in second.json()["files"])
    assert trace2 != trace and trace.exists()
    assert ATTENTION_OP not in {e.get("name") for e in trace_events(trace2)}
    assert read_steps(steps2) == (engine, [])  # no step ran
    assert complete(profiled) is not None  # serving went on
    wait_engine_idle(profiled)


def test_a_steps_decode_rows_over_one_prompt_attend_its_whole_blocks_once(
    profiled: Server,
) -> None:
    """SHARED_PREFIX_MIN_ROWS choices (n) of one 300-token prompt (token ids), sent to the
    engine together: their decode steps' rows share the prompt's whole blocks in the prefix
    cache, and the steps file says how many tokens those are (18 blocks of 16)."""
    client = openai.OpenAI(base_url=f"{profiled.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    prompt = list(range(100, 400))
    assert post(profiled, "start_profile").status_code == 200
    client.completions.create(
        model=model, prompt=prompt, n=SHARED_PREFIX_MIN_ROWS, max_tokens=TOKENS,
        temperature=0.0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    stopped = post(profiled, "stop_profile")
    assert stopped.status_code == 200, stopped.text
    _, shapes = read_steps(Path(stopped.json()["files"][2]))
    full = [s for s in shapes if s["new"] == [1] * SHARED_PREFIX_MIN_ROWS]
    assert full, shapes  # the choices decode together
    assert {s["shared"] for s in full} == {len(prompt) // 16 * 16}
    # Below SHARED_PREFIX_MIN_ROWS one-token rows, no step attends a prefix once.
    assert all(s["shared"] == 0 for s in shapes if s["new"].count(1) < SHARED_PREFIX_MIN_ROWS)
    wait_engine_idle(profiled)


def test_without_a_profile_dir_the_routes_say_how_to_enable_them(tiny_server: Server) -> None:
    for route in ("start_profile", "stop_profile"):
        r = post(tiny_server, route)
        assert r.status_code == 400, r.text
        assert "--profile-dir" in r.json()["error"]["message"]
    assert complete(tiny_server) is not None


def test_the_routes_stay_out_of_the_published_document(profiled: Server) -> None:
    """Development routes, as vLLM's: the serving API's document does not list them."""
    paths = httpx.get(f"{profiled.base_url}/openapi.json", timeout=30).json()["paths"]
    assert "/v1/completions" in paths
    assert not {"/start_profile", "/stop_profile"} & set(paths)


def test_a_profile_dir_made_unusable_after_start_is_a_400_and_serving_goes_on(
    profiled: Server, traces: Path
) -> None:
    """The folder checked at start-up, then replaced by a file: /start_profile answers 400
    naming --profile-dir and why, and the engine serves on (the OSError used to end its loop,
    and requests met a restart's 503s)."""
    shutil.rmtree(traces, ignore_errors=True)
    traces.write_text("a file where the traces would go")
    try:
        for _ in range(2):  # the engine answers the second as it did the first
            r = post(profiled, "start_profile")
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert f"--profile-dir {traces}" in message and "exists" in message, message
        assert complete(profiled) is not None
    finally:
        traces.unlink()
    wait_engine_idle(profiled)
