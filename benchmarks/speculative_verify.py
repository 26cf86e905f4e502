"""`speculative-verify`: what a verify step costs, with a draft that is always right.

    python -m benchmarks speculative-verify                  # llama-1b and llama-8b, on the GPU
    python -m benchmarks speculative-verify --models random:llama-1b --batches 1,8 --k 3
    python -m benchmarks speculative-verify --models random:llama-1b --dtype float32
    python -m benchmarks speculative-verify --method eagle3 --models random:llama-8b --batches 1,8

Each model (random-weight presets by default, engine_core/presets.py) drafts for itself
(``"method": "draft_model"`` with the model as its own draft: the same seeded weights, so every
draft is kept and each step yields K + 1 tokens). B greedy requests of random prompts decode
together, once without speculation and once with it (the engines one after the other, each
with ``--num-kv-blocks`` blocks), for each batch size B, after a warm-up run of each.

Per batch size: the median decode step without drafts; the median speculative step and its
parts, the draft's proposal (K one-token forwards of the draft) and its forward beside the
target's (each timed with the device synchronised around it), the rest being the target's
verify step (K + 1 positions a row) and the host's work; the verify step over the plain step
(the overhead of scoring K drafts); the target's verify forward alone (synchronised around it,
steps whose every row has the same K + 1 positions) and how many of those replayed a verify
graph (engine_core/cuda_graph.py); TPOT both ways (the median over requests of the time from
their first token to their last over the tokens after the first) and tokens a step.
The outputs must be the same tokens both ways: exit status 1 if one differs. ``--dtype``:
both engines' (the model's and its cache's); in float32 a self-draft is kept every time up to the
rounding of float32 sums, in bfloat16 a verify chunk and a one-token step round differently and
near-ties go either way (docs/design/speculative-decoding.md).

``--method eagle3``: a random EAGLE-3 head at the model's shape drafts instead (written to a
temporary folder in the published layout: one layer of the target's width, a draft vocabulary
of 32,000 ids, reading target layers 2, L/2 and L-3). Its drafts are almost never kept, so the
table shows what the head costs a step (its proposal, its forward beside the target's, the
verify step), not a speed-up; the outputs must still be the plain engine's.

``--method mtp``: the MTP layer the target's own checkpoint ships drafts (``--models`` a
DeepSeek-V3-architecture folder that holds it; no preset has one). "eager draft fwd" then counts
the layer's forwards beside the target's, which run eagerly by design (engine_core/mtp.py), and
any proposal no graph served.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, fmt, format_table, write_json


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="random:llama-1b,random:llama-8b", help="comma-separated"
    )
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="the models' dtype (default: %(default)s: bfloat16 on cuda, float32 on cpu)",
    )
    parser.add_argument("--batches", default="1,8,32", help="default: %(default)s")
    parser.add_argument("--k", type=int, default=4, help="drafts a step (default: 4)")
    parser.add_argument(
        "--method",
        default="draft_model",
        choices=["draft_model", "eagle3", "mtp"],
        help="the model as its own draft, a random EAGLE-3 head, or the MTP layer of the "
        "model's checkpoint (default: %(default)s)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128, help="default: 128")
    parser.add_argument("--max-tokens", type=int, default=256, help="default: 256")
    parser.add_argument("--num-kv-blocks", type=int, default=4096, help="default: 4096")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


@dataclass
class Run:
    """One batch's run: its outputs, each request's TPOT, each decode step's wall time and
    (speculative runs) the draft's parts of those steps."""

    tokens: list[list[int]]
    tpots: list[float]
    steps: list[float]
    proposals: list[float] = field(default_factory=list)
    alongside: list[float] = field(default_factory=list)
    drafted: int = 0  # draft tokens proposed (speculative runs)
    kept: int = 0  # of them, kept by the target
    # The draft's proposals and forwards beside the target's that ran eagerly, not as a CUDA
    # graph's replay (engine_core/draft_model.py DraftForwards): 0 where graphs serve them all.
    eager_draft: int = 0
    verify_forwards: list[float] = field(default_factory=list)  # the target's, verify steps
    verify_replays: int = 0  # of those, replays of a verify graph


def engine(args: argparse.Namespace, model: str, speculative: str | None) -> Any:
    from engine_core.config import EngineConfig
    from engine_core.core import EngineCore

    config = EngineConfig(
        model=model, device=args.device, dtype=args.dtype,
        max_model_len=args.prompt_tokens + args.max_tokens + 8,
        num_kv_blocks=args.num_kv_blocks, speculative_config=speculative,
    )  # fmt: skip
    return EngineCore(config)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(batch)]


