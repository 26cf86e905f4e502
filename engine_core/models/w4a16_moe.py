"""W4A16 experts on CUDA: which of the two paths runs a step, by its shape.

- up to DEQUANTIZE_TOKENS tokens (decode, short prefills): the kernels that dequantize the
  4-bit weights in registers (w4a16_moe_kernels.py), reading a quarter of bf16's bytes;
- from DEQUANTIZE_TOKENS (prefill): the experts dequantized into a scratch buffer, then the bf16
  grouped GEMMs (w4a16_prefill.py), where the registers' conversion, redone for every row
  block, costs more than the product.

The choice depends on shapes only (a CUDA graph replays what was captured), by ``MEASURED``
where ``python -m benchmarks w4a16-moe --sweep`` has timed the shape, else by ``rule``.
Importing this module imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.models import mxfp4_moe
from engine_core.models.fused_moe import Blocks
from engine_core.models.w4a16 import W4A16Experts
from engine_core.models.w4a16_kernels import row_bucket
from engine_core.models.w4a16_moe_kernels import check_layout, fused_moe_w4a16
from engine_core.models.w4a16_prefill import dequantized_moe_w4a16


@dataclass(frozen=True)
class Dequantize:
    """The prefill path: dequantize, then bf16 grouped GEMMs with these tiles (None:
    fused_moe.block_sizes' choice)."""

    blocks: Blocks | None = None


@dataclass(frozen=True)
class Tiled:
    """The register-dequantizing kernels with these tiles (None: their block_sizes' choice,
    and the one-token path for one token)."""

    blocks: Blocks | None = None


Choice = Tiled | Dequantize
# The prefill GEMMs' tiles the sweep times beside fused_moe.block_sizes': MXFP4's candidates,
# the same bf16 GEMMs (mxfp4_moe says why these).
DEQUANTIZE_CANDIDATES = tuple(Dequantize(d.blocks) for d in mxfp4_moe.DEQUANTIZE_CANDIDATES)
# From this many tokens, dequantize and run bf16 GEMMs, for shapes the sweep has not timed. The
# sweep at Qwen3-30B-A3B's layer put the crossover between 512 tokens (the tiles 10% faster) and
# 2,048 (dequantizing 2.3x faster); the pass over all the experts would also be paid by every
# layer of a captured decode step of 256 sequences, so the rule stays above the decode batches.
DEQUANTIZE_TOKENS = 1024
# The sweep's fastest choice by (token bucket, hidden, width, experts, top k), where measured
# (`python -m benchmarks w4a16-moe --tokens 64,512,2048 --sweep`, zero points, groups of 128).
MEASURED: dict[tuple[int, int, int, int, int], Choice] = {
    (64, 2048, 768, 128, 8): Tiled(blocks=Blocks(m=16, n=128, k=128, warps=4, stages=3)),
    (512, 2048, 768, 128, 8): Tiled(blocks=Blocks(m=16, n=128, k=128, warps=4, stages=3)),
    (2048, 2048, 768, 128, 8): Dequantize(blocks=None),
}


def rule(num_tokens: int) -> Choice:
    """The path for a shape the sweep has not measured (module docstring)."""
    return Dequantize() if num_tokens >= DEQUANTIZE_TOKENS else Tiled()


def choose(num_tokens: int, top_k: int, experts: W4A16Experts, hidden: int) -> Choice:
    """MEASURED's choice for the shape, else ``rule``'s."""
    num_experts, rows = experts.w13_qweight.shape[:2]
    key = (row_bucket(num_tokens), hidden, rows // 2, num_experts, top_k)
    return MEASURED.get(key) or rule(num_tokens)


def w4a16_moe(
    x: torch.Tensor,  # [T, H]
    experts: W4A16Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    choice: Choice | None = None,  # None: ``choose``'s (a benchmark or a test may force one)
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H], each
    expert a SwiGLU over its 4-bit weights. No host sync."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    choice = choice or choose(num_tokens, top_k, experts, x.shape[1])
    if isinstance(choice, Dequantize):
        check_layout(experts, x.shape[1], None)
        return dequantized_moe_w4a16(x, experts, topk_weights, topk_ids, choice.blocks)
    return fused_moe_w4a16(x, experts, topk_weights, topk_ids, choice.blocks)
