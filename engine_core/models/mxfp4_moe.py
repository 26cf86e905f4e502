"""gpt-oss's MXFP4 experts on CUDA: which of the three paths runs a step, by its shape.

- one slot an expert or fewer (decode of a few tokens): the CUDA-core matrix-vector kernels
  (mxfp4_gemv.py), which convert each code once per program;
- more: the swapped kernels that put the weights on the tensor cores' M side and widen the
  codes through tl.dot_scaled (mxfp4_swapped.py); the tiled kernels with the tokens on the M
  side (mxfp4_kernels.py) run only where forced (a benchmark's or a test's choice);
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
from engine_core.models.mxfp4_kernels import check_layout, fused_moe_mxfp4
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

# Up to this many (token, k) slots an expert on average, the CUDA-core kernels; beyond, the
# swapped kernels, which the sweep measured faster than every GEMV tile from two slots an expert
# (16 tokens of gpt-oss-20b: 299 us a layer; at 64 tokens 361 us against the GEMV's best 1,323
# and the tiled kernels' 1,025). One slot an expert and fewer (8 tokens) is unmeasured.
GEMV_SLOTS_PER_EXPERT = 1
# The swapped kernels' tiles where the sweep has not measured the shape: its fastest at 16 and 64
# tokens, within 4% of the fastest at 256.
SWAPPED_RULE = Swapped(rows=128, slots=16, k=64, warps=4, stages=3)
# From this many tokens, dequantize and run bf16 GEMMs: at 256 tokens the swapped kernels still
# win (740 us a layer; dequantizing 1.4 ms at 64), at 2,048 dequantizing does (2.16 ms against
# the tiled kernels' 7.39; the swapped ones unmeasured there).
DEQUANTIZE_TOKENS = 512
# The sweep's fastest choice by (token bucket, hidden, width, experts, top k), where measured
# (gpt-oss-20b's layer, `python -m benchmarks mxfp4 --tokens N --sweep`; docs/design/
# gpt-oss-and-deepseek.md has the figures beside bf16's).
MEASURED: dict[tuple[int, int, int, int, int], Choice] = {
    (1, 2880, 2880, 32, 4): GemvTiles(rows=1, block_n=32, words=8, split_k=4, warps=4),
    (16, 2880, 2880, 32, 4): Swapped(rows=128, slots=16, k=64, warps=4, stages=3),
    (64, 2880, 2880, 32, 4): Swapped(rows=128, slots=16, k=64, warps=4, stages=3),
    (256, 2880, 2880, 32, 4): Swapped(rows=128, slots=32, k=64, warps=8, stages=3),
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
    return SWAPPED_RULE


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
