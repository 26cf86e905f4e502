"""scripts/device/decode_timeline.py's report against a hand-written Chrome trace of the
PyTorch profiler: steps cut at each input copy, the step cut short at the capture's end left
out, per-kernel durations, shares and gaps (negative where a launch overlaps the one before)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_modules import load_script

# Two whole steps of 100 us wall (norm 10 us, gemm 30 us starting 2 us before the norm ends,
# attention 40 us after a 5 us gap, the ids' copy back), then a third cut short. Times in us.
ROWS = [
    (0, 1, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)"),
    (10, 10, "kernel", "rms_norm_kernel"),
    (18, 30, "kernel", "void gemm_kernel<float>(int)"),
    (53, 40, "kernel", "_decode_kernel"),
    (94, 1, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)"),
    (100, 1, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)"),
    (110, 10, "kernel", "rms_norm_kernel"),
    (118, 30, "kernel", "void gemm_kernel<float>(int)"),
    (153, 40, "kernel", "_decode_kernel"),
    (200, 1, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)"),
    (210, 10, "kernel", "rms_norm_kernel"),
]


@pytest.fixture(scope="module")
def timeline() -> ModuleType:
    return load_script("device/decode_timeline")


def write_trace(tmp_path: Path) -> Path:
    """ROWS as the profiler writes them, shuffled, with host-side events that must be ignored."""
    events = [
        {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}
        for ts, dur, cat, name in ROWS
    ]
    events.reverse()
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5, "dur": 9})
    events.append({"ph": "i", "cat": "kernel", "name": "marker", "ts": 50, "s": "t"})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_steps_are_cut_at_input_copies(timeline: ModuleType, tmp_path: Path) -> None:
    steps = timeline.split_steps(timeline.read_trace(write_trace(tmp_path)))
    assert [[k[2] for k in s] for s in steps] == [
        ["rms_norm_kernel", "void gemm_kernel<float>(int)", "_decode_kernel"]
    ] * 2
    assert steps[1][0][:2] == (110.0, 10.0)  # microseconds


def test_report_gives_each_kernel_its_time_share_and_gap(
    timeline: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline.main(["report", str(write_trace(tmp_path))])
    lines = capsys.readouterr().out.splitlines()
    # Wall: the first kernel's start to the last one's end, 10 -> 93 us.
    assert lines[0] == "2 steps: median wall 83.0 us, kernels' own time 80.0 us, 3 kernels a step"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["_decode_kernel"] == ["1", "40.00", "48.2%", "5.00"]
    assert rows["gemm_kernel"] == ["1", "30.00", "36.1%", "-2.00"]
    assert rows["rms_norm_kernel"] == ["1", "10.00", "12.0%", "nan"]
    order = [line.split()[0] for line in lines[2:]]  # by time a step, largest first
    assert order == ["_decode_kernel", "gemm_kernel", "rms_norm_kernel"]
