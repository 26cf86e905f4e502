"""The INT8 expert kernels (fp8_moe_kernels.fused_moe_int8) on the CPU, through Triton's
interpreter, against the reference the CPU serves with (moe.py ``SparseMoE.int8_expert``: each
expert's gate/up and down through int8.py's ``int8_linear``, weights dequantized and each
product's input quantized per token), which tests/test_int8_moe.py checks against HF
transformers: several experts, top 1 to 4, uneven loads with an expert that gets no token,
token and width counts that are not multiples of the tiles, the one-token path, and a scale
read from the wrong row caught.

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_int8_moe_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models import fp8_moe_kernels as kernels  # noqa: E402
from engine_core.models.fused_moe import Blocks  # noqa: E402
from tests.fp8_moe_cases import relative_error, routing  # noqa: E402
from tests.int8_moe_cases import int8_reference, random_int8_experts  # noqa: E402

# The kernels sum the same int8 products exactly (int32) and scale the sums once, where the
# reference multiplies dequantized float32 operands: outputs differ by float32 ulps, except where
# an activation between the two products lies a few ulps from a rounding boundary and
# re-quantizes one level apart (a 255th of its token's range, far finer than e4m3's steps, so it
# happens on these random inputs): that token's row moves by one level times one down column, up
# to 2.4e-3 of the output here. So most rows must agree to float32 ulps and every row within
# FLIP_BOUND; a scale read from the wrong row moves every row by the output's size
# (test_a_wrong_row_scale_would_show).
ULPS = 1e-5
FLIP_BOUND = 1e-2


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Rows (tokens) of got and want: at least half within ULPS of the output's largest
    magnitude, all within FLIP_BOUND (the comment above says why)."""
    rows = (got.float() - want.float()).abs().amax(-1) / want.float().abs().max()
    assert float((rows <= ULPS).float().mean()) >= 0.5, f"row errors {rows.tolist()}"
    assert float(rows.max()) < FLIP_BOUND, f"row errors {rows.tolist()}"


# (tokens, experts, top_k, hidden, inter)
SHAPES = [
    (1, 4, 2, 128, 64),  # one token: the one-slot-a-block path
    (1, 5, 4, 96, 64),  # ... top 4, a partial K tile
    (7, 6, 3, 128, 192),  # an inter that leaves a partial column tile
    (33, 8, 4, 128, 64),  # 132 slots: 32-row blocks, rows not a multiple of them
    (20, 4, 1, 64, 160),  # top 1, a partial column tile
]


def run_both(
    tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
    tiles: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    seed = tokens * 31 + hidden + inter
    experts = random_int8_experts(num_experts, hidden, inter, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    weights, ids = routing(tokens, num_experts, top_k, seed)
    got = kernels.fused_moe_int8(x, experts, weights, ids, tiles)
    return got, int8_reference(x, experts, weights, ids)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"), SHAPES)
def test_the_fused_kernels_match_the_reference(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> None:
    assert_matches(*run_both(tokens, experts, top_k, hidden, inter))


@pytest.mark.parametrize("tiles", [Blocks(16, 64, 64), Blocks(64, 128, 128, warps=8)])
def test_tile_choices_give_the_same_result(tiles: Blocks) -> None:
    assert_matches(*run_both(24, 4, 2, 128, 128, tiles))


def test_a_wrong_row_scale_would_show() -> None:
    """The reference with the down scales shifted by one row differs by the output's size, so
    the tolerance above would catch a kernel that read them so."""
    experts = random_int8_experts(4, 64, 64, seed=3)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(9, 4, 2, seed=3)
    got = kernels.fused_moe_int8(x, experts, weights, ids)
    shifted = experts.__class__(
        experts.w13, experts.w13_scale, experts.w2, experts.w2_scale.roll(1, dims=1)
    )
    assert relative_error(got, int8_reference(x, shifted, weights, ids)) > 10 * FLIP_BOUND


def test_float_weights_are_refused() -> None:
    experts = random_int8_experts(2, 64, 64, seed=0)
    widened = experts.__class__(experts.w13.float(), experts.w13_scale, experts.w2,
                                experts.w2_scale)  # fmt: skip
    weights, ids = routing(2, 2, 1, seed=0)
    with pytest.raises(ValueError, match="w13 is .*torch.float32"):
        kernels.fused_moe_int8(torch.randn(2, 64), widened, weights, ids)
