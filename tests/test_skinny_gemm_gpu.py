"""GPU tests of the skinny GEMM on plain (bf16/fp16) weights (engine_core/models/skinny_gemm.py),
against float32 products computed here: every tile shape and K split the engine picks, with and
without bias, rows from 1 to 128 (past 64 in row tiles), widths that leave a partial weight tile;
``decode_linear`` takes exactly the products it is meant for (decode-sized, bf16/fp16,
TMA-aligned, on Hopper) and leaves the rest to cuBLAS; a plain Linear on the GPU runs it inside
``for_graphs()`` (the runner's graph capture) and cuBLAS outside, both matching ``F.linear``; a
CUDA graph replays it exactly; a call at a row count the CUDA graphs did not have (the FP8 path's
eager steps) compiles no new variant. The SiLU-and-mul epilogue over an interleaved gate/up
weight gives what the product followed by SiLU-and-mul gives, and a Llama MLP whose weight
interleave_gate_ups rearranged computes what it did before, at decode sizes and above them; the
argmax epilogue gives the argmax of the logits it wrote; the RMSNorm split between two products
(decode_norm_between) gives HF's norm between them; a bf16 model on the skinny path gives HF's
logits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models import model_config_from_hf, skinny_gemm, triton_ops  # noqa: E402
from engine_core.models.gate_up_layout import interleave_gate_up  # noqa: E402
from engine_core.models.layers import Linear, rms_norm_torch  # noqa: E402
from engine_core.models.llama import (  # noqa: E402
    LlamaMLP,
    interleave_gate_ups,
    interleave_loaded_gate_ups,
)
from engine_core.models.target import BuildTarget  # noqa: E402
from engine_core.presets import hf_config  # noqa: E402
from engine_core.triton_pdl import hopper_or_later  # noqa: E402
from tests.triton_variants import compiled_variants  # noqa: E402

HOPPER = hopper_or_later(torch.device("cuda"))
# (N, K): smollm2's qkv, o-sized, gate_up and down; llama-1b's and llama-8b's down (two K splits);
# a router-sized N of 8 and an N that leaves a partial 64-row tile.
SHAPES = (
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (2048, 8192),
    (4096, 14336),
    (8, 2048),
    (200, 1024),
)


def operands(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype)
    return x, w


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return out if bias is None else out + bias.float()


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the float32 product up to the output's rounding (and float32 sums in another
    order): at most a few units in the last place of the largest value."""
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    err = (got.float() - want).abs().max().item()
    assert err <= 2 * ulp * want.abs().max().item(), f"max error {err:.3g}"


