"""One line per kernel from Nsight Compute's text report (``ncu --import REP --page details``):
grid, time alone, DRAM and SM throughput, and the share of the elapsed cycles in which the SMs
were active (averaged over all SMs, so a grid of fewer programs than SMs shows less).

    python scripts/device/ncu_summary.py DETAILS.txt     (or - for standard input)

Prints a Markdown table. Used by scripts/device/ncu_layer.sh; runs anywhere (no GPU, no ncu).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# "  _decode_kernel (3, 2, 64)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0"
_KERNEL = re.compile(r"^  (\S.*?) \(([\d, ]+)\)x\(([\d, ]+)\), Context")
# "    Duration                         us        13.73"
_METRIC = re.compile(r"^    (\S.*?)\s{2,}(\S+)?\s+([\d,.]+)$")
_TIME_UNITS = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
_WANTED = {
    "Duration",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "Elapsed Cycles",
    "SM Active Cycles",
    "SM Frequency",
}


@dataclass
class Kernel:
    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    metrics: dict[str, tuple[str, float]] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        return self.metrics[name][1] if name in self.metrics else None

    def duration_us(self) -> float | None:
        if "Duration" not in self.metrics:
            return None
        unit, value = self.metrics["Duration"]
        return value * _TIME_UNITS[unit]

    def active_share(self) -> float | None:
        active, elapsed = self.value("SM Active Cycles"), self.value("Elapsed Cycles")
        return None if not active or not elapsed else 100 * active / elapsed


def parse(lines: Iterable[str]) -> list[Kernel]:
    """The kernels in report order, each with the metrics of _WANTED it reports."""
    kernels: list[Kernel] = []
    for line in lines:
        line = line.rstrip("\n")
        if head := _KERNEL.match(line):
            kernels.append(Kernel(head[1], _dims(head[2]), _dims(head[3])))
        elif kernels and (metric := _METRIC.match(line)) and metric[1] in _WANTED:
            kernels[-1].metrics.setdefault(metric[1], (metric[2] or "", _number(metric[3])))
    return kernels


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(","))


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def table(kernels: list[Kernel]) -> str:
    rows = [
        "| # | kernel | grid | block | µs alone | DRAM % | SM % | SM active / elapsed | SM GHz |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, k in enumerate(kernels):
        cells = [
            str(i),
            k.name[:60],
            " × ".join(str(d) for d in k.grid if d > 1) or "1",
            str(k.block[0]),
            _fmt(k.duration_us(), 2),
            _fmt(k.value("DRAM Throughput"), 1),
            _fmt(k.value("Compute (SM) Throughput"), 1),
            _fmt(k.active_share(), 0, "%"),
            _fmt(k.value("SM Frequency"), 2),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _fmt(value: float | None, digits: int, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    text = sys.stdin.read() if argv[0] == "-" else Path(argv[0]).read_text()
    kernels = parse(text.splitlines())
    if not kernels:
        print("no kernels found: is this `ncu --import REP --page details` output?")
        return 1
    print(table(kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