def timed_parts(core: Any, run: Run, sync: Callable[[], None]) -> None:
    """Time the draft's proposal and its forward beside the target's into ``run``."""
    drafter = core.runner.drafter

    def wrap(method: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
        def timed(*a: Any) -> Any:
            sync()
            start = time.perf_counter()
            result = method(*a)
            sync()
            into.append(time.perf_counter() - start)
            return result

        return timed

    # Instance attributes over the class's methods, deleted again by ``untimed``.
    drafter.propose_batch = wrap(drafter.propose_batch, run.proposals)
    drafter.run_alongside = wrap(drafter.run_alongside, run.alongside)
    forward, timed_forward = core.runner._forward, wrap(core.runner._forward, run.verify_forwards)

    def verify_timed(inputs: Any) -> Any:
        verifies = inputs.meta.uniform_query_len > 1  # every row its last token and K drafts
        return timed_forward(inputs) if verifies else forward(inputs)

    core.runner._forward = verify_timed


def untimed(core: Any) -> None:
    del core.runner.drafter.propose_batch, core.runner.drafter.run_alongside
    del core.runner._forward


def verify_replays(core: Any) -> int:
    graphs = core.runner.graph_runner
    return 0 if graphs is None else graphs.verify_replays


def decode(core: Any, batch: list[list[int]], max_tokens: int, tag: str) -> Run:
    """The batch's greedy requests, all at once, until they finish."""
    from engine_core.request import Request
    from protocol.messages import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(batch):
        core.add_request(Request(f"{tag}-{i}", prompt, params))
    arrivals: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(len(batch))}
    tokens: dict[str, list[int]] = {rid: [] for rid in arrivals}
    run = Run([], [], [])
    if core.runner.drafter is not None:
        timed_parts(core, run, sync_of(core))
    before = core.scheduler.counts()
    eager_before, replays_before = eager_draft_forwards(core), verify_replays(core)
    while core.has_unfinished():
        start = time.perf_counter()
        outputs = core.step()
        now = time.perf_counter()
        if all(arrivals[rid] for rid in arrivals):  # every first token out: a decode step
            run.steps.append(now - start)
        for out in outputs:
            rid = out.request.request_id
            arrivals[rid] += [now] * len(out.new_token_ids)
            tokens[rid] += out.new_token_ids
    if core.runner.drafter is not None:
        untimed(core)
    after = core.scheduler.counts()
    run.drafted = after.spec_draft_tokens - before.spec_draft_tokens
    run.kept = after.spec_accepted_tokens - before.spec_accepted_tokens
    run.eager_draft = eager_draft_forwards(core) - eager_before
    run.verify_replays = verify_replays(core) - replays_before
    run.tokens = [tokens[rid] for rid in arrivals]
    run.tpots = [(a[-1] - a[0]) / max(1, len(a) - 1) for a in arrivals.values()]
    return run


def eager_draft_forwards(core: Any) -> int:
    drafter = core.runner.drafter
    if drafter is None:
        return 0
    return drafter.forwards.proposal_eager + drafter.forwards.alongside_eager


def sync_of(core: Any) -> Callable[[], None]:
    import torch

    if core.runner.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def measure(args: argparse.Namespace, model: str, speculative: str | None) -> dict[int, Run]:
    """Every batch size's run on one engine (built, warmed up, then released)."""
    import gc

    import torch

    core = engine(args, model, speculative)
    vocab = core.model_config.vocab_size
    runs = {}
    try:
        for batch in parse_batches(args.batches):
            work = prompts(batch, args.prompt_tokens, vocab)
            decode(core, work, 16, f"warm-{batch}")
            runs[batch] = decode(core, work, args.max_tokens, f"b{batch}")
    finally:
        core.shutdown()
        del core
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return runs


def parse_batches(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b]


def summarize(model: str, batch: int, plain: Run, spec: Run, k: int) -> dict[str, Any]:
    step = statistics.median(plain.steps)
    spec_step = statistics.median(spec.steps)
    proposal = statistics.median(spec.proposals) if spec.proposals else 0.0
    alongside = statistics.median(spec.alongside) if spec.alongside else 0.0
    verify = spec_step - proposal - alongside
    verify_forward = statistics.median(spec.verify_forwards) if spec.verify_forwards else 0.0
    tokens = sum(len(t) for t in spec.tokens) / len(spec.tokens)
    tpot, spec_tpot = statistics.median(plain.tpots), statistics.median(spec.tpots)
    return {
        "model": model,
        "batch": batch,
        "k": k,
        "step_ms": 1e3 * step,
        "spec_step_ms": 1e3 * spec_step,
        "proposal_ms": 1e3 * proposal,
        "draft_alongside_ms": 1e3 * alongside,
        "verify_ms": 1e3 * verify,
        "verify_over_step": verify / step,
        "verify_forward_ms": 1e3 * verify_forward,
        "verify_steps": len(spec.verify_forwards),
        "verify_replays": spec.verify_replays,
        "tpot_ms": 1e3 * tpot,
        "spec_tpot_ms": 1e3 * spec_tpot,
        "speedup": tpot / spec_tpot,
        # Every step after the first token: (tokens - 1) / steps; K + 1 when all are kept.
        "tokens_per_step": (tokens - 1) / max(1, len(spec.steps)),
        "kept": spec.kept / max(1, spec.drafted),  # 1.0 for a self-draft in exact arithmetic
        "eager_draft_forwards": spec.eager_draft,
        "same_tokens": plain.tokens == spec.tokens,
    }


