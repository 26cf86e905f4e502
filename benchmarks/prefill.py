"""`prefill`: time to first token of a burst of long prompts, Tandem beside vLLM.

    python -m benchmarks prefill --model llama-8b \\
        --vllm-python python3 --vllm-pythonpath /tmp/vsite --json OUT.json

The serving benchmark's driver (serving.py: one server at a time, the same load generator over
HTTP, random weights of the same shapes) with one workload by default: 64 prompts of 2,048
random tokens sent at once, one output token each. The table: TTFT p50 and p99, the time to
the last first token, and prompt tokens per second over it; under it, for a random preset, what
that rate is in TFLOP/s against the GPU's dense bf16 peak (roofline.py).
"""

from __future__ import annotations

import argparse

from benchmarks import serving
from benchmarks.report import fmt
from benchmarks.roofline import DENSE_BF16_PEAK_TFLOPS, prefill_flops
from benchmarks.side_by_side import Figures, Metric

PREFILL_METRICS = (
    Metric("TTFT p50 ms", "ttft_p50_ms", ",.0f", False),
    Metric("TTFT p99 ms", "ttft_p99_ms", ",.0f", False),
    Metric("last first token s", "duration_s", ".2f", False),
    Metric("prompt tok/s", "prompt_tok_s", ",.0f", True),
)


def add_args(parser: argparse.ArgumentParser) -> None:
    serving.add_args(parser, workloads="64:2048:1")
    parser.add_argument(
        "--peak-tflops", type=float, default=DENSE_BF16_PEAK_TFLOPS,
        help="the GPU's dense bf16 peak (default: %(default)s, H100 SXM and H200)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    return serving.compare(args, PREFILL_METRICS, lambda results: peak_shares(args, results))


def peak_shares(args: argparse.Namespace, results: list[Figures]) -> list[str]:
    """A line per result: its FLOP rate over the time to the last first token, for a preset.
    Its prompts' length is the server's count (a random text tokenizes to a few more tokens
    than were drawn)."""
    from engine_core.presets import PRESETS

    if args.model not in PRESETS:
        return []
    by_label = {w.label: w for w in args.workloads}
    lines = []
    for r in results:
        prompts = by_label[r.workload].num_requests
        length = round(r.prompt_tok_s * r.duration_s / prompts)
        tflops = prefill_flops(args.model, prompts, length) / r.duration_s / 1e12
        share = fmt(100 * tflops / args.peak_tflops, ".0f")
        lines.append(f"{r.server} {r.workload}: {tflops:.0f} TFLOP/s, {share}% of the bf16 peak")
    return lines