def spy_on_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, each skinny GEMM launch appends whether it ran the SiLU-and-mul epilogue."""
    launches: list[bool] = []
    real = skinny_gemm.skinny_gemm

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(bool(kwargs.get("glu", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_gemm", spy)
    return launches


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", (1, 7, 64, 65, 100, 128))
def test_dense_tiles_product_equals_float32(n: int, k: int, m: int) -> None:
    """Every row count a decode graph may have, in one row tile or (past ONE_TILE_ROWS) in
    several, the last one partial."""
    x, w = operands(m, n, k, torch.bfloat16)
    tiles = skinny_gemm.dense_tiles(n, k, x.device)
    block_m = skinny_gemm.dense_row_tile(m, n, k, x.device)
    got = skinny_gemm.skinny_gemm(x, w, x.dtype, block_m=block_m, **tiles)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert_within_rounding(got, reference(x, w, None), torch.bfloat16)


@pytest.mark.parametrize("split_k", (1, 2, 4))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_bias_splits_and_dtypes(split_k: int, dtype: torch.dtype) -> None:
    x, w = operands(33, 200, 2048, dtype)
    bias = torch.randn(200, device="cuda").to(dtype)
    got = skinny_gemm.skinny_gemm(x, w, dtype, bias=bias, block_k=128, split_k=split_k)
    assert_within_rounding(got, reference(x, w, bias), dtype)


@pytest.mark.parametrize("m,block_m", ((16, None), (40, 16), (100, 64)))
def test_per_thread_loads_give_the_same_product(m: int, block_m: int | None) -> None:
    """The kernel without TMA (any GPU; on Hopper where an operand is misaligned), in one row
    tile and in several, the last one partial."""
    x, w = operands(m, 576, 1536, torch.bfloat16)
    got = skinny_gemm.skinny_gemm(x, w, x.dtype, block_k=128, tma=False, block_m=block_m)
    assert_within_rounding(got, reference(x, w, None), torch.bfloat16)


def test_out_receives_the_product() -> None:
    """``out`` (the decode graphs' static logits rows) gets the product and nothing around it;
    a buffer of another shape is refused."""
    x, w = operands(64, 3072, 1024, torch.bfloat16)
    buf = torch.full((80, 3072), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = skinny_gemm.skinny_gemm(x, w, torch.bfloat16, out=buf[:64])
    assert got.data_ptr() == buf.data_ptr()
    assert_within_rounding(buf[:64], reference(x, w, None), torch.bfloat16)
    assert buf[64:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        skinny_gemm.skinny_gemm(x, w, torch.bfloat16, out=buf[:63])


def test_scales_must_come_in_pairs() -> None:
    x, w = operands(4, 64, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        skinny_gemm.skinny_gemm(x, w, x.dtype, a_scale=torch.ones(4, device="cuda"), block_k=64)


def test_decode_linear_takes_what_it_should() -> None:
    x, w = operands(64, 576, 576, torch.bfloat16)
    taken = skinny_gemm.decode_linear(x, w, None)
    assert (taken is not None) == HOPPER
    if taken is not None:
        assert_within_rounding(taken, reference(x, w, None), torch.bfloat16)
    tiled, _ = operands(100, 576, 576, torch.bfloat16)  # in row tiles
    taken = skinny_gemm.decode_linear(tiled, w, None)
    assert (taken is not None) == HOPPER
    if taken is not None:
        assert_within_rounding(taken, reference(tiled, w, None), torch.bfloat16)
    # Past 64 rows, only weights with a side of at most 2,048 (llama-1b's, not llama-8b's).
    for n, k, tiled in ((3072, 2048, True), (2048, 8192, True), (4096, 4096, False)):
        x_k, w_k = operands(100, n, k, torch.bfloat16)
        assert (skinny_gemm.decode_linear(x_k, w_k, None) is not None) == (tiled and HOPPER)
    big, _ = operands(skinny_gemm.DENSE_MAX_ROWS + 1, 576, 576, torch.bfloat16)
    assert skinny_gemm.decode_linear(big, w, None) is None  # past DENSE_MAX_ROWS: cuBLAS
    assert skinny_gemm.decode_linear(x.float(), w.float(), None) is None  # float32: cuBLAS
    odd_x, odd_w = operands(8, 64, 96, torch.bfloat16)
    assert skinny_gemm.decode_linear(odd_x, odd_w, None) is None  # K not whole 64-column tiles
    wide, _ = operands(8, 576, 576 + 8, torch.bfloat16)
    shifted = wide[:, 1:577]  # base address 2 bytes in: TMA refuses it
    assert skinny_gemm.decode_linear(shifted, w, None) is None


@pytest.mark.skipif(not HOPPER, reason="the skinny GEMM takes plain weights on Hopper only")
def test_linear_on_the_gpu_runs_it_and_matches_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = spy_on_launches(monkeypatch)
    layer = Linear(1024, 200, bias=True).to("cuda", torch.bfloat16)
    x, _ = operands(12, 200, 1024, torch.bfloat16)
    eager = layer(x)
    assert launches == []  # eagerly cuBLAS: its launch costs the host less
    with skinny_gemm.for_graphs():
        got = layer(x)
    assert launches == [False]  # for a graph, one launch, a plain product
    assert not skinny_gemm.graphed()  # the block ended
    assert_within_rounding(eager, F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                           torch.bfloat16)  # fmt: skip
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert_within_rounding(got, want, torch.bfloat16)


def test_a_cuda_graph_replays_it_exactly() -> None:
    x, w = operands(64, 2048, 8192, torch.bfloat16)  # K splits: the reduce launch too
    tiles = skinny_gemm.dense_tiles(2048, 8192, x.device)
    eager = skinny_gemm.skinny_gemm(x, w, x.dtype, **tiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm.skinny_gemm(x, w, x.dtype, **tiles)
    x.copy_(operands(64, 2048, 8192, torch.bfloat16)[0] * 0.5)
    graph.replay()
    assert torch.equal(out, skinny_gemm.skinny_gemm(x, w, x.dtype, **tiles))
    assert not torch.equal(out, eager)


@pytest.mark.skipif(not HOPPER, reason="decode_linear runs the TMA kernel on Hopper only")
@pytest.mark.parametrize("k", (1536, 2048))  # a short K (16-row tiles) and another
def test_new_row_counts_compile_no_new_variant(k: int) -> None:
    """An eager step (a short prompt's prefill, a batch no graph covers) may bring any row count
    to the FP8 path's skinny GEMM (plain weights take cuBLAS eagerly). Within one row tile (33
    to 64 rows share BLOCK_M 64, as do the tiles of 65 to 128 rows, and a short K's 16-row
    tiles up to 64) none may compile a variant of its own: that would stall serving for the
    compile."""
    w = operands(1, 576, k, torch.bfloat16)[1]

    def run(m: int) -> int:
        x = operands(m, 576, k, torch.bfloat16)[0]
        assert_within_rounding(
            skinny_gemm.decode_linear(x, w, None), reference(x, w, None), torch.bfloat16
        )
        return compiled_variants(skinny_gemm._skinny_gemm_tma_kernel)

    run(64)  # the two row-tile classes, compiled
    run(100)
    counts = [run(m) for m in (63, 48, 33, 40, 65, 128)]
    assert counts == [counts[0]] * len(counts), counts


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 values at most one rounding apart, element by element."""
    diff = (got.float() - want.float()).abs()
    bound = 2.0**-7 * want.float().abs() + 1e-6
    assert bool((diff <= bound).all()), f"max difference {diff.max().item():.3g}"


@pytest.mark.parametrize("m", (1, 7, 64, 100))
@pytest.mark.parametrize("n,k", ((3072, 576), (16384, 2048), (192, 1024)))
def test_glu_epilogue_equals_product_then_silu_and_mul(n: int, k: int, m: int) -> None:
    """(n: gate/up rows 2I.) The epilogue rounds the product as the separate GEMM writes it, then
    applies the same SiLU-and-mul (in one row tile, and in several past 64 rows)."""
    x, w = operands(m, n, k, torch.bfloat16)
    tiles = dict(block_n=64, block_k=skinny_gemm.dense_tiles(n, k, x.device)["block_k"])
    tiles["block_m"] = skinny_gemm.dense_row_tile(m, n, k, x.device)
    separate = triton_ops.silu_and_mul(skinny_gemm.skinny_gemm(x, w, x.dtype, **tiles))
    interleaved = interleave_gate_up(w)
    fused = skinny_gemm.skinny_gemm(x, interleaved, x.dtype, glu=True, **tiles)
    assert fused.shape == (m, n // 2)
    assert_within_one_rounding(fused, separate)
    product = reference(x, w, None).to(torch.bfloat16).float()
    gate, up = product.chunk(2, dim=-1)
    assert_within_rounding(fused, F.silu(gate) * up, torch.bfloat16)


@pytest.mark.parametrize("m", (1, 7, 64, 100))
@pytest.mark.parametrize("n,k", ((49152, 576), (128256, 2048), (50304, 768)))
def test_argmax_epilogue_gives_the_logits_and_their_argmax(n: int, k: int, m: int) -> None:
    """The decode graphs' LM head (smollm2's, llama's, GPT-2's padded vocabularies): the product
    as decode_linear writes it, and the argmax over the columns under the vocabulary of what it
    wrote (the padding columns hold the largest values and are never an answer)."""
    x, w = operands(m, n, k, torch.bfloat16)
    vocab = n - 47
    w[vocab:] = x.mean(0) * 50  # every row's largest products: padding
    logits = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    argmax = torch.full((m,), -1, dtype=torch.int64, device="cuda")
    took = skinny_gemm.decode_linear_argmax(x, w, vocab, logits, argmax)
    assert took == (HOPPER and skinny_gemm.takes_plain_product(x, w))
    if not took:
        pytest.skip("decode_linear leaves this product to cuBLAS here")
    wanted = torch.empty_like(logits)
    assert skinny_gemm.decode_linear(x, w, None, out=wanted) is not None
    assert torch.equal(logits, wanted)
    assert_within_rounding(logits, reference(x, w, None), torch.bfloat16)
    assert torch.equal(argmax, logits[:, :vocab].argmax(dim=-1))


def test_argmax_epilogue_refuses_what_it_cannot_do() -> None:
    x, w = operands(8, 256, 1024, torch.bfloat16)
    parts = skinny_gemm.TileArgmax.allocate(8, 4, 200, x.device)
    with pytest.raises(ValueError, match="argmax"):
        skinny_gemm.skinny_gemm(x, w, x.dtype, block_n=64, block_k=128, split_k=2,
                                tile_argmax=parts)  # fmt: skip
    with pytest.raises(ValueError, match="parts"):  # 128-row weight tiles: 2 parts a row
        skinny_gemm.skinny_gemm(x, w, x.dtype, block_n=128, block_k=128, tile_argmax=parts)
    too_many = skinny_gemm.TileArgmax.allocate(8, 4, 257, x.device)
    with pytest.raises(ValueError, match="columns"):
        skinny_gemm.skinny_gemm(x, w, x.dtype, block_n=64, block_k=128, tile_argmax=too_many)


def test_interleaved_silu_and_mul_reads_the_tiles() -> None:
    """Above decode sizes the product comes from cuBLAS in the interleaved column order and the
    SiLU-and-mul kernel reads each tile's gate and up columns."""
    x, w = operands(100, 3072, 576, torch.bfloat16)
    product = F.linear(x, interleave_gate_up(w))
    got = triton_ops.silu_and_mul(product, skinny_gemm.GLU_HALF)
    assert_within_one_rounding(got, triton_ops.silu_and_mul(F.linear(x, w)))


def test_glu_epilogue_refuses_what_it_cannot_do() -> None:
    x, w = operands(8, 128, 1024, torch.bfloat16)
    for bad in ({"block_n": 32}, {"split_k": 2}, {"bias": torch.zeros(128, device="cuda")}):
        launch = {"block_n": 64, "block_k": 128, **bad}
        with pytest.raises(ValueError, match="epilogue"):
            skinny_gemm.skinny_gemm(x, w, x.dtype, glu=True, **launch)
    with pytest.raises(ValueError, match="epilogue"):  # N not whole 64-row tiles
        skinny_gemm.skinny_gemm(x, w[:96], x.dtype, block_n=64, block_k=128, glu=True)
    with pytest.raises(ValueError, match="tiles"):
        interleave_gate_up(w[:96])
    with pytest.raises(ValueError, match="groups"):
        triton_ops.silu_and_mul(torch.zeros(4, 96, device="cuda"), skinny_gemm.GLU_HALF)


@pytest.mark.skipif(not HOPPER, reason="the gate/up weights are interleaved on Hopper only")
@pytest.mark.parametrize("m", (8, 64, 100, 200))
def test_interleaved_mlp_computes_what_it_did(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    torch.manual_seed(0)
    mlp = LlamaMLP(model_config_from_hf(hf_config("smollm2-135m"))).to("cuda", torch.bfloat16)
    x = torch.randn(m, 576, device="cuda").to(torch.bfloat16)
    before = mlp(x)
    assert interleave_gate_ups(mlp) == 1 and mlp.gate_up_interleaved  # marked...
    interleave_loaded_gate_ups(mlp)  # ...and its rows moved, as loading finishes
    epilogues = spy_on_launches(monkeypatch)
    eager = mlp(x)  # cuBLAS and the SiLU-and-mul that reads the interleaved columns
    assert epilogues == []
    with skinny_gemm.for_graphs():
        after = mlp(x)
    # Decode sizes: the epilogue ran (and the down projection); above them cuBLAS ran both.
    assert epilogues == ([True, False] if m <= skinny_gemm.DENSE_MAX_ROWS else [])
    assert_within_rounding(after, before.float(), torch.bfloat16)
    assert_within_rounding(eager, before.float(), torch.bfloat16)


NORM_EPS = 1e-5


def stream_operands(
    m: int, k: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention output x [m, k], o_proj's weight [n, k], the residual stream [m, n] before
    it and the post-attention norm's weight [n]."""
    x, first = operands(m, n, k, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n)
    residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
    return x, first, residual, norm_weight


@pytest.mark.skipif(not HOPPER, reason="the norm halves need TMA loads (Hopper)")
@pytest.mark.parametrize("m", (1, 7, 64, 100))
@pytest.mark.parametrize(
    "k,n,second_rows,glu,biases",
    (
        (576, 576, 3072, True, False),  # smollm2's o, then its gate/up
        (2048, 2048, 16384, True, False),  # llama-1b's (past NORM_BETWEEN_MAX_K: lifted here)
        (1536, 576, 960, False, False),  # a plain second product (smollm2's down, qkv shapes)
        (896, 896, 1152, False, True),  # Qwen2-0.5B-like: o with bias, qkv with bias
    ),
)
def test_norm_between_gives_the_norm_between_the_products(
    monkeypatch: pytest.MonkeyPatch, k: int, n: int, second_rows: int, glu: bool, biases: bool,
    m: int,
) -> None:  # fmt: skip
    """The stream is the first product (as decode_linear writes it) plus the residual, bit for
    bit; the second product is HF's norm of that stream followed by the float32 product (and
    SiLU-and-mul, or the bias), within the output's rounding, and within a rounding of the
    separate norm and product's; it runs where decode_linear takes both products."""
    monkeypatch.setattr(skinny_gemm, "NORM_BETWEEN_MAX_K", 1 << 20)
    x, first, residual, norm_weight = stream_operands(m, k, n)
    _, second = operands(m, second_rows, n, torch.bfloat16)
    first_bias = second_bias = None
    if biases:
        first_bias = torch.linspace(-1, 1, n, device="cuda").to(torch.bfloat16)
        second_bias = torch.linspace(2, -2, second_rows, device="cuda").to(torch.bfloat16)
    product = skinny_gemm.decode_linear(x, first, first_bias)
    if glu:
        second = interleave_gate_up(second)
    got = skinny_gemm.decode_norm_between(
        x, first, first_bias, residual, norm_weight, NORM_EPS, second, second_bias, glu
    )
    if product is None:
        assert got is None
        pytest.skip("decode_linear leaves these products to cuBLAS")
    assert got is not None
    y, stream = got
    assert torch.equal(stream, product + residual)  # bf16 + bf16: one rounding, as the kernel's
    normed, _ = triton_ops.rms_norm(product, norm_weight, NORM_EPS, residual)
    hf = reference(rms_norm_torch(stream, norm_weight, NORM_EPS), second, second_bias)
    if glu:
        separate = skinny_gemm.decode_glu(normed, second)
        gate_up = hf.to(torch.bfloat16).float().view(m, -1, 2, skinny_gemm.GLU_HALF)
        hf = (F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]).reshape(m, -1)
    else:
        separate = skinny_gemm.decode_linear(normed, second, second_bias)
    assert separate is not None and y.shape == separate.shape
    assert_within_rounding(y, hf, torch.bfloat16)
    assert_within_rounding(y, separate.float(), torch.bfloat16)


@pytest.mark.skipif(not HOPPER, reason="the norm halves need TMA loads (Hopper)")
def test_norm_halves_refuse_what_they_cannot_do() -> None:
    x, first, residual, norm_weight = stream_operands(8, 1024, 256)
    scaled = torch.empty_like(residual)
    parts = torch.empty((4, 8), device="cuda")  # 256 columns in 64-row weight tiles
    good = skinny_gemm.NormOut(residual, norm_weight, scaled, parts)
    launch = {"block_n": 64, "block_k": 128}
    for bad in ({"split_k": 2}, {"tma": False}):
        with pytest.raises(ValueError, match="norm halves take TMA"):
            skinny_gemm.skinny_gemm(x, first, x.dtype, norm_out=good, **launch, **bad)
    refused = {
        "residual must be": skinny_gemm.NormOut(residual[:4], norm_weight, scaled, parts),
        "weight must be": skinny_gemm.NormOut(residual, norm_weight[:-1], scaled, parts),
        "sums of squares": skinny_gemm.NormOut(residual, norm_weight, scaled, parts[:3]),
    }
    for message, bad_out in refused.items():
        with pytest.raises(ValueError, match=message):
            skinny_gemm.skinny_gemm(x, first, x.dtype, norm_out=bad_out, **launch)
    with pytest.raises(ValueError, match="sums of squares"):
        skinny_gemm.skinny_gemm(scaled, first[:, :256], x.dtype,
                                norm_in=skinny_gemm.NormIn(parts.double(), NORM_EPS),
                                **launch)  # fmt: skip


@pytest.mark.skipif(not HOPPER, reason="the norm halves need TMA loads (Hopper)")
def test_norm_between_leaves_long_products_alone() -> None:
    """Past NORM_BETWEEN_MAX_K (llama-1b's o, K 2,048) the norm keeps its own launch."""
    x, first, residual, norm_weight = stream_operands(64, 2048, 2048)
    _, second = operands(64, 16384, 2048, torch.bfloat16)
    assert skinny_gemm.decode_linear(x, first, None) is not None  # the product alone: taken
    second = interleave_gate_up(second)
    args = (x, first, None, residual, norm_weight, NORM_EPS, second, None, True)
    assert skinny_gemm.decode_norm_between(*args) is None


def spy_on_norms_between(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, each decode_norm_between call appends whether it ran the products."""
    calls: list[bool] = []
    real = skinny_gemm.decode_norm_between

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        result = real(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(skinny_gemm, "decode_norm_between", spy)
    return calls


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.skipif(not HOPPER, reason="the skinny path and the interleave are Hopper's")
def test_bf16_model_on_the_skinny_path_matches_hf(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """End to end in bf16, the dtype the skinny path takes: a tiny Llama whose gate/up weights
    were interleaved, its first step (three prompts, 39 tokens) through the skinny GEMM and its
    SiLU-and-mul epilogue, gives HF's float32 logits and the cuBLAS path's within bf16's error
    (1.5e-2 relative on the CPU in bf16 against HF; a misplaced row would be of order one)."""
    from engine_core.attention.triton_backend import TritonBackend
    from engine_core.loader import load_model
    from tests.paged_harness import generate_greedy, hf_greedy
    from tests.test_models_hf import PROMPTS, make_hf_model

    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path)

    def first_logits(model: torch.nn.Module) -> list[torch.Tensor]:
        got = generate_greedy(model, PROMPTS, 4, block_size=4, backend=TritonBackend())
        return [rows[0].float().cpu() for rows in got.logits]

    cuda = torch.device("cuda")
    cublas = first_logits(load_model(str(tmp_path), cuda, torch.bfloat16).module)
    target = BuildTarget(cuda, torch.bfloat16, cuda_graphs=True)  # as the runner serves it
    model = load_model(str(tmp_path), cuda, torch.bfloat16, target=target).module
    assert sum(m.gate_up_interleaved for m in model.modules() if isinstance(m, LlamaMLP)) == 2
    epilogues = spy_on_launches(monkeypatch)
    norms_between = spy_on_norms_between(monkeypatch)
    with skinny_gemm.for_graphs():  # as the runner's graph capture runs the layers
        ours = first_logits(model)
    assert True in epilogues and False in epilogues  # the epilogue and the plain products ran
    assert norms_between and all(norms_between)  # every post-attention norm split
    for i, prompt in enumerate(PROMPTS):
        reference = hf_greedy(hf_model, prompt, 1).logits[0][0]
        assert relative_error(ours[i], reference) < 3e-2, f"prompt {i} against HF"
        assert relative_error(ours[i], cublas[i]) < 3e-2, f"prompt {i} against cuBLAS"


@pytest.mark.skipif(not HOPPER, reason="the skinny GEMM takes plain weights on Hopper only")
def test_the_layers_take_it_in_cuda_graphs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's CUDA-graph warm-up and capture run a bf16 model's decode-sized products on
    the skinny GEMM; an eager forward keeps cuBLAS (the graphs' replay against eager, across
    the two paths: tests/test_cuda_graph.py)."""
    from engine_core.forward_context import forward_context
    from tests.test_cuda_graph import decode_batch, graphs_on_random_model

    launches = spy_on_launches(monkeypatch)
    on = graphs_on_random_model("smollm2-135m", seed=0, num_blocks=512, max_num_seqs=4)
    assert launches and not any(launches)  # plain products (this model's MLP is not interleaved)
    launches.clear()
    device = torch.device("cuda")
    ids, positions, meta = decode_batch(4, 512, random.Random(0), on.config.vocab_size, device)
    with torch.inference_mode(), forward_context(meta, on.backend):
        on.model(ids, positions)
    assert launches == []
