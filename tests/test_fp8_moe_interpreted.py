"""The FP8 expert kernels (engine_core/models/fp8_moe_kernels.py) on the CPU, through Triton's
interpreter, against the reference the CPU serves with (moe.py ``SparseMoE.fp8_expert``: each
expert's gate/up and down through fp8.py's dequantizing ``fp8_linear``, the activations
round-tripped through e4m3 as the scheme says), which tests/test_fp8_moe.py checks against HF
transformers: row scales (per-channel checkpoints, ``--quantization fp8``) and block scales
(128 x 128 as Qwen3's and DeepSeek's FP8 releases, and narrower ones), several experts, top 1 to
4, uneven loads with an expert that gets no token, token and width counts that are not multiples
of the tiles, the one-token path, every candidate tile, and the layers of a tiny FP8 Qwen3-MoE
checkpoint as the loader lays them out.

Triton's interpreter converts float32 to e4m3 wrongly where rounding carries into the next
power of two (124.3 becomes 64, not 128; the GPU's conversion is right), so here the activations
are quantized by torch with the kernels' own math (``torch_quantizers``), and the GEMM kernels,
which only read e4m3, are what is checked; tests/test_fp8_moe_gpu.py runs the Triton quantizers.

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_fp8_moe_interpreted.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models import fp8_moe_kernels as kernels  # noqa: E402
from engine_core.models.fp8 import FP8_DTYPE, Fp8Experts  # noqa: E402
from engine_core.models.fused_moe import Blocks  # noqa: E402
from tests.fp8_moe_cases import random_experts, reference, relative_error, routing  # noqa: E402

# Largest error allowed, relative to the output's largest magnitude. In float32 the kernel
# multiplies the same e4m3 values as the reference (their products are exact in float32) and
# scales the sums where the reference scales the operands, so outputs differ by float32 ulps
# (these inputs: at most 8e-7). The activation between the two products is quantized to e4m3
# again, where a value a few ulps apart could round to the neighbouring e4m3 value (1/16 of
# itself, about 1e-3 of the output); none of these inputs does. A wrong scale (a row, block or
# group off) is wrong by the size of the output (test_a_wrong_scale_group_would_show).
TOLERANCE = 1e-5


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_kernels.quantize_per_token_group's math in torch: [M, K] -> (e4m3, [M, K / group])."""
    groups = x.float().unflatten(-1, (-1, group))
    scale = (groups.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    quantized = (groups / scale).clamp(-448.0, 448.0).to(FP8_DTYPE)
    return quantized.flatten(-2), scale.squeeze(-1)


@pytest.fixture(autouse=True)
def torch_quantizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' activation quantizers replaced by torch's (the module docstring says why)."""
    monkeypatch.setattr(kernels, "quantize_per_token", lambda x: quantize_groups(x, x.shape[1]))
    monkeypatch.setattr(kernels, "quantize_per_token_group", quantize_groups)


def run_both(
    tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
    block: tuple[int, int] | None, dtype: torch.dtype = torch.float32, tiles: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(the kernels' output, the reference's) on random experts, tokens and routing."""
    seed = tokens * 31 + hidden + inter
    experts = random_experts(num_experts, hidden, inter, block, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights, ids = routing(tokens, num_experts, top_k, seed)
    got = kernels.fused_moe_fp8(x, experts, weights, ids, tiles)
    return got, reference(x, experts, weights, ids)


# (tokens, experts, top_k, hidden, inter, block)
SHAPES = [
    (1, 4, 2, 256, 128, (128, 128)),  # one token: the one-slot-a-block path, 128 x 128 blocks
    (1, 5, 4, 96, 64, None),  # ... top 4, row scales, a partial K tile
    (7, 6, 3, 128, 192, (64, 64)),  # an inter that leaves a partial column tile
    (33, 8, 4, 128, 64, (32, 32)),  # 132 slots: 32-row blocks, rows not a multiple of them
    (20, 4, 1, 64, 160, None),  # top 1, row scales, a partial column tile
    (48, 4, 2, 256, 128, (128, 128)),  # two K groups a row, 24 rows an expert
]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "block"), SHAPES)
def test_the_fused_kernels_match_the_reference(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, block: tuple[int, int] | None
) -> None:
    got, want = run_both(tokens, experts, top_k, hidden, inter, block)
    assert relative_error(got, want) < TOLERANCE


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_bf16_activations_match_the_reference(block: tuple[int, int] | None) -> None:
    """In bf16 the reference computes its activation scales in bf16 and rounds its dequantized
    operands to bf16, where the kernels keep float32 scales and multiply e4m3 exactly; bf16
    keeps only 4 more bits than e4m3, so about one activation in 16 re-quantizes to a
    neighbouring e4m3 value (1/16 of itself) in one and not the other: a few percent of the
    output (3.7% at most over these and other seeds), where a wrong scale is 100%."""
    got, want = run_both(9, 4, 2, 256, 128, block, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, want) < 8e-2


@pytest.mark.parametrize("tiles", kernels.CANDIDATES, ids=str)
def test_tile_choices_give_the_same_result(tiles: Blocks) -> None:
    got, want = run_both(24, 4, 2, 256, 128, (128, 128), tiles=tiles)
    assert relative_error(got, want) < TOLERANCE


def test_a_wrong_scale_group_would_show() -> None:
    """The check above can fail: the same experts with one block's weight scale doubled give
    an output the tolerance rejects (so a kernel reading the wrong block would be caught)."""
    experts = random_experts(4, 256, 128, (128, 128), seed=5)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(9, 4, 2, seed=5)
    want = reference(x, experts, weights, ids)
    experts.w2_scale[0, 1, 0] *= 2  # expert 0, hidden rows 128-255, inter columns 0-127
    got = kernels.fused_moe_fp8(x, experts, weights, ids)
    assert relative_error(got, want) > 0.1


@pytest.mark.parametrize(
    ("block", "match"),
    [((128, 48), "multiple of 32"), ((64, 32), "64-row blocks")],
)
def test_layouts_the_kernels_cannot_take_are_refused(block: tuple[int, int], match: str) -> None:
    experts = random_experts(2, 192, 96, None, seed=1)
    odd = Fp8Experts(experts.w13, experts.w13_scale, experts.w2, experts.w2_scale, block)
    weights, ids = routing(3, 2, 1, seed=1)
    with pytest.raises(ValueError, match=match):
        kernels.fused_moe_fp8(torch.randn(3, 192), odd, weights, ids)


def test_a_loaded_checkpoints_layers_match_their_cpu_path(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE in transformers' block-FP8 format (tests/test_fp8.py's writer, the
    layout of Qwen3-30B-A3B-FP8 with 32 x 32 blocks to fit the tiny widths): each MoE layer's
    experts through the kernels equal the layer's own CPU forward."""
    from engine_core.loader import load_model
    from tests.test_fp8 import fp8_block_format, write_quantized
    from tests.test_fp8_moe import make_hf_model

    experts = ("gate_proj", "up_proj", "down_proj")
    fmt = fp8_block_format((32, 32), not_converted=("self_attn",))
    write_quantized(make_hf_model(), fmt, tmp_path / "fp8", tmp_path / "ref", experts)
    model = load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32).module
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(3))
    checked = 0
    for layer in model.model.layers:
        moe = layer.mlp
        if getattr(moe, "fp8", None) is None:
            continue
        routed, weights, ids = moe.softmax_route(x)
        got = kernels.fused_moe_fp8(routed, moe.fp8_experts(), weights, ids.to(torch.int32))
        assert relative_error(got, moe(x)) < TOLERANCE
        checked += 1
    assert checked == len(model.model.layers)
