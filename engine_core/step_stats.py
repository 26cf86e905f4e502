"""Per-step instrumentation of the engine core's hot loop, off by default.

With ``--step-stats`` (or ``TANDEM_STEP_STATS=1``) the engine core times each part of a step on
the host (schedule, prepare, forward launch, sample launch, device-to-host copy enqueue, wait for
the result, update, send) and, on CUDA, the GPU time of each step and the time the GPU sat idle
waiting for the host, before the step and inside it (from CUDA events around each stretch of GPU
work the step enqueues, see ``GpuTimeline``; they are read only after the step's result has
arrived, so they add no synchronisation). A summary is logged every ``log_interval_s`` seconds
and is available from ``summary()``.

It also counts the time the loop's thread spent off the CPU between one step's end and the next
(wall time less the thread's CPU time): a spinning loop has almost none, so off-CPU time is the
thread preempted by another (its run-queue wait, from ``/proc/thread-self/schedstat``), the
host taking the virtual CPU (steal, ``/proc/stat``), or the thread blocked (the GIL, a lock).

With ``--nvtx`` each part is also an NVTX range, for Nsight Systems.
"""

from __future__ import annotations

import logging
import os
import time
from types import TracebackType
from typing import TYPE_CHECKING

from common import env

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tandem.step_stats")

PHASES = (
    "schedule",
    "prepare",
    "forward",
    "sample",
    "bitmask",
    "to_host",
    "wait",
    "update",
    "send",
)


class _NullPhase:
    """The phase of disabled instrumentation: costs one attribute lookup and two calls."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _NullPhase()


class _Phase:
    __slots__ = ("_stats", "_name", "_start")

    def __init__(self, stats: StepStats, name: str) -> None:
        self._stats, self._name, self._start = stats, name, 0.0

    def __enter__(self) -> None:
        if self._stats.nvtx:
            import torch

            torch.cuda.nvtx.range_push(self._name)
        self._start = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        elapsed = time.perf_counter() - self._start
        if self._stats.nvtx:
            import torch

            torch.cuda.nvtx.range_pop()
        if self._stats.enabled:
            self._stats.host_s[self._name] += elapsed


class GpuTimeline:
    """CUDA events around each stretch of GPU work that one step enqueues.

    The host enqueues a step in stretches (the input copy, the forward, the sampler and the copy
    back) with host work between them. An event completes when the GPU reaches it in the stream:
    at once, if the GPU had run out of work (then at about the time the host recorded it), else
    when the work ahead of it ends. So from one stretch's end event to the next stretch's start
    event is exactly the time the GPU sat waiting for the host, and start to end of a stretch is
    GPU time. (Kernels of one stretch are launched back to back, so a gap inside a stretch is
    the GPU's own launch latency, not the host's; it counts as busy.)
    """

    def __init__(self) -> None:
        self._events: list[torch.cuda.Event] = []

    def begin(self) -> None:
        """Mark the start of a stretch (call right before enqueuing its first GPU work)."""
        self._record()

    def end(self) -> None:
        """Mark the end of a stretch (call right after enqueuing its last GPU work)."""
        self._record()

    def _record(self) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append(event)

    @property
    def first(self) -> torch.cuda.Event | None:
        return self._events[0] if self._events else None

    @property
    def last(self) -> torch.cuda.Event | None:
        return self._events[-1] if self._events else None

    def busy_and_idle_ms(self) -> tuple[float, float]:
        """GPU ms inside the stretches, and ms the GPU waited between them (events complete)."""
        events = self._events
        busy = sum(events[i].elapsed_time(events[i + 1]) for i in range(0, len(events) - 1, 2))
        idle = sum(events[i].elapsed_time(events[i + 1]) for i in range(1, len(events) - 1, 2))
        return busy, max(idle, 0.0)


class StepStats:
    """Accumulates per-step host and GPU times; ``phase(name)`` is a no-op when disabled."""

    def __init__(self, enabled: bool = False, nvtx: bool = False, log_interval_s: float = 10.0):
        self.enabled = enabled or env.step_stats()
        self.nvtx = nvtx and _cuda_available()  # NVTX calls need a CUDA build
        self.log_interval_s = log_interval_s
        self._phases = {name: _Phase(self, name) for name in PHASES}
        self._last_log = time.monotonic()
        self.reset()

    @property
    def active(self) -> bool:
        return self.enabled or self.nvtx

    def reset(self) -> None:
        """Start a new window (the summary covers the steps since the last reset)."""
        self.host_s = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.gpu_ms = 0.0
        self.num_gpu_steps = 0
        self.idle_ms = 0.0
        self.inner_idle_ms = 0.0  # waits for the host between a step's own stretches
        self.busy_ms_with_gap = 0.0  # GPU time of the steps whose idle gap is known
        self.num_gaps = 0
        self.off_cpu_ms = 0.0
        self.off_cpu_max_ms = 0.0
        self.off_cpu_steps = 0  # steps with over OFF_CPU_STEP_MS off the CPU
        self._last_clocks: tuple[float, float] | None = None  # (wall, thread CPU) at end_step
        self._window_start = time.perf_counter()
        # Read at the window's first step, as off-CPU time starts there: not start-up or the
        # idle wait before a burst.
        self._window_wait_ms = 0.0
        self._window_steal_ms = 0.0

    def phase(self, name: str) -> _Phase | _NullPhase:
        """``with stats.phase("prepare"): ...`` times the block (and names an NVTX range)."""
        return self._phases[name] if self.enabled or self.nvtx else _NULL

    def add_gpu(self, gpu_ms: float, inner_idle_ms: float, idle_ms: float | None) -> None:
        """One step's GPU time, the GPU's waits for the host inside the step, and the idle gap
        before it (None: the GPU had no previous step, e.g. the engine had been idle, so the
        gap is no overhead of the loop)."""
        self.gpu_ms += gpu_ms
        self.num_gpu_steps += 1
        if idle_ms is not None:
            self.idle_ms += max(idle_ms, 0.0) + inner_idle_ms
            self.inner_idle_ms += inner_idle_ms
            self.busy_ms_with_gap += gpu_ms
            self.num_gaps += 1

    def end_step(self) -> None:
        """Count one engine step; log a summary every ``log_interval_s`` seconds."""
        if not self.enabled:
            return
        self.num_steps += 1
        self._count_off_cpu()
        if time.monotonic() - self._last_log >= self.log_interval_s:
            self.log_window()

    def _count_off_cpu(self) -> None:
        """The loop thread's time off the CPU since the last step ended (not counted for a
        window's first step: before it the loop may have been idle, blocked on its inbox)."""
        clocks = (time.perf_counter(), time.thread_time())
        if self._last_clocks is None:
            self._window_wait_ms = _run_queue_wait_ms()
            self._window_steal_ms = _steal_ms()
        else:
            wall, cpu = (now - last for now, last in zip(clocks, self._last_clocks, strict=True))
            off_ms = max(wall - cpu, 0.0) * 1e3
            self.off_cpu_ms += off_ms
            self.off_cpu_max_ms = max(self.off_cpu_max_ms, off_ms)
            self.off_cpu_steps += off_ms > OFF_CPU_STEP_MS
        self._last_clocks = clocks

    def log_window(self) -> None:
        """Log the summary of the steps since the last one, if any, and start a new window. The
        engine also calls it when it goes idle, so a burst of work shorter than the interval (a
        benchmark run) gets a line of its own, not one shared with the next burst."""
        if not self.enabled or not self.num_steps:
            return
        self._last_log = time.monotonic()
        logger.info("step stats: %s", format_summary(self.summary()))
        self.reset()

    def summary(self) -> dict[str, float]:
        """Means per step over the window: host ms per phase, GPU ms, idle ms (before and inside
        the step) and the idle fraction (idle over idle + GPU time); totals over the window:
        the loop thread's time off the CPU (its longest stretch, the steps with over
        OFF_CPU_STEP_MS), its run-queue wait and the host's steal, from the window's first step
        on (0 where Linux's /proc is not there to read)."""
        steps = max(self.num_steps, 1)
        out = {f"host_{name}_ms": seconds * 1e3 / steps for name, seconds in self.host_s.items()}
        out["steps"] = float(self.num_steps)
        out["step_wall_ms"] = (time.perf_counter() - self._window_start) * 1e3 / steps
        if self.num_gpu_steps:
            out["gpu_ms"] = self.gpu_ms / self.num_gpu_steps
        if self.num_gaps:
            out["gpu_idle_ms"] = self.idle_ms / self.num_gaps
            out["gpu_inner_idle_ms"] = self.inner_idle_ms / self.num_gaps
            total = self.idle_ms + self.busy_ms_with_gap
            out["gpu_idle_fraction"] = self.idle_ms / total if total > 0 else 0.0
        out["off_cpu_ms"] = self.off_cpu_ms
        out["off_cpu_max_ms"] = self.off_cpu_max_ms
        out["off_cpu_steps"] = float(self.off_cpu_steps)
        counted = self._last_clocks is not None  # the baselines below were read
        out["run_queue_wait_ms"] = _run_queue_wait_ms() - self._window_wait_ms if counted else 0.0
        out["steal_ms"] = _steal_ms() - self._window_steal_ms if counted else 0.0
        return out


