"""GPU tests of the W8A8 Triton kernels (engine_core/models/w8a8_kernels.py) on llama-8b's
projection shapes against torch: the quantizer bit for bit against int8.quantize_per_token (torch
on CUDA); the GEMM bit for bit against cuBLASLt's exact int32 product (``torch._int_mm``) scaled
as int8.int_mm_product scales it, at the rule's tiles (by pointers and by TMA), at the
engine's choice and at the persistent kernel's tiles (warp-specialized and not); the engine's
product (int8_linear) replayed in a CUDA graph gives its eager bits.

Written without a GPU at hand: the lead runs these on the GPU machine.

    .venv/bin/python -m pytest -q tests/test_w8a8_gpu.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.models import int8  # noqa: E402
from engine_core.models import w8a8_kernels as kernels  # noqa: E402

# llama-8b: qkv, o, gate/up, down as (N, K).
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
ROWS = (1, 16, 64, 300, 2048)
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def activations(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    x = torch.randn(m, k, device="cuda", generator=gen)
    x[0, : min(k, 256)] = torch.arange(min(k, 256), device="cuda") - 127.5  # ties, -128
    return x.to(dtype)


def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    return int8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [4096, 14336])
def test_the_quantizer_is_torchs_bit_for_bit(k: int, dtype: torch.dtype) -> None:
    x = activations(300, k, dtype)
    x[5] = 0
    q, scale = kernels.quantize_per_token(x)
    expected_q, expected_scale = int8.quantize_per_token(x)
    assert torch.equal(scale, expected_scale.float())
    assert torch.equal(q, expected_q.to(torch.int8))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_gemm_is_cublaslts_int32_product_scaled(n: int, k: int) -> None:
    w, w_scale = weight(n, k)
    bias = torch.randn(n, device="cuda").bfloat16()
    for m in ROWS:
        q, scale = kernels.quantize_per_token(activations(m, k, torch.bfloat16))
        expected = int8.int_mm_product(q, scale, w, w_scale, torch.bfloat16)
        rule = kernels.rule_tiles(m, n, k, SMS)
        chosen = kernels.choose_tiles(m, n, k, SMS)
        for tiles in {rule, replace(rule, tma=True), chosen} - {None}:
            got = kernels.int8_gemm(q, scale, w, w_scale, torch.bfloat16, None, tiles)
            assert torch.equal(got, expected), f"M={m} {tiles}"
        # With a bias the compiler may fuse the last product and the add: one float32 rounding,
        # which can move the result to the neighbouring bfloat16 value (2**-7 apart, relatively).
        got = kernels.int8_gemm(
            q, scale, w, w_scale, torch.bfloat16, bias, kernels.rule_tiles(m, n, k, SMS)
        )
        with_bias = int8.int_mm_product(q, scale, w, w_scale, torch.bfloat16, bias)
        torch.testing.assert_close(got, with_bias, rtol=2**-7, atol=1e-6)


# The persistent kernel as the sweep offers it: warp-specialized at 4 warps (12 run), and not.
PERSISTENT = (
    kernels.Tiles(128, 256, 128, warps=4, stages=3, tma=True, persistent=True, ws=True),
    kernels.Tiles(128, 256, 128, warps=4, stages=4, tma=True, persistent=True, ws=True),
    kernels.Tiles(128, 128, 128, warps=4, stages=4, tma=True, persistent=True, ws=True),
    kernels.Tiles(128, 256, 128, warps=8, stages=3, tma=True, persistent=True),
    kernels.Tiles(128, 128, 128, warps=4, stages=4, tma=True, persistent=True),
)


@pytest.mark.parametrize("tiles", PERSISTENT, ids=[str(i) for i in range(len(PERSISTENT))])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_persistent_gemm_is_cublaslts_int32_product_scaled(
    n: int, k: int, tiles: kernels.Tiles
) -> None:
    """At prefill rows (2,048 whole tiles, 300 not: the last row tile partly past M) and at 64
    (fewer tiles than multiprocessors on most shapes), the device's grid and a small one (every
    program walks many tiles): cuBLASLt's bits."""
    w, w_scale = weight(n, k)
    for m in (64, 300, 2048):
        q, scale = kernels.quantize_per_token(activations(m, k, torch.bfloat16))
        expected = int8.int_mm_product(q, scale, w, w_scale, torch.bfloat16)
        for programs in (None, 7):
            got = kernels.int8_gemm(q, scale, w, w_scale, torch.bfloat16, None, tiles, programs)
            assert torch.equal(got, expected), f"M={m} programs={programs} {tiles}"
    # With a bias: torch's product within the one bfloat16 step a fused multiply-add may move
    # it (as the test above), and the one-tile-a-program TMA kernel's at the same tiles.
    bias = torch.randn(n, device="cuda").bfloat16()
    got = kernels.int8_gemm(q, scale, w, w_scale, torch.bfloat16, bias, tiles)
    with_bias = int8.int_mm_product(q, scale, w, w_scale, torch.bfloat16, bias)
    torch.testing.assert_close(got, with_bias, rtol=2**-7, atol=1e-6)
    plain = replace(tiles, persistent=False, ws=False)
    want = kernels.int8_gemm(q, scale, w, w_scale, torch.bfloat16, bias, plain)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


def test_the_persistent_gemm_replays_in_a_cuda_graph() -> None:
    n, k = SHAPES[1]
    w, w_scale = weight(n, k)
    q, scale = kernels.quantize_per_token(activations(2048, k, torch.bfloat16))
    tiles = PERSISTENT[2]
    eager = kernels.int8_gemm(q, scale, w, w_scale, torch.bfloat16, None, tiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.int8_gemm(q, scale, w, w_scale, torch.bfloat16, None, tiles)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("m", [16, 300])
def test_the_engines_product_replays_in_a_cuda_graph(m: int) -> None:
    n, k = SHAPES[0]
    w, w_scale = weight(n, k)
    x = activations(m, k, torch.bfloat16)
    eager = int8.int8_linear(x, w, w_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int8.int8_linear(x, w, w_scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
