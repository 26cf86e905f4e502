"""MoE benchmark on the GPU machine: decode against the HBM roofline of the experts a step
touches, and a long prefill against the tensor-core peak for the active parameters.

    python scripts/bench_moe.py [--model qwen3-30b-a3b] [--batches 1,64,256] [--json OUT]

One engine core, in this process (CUDA graphs, overlapped loop, random bf16 weights with the
preset's real shapes), serves every run, each with fresh random prompts:

- **decode** at each batch B: B requests of --prompt-len random tokens and --output-len output
  tokens, EOS ignored, greedy, after a short warm-up; output tok/s and TPOT p50.
- **roofline** of that decode: the bytes a step must read, over the measured copy bandwidth. A
  step reads the dense weights (attention, norms, routers, embeddings and LM head), for each
  layer one copy of every expert that some token of the batch was routed to, and the KV cache at
  the mean context. How many experts a batch of B tokens touches is measured from the model's
  own routers: forward hooks on each layer's router record its top-k choices over the prefill
  run's tokens (prefills run eagerly, so the hooks fire), and the distinct experts are counted
  over random groups of B tokens. What uniform routing would give, E (1 - (1 - k/E)^B), is
  printed beside it.
- **routing**: ``--routing model`` (default) keeps the random-weight routers' own choices, which
  pile onto few experts (the hidden states of random weights share a large common part);
  ``--routing uniform`` replaces every router's logits by standard normals, drawn afresh at every
  step (inside the CUDA graphs too), so that each token takes a uniformly random set of top-k
  experts: the balance a trained router's load-balancing loss aims for. Both are measured as
  above; the roofline always counts the experts the run's routing touched.
- **prefill**: --prefill-requests prompts of --prefill-len tokens at once, one output token each;
  the achieved TFLOP/s are (2 x active parameters per token x tokens + causal attention FLOPs)
  over the time to the last first token, as a share of the GPU's dense bf16 peak (--peak-tflops,
  default 989: the H100 SXM and H200 figure).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import (  # noqa: E402
    RunResult,
    Workload,
    device_name,
    measure_hbm_bandwidth,
    profile_decode_step,
    run_inproc,
)

from engine_core.config import EngineConfig, ModelConfig  # noqa: E402
from engine_core.models import build_model  # noqa: E402
from engine_core.presets import PRESETS  # noqa: E402

BLOCK_SIZE = 16


@dataclass
class DecodeResult:
    batch: int
    run: RunResult
    experts_touched: float  # per layer per step, measured from the routers
    experts_uniform: float  # per layer per step, if routing were uniform
    step_bytes: int
    roofline_tok_s: float

    @property
    def share(self) -> float:
        return self.run.tok_s / self.roofline_tok_s


@dataclass
class Report:
    model: str
    gpu: str
    bandwidth: float
    dense_bytes: int
    expert_bytes: int
    routing: str  # "model": the random routers' own choices; "uniform": standard-normal logits
    decode: list[DecodeResult] = field(default_factory=list)
    prefill: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)  # one decode step, --profile-batch


# ---- the model's byte and FLOP counts -----------------------------------------------------------


def split_bytes(config: ModelConfig) -> tuple[int, int]:
    """(bytes of every weight outside the experts, bytes of one expert of one layer), bf16."""
    with torch.device("meta"):
        model = build_model(config)
    total = sum(p.numel() * 2 for p in model.parameters())
    expert = 3 * config.hidden_size * config.moe_intermediate_size * 2
    return total - config.num_layers * config.num_experts * expert, expert


def active_flops_per_token(config: ModelConfig, dense_bytes: int) -> float:
    """2 x the parameters one prompt token multiplies through: the dense ones minus the
    embedding and the LM head (a prefill projects only its last token), plus top-k experts."""
    vocab_params = config.vocab_size * config.hidden_size
    vocab_params *= 1 if config.tie_word_embeddings else 2
    dense = dense_bytes // 2 - vocab_params
    experts = config.num_layers * config.num_experts_per_tok * 3 * config.hidden_size
    return 2.0 * (dense + experts * config.moe_intermediate_size)


def attention_flops(config: ModelConfig, prompt_len: int) -> float:
    """Causal QK^T and PV of one prompt over every layer and head."""
    per_head = 2.0 * prompt_len * prompt_len * config.head_dim  # 2 x (T^2 / 2) x D, twice
    return per_head * config.num_heads * config.num_layers


# ---- routing, measured ---------------------------------------------------------------------------


class RouterTap:
    """Records each MoE router's top-k choices while installed (eager forwards only)."""

    def __init__(self, model: nn.Module, num_experts: int, top_k: int, keep: int) -> None:
        self.top_k, self.keep = top_k, keep
        self.choices: dict[str, list[torch.Tensor]] = {}
        self.handles = [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if is_router(name, module, num_experts)
        ]
        if not self.handles:
            raise RuntimeError("no MoE router found to measure the routing with")

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, args: Any, logits: torch.Tensor) -> None:
            held = sum(c.shape[0] for c in self.choices.get(name, []))
            if held < self.keep and logits.dim() == 2:
                ids = logits[: self.keep - held].float().topk(self.top_k, -1).indices
                self.choices.setdefault(name, []).append(ids.to(torch.int16).cpu())

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def distinct_per_group(self, batch: int, samples: int = 64) -> float:
        """Mean distinct experts among ``batch`` random recorded tokens, over layers."""
        rng = random.Random(0)
        counts = []
        for chunks in self.choices.values():
            ids = torch.cat(chunks)
            for _ in range(samples):
                rows = rng.sample(range(ids.shape[0]), min(batch, ids.shape[0]))
                counts.append(ids[rows].unique().numel())
        return statistics.mean(counts)


