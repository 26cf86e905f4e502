"""What the API process asks the engine for: each choice's tokens in runs as long as its chunks
need (AddRequest's output_interval), and an inter-token latency that counts every token however
the tokens were batched.

The engine's side (runs of exactly that many, the HF tokens all the same, aborts) is tested on a
real engine process in tests/test_engine_proc.py; streams and stop strings through a real server
with --stream-interval 4 in tests/test_api_servers.py.
"""

from __future__ import annotations

import bisect
from types import SimpleNamespace

import pytest

from frontend.generation import MAX_OUTPUT_INTERVAL, UNSTREAMED_OUTPUT_INTERVAL, Generation
from frontend.metrics import Metrics
from protocol.messages import SamplingParams


def generation(stream_interval: int | None, stop: list[str]) -> Generation:
    ctx = SimpleNamespace(
        resume_timeout_s=60.0,
        tokenizer=SimpleNamespace(decode=lambda ids: "".join(f"<{i}>" for i in ids)),
    )
    params = [SamplingParams(max_tokens=100)] * 2
    return Generation(ctx, [[1, 2], [3]], params, 2, stop, "cmpl-x", 0.0, stream_interval)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stream_interval", "stop", "expected"),
    [
        (16, [], 16),  # a stream: one run per chunk
        (1, [], 1),  # a stream of every token
        (16, ["\n"], 1),  # stop strings are matched at the step that completes them
        (None, [], UNSTREAMED_OUTPUT_INTERVAL),  # not streamed: needed only at the end
        (None, ["END"], 1),
        (5000, [], MAX_OUTPUT_INTERVAL),  # a longer chunk gathers several runs
    ],
)
def test_each_choice_asks_for_runs_as_long_as_its_chunks(
    stream_interval: int | None, stop: list[str], expected: int
) -> None:
    gen = generation(stream_interval, stop)
    assert [r.output_interval for r in gen.requests] == [expected] * 4


def test_a_resumed_choice_keeps_its_output_interval() -> None:
    request = generation(8, []).requests[0]
    assert request.resumed("cmpl-x-0-r1", [7, 8, 9]).output_interval == 8


def test_a_run_of_tokens_counts_one_gap_per_token() -> None:
    metrics = Metrics("m")
    metrics.record_inter_token(0.16, 16)  # a run of 16 tokens, 160 ms after the last output
    metrics.record_inter_token(0.2)
    itl = metrics.itl
    below_10ms = itl.counts[: bisect.bisect_left(itl.bounds, 0.01) + 1]
    assert sum(below_10ms) == 16 and sum(itl.counts) == 17
    assert itl.sum == pytest.approx(0.36)
