"""What every benchmark prints with its figures: the provenance header, the table, the JSON."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import (
    ROOT,
    Provenance,
    fmt,
    format_table,
    git_commit,
    gpu_summary,
    percentile,
    ratio,
    write_json,
)


def test_table_is_markdown_with_padded_columns() -> None:
    table = format_table(["model", "tok/s"], [["llama-1b", "45,025"], ["gpt2", "9"]])
    assert table.splitlines() == [
        "| model    |  tok/s |",
        "|:---------|-------:|",
        "| llama-1b | 45,025 |",
        "| gpt2     |      9 |",
    ]


def test_cells_say_dash_for_what_is_missing() -> None:
    assert fmt(None) == "-"
    assert fmt(math.nan, ",.0f") == "-"
    assert fmt(45025.4, ",.0f") == "45,025"
    assert fmt(0.5) == "0.50"
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(3.0, 0.0) is None and ratio(None, 2.0) is None and ratio(math.nan, 1.0) is None


def test_provenance_names_the_command_commit_device_and_date() -> None:
    header = Provenance.here(["serving", "--tandem-args", "--api-servers 4"], device="2 x H200")
    assert header.command == "python -m benchmarks serving --tandem-args '--api-servers 4'"
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert header.commit in (head, f"{head}+changes")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", header.date)
    assert header.format().splitlines() == [
        f"command: {header.command}",
        f"commit:  {header.commit}",
        "device:  2 x H200",
        f"date:    {header.date}",
    ]


def test_provenance_of_a_tree_that_is_no_checkout(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == "unknown"


def test_provenance_names_this_machine_when_asked() -> None:
    device = Provenance.here(["decode"]).device
    if shutil.which("nvidia-smi") is None:
        assert device.endswith(f"({os.cpu_count()} CPUs), no GPU")
    else:
        assert "no GPU" not in device


def test_gpus_are_counted_by_name() -> None:
    assert gpu_summary(["NVIDIA H200"]) == "NVIDIA H200"
    assert gpu_summary(["NVIDIA H200", "NVIDIA H200"]) == "2 x NVIDIA H200"
    assert gpu_summary(["A", "B", "A"]) == "2 x A, B"


def test_percentile_interpolates_between_ranks() -> None:
    # Two equal groups: the median lies halfway between them, not on one of them.
    assert percentile([10.0, 10.0, 20.0, 20.0], 50) == 15.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


@dataclass
class _Result:
    name: str
    tok_s: float


def test_json_holds_the_provenance_and_plain_results(tmp_path: Path) -> None:
    header = Provenance("python -m benchmarks decode", "abc1234", "cpu", "2026-12-01 10:00 UTC")
    path = tmp_path / "out.json"
    write_json(path, header, {"models": [_Result("a", 1.5), _Result("b", math.nan)]})
    assert json.loads(path.read_text()) == {
        "provenance": {
            "command": "python -m benchmarks decode",
            "commit": "abc1234",
            "device": "cpu",
            "date": "2026-12-01 10:00 UTC",
        },
        "results": {"models": [{"name": "a", "tok_s": 1.5}, {"name": "b", "tok_s": None}]},
    }