def is_router(name: str, module: nn.Module, num_experts: int) -> bool:
    weight = getattr(module, "weight", None)
    return (
        name.rsplit(".", 1)[-1] in ("gate", "router")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[0] == num_experts
    )


def uniform_routing(num_experts: int, hidden: int, num_layers: int) -> RemovableHandle:
    """Replace every MoE router's logits [T, E] by standard normals, for modules built from now
    on too: a global forward hook, which must be in place before the engine captures its CUDA
    graphs (they then draw fresh normals at every replay). Returns the hook's handle.

    Its costs are in the figures it produces: every eager module call (the prefills) goes
    through torch's hooked call path, and each forward draws its normals: for decode-sized
    batches (up to DRAW_ONCE_MAX_TOKENS) all ``num_layers`` routers' at the first router, one
    launch a step (a trained router has no such launch at all: the uniform rows carry a few
    microseconds of it), for larger ones one launch a layer."""
    order: dict[int, int] = {}  # id(router) -> its place in the forward, learnt on first call
    drawn: list[torch.Tensor] = []  # this forward's normals [num_layers, T, E], when drawn once

    def draw(module: nn.Module, args: Any, logits: Any) -> Any:
        weight = getattr(module, "weight", None)
        if not (
            isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (num_experts, hidden)
            and isinstance(logits, torch.Tensor)
            and logits.shape[-1] == num_experts
        ):
            return None
        if logits.shape[0] > DRAW_ONCE_MAX_TOKENS:
            return torch.randn_like(logits)
        index = order.setdefault(id(module), len(order)) % num_layers
        if index == 0:
            drawn[:] = [torch.randn((num_layers, *logits.shape), dtype=logits.dtype,
                                    device=logits.device)]  # fmt: skip
        return drawn[0][index]

    return torch.nn.modules.module.register_module_forward_hook(draw)


DRAW_ONCE_MAX_TOKENS = 512


# ---- the runs ------------------------------------------------------------------------------------


