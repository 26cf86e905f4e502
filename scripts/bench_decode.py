"""Decode benchmark on the GPU machine: our engine against the HBM roofline and HF transformers.

    python scripts/bench_decode.py [--models smollm2-135m,llama-1b,llama-8b,gpt2] [--json OUT]

In one run: measure HBM bandwidth with a device-to-device copy; then for each random-weight
preset (engine_core/presets.py) run the "decode-64" workload (64 requests at once, 128 random
prompt tokens, 256 output tokens each, EOS ignored, greedy, after a warm-up run) through

- ``inproc``: EngineCore stepped in this process (the offline path), and
- ``zmq``:    a real engine-core process (engine_core/server.py) driven by the raw ZMQ client,

then HF transformers ``generate`` on the same shapes (batch 64, same prompts; fewer output
tokens, --hf-output-len, to keep the run short). Prints one table: tok/s, TPOT and TTFT p50/p99,
% of the HBM roofline (all weights + the KV cache at the mean context, read once per step, over
the best of 20 timed device copies) two ways: the run's tok/s over the roofline's, which counts
the prefill too, and the roofline step time over the median gap between a request's tokens
(ITL p50, a steady decode step: the few gaps that span another request's prefill are outliers
of it); the steady decode's stalls (time lost to gaps of more than three steps once every
request has started, which TPOT carries over ITL); and the ratio to HF; then where one decode
step's time goes (graph replay alone, GPU kernel time under the profiler, the whole engine
step), with the overlapped loop and with the simple one (``--no-async-scheduling``), each with
the engine's step stats: host ms per part of the step, GPU ms per step and the share of the
time the GPU sat idle between steps (the target: under 5% with overlap). ``--no-overlap`` runs
the throughput table with the simple loop.

The zmq path starts the engine through this script's own ``engine`` subcommand (the engine core
of `tandem engine`, with this checkout on sys.path).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.models import build_model  # noqa: E402
from engine_core.presets import PRESETS, hf_config  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

# ---- results ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One workload run: what a client saw."""

    path: str
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float  # the median gap between a request's tokens: a steady decode step
    duration_s: float
    output_tokens: int
    stall_ms: float = 0.0  # steady decode's time lost to long gaps (stall_ms below)


@dataclass
class ModelResult:
    model: str
    weight_bytes: int
    bytes_per_step: int
    roofline_tok_s: float
    roofline_step_ms: float  # bytes_per_step over the measured bandwidth
    runs: list[RunResult] = field(default_factory=list)
    hf_tok_s: float | None = None
    hf_output_len: int = 0
    startup_s: float = 0.0
    step_profile: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def summarize(path: str, start: float, token_times: list[list[float]]) -> RunResult:
    """Client-side metrics from each request's token arrival times (perf_counter seconds)."""
    ttft = [(times[0] - start) * 1e3 for times in token_times]
    tpot = [(t[-1] - t[0]) * 1e3 / (len(t) - 1) for t in token_times if len(t) > 1]
    itl = [gap * 1e3 for times in token_times for gap in token_gaps(times)]
    end = max(times[-1] for times in token_times)
    total = sum(len(times) for times in token_times)
    itl_p50 = percentile(itl, 50)
    return RunResult(
        path=path,
        tok_s=total / (end - start),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
        itl_p50_ms=itl_p50,
        duration_s=end - start,
        output_tokens=total,
        stall_ms=stall_ms(token_times, itl_p50),
    )


# A gap between arrivals longer than this many steady steps is a stall.
STALL_FACTOR = 3.0


def stall_ms(token_times: list[list[float]], itl_ms: float) -> float:
    """The steady decode's stalls: from the moment every request has its first token to the
    last token, the milliseconds by which gaps between arrivals (of any request's tokens) longer
    than STALL_FACTOR steady steps (``itl_ms``) exceed one step. 0 in a run that streamed
    evenly; what TPOT carries over ITL when a few steps took much longer than the rest."""
    if itl_ms <= 0:
        return 0.0
    begin = max(times[0] for times in token_times if times)
    arrivals = sorted({t for times in token_times for t in times if t >= begin})
    gaps = [(after - before) * 1e3 for before, after in zip(arrivals, arrivals[1:], strict=False)]
    return sum(gap - itl_ms for gap in gaps if gap > STALL_FACTOR * itl_ms)


