"""The output interval: the rule itself (against a hand-written table), what the API process
asks for (each choice's tokens in runs as long as its chunks need), what the engine process sends
and when (release_held, fed by hand), and an inter-token latency that counts every token however
the tokens were batched.

The engine's side end to end (runs of exactly that many, the HF tokens all the same, prompt
logprobs, aborts) is tested on a real engine process in tests/test_engine_server.py; streams and
stop strings through a real server with --stream-interval 4 in tests/test_api_servers.py.
"""

from __future__ import annotations

import bisect
from types import SimpleNamespace
from typing import Any

import pytest

from engine_core.request import EngineOutput, HeldTokens, Request
from engine_core.server import release_held
from frontend.generation import MAX_OUTPUT_INTERVAL, Generation
from frontend.metrics import Metrics
from protocol.messages import FinishReason, SamplingParams, TokenLogprobs
from protocol.output_interval import IntervalCounter, OutputInterval


@pytest.mark.parametrize(
    ("every", "gathered", "sent_any", "ending", "due"),
    [
        (4, 1, False, False, True),  # a request's first tokens go at once
        (4, 3, True, False, False),  # then they gather...
        (4, 4, True, False, True),  # ...until four wait
        (4, 9, True, False, True),
        (4, 0, True, True, True),  # the end goes at once, with or without tokens
        (4, 0, False, False, False),  # nothing gathered, nothing due
        (1, 1, True, False, True),  # every token
        (None, 1, False, False, False),  # only the end: not even the first tokens
        (None, 500, True, False, False),
        (None, 2, True, True, True),
    ],
)
def test_the_rule(
    every: int | None, gathered: int, sent_any: bool, ending: bool, due: bool
) -> None:
    assert OutputInterval(every).due(gathered, sent_any, ending) is due


def test_a_counter_counts_from_what_last_went_on() -> None:
    counter = IntervalCounter(OutputInterval(3))
    assert counter.add(1)  # the first token
    assert not counter.add(1)  # the first went (or is going): the next ones gather
    counter.went_on()
    assert [counter.add(1) for _ in range(3)] == [False, False, True]
    assert counter.add(2)  # four gathered: it stays due until what gathered went on
    counter.went_on()
    assert not counter.add(1) and counter.add(0, ending=True)
    with pytest.raises(ValueError, match="at least 1"):
        OutputInterval(0)


def generation(stream_interval: int | None, stop: list[str]) -> Generation:
    ctx = SimpleNamespace(
        served_model="m",
        resume_timeout_s=60.0,
        eos_token_ids=(),
        tokenizer=SimpleNamespace(
            decode=lambda ids: "".join(f"<{i}>" for i in ids), byte_level=False
        ),
    )
    params = [SamplingParams(max_tokens=100)] * 2
    return Generation(ctx, [[1, 2], [3]], params, 2, stop, "cmpl-x", 0.0, stream_interval)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stream_interval", "stop", "expected"),
    [
        (16, [], 16),  # a stream: one run per chunk
        (1, [], 1),  # a stream of every token
        (16, ["\n"], 1),  # stop strings are matched at the step that completes them
        (None, [], MAX_OUTPUT_INTERVAL),  # not streamed: needed only at the end
        (None, ["END"], 1),
        (200, [], MAX_OUTPUT_INTERVAL),  # a longer chunk gathers several runs
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


# ---- the engine's side: what release_held sends and when ------------------------------------


def lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(value, [], [])


def held(interval: int) -> HeldTokens:
    return HeldTokens(IntervalCounter(OutputInterval(interval)))


def test_held_tokens_go_out_in_runs_and_with_the_end() -> None:
    request = Request("r", [1, 2], SamplingParams(max_tokens=20, logprobs=0))
    hold = held(3)

    def step(tokens: list[int], reason: FinishReason | None = None) -> Any:
        logprobs = [lp(-t) for t in tokens] or None
        return release_held(hold, EngineOutput(request, tokens, reason, logprobs))

    assert step([5]) == ([5], [lp(-5)])  # the first token at once
    assert step([6]) is None and step([7]) is None
    assert step([8]) == ([6, 7, 8], [lp(-6), lp(-7), lp(-8)])
    assert step([9]) is None
    assert step([10], FinishReason.LENGTH) == ([9, 10], [lp(-9), lp(-10)])


def test_an_output_without_tokens_takes_the_held_ones_with_it() -> None:
    """A constraint's dead end comes as an output with no token: what was held goes with it."""
    request = Request("r", [1], SamplingParams(max_tokens=20))
    hold = held(16)
    assert release_held(hold, EngineOutput(request, [5])) == ([5], None)
    assert release_held(hold, EngineOutput(request, [6])) is None
    assert release_held(hold, EngineOutput(request, [7])) is None
    dead_end = EngineOutput(request, [], FinishReason.DEAD_END)
    assert release_held(hold, dead_end) == ([6, 7], None)
    assert hold.token_ids == [] and hold.logprobs == []