def engine_config(name: str, args: argparse.Namespace) -> EngineConfig:
    def blocks(seqs: int, tokens: int) -> int:
        return seqs * (-(-tokens // BLOCK_SIZE) + 1)

    decode = blocks(max(args.batches), args.prompt_len + args.output_len)
    prefill = blocks(args.prefill_requests, args.prefill_len + 1)
    seqs = max(max(args.batches), args.prefill_requests)
    return EngineConfig(
        model=f"random:{name}",
        device=args.device,
        max_model_len=min(4096, PRESETS[name].max_position_embeddings),
        block_size=BLOCK_SIZE,
        num_kv_blocks=max(decode, prefill),  # the runs take turns: room for the larger
        max_num_seqs=seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def run_prefill(core: Any, args: argparse.Namespace, vocab: int, seed: int) -> float:
    """Seconds from adding the prompts to the last one's first token."""
    work = Workload(args.prefill_requests, args.prefill_len, 1, seed)
    return run_inproc(core, work, vocab, f"prefill-{seed}").duration_s


def bench(args: argparse.Namespace) -> Report:
    from engine_core.core import EngineCore

    config = PRESETS[args.model]
    bandwidth = measure_hbm_bandwidth(args.device)
    dense_bytes, expert_bytes = split_bytes(config)
    report = Report(args.model, device_name(), bandwidth, dense_bytes, expert_bytes, args.routing)
    sizes = f"dense weights {dense_bytes / 2**30:.2f} GiB, an expert {expert_bytes / 2**20:.1f} MiB"
    print(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s; {sizes}", flush=True)
    if args.routing == "uniform":
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
        uniform_routing(config.num_experts, config.hidden_size, moe_layers)
    core = EngineCore(engine_config(args.model, args))
    vocab = core.model_config.vocab_size
    seed = iter(range(1, 1000))

    run_inproc(core, Workload(8, 64, 8, next(seed)), vocab, "warmup")
    run_prefill(core, args, vocab, next(seed))  # warm-up: the prefill's kernels compile here
    tap = RouterTap(core.runner.model, config.num_experts, config.num_experts_per_tok, 4096)
    seconds = run_prefill(core, args, vocab, next(seed))
    tap.remove()
    tokens = args.prefill_requests * args.prefill_len
    flops = tokens * active_flops_per_token(config, dense_bytes)
    flops += args.prefill_requests * attention_flops(config, args.prefill_len)
    report.prefill = {
        "requests": args.prefill_requests, "prompt_len": args.prefill_len,
        "seconds": seconds, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
        "peak_share": flops / seconds / 1e12 / args.peak_tflops,
    }  # fmt: skip
    print(f"prefill {args.prefill_requests} x {args.prefill_len}: {seconds:.2f} s, "
          f"{report.prefill['tflops']:.0f} TFLOP/s", flush=True)  # fmt: skip

    for batch in args.batches:
        work = Workload(batch, args.prompt_len, args.output_len, next(seed))
        run_inproc(core, work.shorter(16, next(seed)), vocab, f"warm-{batch}")
        run = run_inproc(core, work, vocab, f"decode-{batch}")
        report.decode.append(decode_result(config, report, tap, work, run))
        d = report.decode[-1]
        print(f"decode batch {batch}: {run.tok_s:,.0f} tok/s, TPOT p50 {run.tpot_p50_ms:.2f} ms, "
              f"{d.share:.0%} of roofline", flush=True)  # fmt: skip
    if args.profile_batch and args.device != "cpu":
        work = Workload(args.profile_batch, args.prompt_len, args.output_len, next(seed))
        profile = profile_decode_step(core, work, vocab, top=args.top_kernels)
        report.profile = profile | {"batch": args.profile_batch}
    return report


def decode_result(
    config: ModelConfig, report: Report, tap: RouterTap, work: Workload, run: RunResult
) -> DecodeResult:
    experts, top_k = config.num_experts, config.num_experts_per_tok
    touched = tap.distinct_per_group(work.num_requests)
    uniform = experts * (1 - (1 - top_k / experts) ** work.num_requests)
    mean_context = work.prompt_len + work.output_len / 2
    kv = work.num_requests * mean_context * config.kv_bytes_per_token
    step = int(report.dense_bytes + config.num_layers * touched * report.expert_bytes + kv)
    roof = work.num_requests * report.bandwidth / step
    return DecodeResult(work.num_requests, run, touched, uniform, step, roof)


# ---- output --------------------------------------------------------------------------------------


def format_report(report: Report, argv: list[str]) -> str:
    lines = [
        f"{report.gpu}, {time.strftime('%Y-%m-%d %H:%M')}",
        f"command: python {shlex.join([sys.argv[0], *argv])}",
        f"model {report.model} (random bf16 weights, {report.routing} routing), HBM copy bandwidth "
        f"{report.bandwidth / 1e12:.2f} TB/s",
        "",
        "| batch | tok/s | TPOT p50 ms | experts touched / layer (uniform) | bytes / step | "
        "roofline tok/s | % of roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in report.decode:
        lines.append(
            f"| {d.batch} | {d.run.tok_s:,.0f} | {d.run.tpot_p50_ms:.2f} | "
            f"{d.experts_touched:.1f} ({d.experts_uniform:.1f}) | {d.step_bytes / 2**30:.2f} GiB | "
            f"{d.roofline_tok_s:,.0f} | {d.share:.0%} |"
        )
    if report.routing == "uniform" and any(d.batch == 1 for d in report.decode):
        lines.append(
            "(batch 1: a single token's router runs as one kernel that the uniform hook does "
            "not see, so it routes by the random router; any routing touches top-k experts a layer "
            "at one token, so its bytes and roofline are the same)"
        )
    p = report.prefill
    lines += [
        "",
        f"prefill {p['requests']} x {p['prompt_len']} tokens: {p['seconds']:.2f} s, "
        f"{p['tokens_per_s']:,.0f} tok/s, {p['tflops']:.0f} TFLOP/s = {p['peak_share']:.0%} of "
        "the dense bf16 peak",
    ]
    if report.profile:
        prof = {k: v for k, v in report.profile.items() if "top_kernels" not in k}
        lines += ["", f"decode step at batch {report.profile.get('batch', '?')}: {prof}"]
        lines += ["top kernels:", str(report.profile.get("top_kernels", ""))]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--batches", default="1,64,256", type=lambda s: [int(b) for b in s.split(",")])
    p.add_argument(
        "--routing",
        choices=("model", "uniform"),
        default="model",
        help="model: the random routers' own choices; uniform: each token's top-k drawn "
        "uniformly at random every step (a load-balanced router)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-requests", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="the engine's: qwen3-30b-a3b's 56 GiB of bf16 weights and the batch-256 run's KV "
        "cache need about 0.92 of an 80 GB H100",
    )
    p.add_argument("--profile-batch", type=int, default=64, help="0: no step profile")
    p.add_argument("--top-kernels", type=int, default=6, help="kernels listed in the profile")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    report = bench(args)
    print(format_report(report, argv), flush=True)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
