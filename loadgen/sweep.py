"""``--sweep``: the same workload at several request rates or concurrency caps, one plot.

The plot shows output-token throughput against latency (TTFT, TPOT, end-to-end; median and P99),
one point per sweep value (repeat runs averaged), labelled with the value: the knee where latency
climbs while throughput stops growing is what a sweep is for. matplotlib is imported only here,
and only when a sweep runs (``pip install 'tandem[bench]'``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.metrics import Summary

PARAMS = ("rate", "concurrency")


@dataclass(frozen=True)
class Sweep:
    param: str  # rate | concurrency
    values: list[float]

    @classmethod
    def parse(cls, text: str) -> Sweep:
        """``"rate=1,2,4,inf"`` or ``"concurrency=1,4,16"``."""
        param, sep, values = text.partition("=")
        param = param.strip().lower()
        if not sep or param not in PARAMS:
            raise ValueError(f"bad sweep {text!r}: expected rate=R1,R2,... or concurrency=C1,...")
        vals = [float(v) for v in values.split(",") if v.strip()]
        if not vals or any(not v > 0 for v in vals):  # NaN too
            raise ValueError(f"bad sweep {text!r}: values must be > 0")
        if param == "concurrency" and any(math.isinf(v) or v != int(v) for v in vals):
            raise ValueError(f"bad sweep {text!r}: concurrency values must be whole numbers")
        return cls(param, vals)

    def label(self, value: float) -> str:
        if self.param == "concurrency":
            return f"concurrency {int(value)}"
        return "rate inf" if math.isinf(value) else f"rate {value:g}/s"


def mean_summary_figures(summaries: list[Summary]) -> dict[str, float]:
    """The figures the plot and the sweep table need, averaged over repeat runs."""
    fig: dict[str, list[float]] = {}
    for s in summaries:
        values = {
            "request_throughput": s.request_throughput,
            "output_throughput": s.output_throughput,
            "failed": float(s.failed),
        }
        for name in ("ttft", "tpot", "e2e"):
            values[f"{name}_p50"] = getattr(s, name).p50
            values[f"{name}_p99"] = getattr(s, name).p99
        for k, v in values.items():
            fig.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in fig.items()}


def format_sweep_table(sweep: Sweep, figures: list[dict[str, float]]) -> str:
    head = (
        f"{'sweep point':<18}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"
        f"{'E2E p50':>10}{'failed':>8}"
    )
    lines = [head, "-" * len(head)]
    for value, f in zip(sweep.values, figures, strict=True):
        lines.append(
            f"{sweep.label(value):<18}{f['request_throughput']:>8.2f}"
            f"{f['output_throughput']:>11.1f}{f['ttft_p50']:>10.1f}{f['tpot_p50']:>10.1f}"
            f"{f['e2e_p50']:>10.1f}{f['failed']:>8.0f}"
        )
    return "\n".join(lines) + "\n(latencies in ms, medians)"


def plot_sweep(sweep: Sweep, figures: list[dict[str, float]], path: Path, title: str) -> None:
    """Write a PNG of throughput (x) against TTFT, TPOT and E2E latency (y), one panel each."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    x = [f["output_throughput"] for f in figures]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    for ax, (name, long) in zip(
        axes, [("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end latency")], strict=True
    ):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [f[f"{name}_{pct}"] for f in figures], style, label=pct)
        for xi, f, value in zip(x, figures, sweep.values, strict=True):
            ax.annotate(sweep.label(value), (xi, f[f"{name}_p50"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))  # fmt: skip
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{long} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
