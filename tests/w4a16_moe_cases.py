"""Random W4A16 experts and the reference the CPU serves with, shared by the interpreted and the
GPU tests of the fused W4A16 MoE kernels (engine_core/models/w4a16_moe_kernels.py)."""

from __future__ import annotations

import torch

from engine_core.models.moe import grouped_experts, w4a16_expert_mlp
from engine_core.models.w4a16 import PACK, W4A16Experts
from tests.fp8_moe_cases import relative_error, routing

__all__ = ["random_experts", "reference", "relative_error", "routing"]


def random_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    group: int,  # -1: one group over each projection's input
    zero_points: bool,
    seed: int,
    device: str = "cpu",
    act_order: bool = False,
) -> W4A16Experts:
    """Every nibble random, scales positive and small (outputs of order one), zero points 0..16
    (16: GPTQ's original format's 15, read back without wrapping); ``act_order``: each expert's
    inputs gathered in a random order of its own (the columns' order after sorting by group)."""
    gen = torch.Generator().manual_seed(seed)
    groups = (hidden if group == -1 else group, inter if group == -1 else group)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(
            torch.int32
        )

    def per_group(cols: int, group_cols: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_experts, cols // group_cols, rows)
        scales = 0.002 + 0.01 * torch.rand(shape, generator=gen)
        zeros = torch.randint(0, 17, shape, generator=gen, dtype=torch.uint8)
        return scales, zeros

    scales13, zeros13 = per_group(hidden, groups[0], 2 * inter)
    scales2, zeros2 = per_group(inter, groups[1], hidden)

    def orders(cols: int) -> torch.Tensor | None:
        if not act_order:
            return None
        perms = [torch.randperm(cols, generator=gen) for _ in range(num_experts)]
        return torch.stack(perms).to(torch.int32)

    experts = W4A16Experts(
        words(num_experts, 2 * inter, hidden // PACK), scales13, zeros13 if zero_points else None,
        words(num_experts, hidden, inter // PACK), scales2, zeros2 if zero_points else None,
        groups, orders(hidden), orders(inter),
    )  # fmt: skip
    return to_device(experts, device)


def to_device(experts: W4A16Experts, device: str | torch.device) -> W4A16Experts:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    e = experts
    return W4A16Experts(
        move(e.w13_qweight), move(e.w13_scales), move(e.w13_zeros),
        move(e.w2_qweight), move(e.w2_scales), move(e.w2_zeros), e.groups,
        move(e.w13_perm), move(e.w2_perm),
    )  # fmt: skip


def reference(
    x: torch.Tensor, experts: W4A16Experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """SparseMoE's CPU path (moe.py ``w4a16_expert_mlp`` over each expert's tokens, grouped and
    weighed as ``grouped_experts`` does), on the CPU whatever the inputs' device."""
    e = to_device(experts, "cpu")

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        return w4a16_expert_mlp(e, index, rows)

    cpu = x.cpu(), weights.cpu(), ids.cpu().long()
    return grouped_experts(cpu[0], cpu[1], cpu[2], e.w13_qweight.shape[0], expert).to(x.device)
