"""`--profile`: after a server's measured runs of a workload, one more run under its torch profiler,
and the kernels that run spent its time in.

Both servers serve the same two routes, POST /start_profile and /stop_profile: Tandem with
``--profile-dir`` (engine_core/profiler.py), vLLM with ``--profiler-config`` (torch, no stacks, the
engine's process only). Each writes Chrome traces into its own folder under the benchmark's
output folder; the traces a stop wrote are read here alike: the GPU kernels' device time by kernel
name (a CUDA graph's kernels included), or where a trace has no kernel (the CPU), each torch op's
time, nested ops included. The profiled run is not among the reported figures: the profiler slows
the steps it records.

A kernel's time is the part of its span that no earlier kernel on its stream still covers. Under
programmatic dependent launch (Tandem's Triton kernels, engine_core/triton_pdl.py) a kernel is
resident, and its span open, while the kernel before it finishes: raw spans would count that wait
twice (a decode step's attention merge then looked like 14% of the time when it was 0.6%). Kernels
that do not overlap (vLLM's) keep their spans. The tables' totals are so each stream's busy time.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.report import fmt, format_table
from benchmarks.servers import Server

TOP = 20  # kernels listed a server and workload
NAME_WIDTH = 90  # kernel names are C++ templates: the head says which kernel it is
STOP_TIMEOUT_S = 900.0  # a stop writes the whole trace first (vLLM's docs: minutes on a GPU)


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls: int
    total_us: float
    share: float  # of all the kernels' (or ops') time in the traces


def enable(server: Server, folder: Path) -> None:
    """Give ``server`` the flags that turn its profiler on, writing into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if server.name == "tandem":
        server.command += ["--profile-dir", str(folder)]
    elif server.name == "vllm":
        config = {
            "profiler": "torch",
            "torch_profiler_dir": str(folder.resolve()),
            "torch_profiler_with_stack": False,
            "ignore_frontend": True,
        }
        server.command += ["--profiler-config", json.dumps(config)]
    else:
        raise SystemExit(f"--profile is wired for tandem and vllm, not {server.name}")
    server.profile_dir = folder


def profiled(server: Server, run: Callable[[], object]) -> tuple[list[KernelTime], str]:
    """``run()`` between the server's /start_profile and /stop_profile; the kernels (or ops) of
    the traces that stop wrote, most time first, and which of the two they are."""
    assert server.profile_dir is not None
    started = time.time()
    post(server, "start_profile", 60.0)
    try:
        run()
    finally:
        post(server, "stop_profile", STOP_TIMEOUT_S)
    traces = [p for p in server.profile_dir.rglob("*.json.gz") if p.stat().st_mtime >= started]
    return kernel_times(read_events(traces))


def post(server: Server, route: str, timeout: float) -> None:
    r = httpx.post(f"{server.url}/{route}", timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{server.name} /{route}: {r.status_code} {r.text[:300]}")


def read_events(traces: Iterable[Path]) -> list[dict]:
    events: list[dict] = []
    for path in traces:
        with gzip.open(path, "rt") as f:
            events += json.load(f).get("traceEvents", [])
    return events


def kernel_times(events: list[dict]) -> tuple[list[KernelTime], str]:
    """The events' GPU kernels by name, most time first (``"kernels"``); with none, the torch
    ops (``"ops"``, each op's whole duration: nested ops are counted within their callers)."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    kind = "kernels" if kernels else "ops"
    if kernels:
        timed = own_times(kernels)
    else:
        timed = [(e["name"], float(e.get("dur", 0.0))) for e in events if e.get("cat") == "cpu_op"]
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for name, us in timed:
        calls[name] += 1
        total[name] += us
    overall = sum(total.values()) or 1.0
    ranked = sorted(total, key=total.__getitem__, reverse=True)
    return [KernelTime(n, calls[n], total[n], total[n] / overall) for n in ranked], kind


def own_times(kernels: list[dict]) -> list[tuple[str, float]]:
    """Each kernel's name and the microseconds of its span past the end of every earlier kernel
    on the same stream (of the same process and device)."""
    lanes: dict[tuple, list[dict]] = defaultdict(list)
    for event in kernels:
        lanes[(event.get("pid"), event.get("tid"))].append(event)
    owned = []
    for lane in lanes.values():
        covered_until = -math.inf
        for event in sorted(lane, key=lambda e: float(e.get("ts", 0.0))):
            start = float(event.get("ts", 0.0))
            end = start + float(event.get("dur", 0.0))
            owned.append((event["name"], max(0.0, end - max(start, covered_until))))
            covered_until = max(covered_until, end)
    return owned


# Kernels by what they compute, for a line that two servers' tables share whatever their kernels
# are called. Tandem's attention kernels by name (engine_core/attention/); the peers' by
# FlashAttention's, FlashInfer's and vLLM's paged kernels' names. Matrix products: cuBLAS
# (nvjet, xmma, its split-K reduction), CUTLASS and Triton GEMMs and GEMVs, Tandem's fused
# experts' gate/up and down products and the skinny GEMM's split sum. A cache write (vLLM's
# reshape_and_cache_flash, Tandem's rotary_write_kv) is neither.
TANDEM_ATTENTION = frozenset(
    {"_decode_kernel", "_decode_merge_kernel", "_prefill_kernel", "_mla_decode_kernel",
     "_verify_kernel", "_shared_prefix_kernel"}
)  # fmt: skip
ATTENTION_MARKS = ("flash", "attn", "attention")
CACHE_WRITE_MARKS = ("reshape_and_cache",)
PRODUCT_MARKS = (
    "gemm", "gemv", "nvjet", "xmma", "splitkreduce", "matmul", "skinny", "_gate_up", "_down"
)  # fmt: skip
KINDS = ("attention", "matrix products", "the rest")


def kernel_kind(name: str) -> str:
    """What a kernel computes: one of KINDS."""
    lowered = name.lower()
    if any(mark in lowered for mark in CACHE_WRITE_MARKS):
        return "the rest"
    if name in TANDEM_ATTENTION or any(mark in lowered for mark in ATTENTION_MARKS):
        return "attention"
    if any(mark in lowered for mark in PRODUCT_MARKS):
        return "matrix products"
    return "the rest"


def by_kind(times: list[KernelTime]) -> dict[str, float]:
    """Microseconds of each of KINDS (each kind present, zero where none ran)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for t in times:
        totals[kernel_kind(t.name)] += t.total_us
    return totals


def format_profile(server: str, workload: str, times: list[KernelTime], kind: str) -> str:
    """A server's table for one workload's profiled run: its kernels' time by kind, then the
    TOP kernels (or ops)."""
    total_ms = sum(t.total_us for t in times) / 1000
    headers = [kind[:-1], "calls", "ms", "% of time"]
    rows = [
        [
            t.name[:NAME_WIDTH],
            str(t.calls),
            fmt(t.total_us / 1000, ",.2f"),
            fmt(100 * t.share, ".1f"),
        ]
        for t in times[:TOP]
    ]
    head = f"[{server}] {workload}, profiled run: {total_ms:,.1f} ms of {kind}"
    if not rows:
        return f"{head}: no trace events"
    if kind == "kernels":
        kinds = by_kind(times).items()
        head += " (" + ", ".join(f"{name} {fmt(us / 1000, ',.1f')}" for name, us in kinds) + ")"
    return f"{head}\n{format_table(headers, rows)}"
