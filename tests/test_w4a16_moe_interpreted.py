"""The W4A16 expert kernels (engine_core/models/w4a16_moe_kernels.py) on the CPU, through Triton's
interpreter, against the reference the CPU serves with (moe.py ``w4a16_expert_mlp``: each
expert's weights dequantized by w4a16.py and its SwiGLU in the activations' dtype), which
tests/test_w4a16_moe.py checks against HF transformers: several experts, top 1 to 8, uneven loads
with an expert that gets no token, groups of 32 and 128 columns and one over each input, zero
points (up to GPTQ's 16) and none, token and width counts that are not multiples of the tiles,
the one-token path, candidate tiles, float16, a planted wrong scale, and the layers of a loaded
AWQ Qwen3-MoE checkpoint.

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_w4a16_moe_interpreted.py -q
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models import w4a16_moe_kernels as kernels  # noqa: E402
from engine_core.models.fused_moe import Blocks  # noqa: E402
from tests.w4a16_moe_cases import (  # noqa: E402
    random_experts,
    reference,
    relative_error,
    routing,
)

# Largest error allowed, relative to the output's largest magnitude. In float32 the kernels
# multiply the same dequantized weights as the reference (each (q - zero) * scale is exact in
# float32), so only the order of the sums differs: float32 ulps. A wrong scale, zero point or
# column is wrong by the size of the output (test_a_wrong_scale_would_show).
TOLERANCE = 1e-5


def run_both(
    tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, group: int,
    zeros: bool, dtype: torch.dtype = torch.float32, tiles: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(the kernels' output, the reference's) on random experts, tokens and routing."""
    seed = tokens * 31 + hidden + inter + group
    experts = random_experts(num_experts, hidden, inter, group, zeros, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights, ids = routing(tokens, num_experts, top_k, seed)
    return kernels.fused_moe_w4a16(x, experts, weights, ids, tiles), reference(
        x, experts, weights, ids
    )


# (tokens, experts, top_k, hidden, inter, group, zero points)
SHAPES = [
    (1, 4, 2, 256, 128, 128, True),  # one token: the one-slot-a-block path, groups of 128
    (1, 9, 8, 128, 64, 32, False),  # ... top 8, symmetric, a K step past the down's input
    (5, 6, 1, 128, 96, 32, True),  # top 1; the down's 96 inputs: a partial K step
    (37, 8, 4, 256, 128, 128, False),  # uneven loads, the last expert idle
    (70, 3, 2, 128, 64, -1, True),  # one group over each input; large row blocks
]


@pytest.mark.parametrize("tokens", [1, 37])
def test_act_order_experts_gather_their_inputs_in_their_own_orders(tokens: int) -> None:
    """Each expert's columns sorted by group under act-order: its gate/up and down inputs read
    in its own order (the one-token path and row blocks), as the reference gathers them."""
    experts = random_experts(6, 256, 128, 32, True, seed=tokens, act_order=True)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
    weights, ids = routing(tokens, 6, 2, tokens)
    got = kernels.fused_moe_w4a16(x, experts, weights, ids)
    expected = reference(x, experts, weights, ids)
    assert relative_error(got, expected) < TOLERANCE
    in_order = dataclasses.replace(experts, w13_perm=None, w2_perm=None)
    assert relative_error(reference(x, in_order, weights, ids), expected) > 0.1  # orders count


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernels_match_the_reference(shape: tuple) -> None:
    got, want = run_both(*shape)
    assert relative_error(got, want) < TOLERANCE


def test_candidate_tiles_match_the_reference() -> None:
    want = None
    for tiles in (Blocks(16, 32, 128), Blocks(32, 64, 256), Blocks(64, 128, 128, warps=8)):
        got, want = run_both(9, 4, 2, 256, 128, 64, True, tiles=tiles)
        assert relative_error(got, want) < TOLERANCE, tiles


def test_half_precision_activations() -> None:
    """float16: weights rounded to it as the reference rounds them; the sums' order and each
    linear's rounding leave a few ulps. (bf16 is the same code path; Triton 3.9's interpreter
    multiplies bf16 ``tl.dot`` operands made in the kernel wrongly, so tests/test_w4a16_moe_gpu.py
    checks it.)"""
    got, want = run_both(6, 4, 2, 128, 64, 32, True, dtype=torch.float16)
    assert got.dtype == torch.float16
    assert relative_error(got, want) < 5e-3


def test_a_wrong_scale_would_show() -> None:
    """The tolerance above would catch a kernel reading one group's scale for another."""
    experts = random_experts(4, 128, 64, 32, True, seed=3)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(6, 4, 2, 3)
    want = reference(x, experts, weights, ids)
    scales = experts.w13_scales.clone()
    scales[:, 1] = scales[:, 0]  # group 1 of every gate/up row takes group 0's scale
    wrong = dataclasses.replace(experts, w13_scales=scales)
    assert relative_error(kernels.fused_moe_w4a16(x, wrong, weights, ids), want) > 100 * TOLERANCE


def test_layouts_the_kernels_cannot_read_are_refused() -> None:
    experts = random_experts(4, 128, 64, 32, True, seed=0)
    weights, ids = routing(2, 4, 2, 0)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="K steps of 64"):
        kernels.fused_moe_w4a16(x, experts, weights, ids, Blocks(16, 64, 64))
    odd = dataclasses.replace(experts, groups=(12, 32))
    with pytest.raises(ValueError, match=r"groups of \(12, 32\) columns"):
        kernels.fused_moe_w4a16(x, odd, weights, ids)


def test_a_loaded_checkpoints_layers(tmp_path: Path) -> None:
    """The experts as the loader lays them out from an AWQ Qwen3-MoE checkpoint."""
    from tests.paged_harness import load_float32
    from tests.test_w4a16_moe import qwen3_moe, write_w4a16_moe

    qwen3_moe().save_pretrained(tmp_path / "plain")
    folder, _ = write_w4a16_moe(tmp_path / "plain", tmp_path, "awq-g32")
    model = load_float32(folder)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(7))
    for layer in model.model.layers:
        moe = layer.mlp
        weights, ids = moe.route_tokens(x)
        got = kernels.fused_moe_w4a16(x, moe.w4a16_experts(), weights, ids.to(torch.int32))
        assert relative_error(got, moe.run_routed(x, weights, ids)) < TOLERANCE
