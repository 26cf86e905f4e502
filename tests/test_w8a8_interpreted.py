"""The W8A8 CUDA kernels (engine_core/models/w8a8_kernels.py) on the CPU, through Triton's
interpreter: the per-token quantizer bit for bit against the reference
(engine_core/models/int8.py ``quantize_per_token``, compressed-tensors' math) in float32, fp16
and bf16, ties and clamping included; the int8 GEMM bit for bit against an exact integer
product scaled as torch's cuBLASLt path scales it, and within one rounding of the float product
of the dequantized operands; rows 1, 7 and 130, a K that is not whole tiles, N an odd multiple
of 16 (a partial column tile), with a bias and without, K whole and split, tiles by pointers
and by TMA descriptors, and the persistent kernel (with its K loop warp-specialized and
without) over fewer programs than tiles.

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=<numpy 2.2>:.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_w8a8_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models import int8  # noqa: E402
from engine_core.models import w8a8_kernels as kernels  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SMALL = kernels.Tiles(16, 32, 64)  # K = 208 is 3 1/4 K tiles; N = 48 one and a half columns
# K split in two: columns 0-127 and 128-207 (a partial tile), int32 sums added by a second launch.
SPLIT = kernels.Tiles(16, 32, 64, split_k=2)
# Tiles by the tensor memory accelerator's descriptors: past the edges they read zeros.
TMA = kernels.Tiles(16, 32, 64, tma=True)
TMA_SPLIT = kernels.Tiles(16, 32, 64, split_k=2, tma=True)
# The persistent kernel: a few programs walking the tiles in grouped order (TMA, no split), its
# K loop warp-specialized or not (the interpreter runs the loop as one role either way: what
# it checks is the tile walk and the epilogue).
PERSISTENT = kernels.Tiles(16, 32, 64, tma=True, persistent=True)
PERSISTENT_WS = kernels.Tiles(16, 32, 64, group_m=2, tma=True, persistent=True, ws=True)


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, with (where there are enough) a row of zeros and a row of exact ties: -127.5,
    -126.5, ... (absmax 127.5, so the scale is 1 and every value lies halfway)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    if m >= 3:
        x[1] = 0
        x[2] = torch.arange(k) % 256 - 127.5
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_writes_the_int8_rows_the_quantizer_makes_of_its_output(
    dtype: torch.dtype, residual: bool
) -> None:
    """An RMSNorm in front of INT8 linears quantizes its output in its own launch
    (triton_ops.rms_norm with int8 rows; models/llama.py fuse_quantizers): the rows and scales
    are the separate quantizer's of the norm's output, bit for bit, and the norm's own outputs
    do not change."""
    from engine_core.models import triton_ops

    m, n = 5, 200
    x = activations(m, n, dtype, seed=11)
    w = (torch.rand(n, generator=torch.Generator().manual_seed(12)) + 0.5).to(dtype)
    res = activations(m, n, dtype, seed=13) if residual else None
    plain = triton_ops.rms_norm(x, w, 1e-6, res)
    rows = triton_ops.quantized_rows(m, n, torch.int8, x.device)
    fused = triton_ops.rms_norm(x, w, 1e-6, res, rows)
    plain, fused = (plain, fused) if residual else ((plain,), (fused,))
    for got, want in zip(fused, plain, strict=True):
        assert torch.equal(got, want)
    q, scale = kernels.quantize_per_token(plain[0])
    assert torch.equal(rows[1], scale) and torch.equal(rows[0], q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [100, 5000])  # one block of columns; two (4,096 a block)
def test_silu_and_mul_writes_the_int8_rows_the_quantizer_makes_of_its_output(
    dtype: torch.dtype, inter: int
) -> None:
    """SiLU-and-mul in front of an INT8 down projection quantizes its output in its own launch
    (fp8_kernels.silu_and_mul_quant to int8): the separate launches' bits."""
    from engine_core.models import fp8_kernels, triton_ops

    gate_up = activations(3, 2 * inter, dtype, seed=inter)
    act, q, scale = fp8_kernels.silu_and_mul_quant(gate_up, torch.int8)
    want = triton_ops.silu_and_mul(gate_up)
    assert torch.equal(act, want)
    want_q, want_scale = kernels.quantize_per_token(want)
    assert q.dtype == torch.int8 and torch.equal(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(1, 64), (7, 200), (130, 300)])
