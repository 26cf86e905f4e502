"""The GPU-idle arithmetic of the step stats (engine_core/step_stats.py), with stand-in events.

CUDA events need a GPU; the pairing of stretches and gaps is plain arithmetic on their times, so
events with a known completion time (in ms) check it by hand computation on the CPU.
"""

from __future__ import annotations

import pytest

from engine_core.step_stats import GpuTimeline, StepStats


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
