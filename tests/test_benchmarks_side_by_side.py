"""The comparison table of `serving`, `prefill` and `cpu`: each figure from the run of median
throughput, and the ratios oriented so that above 1 is better for the first server."""

from __future__ import annotations

from typing import Any

from benchmarks.servers import Workload
from benchmarks.side_by_side import (
    SERVING_METRICS,
    Figures,
    Metric,
    format_comparison,
    format_runs,
)

WORK = Workload(64, 128, 256)


def summary(tok_s: float, ttft_p50: float, tpot_p50: float | None = 5.0) -> dict[str, Any]:
    """The parts of a load-generator summary (its --result-json) the figures read."""
    return {
        "output_throughput": tok_s,
        "total_input_tokens": 8192,
        "duration_s": 2.0,
        "ttft": {"p50": ttft_p50, "p99": 2 * ttft_p50},
        "tpot": {"p50": tpot_p50},
    }


def test_figures_come_from_the_run_of_median_throughput() -> None:
    runs = [summary(100.0, 10.0), summary(300.0, 30.0), summary(200.0, 20.0)]
    figures = Figures.of("tandem", WORK, runs)
    assert (figures.output_tok_s, figures.ttft_p50_ms) == (200.0, 20.0)
    assert figures.runs_output_tok_s == (100.0, 300.0, 200.0)
    assert figures.prompt_tok_s == 4096.0 and figures.workload == "64 x (128 -> 256)"
    # Of two runs, the better one.
    assert Figures.of("tandem", WORK, runs[:2]).output_tok_s == 300.0


def test_ratios_favour_higher_throughput_and_lower_latency() -> None:
    ours = Figures.of("tandem", WORK, [summary(1180.0, 80.0, 4.0)])
    theirs = Figures.of("vllm", WORK, [summary(1000.0, 100.0, 5.0)])
    table = format_comparison([ours, theirs]).splitlines()
    assert table[0].split("|")[1:-1] == [
        " workload          ", " tandem tok/s ", " tandem TTFT p50 ms ", " tandem TTFT p99 ms ",
        " tandem TPOT p50 ms ", " vllm tok/s ", " vllm TTFT p50 ms ", " vllm TTFT p99 ms ",
        " vllm TPOT p50 ms ", " tok/s x ", " TTFT p50 ms x ", " TTFT p99 ms x ",
        " TPOT p50 ms x ",
    ]  # fmt: skip
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells == [
        "64 x (128 -> 256)", "1,180", "80.0", "160.0", "4.00", "1,000", "100.0", "200.0",
        "5.00", "1.18", "1.25", "1.25", "1.25",
    ]  # fmt: skip
    assert table[-1].startswith("x: tandem's advantage over vllm, above 1 better for tandem")


def test_with_two_peers_the_first_server_is_compared_with_each() -> None:
    """Tandem, vLLM and SGLang: the ratios of Tandem over each, each column naming its peer."""
    metric = SERVING_METRICS[:1]  # output tok/s
    results = [
        Figures.of(name, WORK, [summary(tok_s, 100.0)])
        for name, tok_s in (("tandem", 1200.0), ("vllm", 1000.0), ("sglang", 1500.0))
    ]
    table = format_comparison(results, metric).splitlines()
    assert [c.strip() for c in table[0].split("|")[1:-1]][-2:] == ["tok/s x vllm", "tok/s x sglang"]
    assert [c.strip() for c in table[2].split("|")[1:-1]][-2:] == ["1.20", "0.80"]
    assert table[-1].startswith("x: tandem's advantage over vllm and sglang")


def test_a_prefill_has_no_tpot_and_one_server_no_ratios() -> None:
    alone = Figures.of("tandem", Workload(64, 2048, 1), [summary(32.0, 900.0, None)])
    table = format_comparison([alone], SERVING_METRICS).splitlines()
    assert len(table) == 3 and "x" not in table[0].split("|")[-2]
    assert [c.strip() for c in table[2].split("|")[1:-1]][-1] == "-"


def test_a_workload_one_server_failed_shows_dashes() -> None:
    ours = Figures.of("tandem", WORK, [summary(1180.0, 80.0)])
    theirs = Figures.of("vllm", Workload(1, 1, 1), [summary(1.0, 1.0)])
    metrics = (Metric("tok/s", "output_tok_s", ",.0f", True),)
    rows = format_comparison([ours, theirs], metrics).splitlines()[2:4]
    assert [c.strip() for c in rows[0].split("|")[1:-1]] == ["64 x (128 -> 256)", "1,180", "-", "-"]
    assert [c.strip() for c in rows[1].split("|")[1:-1]] == ["1 x (1 -> 1)", "-", "1", "-"]


def test_goodput_figures_and_a_ratio_on_one_column_only() -> None:
    from benchmarks.goodput import GOODPUT, GOODPUT_METRICS

    def with_goodput(goodput: float) -> dict[str, Any]:
        return summary(1000.0, 80.0) | {"request_throughput": 4.0, "goodput": goodput}

    ours = Figures.of("tandem", WORK, [with_goodput(3.0)])
    theirs = Figures.of("vllm", WORK, [with_goodput(2.0)])
    assert (ours.goodput, ours.request_rate) == (3.0, 4.0)
    table = format_comparison([ours, theirs], GOODPUT_METRICS, (GOODPUT,)).splitlines()
    headers = [c.strip() for c in table[0].split("|")[1:-1]]
    assert headers[1] == "tandem goodput req/s" and headers[-1] == "goodput req/s x"
    assert len(headers) == 1 + 2 * len(GOODPUT_METRICS) + 1
    assert [c.strip() for c in table[2].split("|")[1:-1]][-1] == "1.50"
    # A summary without an SLO (the serving benchmark's) has no goodput.
    assert Figures.of("tandem", WORK, [summary(1.0, 1.0)]).goodput is None


def test_each_run_is_set_beside_the_peers_run_of_the_same_turn() -> None:
    """With several runs: each run's tok/s of both servers, the first's over the other's in the
    same run (by hand), and each run's TTFT p99 over its p50 (summary() makes p99 twice p50,
    so 2.00 everywhere); a run the peer lacks shows a dash. One run: no such table."""
    ours = Figures.of("tandem", WORK, [summary(110.0, 10.0), summary(90.0, 10.0)])
    theirs = Figures.of("vllm", WORK, [summary(100.0, 20.0)])
    table = format_runs([ours, theirs])
    assert table is not None
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:4]]
    assert rows == [
        ["64 x (128 -> 256)", "1", "110.0", "100.0", "1.10", "2.00", "2.00"],
        ["64 x (128 -> 256)", "2", "90.0", "-", "-", "2.00", "-"],
    ]
    assert table.splitlines()[-1] == "per run: tok/s x is tandem's over the other's in the same run"
    assert format_runs([Figures.of("tandem", WORK, [summary(1.0, 1.0)]), theirs]) is None