def table_row(r: dict[str, Any]) -> list[str]:
    return [
        r["model"], str(r["batch"]), fmt(r["step_ms"]), fmt(r["spec_step_ms"]),
        fmt(r["proposal_ms"]), fmt(r["draft_alongside_ms"]), fmt(r["verify_ms"]),
        f"{r['verify_over_step']:.2f}x", fmt(r["verify_forward_ms"]),
        f"{r['verify_replays']}/{r['verify_steps']}", fmt(r["tpot_ms"]), fmt(r["spec_tpot_ms"]),
        f"{r['speedup']:.2f}x", fmt(r["tokens_per_step"]), f"{r['kept']:.1%}",
        str(r["eager_draft_forwards"]), "yes" if r["same_tokens"] else "NO",
    ]  # fmt: skip


EAGLE3_DRAFT_VOCAB = 32000  # the published Llama 3 heads'


def target_hf_config(model: str) -> dict[str, Any]:
    """The config.json of ``model``: a ``random:`` preset's, or a folder's."""
    if model.startswith("random:"):
        from engine_core.presets import hf_config

        return hf_config(model.removeprefix("random:"))
    return json.loads((Path(model) / "config.json").read_text())


def write_random_eagle3_head(target: dict[str, Any], folder: Path) -> Path:
    """A random EAGLE-3 head in the published layout at the shape of ``target`` (an HF Llama
    config): the target's width, heads and MLP, bfloat16 weights of small spread, unit
    norms, draft ids mapped to target ids 0..N-1 (``d2t`` of zeros), no embedding (shared)."""
    import torch
    from safetensors.torch import save_file

    hidden, mlp = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    draft_vocab = min(EAGLE3_DRAFT_VOCAB, target["vocab_size"])
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)

    layer = "midlayer."
    tensors = {
        "fc.weight": randn(hidden, 3 * hidden),
        f"{layer}self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        f"{layer}self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": randn(mlp, hidden),
        f"{layer}mlp.up_proj.weight": randn(mlp, hidden),
        f"{layer}mlp.down_proj.weight": randn(hidden, mlp),
        "lm_head.weight": randn(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{layer}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    kept = ("hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")
    config = {name: target[name] for name in kept if name in target} | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def speculative_config(args: argparse.Namespace, model: str, scratch: Path) -> str:
    """The --speculative-config of ``args.method`` for ``model``."""
    if args.method == "mtp":  # read from the target's own checkpoint: no "model"
        return json.dumps({"method": "mtp", "num_speculative_tokens": args.k})
    draft = model
    if args.method == "eagle3":
        draft = str(write_random_eagle3_head(target_hf_config(model), scratch / "eagle3-head"))
    return json.dumps({"method": args.method, "model": draft, "num_speculative_tokens": args.k})


def run(args: argparse.Namespace) -> int:
    import tempfile

    header = Provenance.here(args.argv)
    results = []
    for model in args.models.split(","):
        plain = measure(args, model, None)
        with tempfile.TemporaryDirectory() as scratch:
            spec = measure(args, model, speculative_config(args, model, Path(scratch)))
        results += [summarize(model, b, plain[b], spec[b], args.k) for b in plain]
    print(header.format())
    drafter = "the model as its own draft"
    if args.method == "eagle3":
        drafter = f"a random EAGLE-3 head (draft vocabulary {EAGLE3_DRAFT_VOCAB})"
    if args.method == "mtp":
        drafter = "the checkpoint's MTP layer"
    print(
        f"{drafter}, K = {args.k}, dtype {args.dtype}; {args.prompt_tokens}-token random "
        f"prompts, {args.max_tokens} tokens each, greedy; medians; ms"
    )
    headers = [
        "model", "batch", "step", "spec step", "proposal", "draft beside", "verify",
        "verify/step", "verify fwd", "verify graphs", "TPOT", "spec TPOT", "speed-up",
        "tokens/step", "kept", "eager draft fwd", "same tokens",
    ]  # fmt: skip
    print(format_table(headers, [table_row(r) for r in results]))
    if args.json:
        write_json(args.json, header, results)
    return 0 if all(r["same_tokens"] for r in results) else 1
