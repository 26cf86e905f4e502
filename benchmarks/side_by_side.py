"""Servers side by side under the same load generator: the driver of `serving`, `prefill` and
`cpu`, and the table with the ratios.

Two ways to take turns:

- ``sequential`` (GPUs): one server at a time: start it, wait until it is ready, run every
  workload (a warm-up run, then the reported runs; or, given one warm-up workload, that once as
  the server starts and no warm-up per workload), stop it, wait until its GPU memory is free,
  then the next. Two servers never share the GPU.
- ``alternating`` (CPUs): every server up at once (an idle engine takes no CPU), each workload's
  runs alternating between them, so that each meets the machine in the same state (a CPU's
  memory bandwidth drifts over minutes).

Each figure is from the reported run of median output tok/s (of two, the better).
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import server_profile
from benchmarks.report import Provenance, fmt, format_table, ratio
from benchmarks.servers import (
    SERVER_COUNTERS,
    LoadShape,
    Server,
    hit_rate,
    preemptions,
    run_loadgen,
    running,
    scrape_counters,
    start,
    stop,
)

# Added to a seeded workload's seed for its profiled run: past every seed a benchmark gives its
# measured runs and warm-ups (goodput's: SEED + the rate's index, and one more for the warm-up).
PROFILED_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Figures:
    """One server's figures on one workload, from the load generator's summary of a run."""

    server: str
    workload: str
    output_tok_s: float
    prompt_tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    duration_s: float
    runs_output_tok_s: tuple[float, ...]  # every reported run, in order
    runs_ttft_p50_ms: tuple[float | None, ...] = ()  # every reported run's, in order
    runs_ttft_p99_ms: tuple[float | None, ...] = ()
    request_rate: float | None = None  # completed requests / s
    goodput: float | None = None  # requests meeting the run's SLO / s; None without one
    # Multi-turn workloads: TTFT p50 of each conversation's first turn and of its later ones;
    # None elsewhere.
    ttft_first_turn_p50_ms: float | None = None
    ttft_later_turns_p50_ms: float | None = None
    # Workloads that read the server's counters (LoadShape.reads_server_counters), over the
    # workload's runs and the warm-up run before them, if any: prefix-cache hits over queries
    # (in prompt tokens), and preemptions for KV room; None elsewhere (or where a server
    # exports no such counter).
    prefix_cache_hit_rate: float | None = None
    preemptions: int | None = None

    @classmethod
    def of(cls, server: str, workload: LoadShape, summaries: list[dict[str, Any]]) -> Figures:
        ranked = sorted(summaries, key=lambda s: s["output_throughput"])
        s = ranked[len(ranked) // 2]
        return cls(
            server=server,
            workload=workload.label,
            output_tok_s=s["output_throughput"],
            prompt_tok_s=s["total_input_tokens"] / s["duration_s"],
            ttft_p50_ms=s["ttft"]["p50"],
            ttft_p99_ms=s["ttft"]["p99"],
            tpot_p50_ms=s["tpot"]["p50"],
            duration_s=s["duration_s"],
            runs_output_tok_s=tuple(x["output_throughput"] for x in summaries),
            runs_ttft_p50_ms=tuple((x.get("ttft") or {}).get("p50") for x in summaries),
            runs_ttft_p99_ms=tuple((x.get("ttft") or {}).get("p99") for x in summaries),
            request_rate=s.get("request_throughput"),
            goodput=s.get("goodput"),
            ttft_first_turn_p50_ms=(s.get("ttft_first_turn") or {}).get("p50"),
            ttft_later_turns_p50_ms=(s.get("ttft_later_turns") or {}).get("p50"),
        )


def progress(f: Figures) -> str:
    """One line as each result comes in."""
    ttft = fmt(f.ttft_p50_ms, ",.1f")
    return f"{f.server} {f.workload}: {f.output_tok_s:,.0f} tok/s, TTFT p50 {ttft} ms"


@dataclass(frozen=True)
class Metric:
    """A column of the table: a Figures field, its format, and which way is better."""

    label: str
    field: str
    spec: str
    higher_is_better: bool
    # Whether the table gives the servers' ratio on it by default (a count, such as the
    # preemptions, is shown side by side only: the ratio of two counts says little).
    ratio_column: bool = True


SERVING_METRICS = (
    Metric("tok/s", "output_tok_s", ",.0f", True),
    Metric("TTFT p50 ms", "ttft_p50_ms", ",.1f", False),
    Metric("TTFT p99 ms", "ttft_p99_ms", ",.1f", False),
    Metric("TPOT p50 ms", "tpot_p50_ms", ".2f", False),
)


def run_sequential(
    servers: list[Server], workloads: Sequence[LoadShape], tokenizer: str, out_dir: Path, runs: int,
    loadgen_extra: list[str] | None = None, warm_up: LoadShape | None = None,
) -> list[Figures]:  # fmt: skip
    """One server at a time, every workload on it: a warm-up run before each, or with
    ``warm_up``, that workload once as the server starts (not reported) and none before each.
    A server that does not start, or a workload that fails, is reported and skipped: the
    others' figures still come out."""
    results = []
    warmups = 1 if warm_up is None else 0
    for server in servers:
        try:
            with running(server, out_dir):
                if warm_up is not None:
                    out = out_dir / f"{server.name}-warm-up.json"
                    print(f"  {server.name} warm-up: {warm_up.label}", flush=True)
                    run_loadgen(server.url, warm_up, tokenizer, out, 1, 0, loadgen_extra)
                for i, workload in enumerate(workloads):
                    out = out_dir / f"{server.name}-w{i}.json"
                    figures = attempt(
                        server, workload, tokenizer, out, runs, loadgen_extra, warmups
                    )
                    results += [figures] if figures else []
        except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
            print(f"  {server.name} failed: {exc}", flush=True)
    return results