def test_the_quantizer_is_the_reference_bit_for_bit(m: int, k: int, dtype: torch.dtype) -> None:
    x = activations(m, k, dtype, seed=m + k)
    q, scale = kernels.quantize_per_token(x)
    expected_q, expected_scale = int8.quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.shape == (m, 1)
    assert torch.equal(scale, expected_scale.float())
    assert torch.equal(q, expected_q.to(torch.int8))
    if m >= 3:  # the rows built to reach the edges did reach them
        assert q[2].tolist()[:4] == [-128, -126, -126, -124]  # halves to even
        assert q[1].eq(0).all() and float(scale[1]) == torch.finfo(dtype).eps


def exact_product(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """q [M, K] @ weight [N, K].T as integers: int64, exact."""
    return q.long() @ weight.long().t()


def scaled(
    acc: torch.Tensor,
    scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """What torch's cuBLASLt path makes of an exact int32 product: float32, both scales, the
    bias, one rounding."""
    out = acc.float() * scale * weight_scale[None, :]
    return (out if bias is None else out + bias.float()).to(dtype)


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return int8.quantize_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize(
    "tiles", [SMALL, SPLIT, TMA, TMA_SPLIT], ids=["one-split", "two-splits", "tma", "tma-split"]
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n"), [(1, 48), (7, 80), (130, 48)])
def test_the_gemm_is_the_exact_integer_product_scaled(
    m: int, n: int, dtype: torch.dtype, tiles: kernels.Tiles
) -> None:
    k = 208  # 16-byte rows, as the descriptors need
    q, scale = kernels.quantize_per_token(activations(m, k, dtype, seed=m))
    weight, weight_scale = int8_weight(n, k, seed=n)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
    acc = exact_product(q, weight)
    for b in (None, bias):
        got = kernels.int8_gemm(q, scale, weight, weight_scale, dtype, b, tiles)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, scaled(acc, scale, weight_scale, b, dtype))


@pytest.mark.parametrize("tiles", [PERSISTENT, PERSISTENT_WS], ids=["persistent", "ws"])
@pytest.mark.parametrize("dtype", DTYPES)
# 130 x 80: 9 x 3 tiles, the last row tile 2 rows and the last column tile 16 columns; over 4
# programs each walks 6 or 7 tiles, over 132 (more programs than tiles) one each.
@pytest.mark.parametrize(
    ("m", "n", "programs"), [(1, 48, 4), (7, 80, 2), (130, 80, 4), (130, 80, 132)]
)
def test_the_persistent_gemm_is_the_exact_integer_product_scaled(
    m: int, n: int, programs: int, dtype: torch.dtype, tiles: kernels.Tiles
) -> None:
    k = 208  # 3 1/4 K tiles; 16-byte rows, as the descriptors need
    q, scale = kernels.quantize_per_token(activations(m, k, dtype, seed=m + 1))
    weight, weight_scale = int8_weight(n, k, seed=n + 1)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.1).to(dtype)
    acc = exact_product(q, weight)
    for b in (None, bias):
        got = kernels.int8_gemm(q, scale, weight, weight_scale, dtype, b, tiles, num_sms=programs)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, scaled(acc, scale, weight_scale, b, dtype))
        # the same bits as the one-tile-a-program TMA kernel
        assert torch.equal(got, kernels.int8_gemm(q, scale, weight, weight_scale, dtype, b, TMA))


def test_persistent_tiles_are_tma_without_split_and_ws_is_theirs() -> None:
    for wrong in (
        dict(persistent=True),  # pointer loads
        dict(persistent=True, tma=True, split_k=2),
        dict(ws=True, tma=True),  # ws without the persistent kernel
    ):
        with pytest.raises(ValueError):
            kernels.Tiles(128, 128, 128, **wrong)


def test_the_sweeps_prefill_grid_offers_the_persistent_forms_first_and_reprs_round_trip() -> None:
    from benchmarks.gemm import describe, sweep_grid, tiles_source

    grid = sweep_grid(2048, 4096, 4096, 132)
    persistent = [t for t in grid if t.persistent]
    assert persistent and grid[: len(persistent)] == persistent
    assert all(t.tma and t.split_k == 1 for t in persistent)
    assert any(t.ws for t in persistent) and any(not t.ws for t in persistent)
    assert all(t.warps == 4 for t in persistent if t.ws)  # Triton 3.6 specializes only there
    assert not any(t.persistent for t in sweep_grid(64, 4096, 4096, 132))
    for tiles in grid:  # measured_table prints these into MEASURED's source
        assert eval(tiles_source(tiles), {"Tiles": kernels.Tiles}) == tiles
    assert (
        tiles_source(PERSISTENT_WS)
        == "Tiles(16, 32, 64, group_m=2, tma=True, persistent=True, ws=True)"
    )
    assert describe(PERSISTENT_WS).endswith(" tma persistent ws")


