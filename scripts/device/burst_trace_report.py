"""Where each burst of a traced `tandem serve` went (scripts/device/burst_trace/sitecustomize.py).

    python scripts/device/burst_trace_report.py FOLDER [--steps]

The records of every process in FOLDER, on one clock, are cut into bursts: a burst starts with
the first request read or taken in once the engine had no live request. For each: the first,
median and last time of each stage (ms from the burst's first record), the prompt encodes, the
engine's first tokens and finishes, and its steps (with ``--steps``, each step up to the burst's
last first token: prompt tokens + decode rows, running/waiting).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

Record = list[Any]  # [time.monotonic(), kind, *fields]
STAGES = (
    ("http", "HTTP request read"),
    ("send", "AddRequest sent"),
    ("add", "engine took it in"),
    ("ft", "API: first token in"),
    ("chunk1", "API: first chunk out"),
    ("fin", "API: finish in"),
)


def load(folder: Path) -> list[Record]:
    records = [
        r for path in sorted(folder.glob("trace-*.json")) for r in json.loads(path.read_text())
    ]
    return sorted(records, key=lambda r: r[0])


def bursts(records: list[Record]) -> list[list[Record]]:
    """Cut where a request arrives after the engine's live requests had all finished or been
    aborted."""
    out: list[list[Record]] = []
    current: list[Record] = []
    live, idle = 0, False
    for r in records:
        if r[1] in ("http", "send", "add") and idle and current:
            out.append(current)
            current, idle = [], False
        current.append(r)
        if r[1] == "add":
            live += 1
        elif r[1] in ("upd", "abort"):
            live -= r[3] if r[1] == "upd" else r[2]
            idle = live == 0
    if current:
        out.append(current)
    return out


def spread(times_ms: list[float]) -> str:
    """first/median/last (n=count), as the report prints a stage."""
    if not times_ms:
        return "-"
    t = sorted(times_ms)
    return f"{t[0]:.0f}/{t[len(t) // 2]:.0f}/{t[-1]:.0f} (n={len(t)})"


def summary(burst: list[Record], steps: bool = False) -> list[str]:
    """The report's lines for one burst."""
    t0 = burst[0][0]
    by_kind: dict[str, list[Record]] = defaultdict(list)
    for r in burst:
        by_kind[r[1]].append(r)

    def ms(r: Record) -> float:
        return 1e3 * (r[0] - t0)

    kind = "HTTP" if by_kind["http"] else "raw ZMQ"
    lines = [f"--- {len(by_kind['add'])} requests, {kind}"]
    for k, label in STAGES:
        if by_kind[k]:
            lines.append(f"  {label:22s} {spread([ms(r) for r in by_kind[k]])}")
    if by_kind["enc"]:
        calls = "; ".join(f"{ms(r):.0f}: {r[2]} in {1e3 * r[3]:.1f} ms" for r in by_kind["enc"])
        lines.append(f"  {'prompt encodes':22s} {calls}")
    firsts = [(ms(r), r[2]) for r in by_kind["upd"] if r[2]]
    last_first = firsts[-1][0] if firsts else None
    if firsts:
        lines.append(f"  {'engine first tokens':22s} {first_tokens(firsts)}")
    ends = [ms(r) for r in by_kind["upd"] if r[3]]
    if ends:
        lines.append(f"  {'engine finishes':22s} {ends[0]:.0f}/{ends[-1]:.0f}")
    plan = [(ms(r), *r[2:]) for r in by_kind["step"]]
    return lines + step_lines(plan, last_first, steps)


def first_tokens(firsts: list[tuple[float, int]]) -> str:
    """When the engine sampled the first of its first tokens, half of them, and the last
    (``firsts``: each step's time and how many first tokens it gave)."""
    total, seen, half = sum(n for _, n in firsts), 0, firsts[-1][0]
    for t, n in firsts:
        seen += n
        if seen >= total / 2:
            half = t
            break
    return f"{firsts[0][0]:.0f}/{half:.0f}/{firsts[-1][0]:.0f} (n={total})"


def step_lines(plan: list[tuple[Any, ...]], last_first: float | None, each: bool) -> list[str]:
    """The steps' count and pace once every request had its first token; with ``each`` also
    the steps before (``plan``: ms, prompt tokens, decode rows, running, waiting)."""
    if not plan:
        return []
    starts = [p[0] for p in plan]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    after = [g for s, g in zip(starts, gaps, strict=False) if last_first is None or s > last_first]
    pace = f"; then a step every {statistics.median(after):.2f} ms (median)" if after else ""
    prompts = [p for p in plan if p[1]]
    tokens = sum(p[1] for p in prompts)
    lines = [f"  steps {len(plan)}, {len(prompts)} with prompt tokens ({tokens}){pace}"]
    if each:
        early = [p for p in plan if last_first is None or p[0] <= last_first]
        lines.append("   " + "; ".join(f"{t:.0f}: {n}+{d} {r}/{w}" for t, n, d, r, w in early))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--steps", action="store_true", help="list the steps to the last first token"
    )
    args = parser.parse_args()
    for burst in bursts(load(args.folder)):
        print("\n".join(summary(burst, args.steps)))


if __name__ == "__main__":
    main()
