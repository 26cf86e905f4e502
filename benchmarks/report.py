"""What every benchmark prints with its figures: where they were made, one table, and the JSON.

    header = Provenance.here(["decode", "--models", "llama-1b"])
    print(header.format())
    print(format_table(["model", "tok/s"], [["llama-1b", fmt(45025.3, ",.0f")]]))
    write_json(path, header, results)

The tables are Markdown, so a result can go into docs/benchmarks.md as printed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Provenance:
    """The command that made a result, and the tree, machine and time it ran on."""

    command: str
    commit: str
    device: str
    date: str

    @classmethod
    def here(cls, argv: list[str], device: str | None = None) -> Provenance:
        """This process's benchmark command (``argv`` after ``python -m benchmarks``)."""
        return cls(
            command=shlex.join(["python", "-m", "benchmarks", *argv]),
            commit=git_commit(),
            device=device or device_name(),
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )

    def format(self) -> str:
        return "\n".join(
            [
                f"command: {self.command}",
                f"commit:  {self.commit}",
                f"device:  {self.device}",
                f"date:    {self.date}",
            ]
        )


def git_commit(root: Path = ROOT) -> str:
    """The checkout's short commit, with "+changes" when tracked files differ from it; "unknown"
    where the tree is no git checkout (a copy of the working tree on another machine)."""
    try:
        head = _git(root, "rev-parse", "--short", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if dirty else head


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def device_name() -> str:
    """The GPUs as nvidia-smi names them (without starting CUDA in this process, which would
    hold GPU memory a server then lacks), else the CPU's model name and core count."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    if names:
        return gpu_summary(names)
    return f"{cpu_model()} ({os.cpu_count()} CPUs), no GPU"


def gpu_summary(names: list[str]) -> str:
    """``["H200", "H200"]`` -> ``"2 x H200"``; a single GPU by its name alone."""
    counts = {name: names.count(name) for name in dict.fromkeys(names)}
    return ", ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt(value: float | int | None, spec: str = ".2f") -> str:
    """One table cell: ``value`` in format ``spec``, "-" when there is none (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None where either is missing or theirs is zero."""
    if ours is None or theirs is None or theirs == 0 or math.isnan(ours) or math.isnan(theirs):
        return None
    return ours / theirs


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, columns padded to their widest cell; the first column left-aligned,
    the others right-aligned (they hold figures)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        padded = [
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths)
    )
    return "\n".join([line(headers), rule + "|", *(line(row) for row in rows)])


def percentile(values: list[float], q: float) -> float:
    """numpy's linear interpolation between order statistics, as loadgen/metrics.py takes it:
    with two equal-sized groups the median falls between them. NaN for no values."""
    return float(np.percentile(values, q)) if values else math.nan


def parse_ints(text: str) -> list[int]:
    """``"1,8,32"`` as [1, 8, 32]: positive integers, comma-separated."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive comma-separated integers, not {text!r}")
    return values


def write_json(path: Path, provenance: Provenance, results: Any) -> None:
    """``{"provenance": ..., "results": ...}``, dataclasses as dicts, NaN as null."""
    payload = {"provenance": asdict(provenance), "results": _plain(results)}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