def test_the_sweeps_table_lines_paste_into_measured_within_the_line_length() -> None:
    """measured_table's lines: the fastest tiles per (bucket, N, K), or None where cuBLASLt
    won, each within ruff's 100 columns, and together a dict literal equal to those choices."""
    from benchmarks.gemm import measured_table

    slow = kernels.Tiles(64, 128, 128, stages=4)
    results = [
        {"n": 28672, "k": 4096, "rows": 8192, "form": "w8a8 cuBLASLt", "tiles": None, "us": 9.0},
        {"n": 28672, "k": 4096, "rows": 8192, "form": "w8a8", "tiles": PERSISTENT_WS, "us": 5.0},
        {"n": 28672, "k": 4096, "rows": 8192, "form": "w8a8", "tiles": slow, "us": 7.0},
        {"n": 4096, "k": 4096, "rows": 1, "form": "w8a8 cuBLASLt", "tiles": None, "us": 2.0},
        {"n": 4096, "k": 4096, "rows": 1, "form": "w8a8", "tiles": slow, "us": 3.0},
    ]
    lines = measured_table(results)
    assert all(len(line) <= 100 for line in lines), lines
    table = eval("{" + "\n".join(lines) + "}", {"Tiles": kernels.Tiles})
    assert table == {(8192, 28672, 4096): PERSISTENT_WS, (1, 4096, 4096): None}


@pytest.mark.parametrize(("split", "tma"), [(1, False), (4, False), (1, True)])
def test_the_accumulation_is_integer_past_float32s_integers(split: int, tma: bool) -> None:
    """Sums beyond 2**24 (where float32 loses integers), scales of 1 and a float32 output: the
    output is the exact sum rounded once (with 4 splits: 512 columns each, the last 464)."""
    m, n, k = 7, 48, 2000
    gen = torch.Generator().manual_seed(0)
    q = torch.where(torch.rand(m, k, generator=gen) < 0.9, -128, 127).to(torch.int8)
    weight = torch.where(torch.rand(n, k, generator=gen) < 0.9, -128, 127).to(torch.int8)
    ones_m, ones_n = torch.ones(m, 1), torch.ones(n)
    acc = exact_product(q, weight)
    assert int(acc.abs().max()) > 2**24
    tiles = kernels.Tiles(16, 32, 64, split_k=split, tma=tma)
    got = kernels.int8_gemm(q, ones_m, weight, ones_n, torch.float32, None, tiles)
    assert torch.equal(got, acc.float())
    if tma:
        got = kernels.int8_gemm(q, ones_m, weight, ones_n, torch.float32, None, PERSISTENT_WS, 2)
        assert torch.equal(got, acc.float())


@pytest.mark.parametrize("m", [1, 7, 130])
def test_bf16_output_is_within_one_rounding_of_the_float_product(m: int) -> None:
    n, k = 112, 300
    x = activations(m, k, torch.bfloat16, seed=5)
    weight, weight_scale = int8_weight(n, k, seed=6)
    q, scale = kernels.quantize_per_token(x)
    got = kernels.int8_gemm(q, scale, weight, weight_scale, torch.bfloat16, None, SMALL)
    expected = (q.double() * scale.double()) @ int8.dequantize(weight, weight_scale).double().t()
    bound = expected.abs() * 2**-8 + 1e-6 * expected.abs().max()
    assert bool(((got.double() - expected).abs() <= bound).all())


def test_the_tile_choice_takes_measured_buckets_and_else_the_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "MEASURED", {})
    assert kernels.choose_tiles(64, 4096, 4096, 132) == kernels.rule_tiles(64, 4096, 4096, 132)
    assert kernels.choose_tiles(2048, 4096, 4096, 132) == kernels.rule_tiles(2048, 4096, 4096, 132)
    tiles = kernels.Tiles(16, 128, 256)
    monkeypatch.setattr(kernels, "MEASURED", {(1, 4096, 4096): tiles, (256, 4096, 4096): None})
    assert kernels.choose_tiles(1, 4096, 4096, 132) == tiles
    # A decode row count the sweep did not time: the rule, never a prefill bucket's entry.
    assert kernels.choose_tiles(2, 4096, 4096, 132) == kernels.rule_tiles(2, 4096, 4096, 132)
    assert kernels.choose_tiles(200, 4096, 4096, 132) is None  # the next measured bucket: 256
    assert kernels.choose_tiles(8192, 4096, 4096, 132) is None  # past the largest: its entry
    assert kernels.choose_tiles(1, 6144, 4096, 132) == kernels.rule_tiles(1, 6144, 4096, 132)
    assert kernels.choose_tiles(300, 6144, 4096, 132) == kernels.rule_tiles(300, 6144, 4096, 132)
