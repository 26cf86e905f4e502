"""gpt-oss's MXFP4 experts on CUDA: which of the three paths runs a step, by its shape.

- few slots an expert (decode): the CUDA-core matrix-vector kernels (mxfp4_gemv.py), which read
  the codes at close to HBM speed and convert each one once per program;
- more: the tiled kernels that widen codes into tensor-core tiles (mxfp4_kernels.py), or,
  where forced (a sweep candidate, not yet chosen by shape), the swapped kernels that put the
  weights on the tensor cores' M side (mxfp4_swapped.py);
- from DEQUANTIZE_TOKENS tokens (prefill): the experts dequantized into a scratch buffer, then
  bf16 grouped GEMMs (mxfp4_prefill.py), where the tiles' conversion, redone for every row
  block, would cost more than the product.

The choice depends on shapes only (a CUDA graph replays what was captured), by ``MEASURED``
where ``python -m benchmarks mxfp4 --sweep`` has timed the shape, else by ``rule``.
Importing this module imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.models.fused_moe import Blocks
from engine_core.models.mxfp4 import Mxfp4Experts
from engine_core.models.mxfp4_gemv import GemvTiles, gemv_moe_mxfp4, rule_tiles
from engine_core.models.mxfp4_kernels import block_sizes, check_layout, fused_moe_mxfp4
from engine_core.models.mxfp4_prefill import dequantized_moe_mxfp4
from engine_core.models.mxfp4_swapped import Swapped, swapped_moe_mxfp4


@dataclass(frozen=True)
class Dequantize:
    """The prefill path: dequantize, then bf16 grouped GEMMs with these tiles (None:
    fused_moe.block_sizes' choice)."""

    blocks: Blocks | None = None


Choice = GemvTiles | Blocks | Dequantize | Swapped
# The prefill GEMMs' tiles ``python -m benchmarks mxfp4 --sweep`` times beside fused_moe's rule
# (whose 128 x 128 tiles, gate and up accumulated side by side, spill registers on sm_90, as
# compiled without a GPU; 128 x 64 with 8 warps spills least).
DEQUANTIZE_CANDIDATES = (
    Dequantize(Blocks(128, 64, 64, warps=8)),
    Dequantize(Blocks(64, 128, 64, warps=8)),
    Dequantize(Blocks(64, 64, 64)),
    Dequantize(Blocks(128, 128, 32, warps=8)),
)

# Up to this many (token, k) slots an expert on average, the CUDA-core kernels (a guess until
# the sweep: at 8 a program converts each code once for 8 rows' multiply-adds).
GEMV_SLOTS_PER_EXPERT = 8
# From this many tokens, dequantize and run bf16 GEMMs: the sweep's crossover lies between 64
# tokens (the tiles win: 1.02 against 1.41 ms) and 2,048 (dequantizing wins: 2.16 against 7.39).
DEQUANTIZE_TOKENS = 256
# The sweep's fastest choice by (token bucket, hidden, width, experts, top k), where measured
# (gpt-oss-20b's layer; docs/design/gpt-oss-and-deepseek.md has the figures beside bf16's).
MEASURED: dict[tuple[int, int, int, int, int], Choice] = {
    (1, 2880, 2880, 32, 4): GemvTiles(rows=1, block_n=32, words=8, split_k=4, warps=4),
    (64, 2880, 2880, 32, 4): Blocks(m=16, n=64, k=64, warps=4, stages=3),
    (2048, 2880, 2880, 32, 4): Dequantize(Blocks(m=128, n=64, k=64, warps=8, stages=3)),
}


def token_bucket(num_tokens: int) -> int:
    """The power of two a token count is measured and tabled under."""
    return 1 << max(0, (num_tokens - 1).bit_length())


def rule(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, multiprocessors: int
) -> Choice:
    """The path for a shape the sweep has not measured (module docstring)."""
    if num_tokens >= DEQUANTIZE_TOKENS:
        return Dequantize()
    num_slots = num_tokens * top_k
    if num_slots <= GEMV_SLOTS_PER_EXPERT * num_experts:
        return rule_tiles(num_slots, num_experts, hidden, multiprocessors)
    return block_sizes(num_slots, num_experts)


def choose(
    num_tokens: int, top_k: int, experts: Mxfp4Experts, hidden: int, multiprocessors: int
) -> Choice:
    """MEASURED's choice for the shape, else ``rule``'s."""
    num_experts, rows = experts.w13_blocks.shape[:2]
    key = (token_bucket(num_tokens), hidden, rows // 2, num_experts, top_k)
    return MEASURED.get(key) or rule(num_tokens, top_k, num_experts, hidden, multiprocessors)


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (132 where there is no GPU, as under the interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def mxfp4_moe(
    x: torch.Tensor,  # [T, H]
    experts: Mxfp4Experts,
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    choice: Choice | None = None,  # None: ``choose``'s (a benchmark or a test may force one)
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H], each
    expert gpt-oss's biased, clamped SwiGLU over MXFP4 weights. No host sync."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    check_layout(experts, x.shape[1])
    if choice is None:
        choice = choose(num_tokens, top_k, experts, x.shape[1], multiprocessors(x.device))
    if isinstance(choice, GemvTiles):
        return gemv_moe_mxfp4(x, experts, topk_weights, topk_ids, choice)
    if isinstance(choice, Dequantize):
        return dequantized_moe_mxfp4(x, experts, topk_weights, topk_ids, choice.blocks)
    if isinstance(choice, Swapped):
        return swapped_moe_mxfp4(x, experts, topk_weights, topk_ids, choice)
    return fused_moe_mxfp4(x, experts, topk_weights, topk_ids, choice)
