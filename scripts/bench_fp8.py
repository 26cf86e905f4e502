"""FP8 benchmark on the GPU machine: bf16 against FP8 weights against FP8 weights + FP8 KV cache.

    python scripts/bench_fp8.py [--model llama-8b] [--variants bf16,fp8,fp8+kv] [--json OUT]

One engine core per variant, in this process (CUDA graphs, overlapped loop, random weights with
the preset's real shapes; the FP8 variants quantize those same random weights per output row as
``--quantization fp8`` does), each serving, with fresh random prompts and EOS ignored:

- **decode-64**: 64 requests of 128 prompt tokens, 256 output tokens; output tok/s, TPOT p50 and
  the share of the HBM roofline: the bytes a step must read (the model's parameters as that
  variant holds them, plus the KV cache at the mean context in the cache's dtype) over the
  measured copy bandwidth.
- **long**: 32 requests of 3,800 prompt tokens, 256 output tokens (the same measures).
- **prefill**: 64 prompts of 2,048 tokens, one output token each; tokens per second to the last
  first token.

``--profile`` adds, per variant, where a decode-64 step's time goes (the engine's step stats and
the top GPU kernels, as scripts/bench_decode.py reports them); ``--profile-prefill`` where the
long workload's prefill goes: the GPU kernels of one step of 4 fresh 3,800-token prompts.

Each workload runs ``--repeats`` times (3) with fresh prompts after a warm-up; the table shows
the run of median speed, and the log every run's. Prints one table per variant and the ratios to
bf16, with the command that made them.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import (  # noqa: E402
    RunResult,
    Workload,
    device_name,
    measure_hbm_bandwidth,
    profile_one_loop,
    run_inproc,
    top_kernels,
)

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.presets import PRESETS  # noqa: E402

BLOCK_SIZE = 16
# variant -> (--quantization, --kv-cache-dtype)
VARIANTS = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "fp8+kv": ("fp8", "fp8")}


@dataclass
class VariantResult:
    variant: str
    weight_bytes: int
    kv_element_bytes: int
    startup_s: float
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)  # a decode-64 step, --profile
    prefill_profile: dict[str, Any] = field(default_factory=dict)  # --profile-prefill


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    return {
        "decode-64": Workload(64, 128, args.output_len, 0),
        "long": Workload(32, args.long_prompt_len, args.output_len, 0),
        "prefill": Workload(64, 2048, 1, 0),
    }


def engine_config(args: argparse.Namespace, variant: str) -> EngineConfig:
    quantization, kv_dtype = VARIANTS[variant]
    blocks = max(w.num_requests * (-(-(w.prompt_len + w.output_len) // BLOCK_SIZE) + 1)
                 for w in workloads(args).values())  # fmt: skip
    return EngineConfig(
        model=f"random:{args.model}",
        device=args.device,
        max_model_len=min(4096, PRESETS[args.model].max_position_embeddings),
        block_size=BLOCK_SIZE,
        num_kv_blocks=blocks,  # the runs take turns: room for the largest
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=quantization,
        kv_cache_dtype=kv_dtype,
    )


def bench_variant(args: argparse.Namespace, variant: str, bandwidth: float) -> VariantResult:
    from engine_core.core import EngineCore

    start = time.perf_counter()
    core = EngineCore(engine_config(args, variant))
    model = core.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = core.runner.kv_cache.element_size()
    result = VariantResult(variant, weight_bytes, kv_bytes, time.perf_counter() - start)
    vocab = core.model_config.vocab_size
    seed = iter(range(1000 * (1 + list(VARIANTS).index(variant)), 10**6))
    run_inproc(core, Workload(8, 64, 8, next(seed)), vocab, "warmup")
    for name, work in workloads(args).items():
        fresh = Workload(work.num_requests, work.prompt_len, work.output_len, next(seed))
        run_inproc(core, fresh.shorter(min(8, work.output_len), next(seed)), vocab, f"w-{name}")
        repeats = []
        for _ in range(args.repeats):  # fresh prompts each time: no prefix-cache hits
            fresh = Workload(work.num_requests, work.prompt_len, work.output_len, next(seed))
            run = run_inproc(core, fresh, vocab, name)
            repeats.append(measures(run, work, core, weight_bytes, kv_bytes, bandwidth))
        result.runs[name] = median_run(repeats)
        print(f"{variant:7s} {name:9s} {summary(result.runs[name])}", flush=True)
    if args.profile:
        work = Workload(64, 128, args.output_len, next(seed))
        result.profile = profile_one_loop(core, work, vocab)
        print(f"{variant} decode-64 step: {result.profile}", flush=True)
    if args.profile_prefill:
        work = Workload(4, args.long_prompt_len, 1, next(seed))
        result.prefill_profile = profile_prefill(core, work, vocab)
        print(f"{variant} long prefill step: {result.prefill_profile}", flush=True)
    del core, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def profile_prefill(core: Any, work: Workload, vocab: int) -> dict[str, Any]:
    """GPU kernel time of the step that prefills ``work``'s prompts (one step: they must fit
    --max-num-batched-tokens), under torch.profiler: total and the top kernels."""
    from engine_core.request import Request

    for i, prompt in enumerate(work.prompts(vocab)):
        core.add_request(Request(f"prefill-prof-{i}", prompt, work.params))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    while core.has_unfinished():
        core.step()
    kernel_ms = sum(e.device_time_total for e in prof.key_averages()) / 1e3
    return {
        "tokens": work.num_requests * work.prompt_len,
        "step_wall_ms": wall_ms,
        "gpu_kernel_ms": kernel_ms,
        "top_kernels": top_kernels(prof, 1, count=12),
    }


def measures(
    run: RunResult, work: Workload, core: Any, weight_bytes: int, kv_bytes: int, bandwidth: float
) -> dict[str, Any]:
    out = asdict(run)
    if work.output_len == 1:  # a prefill: prompt tokens over the time to the last first token
        out["prefill_tok_s"] = work.num_requests * work.prompt_len / run.duration_s
        return out
    mean_context = work.prompt_len + work.output_len / 2
    kv = work.num_requests * mean_context * core.model_config.kv_bytes_per_token_at(kv_bytes)
    step_bytes = weight_bytes + kv
    out["step_bytes"] = step_bytes
    out["roofline_tok_s"] = work.num_requests * bandwidth / step_bytes
    out["roofline_share"] = run.tok_s / out["roofline_tok_s"]
    return out


def median_run(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median speed (the upper middle one for an even count), with every run's
    speed beside it (``repeat_speeds``)."""
    speeds = [m.get("prefill_tok_s", m["tok_s"]) for m in repeats]
    median = sorted(range(len(repeats)), key=lambda i: speeds[i])[len(repeats) // 2]
    return {**repeats[median], "repeat_speeds": speeds}


def summary(m: dict[str, Any]) -> str:
    runs = ", ".join(f"{v:,.0f}" for v in m.get("repeat_speeds", []))
    if "prefill_tok_s" in m:
        return f"{m['prefill_tok_s']:,.0f} prompt tok/s ({m['duration_s']:.2f} s; runs {runs})"
    return (
        f"{m['tok_s']:,.0f} tok/s, TPOT p50 {m['tpot_p50_ms']:.2f} ms, "
        f"{m['roofline_share']:.0%} of roofline (runs {runs})"
    )


def format_report(results: list[VariantResult], argv: list[str], bandwidth: float) -> str:
    base = {r.variant: r for r in results}.get("bf16")
    lines = [
        f"{device_name()}, {time.strftime('%Y-%m-%d %H:%M')}",
        f"command: python {shlex.join([sys.argv[0], *argv])}",
        f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s",
        "",
        "| variant | weights GiB | workload | tok/s | TPOT p50 ms | % of roofline | vs bf16 |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for name, m in r.runs.items():
            speed = m.get("prefill_tok_s", m["tok_s"])
            ratio = ""
            if base is not None and name in base.runs:
                b = base.runs[name]
                ratio = f"{speed / b.get('prefill_tok_s', b['tok_s']):.2f}x"
            share = f"{m['roofline_share']:.0%}" if "roofline_share" in m else "-"
            tpot = f"{m['tpot_p50_ms']:.2f}" if "prefill_tok_s" not in m else "-"
            lines.append(
                f"| {r.variant} | {r.weight_bytes / 2**30:.2f} | {name} | {speed:,.0f} | "
                f"{tpot} | {share} | {ratio} |"
            )
    return "\n".join(lines)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-8b", choices=sorted(PRESETS))
    p.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: s.split(","))
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--long-prompt-len", type=int, default=3800)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="measured runs per workload (the median is shown)",
    )
    p.add_argument("--profile", action="store_true", help="profile a decode-64 step per variant")
    p.add_argument(
        "--profile-prefill", action="store_true", help="profile a long-prompt prefill step"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    bandwidth = measure_hbm_bandwidth(args.device)
    results = []
    for variant in args.variants:
        try:
            results.append(bench_variant(args, variant, bandwidth))
        except Exception as exc:  # one variant failing still leaves the others' figures
            print(f"{variant}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    report = format_report(results, argv, bandwidth)
    print("\n" + report)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
