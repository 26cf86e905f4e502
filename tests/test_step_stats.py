"""The GPU-idle arithmetic of the step stats (engine_core/step_stats.py), with stand-in events.

CUDA events need a GPU; the pairing of stretches and gaps is plain arithmetic on their times, so
events with a known completion time (in ms) check it by hand computation on the CPU.
"""

from __future__ import annotations

import time

import pytest

from engine_core.step_stats import GpuTimeline, StepStats, format_summary


class _At:
    """An event that completed at ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: _At) -> float:
        return later.ms - self.ms


def _timeline(*times: float) -> GpuTimeline:
    timeline = GpuTimeline()
    timeline._events = [_At(t) for t in times]  # type: ignore[list-item]
    return timeline


def test_stretches_are_busy_and_the_gaps_between_them_idle() -> None:
    # Input copy 0.0-0.1, forward 0.3-1.3 (the GPU waited 0.2 for the host), sampler 1.3-1.5.
    busy, idle = _timeline(0.0, 0.1, 0.3, 1.3, 1.3, 1.5).busy_and_idle_ms()
    assert busy == pytest.approx(0.1 + 1.0 + 0.2)
    assert idle == pytest.approx(0.2)


def test_idle_fraction_counts_gaps_before_and_inside_steps() -> None:
    stats = StepStats(enabled=True)
    # Two steps of 1.2 ms GPU time; the second started 0.3 ms after the first ended, and
    # inside it the GPU waited 0.1 ms between stretches. The first step's gap is unknown.
    stats.add_gpu(1.2, 0.0, None)
    stats.add_gpu(1.2, 0.1, 0.3)
    stats.end_step()
    stats.end_step()
    summary = stats.summary()
    assert summary["gpu_ms"] == pytest.approx(1.2)
    assert summary["gpu_idle_ms"] == pytest.approx(0.4)
    assert summary["gpu_inner_idle_ms"] == pytest.approx(0.1)
    assert summary["gpu_idle_fraction"] == pytest.approx(0.4 / 1.6)


def test_a_sleeping_loop_thread_is_counted_off_the_cpu() -> None:
    """Sleeping between two steps' ends puts the thread off the CPU for at least the sleep
    (wall time passes, its CPU time does not); the window's first step is not counted, since
    before it the loop may have been idle."""
    stats = StepStats(enabled=True)
    time.sleep(0.02)  # idle before the window's first step: not counted
    stats.end_step()
    assert stats.summary()["off_cpu_ms"] == 0.0
    time.sleep(0.02)
    stats.end_step()
    summary = stats.summary()
    assert summary["off_cpu_ms"] >= 19.0
    assert summary["off_cpu_max_ms"] == summary["off_cpu_ms"]
    assert summary["off_cpu_steps"] == 1.0
    assert summary["run_queue_wait_ms"] >= 0.0 and summary["steal_ms"] >= 0.0
    assert "loop thread off the CPU" in format_summary(summary)
    stats.reset()
    assert stats.summary()["off_cpu_ms"] == 0.0
