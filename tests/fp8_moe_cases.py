"""Random FP8 experts and the CPU reference the fused FP8 MoE kernels are checked against
(tests/test_fp8_moe_interpreted.py on the CPU, tests/test_fp8_moe_gpu.py on a GPU)."""

from __future__ import annotations

import torch

from engine_core.config import Fp8Config
from engine_core.models.fp8 import FP8_DTYPE, Fp8Experts, fp8_linear
from engine_core.models.layers import silu_and_mul
from engine_core.models.moe import grouped_experts, route


def fp8_config(block: tuple[int, int] | None) -> Fp8Config:
    scales = "channel" if block is None else "block"
    return Fp8Config(scales, dynamic_activations=True, prequantized=True, block=block)


def random_experts(
    num_experts: int, hidden: int, inter: int, block: tuple[int, int] | None, seed: int
) -> Fp8Experts:
    """e4m3 weights of random values and scales that differ per row or block (2^-9 to 2^-6),
    so that a scale read from the wrong row, block or group shows."""
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        values = torch.randn(num_experts, rows, cols, generator=gen) * 64
        return values.clamp(-448, 448).to(FP8_DTYPE)

    def scales(rows: int, cols: int) -> torch.Tensor:
        shape = (num_experts, rows) if block is None else (
            num_experts, -(-rows // block[0]), cols // block[1])  # fmt: skip
        exponents = torch.randint(-9, -5, shape, generator=gen).float()
        return torch.exp2(exponents) * (1 + torch.rand(shape, generator=gen))

    return Fp8Experts(
        weight(2 * inter, hidden), scales(2 * inter, hidden),
        weight(hidden, inter), scales(hidden, inter), block,
    )  # fmt: skip


def reference(
    x: torch.Tensor, experts: Fp8Experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """SparseMoE.fp8_expert's computation on each expert's tokens, grouped and weighed as the
    CPU path groups them."""
    config, e = fp8_config(experts.block), experts

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = fp8_linear(rows, e.w13[index], e.w13_scale[index], None, config)
        return fp8_linear(silu_and_mul(gate_up), e.w2[index], e.w2_scale[index], None, config)

    return grouped_experts(x, weights, ids, e.w13.shape[0], expert)


def routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k of random logits skewed onto the first experts (uneven loads), the last
    expert never chosen (an expert with no tokens)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, :2] += 1.5
    logits[:, -1] = -1e4
    weights, ids = route(logits, top_k, renormalize=True)
    return weights, ids.to(torch.int32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())