def token_gaps(times: list[float]) -> list[float]:
    """Each token's gap to the arrival before it. Tokens that arrive together (one message
    carrying several) split their arrival's gap rather than counting as zero-length gaps."""
    arrivals: list[list[float]] = []  # [time, tokens]
    for now in times:
        if arrivals and arrivals[-1][0] == now:
            arrivals[-1][1] += 1
        else:
            arrivals.append([now, 1])
    gaps: list[float] = []
    for (before, _), (now, count) in zip(arrivals, arrivals[1:], strict=False):
        gaps += [(now - before) / count] * int(count)
    return gaps


def percentile(values: list[float], q: float) -> float:
    """numpy's linear interpolation between order statistics, as loadgen/metrics.py takes it:
    with two equal-sized groups the median falls between them, not on whichever group a
    nearest-rank rounding picks."""
    return float(np.percentile(values, q)) if values else float("nan")


# ---- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: int
    output_len: int
    seed: int

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(3, vocab) for _ in range(self.prompt_len)]
            for _ in range(self.num_requests)
        ]

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True)

    def shorter(self, output_len: int, seed: int) -> Workload:
        return Workload(self.num_requests, self.prompt_len, output_len, seed)


def engine_config(
    name: str,
    work: Workload,
    device: str,
    enforce_eager: bool,
    overlap: bool = True,
    tensor_parallel_size: int = 1,
    tp_all_reduce: str = "auto",
    max_prefill_graph_tokens: int | None = None,
) -> EngineConfig:
    """Room for the workload's sequences, a short max_model_len bound, no memory-sized cache."""
    block_size = 16
    per_seq = -(-(work.prompt_len + work.output_len) // block_size) + 1
    return EngineConfig(
        model=f"random:{name}",
        device=device,
        max_model_len=min(4096, PRESETS[name].max_position_embeddings),
        block_size=block_size,
        num_kv_blocks=2 * work.num_requests * per_seq,
        max_num_seqs=work.num_requests,
        max_num_batched_tokens=max(8192, work.num_requests * work.prompt_len // 2),
        enforce_eager=enforce_eager,
        async_scheduling=overlap,
        tensor_parallel_size=tensor_parallel_size,
        tp_all_reduce=tp_all_reduce,
        **(
            {}
            if max_prefill_graph_tokens is None
            else {"max_prefill_graph_tokens": max_prefill_graph_tokens}
        ),
    )


# ---- in-process engine ---------------------------------------------------------------------------


def run_inproc(core: Any, work: Workload, vocab: int, tag: str) -> RunResult:
    """Add every request at once, step until all finish, timing each token's arrival."""
    from engine_core.request import Request

    prompts = work.prompts(vocab)
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        times[rid] = []
        core.add_request(Request(rid, prompt, work.params))
    while core.has_unfinished():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request.request_id].extend([now] * len(out.new_token_ids))
    return summarize("inproc", start, list(times.values()))


def profile_decode_step(core: Any, work: Workload, vocab: int, top: int = 6) -> dict[str, Any]:
    """Where one steady decode step's time goes, with the overlapped loop and the simple one
    (``sync_*`` keys): graph replay alone, GPU kernel time per step under the profiler, the whole
    engine step, and the engine's own step stats (host ms per part, GPU ms per step from CUDA
    events, and the fraction of the time the GPU sat idle between steps)."""
    result: dict[str, Any] = {}
    for overlap in (True, False):
        prefix = "" if overlap else "sync_"
        core.set_async_scheduling(overlap)
        for key, value in profile_one_loop(core, work, vocab, top=top).items():
            result[prefix + key] = value
    core.set_async_scheduling(True)
    result.update(time_graph_replay(core, work.num_requests))
    return result


def profile_one_loop(
    core: Any, work: Workload, vocab: int, steps: int = 100, top: int = 6
) -> dict[str, Any]:
    """Three windows of steady decode steps: plain (the step period, nothing instrumented), with
    step stats (host ms per part, GPU ms and idle from CUDA events), and under the profiler
    (kernel time per step; the profiler slows the host, so its busy share is taken against the
    plain window's step period, not its own)."""
    from engine_core.request import Request

    short = work.shorter(2 * steps + 60, seed=99)
    for i, prompt in enumerate(short.prompts(vocab)):
        core.add_request(Request(f"prof-{i}", prompt, short.params))
    for _ in range(4):  # the prefill(s) and a few decodes
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - start) / steps * 1e3
    result = step_stats_window(core, steps)
    profiled = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(profiled):
            core.step()
        torch.cuda.synchronize()
        profiled_ms = (time.perf_counter() - start) / profiled * 1e3
    kernel_ms = sum(e.device_time_total for e in prof.key_averages()) / profiled / 1e3
    while core.has_unfinished():
        core.step()
    result.update(
        {
            "engine_step_ms": plain_ms,
            "profiled_step_ms": profiled_ms,
            "gpu_kernel_ms_per_step": kernel_ms,
            "gpu_busy_pct": 100 * kernel_ms / plain_ms,
            "top_kernels": top_kernels(prof, profiled, count=top),
        }
    )
    return result


