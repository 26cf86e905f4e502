"""Random INT8 experts and the CPU reference the fused INT8 MoE kernels are checked against
(tests/test_int8_moe_interpreted.py on the CPU, tests/test_int8_moe_gpu.py on a GPU)."""

from __future__ import annotations

import torch

from engine_core.models.int8 import Int8Experts, int8_linear
from engine_core.models.layers import silu_and_mul
from engine_core.models.moe import grouped_experts


def random_int8_experts(num_experts: int, hidden: int, inter: int, seed: int) -> Int8Experts:
    """int8 weights over the whole range and row scales that differ per row (2^-9 to 2^-6), so
    that a scale read from the wrong row shows."""
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(-128, 128, (num_experts, rows, cols), generator=gen, dtype=torch.int8)

    def scales(rows: int) -> torch.Tensor:
        exponents = torch.randint(-9, -5, (num_experts, rows), generator=gen).float()
        return torch.exp2(exponents) * (1 + torch.rand((num_experts, rows), generator=gen))

    return Int8Experts(weight(2 * inter, hidden), scales(2 * inter), weight(hidden, inter),
                       scales(hidden))  # fmt: skip


def int8_reference(
    x: torch.Tensor, experts: Int8Experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """SparseMoE.int8_expert's computation on each expert's tokens (on the CPU: dequantized
    weights, each product's input quantized per token), grouped and weighed as the CPU path
    groups them."""
    e = experts

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = int8_linear(rows.cpu(), e.w13[index].cpu(), e.w13_scale[index].cpu())
        down = int8_linear(silu_and_mul(gate_up), e.w2[index].cpu(), e.w2_scale[index].cpu())
        return down.to(rows.device)

    return grouped_experts(x, weights, ids, e.w13.shape[0], expert)
