"""The W4A16 CUDA kernels (engine_core/models/w4a16_kernels.py) on the CPU, through Triton's
interpreter, against the dequantizing reference (engine_core/models/w4a16.py ``dequantize``, on
the loaded layout): symmetric and with zero points, groups of 32/48/64/128 and one over K, a K that
is not whole 128-column blocks (padding), an N that leaves a partial column tile, one row and
more rows than a row tile, K splits that divide the blocks unevenly, the dequantize-and-cuBLAS
path (prefill rows, groups that straddle a 16-column slice), and a GPTQ act-order Linear; the
tensor-core kernel in each of its forms (``Tiles.swap``, ``Tiles.joined``).

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
from collections.abc import Callable

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
from tests.quant_fixtures import (  # noqa: E402
    awq_tensors,
    gptq_tensors,
    minmax_quantize,
)
from tests.quant_fixtures import dequantize as dequantize_fixture  # noqa: E402

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
    tiles = kernels.choose_tiles(max(m, kernels.GEMV_ROWS + 1), n, k, group, multiprocessors=4)
    assert isinstance(tiles, kernels.Tiles)  # the tensor-core kernel
    block_m = tiles.block_m if m > 64 else min(tiles.block_m, 32)  # small tiles: several
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    # The weights as the left operand, as the right, and joined into one product a block.
    for form in ({"swap": True}, {"swap": False}, {"joined": True}):
        got = run(a, weight, group, kernels.Tiles(block_m, 32, tiles.split_k, **form))
        assert got.dtype == dtype and got.shape == (m, n)
        assert relative_error(got, reference(a, weight, group)) < tolerance


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("joined", [False, True])
def test_k_splits_sum_to_the_unsplit_product(split: int, joined: bool) -> None:
    """Five blocks over 2, 3 (uneven) and 5 splits: the partials' sum is the one-program
    product up to float32 rounding."""
    weight = layer(32, 640, 64, zeros=True)
    a = torch.randn(3, 640, generator=torch.Generator().manual_seed(2))
    whole = run(a, weight, 64, kernels.Tiles(16, 32, 1, joined=joined))
    split_product = run(a, weight, 64, kernels.Tiles(16, 32, split, joined=joined))
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
        (1, 28672, 4096, kernels.GemvTiles(1, 128, 4)),  # llama-8b gate/up: 224 column tiles
        (1, 4096, 14336, kernels.GemvTiles(1, 128, 16)),  # down: 112 blocks, 16 splits of 7
        (1, 6144, 4096, kernels.GemvTiles(1, 128, 8)),  # qkv: 32 blocks, no split under 4
        (2, 4096, 4096, kernels.GemvTiles(1, 128, 8)),  # o, a program per row
        (3, 28672, 4096, kernels.Tiles(16, 128, 4)),  # past GEMV_ROWS: the tensor cores
        (64, 4096, 4096, kernels.Tiles(64, 128, 8)),  # o
        (127, 28672, 4096, kernels.Tiles(128, 128, 4)),  # one row tile (not swept: 65-127 rows)
    ],
)
def test_decode_tiles_fill_an_h200_four_times_over(
    m: int, n: int, k: int, tiles: kernels.Tiles | kernels.GemvTiles
) -> None:
    """The rule for shapes the sweep has not measured, at 132 multiprocessors."""
    assert kernels.rule_tiles(m, n, k, 132) == tiles


def test_measured_tiles_take_the_place_of_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    swept = kernels.GemvTiles(1, 256, 2, warps=8, stages=2)
    monkeypatch.setitem(kernels.MEASURED, (1, 6144, 4096), swept)
    assert kernels.choose_tiles(1, 6144, 4096, 128, 132) == swept
    # A row bucket the sweep did not time (8 rows) takes the rule.
    assert kernels.choose_tiles(8, 6144, 4096, 128, 132) == kernels.rule_tiles(8, 6144, 4096, 132)
    # Groups that straddle a 16-column slice still go to the dequantized product.
    monkeypatch.setitem(kernels.MEASURED, (1, 64, 96), swept)
    assert kernels.choose_tiles(1, 64, 96, 24, 132) is None


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
    for tiles in (kernels.Tiles(16, 32, 2), kernels.Tiles(16, 32, 2, joined=True)):
        rows = x[:, module.perm.long()]
        got = kernels.run_w4a16(rows, tile_qweight(qweight), scales, z, 64, tiles)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- the decode kernel (CUDA cores) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "group", "zeros"),
    [
        (37, 256, 128, False),  # an odd N: a partial column tile, rows not whole words of N
        (72, 384, 64, True),  # two groups a block: scales reloaded at nibble 4
        (40, 256, 32, True),  # four groups a block
        (24, 320, 320, True),  # one group over a K of 2.5 blocks: padded
        (16, 640, 128, True),  # five blocks: uneven K splits
    ],
)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_decode_kernel_matches_the_reference(
    m: int, n: int, k: int, group: int, zeros: bool, dtype: torch.dtype
) -> None:
    """Every row tile the rule and the sweep use (1 to 16 rows), against the dequantized weight;
    column tiles of 16 and 32 and K split three ways, so partial tiles and splits are met."""
    weight = layer(n, k, group, zeros, seed=m)
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = reference(a, weight, group)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for block_n, split in ((16, 1), (32, 3)):
        tiles = kernels.GemvTiles(kernels.row_bucket(m), block_n, split)
        got = run(a, weight, group, tiles)
        assert got.dtype == dtype and got.shape == (m, n)
        assert relative_error(got, expected) < tolerance


@pytest.mark.parametrize(
    "tiles", [kernels.GemvTiles(1, 32, 1), kernels.Tiles(16, 32, 1, joined=True)], ids=str
)
def test_in_place_nibbles_take_zero_points_of_16(tiles: kernels.Choice) -> None:
    """GPTQ's original format stores a zero of 16 (it stores 15 = zero - 1): the largest value
    the in-place nibbles meet, (q - 16) * 16**4 beside 2**23, still exact."""
    qweight, scales, _ = layer(32, 256, 64, zeros=False)
    sixteen = torch.full((4, 32), 16, dtype=torch.uint8)
    a = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    got = run(a, (qweight, scales, sixteen), 64, tiles)
    assert relative_error(got, reference(a, (qweight, scales, sixteen), 64)) < 1e-5


Checkpoint = tuple[W4A16Config, dict[str, torch.Tensor], torch.Tensor]


def awq_checkpoint(n: int, k: int, group: int) -> Checkpoint:
    tensors, weight = awq_tensors(torch.randn(n, k) * 0.05, group)
    return W4A16Config(source="awq", group_size=group, zero_points=True), tensors, weight


def gptq_checkpoint(n: int, k: int, group: int, act_order: bool, symmetric: bool) -> Checkpoint:
    tensors, weight = gptq_tensors(torch.randn(n, k) * 0.05, group, act_order, symmetric, False, 3)
    config = W4A16Config(
        source="gptq", group_size=group, zero_points=True, act_order=act_order,
        zero_offset=1,
    )  # fmt: skip
    return config, tensors, weight


def compressed_tensors_checkpoint(n: int, k: int, group: int, symmetric: bool) -> Checkpoint:
    """pack-quantized as compressed-tensors' own packer writes it: signed values, packed along
    K; zero points (asymmetric) packed along N."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g_idx = torch.arange(k) // (k if group == -1 else group)
    weight = torch.randn(n, k) * 0.05
    q, scale, zero = minmax_quantize(weight, g_idx, int(g_idx.max()) + 1, symmetric)
    tensors = {
        "weight_packed": pack_to_int32((q - 8).to(torch.int8), 4, packed_dim=1),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32((zero - 8).to(torch.int8), 4, packed_dim=0)
    config = W4A16Config(source="compressed-tensors", group_size=group, zero_points=not symmetric)
    return config, tensors, dequantize_fixture(q, scale.to(torch.bfloat16), zero, g_idx)


def loaded_linear(checkpoint: Checkpoint) -> Linear:
    """A W4A16 Linear loaded from the checkpoint's tensors as the loader loads them (repacked
    into our layout, act-order columns sorted), on the CPU: qweight in the loaded layout."""
    config, tensors, weight = checkpoint
    n, k = weight.shape
    with torch.device("meta"):
        module = Linear(k, n, bias=False)
        module.make_w4a16(config, "test")
    module.to_empty(device="cpu")
    for hf_name, tensor in tensors.items():
        for name, held in module.w4a16_form(hf_name, tensor, hf_name):
            module.load_quantized(name, held, None, hf_name)
    module.finish_loading("test")
    return module


@pytest.mark.parametrize(
    ("make", "n", "k"),
    [
        (lambda: awq_checkpoint(40, 256, 32), 40, 256),
        (lambda: awq_checkpoint(64, 384, 128), 64, 384),
        (lambda: gptq_checkpoint(48, 256, 64, act_order=True, symmetric=False), 48, 256),
        (lambda: gptq_checkpoint(48, 256, 32, act_order=True, symmetric=True), 48, 256),
        (lambda: gptq_checkpoint(24, 192, -1, act_order=False, symmetric=False), 24, 192),
        (lambda: compressed_tensors_checkpoint(37, 256, 128, symmetric=True), 37, 256),
        (lambda: compressed_tensors_checkpoint(32, 256, 64, symmetric=False), 32, 256),
    ],
    ids=["awq-32", "awq-128", "gptq-actorder-64", "gptq-actorder-sym-32", "gptq-1group",
         "ct-odd-n", "ct-zeros-64"],
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("joined", [False, True], ids=["gemv", "joined"])
def test_each_format_after_repacking_through_the_decode_kernels(
    make: Callable[[], Checkpoint], n: int, k: int, m: int, joined: bool
) -> None:
    """A checkpoint in each format's own layout, loaded into a Linear, tiled as on CUDA and
    multiplied by the CUDA-core decode kernel and by the joined tensor-core one: the product of
    the weight the quantizer meant (the fixture's (q - zero) * scale, in the checkpoint's own
    column order)."""
    checkpoint = make()
    module = loaded_linear(checkpoint)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
    rows = x if module.perm is None else x[:, module.perm.long()]
    tiles: kernels.Choice = kernels.GemvTiles(kernels.row_bucket(m), 16, 2)
    if joined:
        tiles = kernels.Tiles(16, 32, 2, joined=True)
    got = kernels.run_w4a16(
        rows, tile_qweight(module.qweight.data), module.scales.data,
        None if module.zeros is None else module.zeros.data, module.group_size, tiles,
    )  # fmt: skip
    torch.testing.assert_close(got, F.linear(x, checkpoint[2]), rtol=1e-5, atol=1e-5)