def step_stats_window(core: Any, steps: int) -> dict[str, float]:
    """The engine's step stats (engine_core/step_stats.py) over ``steps`` steady steps: host ms
    per part (the wait for the GPU shows up in "wait"), GPU ms per step and the idle gap."""
    stats = core.step_stats
    was_enabled, stats.enabled, stats.log_interval_s = stats.enabled, True, float("inf")
    core.runner.mark_idle()  # no gap across the switch
    stats.reset()
    try:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        summary = stats.summary()
    finally:
        stats.enabled = was_enabled
        stats.reset()
    out = {k: v for k, v in summary.items() if k.startswith("host_")}
    out["step_wall_ms"] = summary["step_wall_ms"]
    for key in ("gpu_ms", "gpu_idle_ms", "gpu_inner_idle_ms"):
        if key in summary:
            out[f"stats_{key}"] = summary[key]
    if "gpu_idle_fraction" in summary:
        out["gpu_idle_pct"] = 100 * summary["gpu_idle_fraction"]
    return out


def time_graph_replay(core: Any, batch: int) -> dict[str, float]:
    """The decode graph replayed alone. Not under tensor parallelism: the graph holds
    collectives, and replaying it on rank 0 alone would wait for the other ranks for ever."""
    graphs = getattr(core.runner, "graph_runner", None)
    if graphs is None or batch not in graphs.graphs or core.config.tensor_parallel_size > 1:
        return {}
    graph = graphs.graphs[batch]
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return {"graph_replay_ms": start.elapsed_time(end) / 20}


def top_kernels(prof: Any, steps: int, count: int = 6) -> str:
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:count]
    per_step = [(e.key[:48], e.device_time_total / steps / 1e3, e.count / steps) for e in rows]
    return "; ".join(f"{key} {ms:.3f} ms x{calls:g}" for key, ms, calls in per_step)


def bench_inproc(name: str, work: Workload, args: argparse.Namespace, result: ModelResult) -> None:
    from engine_core.core import EngineCore

    start = time.perf_counter()
    core = EngineCore(
        engine_config(
            name,
            work,
            args.device,
            args.enforce_eager,
            args.overlap,
            args.tensor_parallel_size,
            args.tp_all_reduce,
            args.max_prefill_graph_tokens,
        )  # fmt: skip
    )
    result.startup_s = time.perf_counter() - start
    vocab = core.model_config.vocab_size
    with serving_collector():
        run_inproc(core, work.shorter(16, seed=1), vocab, "warmup")
        result.runs.append(run_inproc(core, work, vocab, "main"))
        if args.profile and args.device != "cpu":
            result.step_profile = profile_decode_step(core, work, vocab, args.top_kernels)
    del core


@contextlib.contextmanager
def serving_collector() -> Iterator[None]:
    """The garbage collector as the engine process sets it before its loop (the start-up heap
    frozen, young collections spread out), so that the in-process path measures the loop that
    `tandem serve` runs; restored afterwards for the script's other stages."""
    from common.processes import freeze_startup_heap, spread_young_collections

    threshold = gc.get_threshold()
    freeze_startup_heap()
    spread_young_collections()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