def attempt(
    server: Server, workload: LoadShape, tokenizer: str, out: Path, runs: int,
    loadgen_extra: list[str] | None, warmup_runs: int = 1,
) -> Figures | None:  # fmt: skip
    """One workload on a running server; None (and a line saying why) if it failed."""
    counted = workload.reads_server_counters
    try:
        before = scrape_counters(server, SERVER_COUNTERS) if counted else None
        summaries = run_loadgen(
            server.url, workload, tokenizer, out, runs, warmup_runs, loadgen_extra
        )
        after = scrape_counters(server, SERVER_COUNTERS) if counted else None
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"  {server.name} {workload.label} failed: {exc}", flush=True)
        return None
    figures = Figures.of(server.name, workload, summaries)
    if counted:
        figures = dataclasses.replace(
            figures,
            prefix_cache_hit_rate=hit_rate(before, after),
            preemptions=preemptions(before, after),
        )
    print(f"  {progress(figures)}", flush=True)
    if server.profile_dir is not None:
        profile_once(server, workload, tokenizer, out, loadgen_extra)
    return figures


def profile_once(
    server: Server, workload: LoadShape, tokenizer: str, out: Path, loadgen_extra: list[str] | None
) -> None:
    """One more run of ``workload`` under the server's profiler (--profile); its kernels."""
    profiled_out = out.with_name(f"{out.stem}-profiled.json")
    fresh = fresh_prompts(workload)

    def run() -> None:
        run_loadgen(server.url, fresh, tokenizer, profiled_out, 1, 0, loadgen_extra)

    times, kind = server_profile.profiled(server, run)
    print(server_profile.format_profile(server.name, workload.label, times, kind), flush=True)


def fresh_prompts(workload: LoadShape) -> LoadShape:
    """``workload`` with prompts no measured run drew: a seeded workload (goodput's) would send
    its measured run's prompts again, and the prefix cache would serve every one of them, so the
    profile would hold no prefill. An unseeded one draws fresh prompts each run already."""
    seed = getattr(workload, "seed", None)
    if seed is None:
        return workload
    return dataclasses.replace(workload, seed=seed + PROFILED_SEED_OFFSET)


def run_alternating(
    servers: list[Server], workloads: Sequence[LoadShape], tokenizer: str, out_dir: Path, runs: int,
    loadgen_extra: list[str] | None = None,
) -> list[Figures]:  # fmt: skip
    """Every server up at once; each workload's runs alternate between them."""
    results = []
    with contextlib.ExitStack() as stack:
        for server in servers:
            start(server, out_dir / f"{server.name}-server.log")
            stack.callback(stop, server)
        for i, workload in enumerate(workloads):
            summaries: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
            for run in range(runs):
                for server in servers:
                    out = out_dir / f"{server.name}-w{i}-r{run}.json"
                    warmup = 1 if run == 0 else 0  # each workload's shapes warmed once
                    got = run_loadgen(
                        server.url, workload, tokenizer, out, 1, warmup, loadgen_extra
                    )
                    summaries[server.name] += got
            for server in servers:
                results.append(Figures.of(server.name, workload, summaries[server.name]))
                print(f"  {progress(results[-1])}", flush=True)
    return results