# A step whose thread was off the CPU longer than this is counted (off_cpu_steps).
OFF_CPU_STEP_MS = 1.0


def _run_queue_wait_ms() -> float:
    """This thread's time so far runnable but waiting for a CPU (0 where Linux's schedstat is
    not readable)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def _steal_ms() -> float:
    """The CPU time the hypervisor took from this machine's virtual CPUs so far, all of them
    together (0 where /proc/stat is not readable)."""
    try:
        with open("/proc/stat") as f:
            ticks = int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0.0
    return ticks * 1e3 / os.sysconf("SC_CLK_TCK")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def format_summary(summary: dict[str, float]) -> str:
    """One log line from ``StepStats.summary()``."""
    parts = [f"{int(summary['steps'])} steps", f"wall {summary['step_wall_ms']:.3f} ms/step"]
    if "gpu_ms" in summary:
        parts.append(f"gpu {summary['gpu_ms']:.3f} ms")
    if "gpu_idle_fraction" in summary:
        parts.append(
            f"gpu idle {summary['gpu_idle_ms']:.3f} ms ({100 * summary['gpu_idle_fraction']:.1f}%)"
        )
    host = ", ".join(f"{name} {summary[f'host_{name}_ms']:.3f}" for name in PHASES)
    parts.append(f"host ms: {host}")
    if "off_cpu_ms" in summary:
        parts.append(
            f"loop thread off the CPU {summary['off_cpu_ms']:.1f} ms in all, longest "
            f"{summary['off_cpu_max_ms']:.2f} ms, {int(summary['off_cpu_steps'])} steps over "
            f"{OFF_CPU_STEP_MS:g} ms (its run-queue wait {summary['run_queue_wait_ms']:.1f} ms, "
            f"host steal {summary['steal_ms']:.0f} ms, all CPUs)"
        )
    return "; ".join(parts)