# ---- engine process over raw ZMQ -----------------------------------------------------------------


@contextlib.contextmanager
def engine_process(
    name: str, work: Workload, args: argparse.Namespace
) -> Iterator[tuple[str, subprocess.Popen]]:
    """This script's ``engine`` subcommand in a subprocess; yields its address and process."""
    from protocol.address import private_ipc_address

    address = str(private_ipc_address())
    config = engine_config(
        name, work, args.device, args.enforce_eager, args.overlap, args.tensor_parallel_size,
        args.tp_all_reduce, args.max_prefill_graph_tokens,
    )  # fmt: skip
    # --engine-step-stats: the engine's step stats, a line per run (logged as it goes idle).
    log_level = "INFO" if args.engine_step_stats else "WARNING"
    command = [sys.executable, __file__, "engine", "--address", address, "--log-level", log_level]
    command += [
        f"--model={config.model}",
        f"--device={config.device}",
        f"--max-model-len={config.max_model_len}",
        f"--num-kv-blocks={config.num_kv_blocks}",
        f"--max-num-seqs={config.max_num_seqs}",
        f"--max-num-batched-tokens={config.max_num_batched_tokens}",
        f"--tensor-parallel-size={config.tensor_parallel_size}",
        f"--tp-all-reduce={config.tp_all_reduce}",
    ]
    if config.max_prefill_graph_tokens is not None:
        command.append(f"--max-prefill-graph-tokens={config.max_prefill_graph_tokens}")
    if config.enforce_eager:
        command.append("--enforce-eager")
    if not config.async_scheduling:
        command.append("--no-async-scheduling")
    if args.engine_step_stats:
        command.append("--step-stats")
    proc = subprocess.Popen(command)
    try:
        yield address, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_zmq(client: Any, work: Workload, vocab: int, tag: str) -> RunResult:
    from protocol.messages import RequestError, StepOutputs

    prompts = work.prompts(vocab)
    times: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    pending = set(times)
    start = time.perf_counter()
    for rid, prompt in zip(times, prompts, strict=True):
        client.add_request(rid, prompt, work.params)
    while pending:
        msg = client.recv(timeout=120.0)
        now = time.perf_counter()
        if msg is None:
            raise TimeoutError("the engine sent nothing for 120 s")
        if isinstance(msg, RequestError):
            raise RuntimeError(f"engine refused {msg.request_id}: {msg.message}")
        if not isinstance(msg, StepOutputs):
            continue
        for out in msg.outputs:
            times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finish_reason is not None:
                pending.discard(out.request_id)
        pending.difference_update(msg.finished_without_tokens)
    return summarize("zmq", start, list(times.values()))


def bench_zmq(name: str, work: Workload, args: argparse.Namespace, result: ModelResult) -> None:
    from protocol.client import EngineClient

    with engine_process(name, work, args) as (address, proc), EngineClient(address) as client:
        connect(client, proc, args.engine_start_timeout)
        vocab = PRESETS[name].vocab_size
        run_zmq(client, work.shorter(16, seed=1), vocab, "warmup")
        result.runs.append(run_zmq(client, work, vocab, "main"))