def format_comparison(
    results: list[Figures], metrics: tuple[Metric, ...] = SERVING_METRICS,
    compared: tuple[Metric, ...] | None = None,
) -> str:  # fmt: skip
    """One row per workload: each server's figures, then the first server's advantage over each
    other server on each metric of ``compared`` (default: every metric with a ratio column; its
    throughput over the other's, the other's latency over its own), so that above 1 is better
    for the first server in every column (with three servers or more, each column names the
    other one)."""
    compared = tuple(m for m in metrics if m.ratio_column) if compared is None else compared
    servers = list(dict.fromkeys(r.server for r in results))
    workloads = list(dict.fromkeys(r.workload for r in results))
    by = {(r.server, r.workload): r for r in results}
    headers = ["workload"] + [f"{s} {m.label}" for s in servers for m in metrics]
    first, others = (servers[0], servers[1:]) if servers else ("", [])
    named = len(others) > 1
    headers += [f"{m.label} x{f' {o}' if named else ''}" for o in others for m in compared]
    rows = []
    for workload in workloads:
        row = [workload]
        for server in servers:
            figures = by.get((server, workload))
            row += [fmt(getattr(figures, m.field) if figures else None, m.spec) for m in metrics]
        ours = by.get((first, workload))
        for other in others:
            theirs = by.get((other, workload))
            row += [fmt(advantage(m, ours, theirs), ".2f") for m in compared]
        rows.append(row)
    table = format_table(headers, rows)
    if not others:
        return table
    other = others[0] if len(others) == 1 else "the other"
    note = (
        f"x: {first}'s advantage over {' and '.join(others)}, above 1 better for {first} "
        f"(throughputs {first} / {other}, latencies {other} / {first})"
    )
    return f"{table}\n{note}"


def format_runs(results: list[Figures]) -> str | None:
    """Where a workload had several runs: each run's output tok/s by server, the first server's
    over each other's in the same run (the runs alternate, so run i of each met the machine in
    the same state), and each server's TTFT p99 over its p50 in that run. None with one run."""
    if max((len(r.runs_output_tok_s) for r in results), default=0) < 2:
        return None
    servers = list(dict.fromkeys(r.server for r in results))
    workloads = list(dict.fromkeys(r.workload for r in results))
    by = {(r.server, r.workload): r for r in results}
    first, others = servers[0], servers[1:]
    headers = ["workload", "run", *(f"{s} tok/s" for s in servers)]
    headers += [f"tok/s x {o}" if len(others) > 1 else "tok/s x" for o in others]
    headers += [f"{s} TTFT p99 / p50" for s in servers]
    rows = []
    for workload in workloads:
        figures = [by.get((s, workload)) for s in servers]
        for i in range(max(len(f.runs_output_tok_s) for f in figures if f is not None)):
            tok_s = [run_value(f, "runs_output_tok_s", i) for f in figures]
            spread = [
                ratio(run_value(f, "runs_ttft_p99_ms", i), run_value(f, "runs_ttft_p50_ms", i))
                for f in figures
            ]
            row = [workload, str(i + 1), *(fmt(t, ",.1f") for t in tok_s)]
            row += [fmt(ratio(tok_s[0], theirs), ".2f") for theirs in tok_s[1:]]
            rows.append(row + [fmt(x, ".2f") for x in spread])
    note = f"per run: tok/s x is {first}'s over the other's in the same run" if others else ""
    return f"{format_table(headers, rows)}\n{note}" if note else format_table(headers, rows)


def run_value(figures: Figures | None, field: str, run: int) -> float | None:
    """Run ``run``'s value of a per-run tuple, None where that server has no such run."""
    values = getattr(figures, field) if figures is not None else ()
    return values[run] if run < len(values) else None


def advantage(metric: Metric, ours: Figures | None, theirs: Figures | None) -> float | None:
    if ours is None or theirs is None:
        return None
    mine, other = getattr(ours, metric.field), getattr(theirs, metric.field)
    return ratio(mine, other) if metric.higher_is_better else ratio(other, mine)


def print_comparison(
    provenance: Provenance, servers: list[Server], results: list[Figures],
    metrics: tuple[Metric, ...], out_dir: Path, compared: tuple[Metric, ...] | None = None,
) -> None:  # fmt: skip
    """The provenance, each server's command line, where the logs are, and the table."""
    print(f"\n{provenance.format()}")
    for server in servers:
        print(f"{server.name}: {server.shown()}")
    print(f"logs: {out_dir}\n")
    print(format_comparison(results, metrics, compared))
    runs = format_runs(results)
    if runs is not None:
        print(f"\n{runs}")
