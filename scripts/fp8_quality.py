"""What FP8 costs in quality, on the default model (SmolLM2-135M-Instruct), on the CPU.

    python scripts/fp8_quality.py [--model default] [--new-tokens 32] [--json OUT]

The GPU machine cannot hold the default model's files, so this runs through the CPU's
dequantizing reference path. For a fixed set of chat prompts, bf16 generates a greedy
continuation; then each variant scores that same text (teacher forcing, one forward over prompt
and continuation) and we compare its next-token distributions at the continuation's positions
with bf16's:

- **flipped**: the share of positions where the variant's greedy token differs from bf16's;
- **KL**: the mean KL(bf16 || variant) of the next-token distributions, in nats.

Variants: ``fp8`` (``--quantization fp8``: weights e4m3 with one scale per output row, as the
CPU runs them: activations not quantized), ``fp8-a8`` (the same, and each linear's input
quantized to e4m3 per token as the GPU kernels do, emulated here by rounding the activations
before the reference matmul), and ``fp8-a8+kv`` (that, with the KV cache in e4m3, scale 1).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from engine_core.forward_context import forward_context  # noqa: E402
from engine_core.loader import load_model, resolve_model_dir  # noqa: E402
from engine_core.models import fp8 as fp8_module  # noqa: E402
from engine_core.models import layers  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the planets of the solar system?",
    "Write a Python function that reverses a string.",
    "How do vaccines work?",
    "Suggest a name for a friendly robot.",
    "What is the difference between weather and climate?",
    "Describe the taste of a lemon.",
    "Tell me a fun fact about octopuses.",
]
BLOCK = 16


def sequence_logits(model: torch.nn.Module, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits [L, vocab] float32 after each token of ``ids``: one prefill over a fresh cache."""
    length, blocks = len(ids), -(-len(ids) // BLOCK)
    attn = model.attention_layers()
    kv_heads, head_dim = attn[0].num_kv_heads, attn[0].head_dim
    cache = torch.zeros(len(attn), 2, blocks, BLOCK, kv_heads, head_dim, dtype=kv_dtype)
    for i, layer in enumerate(attn):
        layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(length),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=length,
        max_seq_len=length,
        query_start_loc_cpu=[0, length],
        seq_lens_cpu=[length],
    )
    with torch.no_grad(), forward_context(meta, TorchReferenceBackend()):
        hidden = model(torch.tensor(ids), torch.arange(length))
        return model.compute_logits(hidden)


@contextmanager
def activations_in_fp8() -> Iterator[None]:
    """Round each FP8 linear's input to e4m3 per token (absmax / 448 scales), as the GPU's
    dynamic activation quantization does, before the CPU's reference matmul."""
    original = layers.fp8_linear

    def quantized_input(x: torch.Tensor, *args: object) -> torch.Tensor:
        absmax = x.float().abs().amax(dim=-1, keepdim=True)
        scale = (absmax / fp8_module.FP8_MAX).clamp(min=fp8_module.MIN_SCALE)
        xq = (x.float() / scale).to(fp8_module.FP8_DTYPE).float() * scale
        return original(xq.to(x.dtype), *args)

    layers.fp8_linear = quantized_input
    try:
        yield
    finally:
        layers.fp8_linear = original


def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """bf16's greedy continuation (recomputed each token: short texts, a small model)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(sequence_logits(model, ids, torch.bfloat16)[-1].argmax()))
    return ids[len(prompt) :]


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[int, float]:
    """(positions whose greedy token differs, summed KL(reference || other))."""
    flipped = int((reference.argmax(-1) != other.argmax(-1)).sum())
    kl = F.kl_div(
        other.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="sum"
    )
    return flipped, float(kl)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    bf16 = load_model(args.model, "cpu", torch.bfloat16).module
    fp8 = load_model(args.model, "cpu", torch.bfloat16, quantization="fp8").module
    variants = {
        "fp8": (fp8, torch.bfloat16, False),
        "fp8-a8": (fp8, torch.bfloat16, True),
        "fp8-a8+kv": (fp8, fp8_module.FP8_DTYPE, True),
    }
    totals = {name: [0, 0.0] for name in variants}
    positions = 0
    for text in PROMPTS:
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(chat, add_special_tokens=False).input_ids
        ids = prompt + greedy(bf16, prompt, args.new_tokens)
        scored = slice(len(prompt) - 1, len(ids) - 1)  # the logits that chose each new token
        reference = sequence_logits(bf16, ids, torch.bfloat16)[scored]
        positions += reference.shape[0]
        for name, (model, kv_dtype, a8) in variants.items():
            with activations_in_fp8() if a8 else nullcontext():
                flipped, kl = compare(reference, sequence_logits(model, ids, kv_dtype)[scored])
            totals[name][0] += flipped
            totals[name][1] += kl
    lines = [
        f"cpu, {time.strftime('%Y-%m-%d %H:%M')}",
        f"command: python {shlex.join([sys.argv[0], *argv])}",
        f"{len(PROMPTS)} chat prompts x {args.new_tokens} greedy bf16 tokens = {positions} "
        f"positions, model {args.model}",
        "",
        "| variant | greedy tokens flipped | mean KL vs bf16 (nats) |",
        "|---|---:|---:|",
    ]
    results = {}
    for name, (flipped, kl) in totals.items():
        results[name] = {"flipped_share": flipped / positions, "mean_kl": kl / positions}
        lines.append(f"| {name} | {flipped} / {positions} ({flipped / positions:.1%}) | "
                     f"{kl / positions:.4f} |")  # fmt: skip
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