def connect(client: Any, proc: subprocess.Popen, timeout: float) -> None:
    """Handshake with the engine, giving up at once if its process dies while starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.connect(timeout=2.0)
            return
        except TimeoutError:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise


# ---- HF transformers peer ----------------------------------------------------------------------


def bench_hf(name: str, work: Workload, args: argparse.Namespace, result: ModelResult) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = hf_config(name)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as our workload does
    ids = torch.tensor(work.prompts(PRESETS[name].vocab_size), device=args.device)
    mask = torch.ones_like(ids)

    def generate(new_tokens: int) -> None:
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )

    with torch.inference_mode():
        generate(4)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        generate(args.hf_output_len)
        sync(args.device)
    result.hf_tok_s = work.num_requests * args.hf_output_len / (time.perf_counter() - start)
    result.hf_output_len = args.hf_output_len


# ---- roofline -----------------------------------------------------------------------------------


def measure_hbm_bandwidth(device: str, gib: float = 2.0, copies: int = 20) -> float:
    """Bytes per second of a device-to-device copy (bytes read + bytes written): the best of
    ``copies``, each timed by CUDA events. The best, not the median: the roofline is what the
    memory can do, and a lower figure (the median moved 2.89-3.00 TB/s between runs on one
    H100) would flatter every share against it."""
    n = int(gib * 2**30) if device == "cuda" else 2**26
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(copies):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - begin)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine's memory plan counts cached blocks as in use
    return 2 * n / min(times)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def roofline(name: str, work: Workload, bandwidth: float) -> tuple[int, int, float]:
    """(weight bytes, bytes per decode step, roofline tok/s): every weight once per step (as
    DESIGN.md's table counts them) plus each sequence's K/V at the mean context."""
    config = PRESETS[name]
    with torch.device("meta"):
        model = build_model(config)
    weights = sum(p.numel() * 2 for p in model.parameters())  # bf16
    mean_context = work.prompt_len + work.output_len / 2
    kv = int(work.num_requests * mean_context * config.kv_bytes_per_token)
    step = weights + kv
    return weights, step, work.num_requests * bandwidth / step


# ---- driver -------------------------------------------------------------------------------------


def bench_model(name: str, work: Workload, args: argparse.Namespace, bw: float) -> ModelResult:
    weights, step, roof = roofline(name, work, bw)
    result = ModelResult(name, weights, step, roof, 1e3 * step / bw)
    stages: list[tuple[str, Callable[..., None]]] = []
    if "inproc" in args.paths:
        stages.append(("inproc", bench_inproc))
    if "zmq" in args.paths:
        stages.append(("zmq", bench_zmq))
    if not args.no_hf:
        stages.append(("hf", bench_hf))
    for stage, fn in stages:
        started = time.perf_counter()
        try:
            fn(name, work, args, result)
        except Exception as exc:  # one failed path must not lose the others' numbers
            result.errors.append(f"{stage}: {type(exc).__name__}: {exc}")
            print(f"[{name}] {stage} failed: {exc!r}", flush=True)
        free_gpu()
        print(f"[{name}] {stage} done in {time.perf_counter() - started:.1f} s", flush=True)
    return result


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def format_table(results: list[ModelResult]) -> str:
    head = (
        f"{'model':<13} {'path':<7} {'tok/s':>9} {'TPOT p50':>9} {'p99':>7} {'TTFT p50':>9} "
        f"{'p99':>8} {'roofline':>9} {'%roof':>6} {'ITL p50':>8} {'step%':>6} {'stall':>7} "
        f"{'HF tok/s':>9} {'xHF':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        hf = f"{r.hf_tok_s:9.0f}" if r.hf_tok_s else f"{'-':>9}"
        for run in r.runs or [None]:
            if run is None:
                lines.append(f"{r.model:<13} {'-':<7} {'failed':>9}")
                continue
            ratio = f"{run.tok_s / r.hf_tok_s:6.1f}" if r.hf_tok_s else f"{'-':>6}"
            lines.append(
                f"{r.model:<13} {run.path:<7} {run.tok_s:9.0f} {run.tpot_p50_ms:8.2f}m "
                f"{run.tpot_p99_ms:6.2f}m {run.ttft_p50_ms:8.1f}m {run.ttft_p99_ms:7.1f}m "
                f"{r.roofline_tok_s:9.0f} {100 * run.tok_s / r.roofline_tok_s:5.1f}% "
                f"{run.itl_p50_ms:7.2f}m {100 * r.roofline_step_ms / run.itl_p50_ms:5.1f}% "
                f"{run.stall_ms:6.1f}m {hf} {ratio}"
            )
    lines.append(
        "%roof: the run's tok/s over the roofline's (prefill time included); step%: the roofline "
        "step time over the median inter-token gap (a steady decode step); stall: steady "
        f"decode's time lost to gaps longer than {STALL_FACTOR:g} steps"
    )
    return "\n".join(lines)


def format_profiles(results: list[ModelResult]) -> str:
    lines = [
        "engine start-up (build + CUDA-graph capture) | decode step: graph replay | "
        "GPU kernels/step (profiler) | engine step | kernel share of step | GPU idle (step stats: "
        "waits for the host before and inside the step, over GPU time + waits)"
    ]
    for r in results:
        p = r.step_profile
        if p:
            lines.append(f"  {r.model:<13} start-up {r.startup_s:5.1f} s")
        for prefix, loop in (("", "overlap"), ("sync_", "no-overlap")):
            if f"{prefix}engine_step_ms" not in p:
                continue
            lines.append(
                f"  {'':<13} {loop:<10} | {p.get('graph_replay_ms', float('nan')):6.3f} ms | "
                f"{p[prefix + 'gpu_kernel_ms_per_step']:6.3f} ms | "
                f"{p[prefix + 'engine_step_ms']:6.3f} ms | {p[prefix + 'gpu_busy_pct']:4.0f}% | "
                f"idle {p.get(prefix + 'gpu_idle_pct', float('nan')):5.1f}% "
                f"({p.get(prefix + 'stats_gpu_idle_ms', float('nan')):.3f} ms, "
                f"{p.get(prefix + 'stats_gpu_inner_idle_ms', float('nan')):.3f} of it inside; "
                f"{p.get(prefix + 'stats_gpu_ms', float('nan')):.3f} ms GPU/step; "
                f"step {p.get(prefix + 'step_wall_ms', float('nan')):.3f} ms instrumented)"
            )
            host = ", ".join(
                f"{k.removeprefix(prefix + 'host_').removesuffix('_ms')} {v:.3f}"
                for k, v in p.items()
                if k.startswith(prefix + "host_")
            )
            lines.append(f"  {'':<13} {'':<10}   host ms/step: {host}")
            lines.append(f"  {'':<13} {'':<10}   top: {p[prefix + 'top_kernels']}")
        for e in r.errors:
            lines.append(f"  {r.model:<13} ERROR {e}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(PRESETS), help="comma-separated presets")
    parser.add_argument("--paths", default="inproc,zmq", help="inproc and/or zmq")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hf-output-len", type=int, default=64)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument(
        "--top-kernels", type=int, default=6, help="kernels listed per profiled step"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--max-prefill-graph-tokens",
        type=int,
        default=None,
        help="the engines' --max-prefill-graph-tokens (default: the engine's own)",
    )
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="throughput runs with the simple loop (the step profile always measures both)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="no-op, kept for old command lines: the models now use the fused kernels on CUDA",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs per engine core (one worker process per extra rank; default: %(default)s)",
    )
    parser.add_argument(
        "--tp-all-reduce",
        default="auto",
        choices=["auto", "nccl"],
        help="with --tensor-parallel-size > 1: the engine's --tp-all-reduce (default: %(default)s)",
    )
    parser.add_argument("--engine-start-timeout", type=float, default=300.0)
    parser.add_argument(
        "--engine-step-stats",
        action="store_true",
        help="zmq path: the engine process times each part of its steps and logs a summary of "
        "each run (host ms per part, GPU ms and idle) on its stderr; the timing costs host time "
        "of its own (about as much again at batch 64, docs/benchmarks.md)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] == ["engine"]:
        return run_engine(argv[1:])
    args = parse_args(argv)
    work = Workload(args.num_requests, args.prompt_len, args.output_len, seed=0)
    bandwidth = measure_hbm_bandwidth(args.device)
    print(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = []
    for name in args.models.split(","):
        results.append(bench_model(name, work, args, bandwidth))
        if args.json:
            write_json(args.json, argv, bandwidth, results)
    print(f"\n{device_name()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"command: python {shlex.join([sys.argv[0], *argv])}")
    print(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s; workload {asdict(work)}")
    print(format_profiles(results))
    print(format_table(results))
    return 0


def write_json(path: Path, argv: list[str], bandwidth: float, results: list[ModelResult]) -> None:
    payload = {
        "command": shlex.join(["python", sys.argv[0], *argv]),
        "device": device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hbm_bandwidth_bytes_per_s": bandwidth,
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=2))


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run_engine(argv: list[str]) -> int:
    """The engine-core process with ``random:<preset>`` models (used by the zmq path)."""
    from engine_core import proc

    parser = argparse.ArgumentParser(prog="bench_decode.py engine")
    proc.add_args(parser)
    return proc.run(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
