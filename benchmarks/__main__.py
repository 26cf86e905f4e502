"""``python -m benchmarks NAME [flags]``: run one benchmark; ``NAME --help`` explains it."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# name -> (module, what it measures); modules load only when chosen, so --help stays quick.
BENCHMARKS = {
    "decode": ("benchmarks.decode", "decode throughput of random-weight presets vs the roofline"),
    "serving": ("benchmarks.serving", "Tandem beside vLLM over HTTP, one server at a time"),
    "first-token": ("benchmarks.first_token", "an idle server's first token, part by part"),
    "prefill": ("benchmarks.prefill", "time to first token of 64 x 2,048-token prompts"),
    "goodput": ("benchmarks.goodput", "goodput under mixed Poisson load, rates swept, beside vLLM"),
    "multi-turn": (
        "benchmarks.multi_turn",
        "multi-turn chats sharing a 2,000-token system prompt, beside vLLM",
    ),
    "soak": ("benchmarks.soak", "mixed load with faults; nothing may be lost"),
    "cpu": ("benchmarks.cpu", "Tandem beside vLLM's CPU build on the default model"),
    "gemm": ("benchmarks.gemm", "one projection's product: bf16, W4A16 and W8A8 against HBM"),
    "attention": ("benchmarks.attention", "the prefill and decode attention kernels, alone"),
    "mla": ("benchmarks.mla", "the MLA decode kernel at DeepSeek-V2-Lite's and V3's heads vs HBM"),
    "lora-kernels": (
        "benchmarks.lora_kernels",
        "LoRA's kernels in decode graphs of a preset's projections: split, fused, none",
    ),
    "gguf-memory": ("benchmarks.gguf", "a GGUF model's weight bytes, blocks kept vs bf16"),
    "w4a16": ("benchmarks.w4a16", "the W4A16 products beside bf16, and a sweep of their tiles"),
    "mxfp4": ("benchmarks.mxfp4", "gpt-oss's MXFP4 expert GEMMs against HBM, beside bf16"),
    "mxfp4-compile": (
        "benchmarks.mxfp4_compile",
        "the MXFP4 expert kernels compiled for sm_90 without a GPU: mma, spills, SASS a weight",
    ),
    "w4a16-compile": (
        "benchmarks.w4a16_compile",
        "the W4A16 tensor-core kernels compiled for sm_90 without a GPU: mma, smem, SASS a weight",
    ),
    "w8a8-compile": (
        "benchmarks.w8a8_compile",
        "the W8A8 int8 GEMM (persistent, warp-specialized) compiled for sm_90 without a GPU",
    ),
    "fp8-moe": ("benchmarks.fp8_moe", "FP8 experts in the fused MoE against HBM, beside bf16"),
    "w4a16-moe": ("benchmarks.w4a16_moe", "W4A16 experts in the fused MoE vs HBM, beside bf16"),
    "vision": ("benchmarks.vision", "a vision encoder's images/s; TTFT of one image + text"),
    "image-stages": (
        "benchmarks.image_stages",
        "one chat image's CPU stages, data URL to the engine's pixels, each timed",
    ),
    "speculative": ("benchmarks.speculative", "batch-1 TPOT with speculative decoding and without"),
    "speculative-serving": (
        "benchmarks.speculative_serving",
        "TPOT at batch 1, 8, 32 with n-gram or self-drafting, over HTTP, beside vLLM",
    ),
    "speculative-verify": (
        "benchmarks.speculative_verify",
        "a verify step's cost and TPOT at batch 1, 8, 32, the model drafting for itself",
    ),
}


def usage() -> str:
    lines = ["usage: python -m benchmarks NAME [flags]   (NAME --help for each)", ""]
    lines += [f"  {name:<12} {what}" for name, (_, what) in BENCHMARKS.items()]
    return "\n".join(lines)


def load(name: str) -> ModuleType:
    return importlib.import_module(BENCHMARKS[name][0])


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of benchmark ``name``: its module's docstring as the description."""
    module = load(name)
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_args(parser)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` (NAME and its flags) parsed; ``args.argv`` keeps it for the printed command."""
    name = argv[0]
    args = build_parser(name).parse_args(argv[1:])
    args.name, args.argv = name, list(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in BENCHMARKS:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    args = parse(argv)
    return load(args.name).run(args)


if __name__ == "__main__":
    sys.exit(main())
