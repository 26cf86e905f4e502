"""Where a step's time goes: the engine core stepped in this process under torch.profiler
(`decode --profile-steps N`), its prompt steps and its steady decode steps apart.

A phase's table lists the kernels (on CUDA: device time, which CUDA graph replays include) or
the torch ops (on the CPU: each op's own CPU time, nested ops not counted twice) that took the
most time, per step of the phase, with their share of all the phase's kernel or op time. The
phase's wall time a step is beside it: the gap between the two is the host's (Python, launches)
where the device waited. The requests are new ones of the benchmark's shape, so prompt steps
run the prefill that the measured run ran, and decode steps run at its batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks.report import fmt, format_table

if TYPE_CHECKING:
    from protocol.messages import LoraRef

NAME_WIDTH = 90  # kernel names are C++ templates: the head says which kernel it is


@dataclass
class OpTime:
    name: str
    calls_per_step: float
    us_per_step: float
    share: float  # of the phase's kernel (or op) time


@dataclass
class PhaseProfile:
    phase: str  # "prompt steps" or "decode steps"
    steps: int
    wall_ms_per_step: float
    busy_ms_per_step: float  # kernel time on CUDA, ops' own CPU time on the CPU
    cuda: bool
    top: list[OpTime] = field(default_factory=list)


def profile_phases(
    core: Any, device: Any, prompts: list[list[int]], params: Any, decode_steps: int,
    loras: list[LoraRef | None] | None = None, top: int = 15,
) -> list[PhaseProfile]:  # fmt: skip
    """Add ``prompts`` at once (prompt i with adapter ``loras[i]``, a LoraRef or None);
    profile the steps until every one has its first token, then ``decode_steps`` more; step
    the rest to completion unprofiled (their blocks come back)."""
    from engine_core.request import Request

    waiting = {f"profile-{i}" for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        lora = loras[i] if loras else None
        core.add_request(Request(f"profile-{i}", prompt, params, lora=lora))

    def prompt_step() -> bool:
        for out in core.step():
            if out.new_token_ids:
                waiting.discard(out.request.request_id)
        return bool(waiting) and core.has_unfinished()

    def decode_step() -> bool:
        core.step()
        return core.has_unfinished()

    phases = [profiled("prompt steps", prompt_step, device, top)]
    if core.has_unfinished() and decode_steps > 0:
        phases.append(profiled("decode steps", decode_step, device, top, decode_steps))
    while core.has_unfinished():
        core.step()
    return phases


def profiled(
    phase: str, step: Callable[[], bool], device: Any, top: int, max_steps: int | None = None
) -> PhaseProfile:
    """Run ``step`` until it returns False (or ``max_steps`` times), under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = 0
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        more = True
        while more and steps != max_steps:
            more = step()
            steps += 1
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    return summarize(phase, prof.key_averages(), steps, wall, cuda, top)


def summarize(
    phase: str, events: Any, steps: int, wall_s: float, cuda: bool, top: int
) -> PhaseProfile:
    """The ``top`` events by their own time (device time for CUDA kernels), per step."""
    times = [(e.key, e.count, own_time_us(e, cuda)) for e in events]
    times = [t for t in times if t[2] > 0]
    busy = sum(t[2] for t in times)
    times.sort(key=lambda t: t[2], reverse=True)
    rows = [
        OpTime(name, count / steps, us / steps, us / busy if busy else 0.0)
        for name, count, us in times[:top]
    ]
    return PhaseProfile(phase, steps, 1e3 * wall_s / steps, busy / steps / 1e3, cuda, rows)


def own_time_us(event: Any, cuda: bool) -> float:
    """An averaged event's own time in microseconds: a CUDA kernel's device time, or on the CPU
    an op's CPU time less its children's (torch names the device field two ways by version)."""
    if not cuda:
        return float(event.self_cpu_time_total)
    if str(getattr(event, "device_type", "")).endswith("CUDA"):
        total = getattr(event, "self_device_time_total", None)
        if total is None:
            total = getattr(event, "self_cuda_time_total", 0)
        return float(total)
    return 0.0


def format_phase(model: str, profile: PhaseProfile) -> str:
    cuda = profile.cuda
    what = "kernel" if cuda else "op (CPU self time)"
    head = (
        f"[{model}] {profile.phase}: {profile.steps} steps, {profile.wall_ms_per_step:.2f} ms a "
        f"step wall, {profile.busy_ms_per_step:.2f} ms of {'kernels' if cuda else 'ops'}"
    )
    rows = [
        [
            op.name[:NAME_WIDTH], fmt(op.calls_per_step, ".1f"), fmt(op.us_per_step, ",.1f"),
            fmt(100 * op.share, ".1f"),
        ]
        for op in profile.top
    ]  # fmt: skip
    return f"{head}\n{format_table([what, 'calls a step', 'us a step', '% of time'], rows)}"
