"""The W4A16 CUDA kernels (engine_core/models/w4a16_kernels.py) on the CPU, through Triton's
interpreter, against the dequantizing reference (engine_core/models/w4a16.py ``dequantize``, on
the loaded layout): symmetric and with zero points, groups of 32/48/64/128 and one over K, a K that
is not whole 128-column blocks (padding), an N that leaves a partial column tile, one row and
more rows than a row tile, K splits that divide the blocks unevenly, the dequantize-and-cuBLAS
path (prefill rows, groups that straddle a 16-column slice), and a GPTQ act-order Linear.

Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands wrongly (it reads their bits as
integers) and rounds float32 to bf16 by truncation, so the kernels are checked here in float32
and float16 (the same code path: the dtype is the activations'); bf16 is checked on a GPU
(tests/test_w4a16_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_w4a16_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.config import W4A16Config  # noqa: E402
from engine_core.models import w4a16_kernels as kernels  # noqa: E402
from engine_core.models.layers import Linear  # noqa: E402
from engine_core.models.w4a16 import dequantize, pack_int4, tile_qweight  # noqa: E402

Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def layer(n: int, k: int, group: int, zeros: bool, seed: int = 0) -> Layer:
    """A random weight in the loaded layout: (qweight [N, K/8], scales, zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) + 0.5) / k**0.5
    z = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen) if zeros else None
    return pack_int4(q), scales, z


def reference(a: torch.Tensor, weight: Layer, group: int) -> torch.Tensor:
    """The weight dequantized, rounded to a's dtype, multiplied in float32."""
    w = dequantize(weight[0], weight[1], weight[2], group).to(a.dtype)
    return F.linear(a.float(), w.float())


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).abs().max() / expected.abs().max())


