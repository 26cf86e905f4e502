"""The MXFP4 expert kernels (engine_core/models/mxfp4_kernels.py, the tiled path; mxfp4_gemv.py,
decode; mxfp4_prefill.py, dequantize then GEMMs; mxfp4_swapped.py, the weights on tl.dot's M
side, here by their bits: tl.dot_scaled runs on a GPU only) on the CPU, through Triton's
interpreter, against the dequantize-then-torch reference (gpt_oss_moe.experts_reference, the
path the CPU serves with): several experts, top 1 to 4, uneven expert loads with an expert that
gets no token, token and width counts that are not multiples of the tiles, the one-token path, K
split over programs, experts dequantized in chunks, every code byte at every scale through the
in-register conversion and the dequantizing kernel, and the layers of a tiny MXFP4 checkpoint
as the loader lays them out.

Triton's interpreter multiplies bf16 ``tl.dot`` operands wrongly (tests/test_w4a16_interpreted.py
says how), so the GEMMs are checked here in float32 and float16, the same code with the
activations' dtype as a parameter; the bf16 conversion is checked bit for bit without a dot, and
the bf16 GEMMs on a GPU (tests/test_mxfp4_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_mxfp4_interpreted.py -q

(Triton 3.6's interpreter fails in ``_align_kernel`` with NumPy 2.4, "only 0-dimensional arrays
can be converted to Python scalars"; put a NumPy below 2.4 first on that path.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine_core.models import (
    mxfp4,  # noqa: E402
    mxfp4_prefill,  # noqa: E402
)
from engine_core.models import mxfp4_kernels as kernels  # noqa: E402
from engine_core.models.fused_moe import Blocks  # noqa: E402
from engine_core.models.gpt_oss_moe import experts_reference, route_gpt_oss  # noqa: E402
from engine_core.models.mxfp4_gemv import GEMV_CANDIDATES, GemvTiles  # noqa: E402
from engine_core.models.mxfp4_moe import DEQUANTIZE_CANDIDATES, mxfp4_moe  # noqa: E402
from engine_core.models.mxfp4_swapped import SWAPPED_CANDIDATES, Swapped  # noqa: E402
from tests.paged_harness import load_float32  # noqa: E402
from tests.test_models_gpt_oss import make_hf_model, write_mxfp4_checkpoint  # noqa: E402

# Largest error allowed, relative to the output's largest magnitude. float32: the kernel and the
# reference multiply the same exact weights and differ only in the order of their float32 sums
# and in how the sigmoid is written, a few float32 ulps (2^-24) per product; 1e-5 leaves room
# for sums of a few hundred terms. float16: both round the gate/up product and the down product
# to float16 (11-bit significands, 2^-11 = 4.9e-4 relative), but the reference also rounds
# each step of the clamped SwiGLU (five roundings) where the kernel rounds its float32 result
# once, so an activation may differ by a few ulps; summed over the down product's columns with
# random signs that stays within a few 2^-11 of the output's largest value: 4e-3.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}


def random_experts(
    num_experts: int, hidden: int, inter: int, seed: int, limit: float = 1.0
) -> mxfp4.Mxfp4Experts:
    """Random codes, scales of 2^-6 to 2^-3 (values up to 0.75: float16 holds every one), and
    biases. limit 1.0 is low enough that the clamp bites on these products."""
    gen = torch.Generator().manual_seed(seed)

    def codes(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(
            0, 256, (num_experts, rows, cols // 2), dtype=torch.uint8, generator=gen
        )

    def scales(rows: int, cols: int) -> torch.Tensor:
        shape = (num_experts, rows, cols // mxfp4.BLOCK)
        return torch.randint(121, 125, shape, dtype=torch.uint8, generator=gen)

    def bias(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.5

    return mxfp4.Mxfp4Experts(
        codes(2 * inter, hidden), scales(2 * inter, hidden), bias(num_experts, 2 * inter),
        codes(hidden, inter), scales(hidden, inter), bias(num_experts, hidden),
        limit=limit, alpha=1.702,
    )  # fmt: skip


def in_dtype(experts: mxfp4.Mxfp4Experts, dtype: torch.dtype) -> mxfp4.Mxfp4Experts:
    """The biases in the model's dtype, as the layer holds them."""
    e = experts
    return mxfp4.Mxfp4Experts(
        e.w13_blocks, e.w13_scales, e.b13.to(dtype),
        e.w2_blocks, e.w2_scales, e.b2.to(dtype), e.limit, e.alpha,
    )  # fmt: skip


def routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing of random logits skewed onto the first experts (uneven loads), the
    last expert never chosen (an expert with no tokens)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, :2] += 1.5
    logits[:, -1] = -1e4
    weights, ids = route_gpt_oss(logits.to(dtype), top_k)
    return weights, ids.to(torch.int32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


# (tokens, experts, top_k, hidden, inter)
SHAPES = [
    (1, 4, 2, 64, 64),  # one token: the one-slot-a-block path
    (1, 5, 4, 96, 32),  # ... top 4, a partial K tile
    (7, 6, 3, 64, 96),  # an inter that leaves a partial column tile
    (33, 8, 4, 96, 64),  # 132 slots: 32-row blocks, rows not a multiple of them
    (20, 4, 1, 32, 160),  # top 1, one scale block across the hidden width
]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_fused_kernels_match_the_dequantizing_reference(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    layer = in_dtype(random_experts(experts, hidden, inter, seed=tokens), dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routing(tokens, experts, top_k, seed=tokens, dtype=dtype)
    assert int(ids.max()) < experts - 1 and len(set(ids.flatten().tolist())) > 1
    want = experts_reference(x, layer, weights, ids.long())
    got = kernels.fused_moe_mxfp4(x, layer, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert relative_error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    "blocks",
    [
        Blocks(16, 32, 64),  # several K steps, the last one partial (96 = 64 + 32)
        Blocks(32, 64, 32, warps=2, stages=2),  # one scale block a K step
        Blocks(16, 16, 128),  # a deep K step, wider than the 96 columns
        *kernels.CANDIDATES,  # the benchmark's sweep
    ],
)
def test_tile_choices_give_the_same_result(blocks: Blocks) -> None:
    layer = random_experts(6, 96, 96, seed=3)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(9, 6, 3, seed=9, dtype=torch.float32)
    want = experts_reference(x, layer, weights, ids.long())
    got = kernels.fused_moe_mxfp4(x, layer, weights, ids, blocks)
    assert relative_error(got, want) <= TOLERANCE[torch.float32]


# (tokens, experts, top_k, hidden, inter, tiles): one token, 7 and 64 tokens; weight-row blocks
# past the rows' end (96 and 160 rows in blocks of 64 and 128), a partial K step (96 = 64 + 32),
# 16- and 32-slot blocks, one scale block a K step.
SWAPPED_CASES = [
    (1, 5, 4, 96, 32, Swapped(64, 16, 64)),
    (7, 6, 3, 64, 96, Swapped(64, 16, 64)),
    (64, 8, 4, 96, 64, Swapped(128, 32, 64)),
    (20, 4, 1, 32, 160, Swapped(64, 16, 32, warps=2, stages=2)),
]


@pytest.mark.parametrize("tiles", SWAPPED_CANDIDATES)
def test_the_swapped_candidates_give_the_same_result(tiles: Swapped) -> None:
    """The benchmark's swapped tiles through mxfp4_moe (by their bits here, whatever
    ``scaled`` says)."""
    layer = random_experts(6, 96, 96, seed=4)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(9, 6, 3, seed=4, dtype=torch.float32)
    want = experts_reference(x, layer, weights, ids.long())
    got = mxfp4_moe(x, layer, weights, ids, tiles)
    assert relative_error(got, want) <= TOLERANCE[torch.float32]


def test_the_clamp_and_the_biases_are_exercised() -> None:
    """Each changes the output beyond the tolerance, or matching the reference proves nothing
    about the kernel's handling of it."""
    layer = random_experts(4, 64, 64, seed=5)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(6, 4, 2, seed=5, dtype=torch.float32)
    got = kernels.fused_moe_mxfp4(x, layer, weights, ids)
    e = layer
    variants = {
        "no clamp": mxfp4.Mxfp4Experts(*astuple(e)[:6], limit=1e9, alpha=e.alpha),
        "no biases": mxfp4.Mxfp4Experts(
            e.w13_blocks, e.w13_scales, e.b13 * 0, e.w2_blocks, e.w2_scales, e.b2 * 0,
            e.limit, e.alpha,
        ),
    }  # fmt: skip
    for name, variant in variants.items():
        other = experts_reference(x, variant, weights, ids.long())
        assert relative_error(got, other) > 100 * TOLERANCE[torch.float32], name


def astuple(e: mxfp4.Mxfp4Experts) -> tuple:
    return (e.w13_blocks, e.w13_scales, e.b13, e.w2_blocks, e.w2_scales, e.b2, e.limit, e.alpha)


@triton.jit
def _widen_kernel(Codes, Scales, Even, Odd, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """ROWS rows of BYTES code bytes (one scale a row) -> their even and odd values in Even's
    dtype, through the kernels' own load and conversion."""
    r = tl.arange(0, ROWS)
    b = tl.arange(0, BYTES)[:, None]
    packed, exponents = kernels.load_codes(
        Codes, Scales, r[None, :] * BYTES + b, r[None, :], BYTES, 1, r < ROWS
    )
    even, odd = kernels.widen(packed, exponents, Even.dtype.element_ty)
    tl.store(Even + r[None, :] * BYTES + b, even)
    tl.store(Odd + r[None, :] * BYTES + b, odd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_at_every_scale_widens_exactly(dtype: torch.dtype) -> None:
    """Every code byte under every e8m0 scale whose products fit a float32 (0 to 252; from 253
    on, 6 x 2^126 overflows), bit for bit equal to mxfp4.dequantize wherever that is zero or a
    normal float; the products below float32's normal range (2^-126) read as zero."""
    scales = torch.arange(0, 253, dtype=torch.uint8).repeat_interleave(16)  # one row a scale
    rows = scales.numel()  # each scale's 16 rows hold the 256 byte values
    codes = torch.arange(256, dtype=torch.int32).repeat(253).view(rows, 16).to(torch.uint8)
    padded_rows = triton.next_power_of_2(rows)
    codes = torch.cat((codes, torch.zeros(padded_rows - rows, 16, dtype=torch.uint8)))
    scales = torch.cat((scales, torch.full((padded_rows - rows,), 127, dtype=torch.uint8)))
    even = torch.empty(padded_rows, 16, dtype=dtype)
    odd = torch.empty(padded_rows, 16, dtype=dtype)
    _widen_kernel[(1,)](codes, scales, even, odd, ROWS=padded_rows, BYTES=16)
    got = torch.stack((even, odd), dim=-1).flatten(-2)[:rows].float()  # [rows, 32]
    want = mxfp4.dequantize(codes[:rows], scales[:rows, None], torch.float32)
    normal = (want == 0) | (want.abs() >= 2.0**-126)
    assert torch.equal(got[normal], want[normal])
    assert bool((got[~normal] == 0).all()) and int((~normal).sum()) > 0


# (tokens, experts, top_k, hidden, inter, decode tiles): one row a program (no grouping) and
# align's blocks of 2, 4 and 8 rows; column tiles wider than the 96-column projections (odd
# columns); K steps of 4 to 16 words; K split in 2 and 3 (a split past the row's end included).
GEMV_CASES = [
    (1, 4, 2, 64, 96, GemvTiles(1, 64, 4, 1)),
    (1, 5, 4, 96, 32, GemvTiles(1, 16, 4, 3)),
    (5, 6, 3, 64, 96, GemvTiles(2, 32, 8, 2)),
    (16, 8, 4, 96, 64, GemvTiles(4, 32, 4, 2)),
    (11, 4, 1, 32, 160, GemvTiles(8, 64, 16, 1)),
]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "tiles"), GEMV_CASES + SWAPPED_CASES
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_decode_and_swapped_kernels_match_the_dequantizing_reference(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, tiles: GemvTiles | Swapped,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    layer = in_dtype(random_experts(experts, hidden, inter, seed=tokens), dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = routing(tokens, experts, top_k, seed=tokens, dtype=dtype)
    want = experts_reference(x, layer, weights, ids.long())
    got = mxfp4_moe(x, layer, weights, ids, tiles)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert relative_error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("choice", [*GEMV_CANDIDATES, *DEQUANTIZE_CANDIDATES, None])
def test_the_sweeps_choices_give_the_same_result(choice: object) -> None:
    """The benchmark's decode and prefill candidates, and the rule's own choice (at 6 tokens:
    the decode kernels) on one layer."""
    layer = random_experts(6, 96, 64, seed=8)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(8))
    weights, ids = routing(6, 6, 3, seed=8, dtype=torch.float32)
    want = experts_reference(x, layer, weights, ids.long())
    got = mxfp4_moe(x, layer, weights, ids, choice)
    assert relative_error(got, want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_prefill_path_in_chunks_of_experts_matches_the_reference(dtype: torch.dtype) -> None:
    """Five experts dequantized two at a time (three chunks, the last one short), tiles that
    leave partial row, column and K blocks."""
    layer = in_dtype(random_experts(5, 96, 96, seed=6), dtype)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
    weights, ids = routing(23, 5, 2, seed=6, dtype=dtype)
    want = experts_reference(x, layer, weights, ids.long())
    got = mxfp4_prefill.dequantized_moe_mxfp4(x, layer, weights, ids, Blocks(16, 64, 64), 2)
    assert relative_error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantize_kernel_is_bit_exact(dtype: torch.dtype) -> None:
    """Every code byte under every e8m0 scale whose products fit a float32, as
    mxfp4.dequantize gives them, wherever that is zero or a normal float (the products below
    2^-126 read as zero), in rows of 256 weights over two experts."""
    codes = torch.arange(256, dtype=torch.int32).repeat(253).to(torch.uint8)  # [253 * 256]
    codes = codes.view(2, -1, 128)  # 2 experts, rows of 128 bytes, 8 scales a row
    scales = torch.arange(0, 253, dtype=torch.uint8).repeat_interleave(16)  # one a 16 bytes
    scales = scales.view(2, -1, 8)
    got = mxfp4_prefill.dequantize(codes, scales, torch.empty(2, codes.shape[1], 256, dtype=dtype))
    want = mxfp4.dequantize(codes, scales, torch.float32)
    normal = (want == 0) | (want.abs() >= 2.0**-126)
    assert torch.equal(got.float()[normal], want[normal])
    assert bool((got.float()[~normal] == 0).all()) and int((~normal).sum()) > 0


def test_a_loaded_checkpoints_layers_match_their_cpu_path(tmp_path: Path) -> None:
    """The tiny MXFP4 gpt-oss of tests/test_models_gpt_oss.py, loaded as published (gate and up
    rows interleaved in the file, sorted at load): each MoE layer through the kernels the CUDA
    layer chooses (at 9 tokens of 4 experts: the decode kernels), on the
    tensors the layer hands them, equals the layer's CPU forward (the dequantizing path)."""
    write_mxfp4_checkpoint(make_hf_model(), tmp_path)
    model = load_float32(tmp_path)
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer in model.model.layers:
        moe = layer.mlp
        weights, ids = route_gpt_oss(moe.router(x), moe.top_k)
        got = mxfp4_moe(x, moe.mxfp4_experts(), weights, ids.to(torch.int32))
        assert relative_error(got, moe(x)) <= TOLERANCE[torch.float32]
