"""The decode benchmark's client-side metrics, against hand computations."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.script_modules import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_decode")


def test_tokens_that_arrive_together_split_their_gap(bench: ModuleType) -> None:
    # Arrivals at 1 s (one token), 2 s (two tokens), 4 s (one token).
    assert bench.token_gaps([1.0, 2.0, 2.0, 4.0]) == [0.5, 0.5, 2.0]
    assert bench.token_gaps([3.0]) == []


def test_percentile_interpolates_between_ranks(bench: ModuleType) -> None:
    # Two equal groups: the median lies halfway between them, not on one of them.
    assert bench.percentile([10.0, 10.0, 20.0, 20.0], 50) == 15.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0
    assert bench.percentile([7.0], 99) == 7.0


def test_itl_is_the_steady_step_despite_a_prefill_stall(bench: ModuleType) -> None:
    # Request a: tokens every 10 ms but one 500 ms stall; request b: every 10 ms.
    a = [0.1, 0.11, 0.12, 0.62, 0.63, 0.64]
    b = [0.62, 0.63, 0.64, 0.65, 0.66, 0.67]
    run = bench.summarize("inproc", 0.0, [a, b])
    assert run.itl_p50_ms == pytest.approx(10.0)
    assert run.tpot_p50_ms == pytest.approx((108.0 + 10.0) / 2)  # (540/5 + 50/5) / 2
    assert run.ttft_p50_ms == pytest.approx(360.0)
    assert run.tok_s == pytest.approx(12 / 0.67)


def test_stalls_count_only_long_gaps_in_the_steady_decode(bench: ModuleType) -> None:
    # Both requests stream every 10 ms, but one 40 ms gap (30 ms lost) after both have started.
    a = [0.00, 0.01, 0.02, 0.06, 0.07]
    b = [0.00, 0.01, 0.02, 0.06, 0.07]
    run = bench.summarize("zmq", 0.0, [a, b])
    assert run.itl_p50_ms == pytest.approx(10.0)
    assert run.stall_ms == pytest.approx(30.0)
    # A gap of three steps is not yet a stall; an even stream has none.
    assert bench.stall_ms([[0.0, 0.01, 0.04, 0.05]], 10.0) == 0.0
    assert bench.stall_ms([[0.0, 0.01, 0.02]], 10.0) == 0.0


def test_a_prefill_before_every_request_started_is_no_stall(bench: ModuleType) -> None:
    # Request a waits 500 ms for b's prefill; b's first token comes after that wait.
    a = [0.1, 0.11, 0.12, 0.62, 0.63, 0.64]
    b = [0.62, 0.63, 0.64, 0.65, 0.66, 0.67]
    assert bench.summarize("inproc", 0.0, [a, b]).stall_ms == 0.0