def run(a: torch.Tensor, weight: Layer, group: int, tiles: kernels.Tiles | None) -> torch.Tensor:
    qweight, scales, zeros = weight
    return kernels.run_w4a16(a, tile_qweight(qweight), scales, zeros, group, tiles)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros"),
    [
        (1, 64, 128, 128, False),  # one decode row, one block
        (3, 48, 256, 32, True),  # slices of two groups per group
        (5, 40, 384, 64, True),  # a partial column tile
        (17, 64, 320, 320, True),  # one group over a K of 2.5 blocks: padded
        (2, 32, 192, 64, False),  # K of 1.5 blocks, symmetric
        (40, 32, 256, 128, True),  # more rows than a row tile
        (100, 32, 256, 64, True),  # one 128-row tile
        (2, 32, 384, 48, True),  # groups of 3 slices: scales loaded for every slice
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_gemm_kernel_matches_the_reference(
    m: int, n: int, k: int, group: int, zeros: bool, dtype: torch.dtype
) -> None:
    weight = layer(n, k, group, zeros)
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    tiles = kernels.choose_tiles(m, n, k, group, multiprocessors=4)
    assert tiles is not None  # the kernel, not the dequantized product
    block_m = tiles.block_m if m > 64 else min(tiles.block_m, 32)  # small tiles: several
    tiles = kernels.Tiles(block_m, 32, tiles.split_k)
    got = run(a, weight, group, tiles)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert relative_error(got, reference(a, weight, group)) < tolerance


@pytest.mark.parametrize("split", [2, 3, 5])
def test_k_splits_sum_to_the_unsplit_product(split: int) -> None:
    """Five blocks over 2, 3 (uneven) and 5 splits: the partials' sum is the one-program
    product up to float32 rounding."""
    weight = layer(32, 640, 64, zeros=True)
    a = torch.randn(3, 640, generator=torch.Generator().manual_seed(2))
    whole = run(a, weight, 64, kernels.Tiles(16, 32, 1))
    split_product = run(a, weight, 64, kernels.Tiles(16, 32, split))
    torch.testing.assert_close(split_product, whole, rtol=1e-5, atol=1e-5)
    assert relative_error(whole, reference(a, weight, 64)) < 1e-5


@pytest.mark.parametrize(
    ("k", "group", "zeros"), [(256, 128, True), (192, 32, False), (576, 576, True), (96, 24, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_dequantize_kernel_is_the_reference_bit_for_bit(
    k: int, group: int, zeros: bool, dtype: torch.dtype
) -> None:
    """W.T as the prefill path multiplies it: exactly the reference's weights in a's dtype, for
    groups that are whole 16-column slices and for one that is not (24)."""
    qweight, scales, z = layer(24, k, group, zeros)
    got = kernels.dequantize_tiled(tile_qweight(qweight), scales, z, group, k, dtype)
    assert torch.equal(got, dequantize(qweight, scales, z, group).to(dtype).t())


def test_prefill_rows_and_odd_groups_take_the_dequantized_product() -> None:
    assert kernels.choose_tiles(kernels.DEQUANTIZE_ROWS, 4096, 4096, 128, 132) is None
    # A weight too large for a transient bf16 copy (llama-70b's gate/up) stays in the kernel.
    assert kernels.choose_tiles(2048, 57344, 8192, 128, 132) == kernels.Tiles(128, 128, 1)
    assert kernels.choose_tiles(1, 64, 96, 24, 132) is None  # a 16-column slice spans 2 groups
    weight = layer(32, 96, 24, zeros=True)
    a = torch.randn(200, 96, generator=torch.Generator().manual_seed(3))
    got = run(a, weight, 24, None)
    assert relative_error(got, reference(a, weight, 24)) < 1e-5


@pytest.mark.parametrize(
    ("m", "n", "k", "tiles"),
    [
        (1, 28672, 4096, (16, 128, 4)),  # llama-8b gate/up: 224 column tiles, 4 splits
        (1, 4096, 14336, (16, 128, 16)),  # down: 112 blocks, 16 splits of 7
        (1, 6144, 4096, (16, 128, 8)),  # qkv: 32 blocks, no split under 4 of them
        (64, 4096, 4096, (64, 128, 8)),  # o
        (127, 28672, 4096, (128, 128, 4)),  # one row tile (not swept: 65-127 rows)
    ],
)
def test_decode_tiles_fill_an_h200_four_times_over(
    m: int, n: int, k: int, tiles: tuple[int, int, int]
) -> None:
    """The table's rule at 132 multiprocessors: the sweep's fastest tiles, or within 6%, at
    these shapes (docs/bench-logs/2026-12-02-h200-w4a16-tiled-sweep.log)."""
    assert kernels.choose_tiles(m, n, k, 128, 132) == kernels.Tiles(*tiles)


def test_a_weight_in_the_loaded_layout_is_refused() -> None:
    qweight, scales, z = layer(48, 256, 128, zeros=True)  # [48, 32]; tiled it is [32, 48]
    with pytest.raises(ValueError, match="not the kernel's layout"):
        kernels.run_w4a16(torch.randn(1, 256), qweight, scales, z, 128, kernels.Tiles(16, 32, 1))


def test_an_act_order_linear_tiled_matches_it_untiled() -> None:
    """A GPTQ act-order Linear (columns sorted by group, the input gathered by ``perm``): its CPU
    forward (the reference) and the kernel on the tiled words of the same layer agree."""
    config = W4A16Config(source="gptq", group_size=64, zero_points=True, act_order=True)
    with torch.device("meta"):
        module = Linear(256, 48, bias=False)
        module.make_w4a16(config, "test")
    module.to_empty(device="cpu")
    qweight, scales, z = layer(48, 256, 64, zeros=True, seed=4)
    module.qweight.data, module.scales.data, module.zeros.data = qweight, scales, z
    module.perm = torch.randperm(256, generator=torch.Generator().manual_seed(5)).int()
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(6))
    expected = module(x)
    tiles = kernels.Tiles(16, 32, 2)
    got = kernels.run_w4a16(x[:, module.perm.long()], tile_qweight(qweight), scales, z, 64, tiles)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
