"""GPU tests of the W4A16 kernels (engine_core/models/w4a16_kernels.py, on the tiled layout) against
the dequantizing reference (engine_core/models/w4a16.py, on the loaded layout), over the presets'
projection shapes: rows from 1 to 200 (decode tiles, K splits, a 128-row tile, the
dequantize-then-cuBLAS path), bf16 and fp16, groups of 128 and 32 columns and one group over K, with
and without zero points; the joined tensor-core kernel (``Tiles.joined``) at 3 to 100 rows; every
configuration of the benchmark's sweep (the joined kernel's among them); the dequantize kernel bit
for bit; every tile choice against the unsplit product; a W4A16 Linear with act-order on CUDA
against the same layer on the CPU; a CUDA graph replay against eager; a tiny GPTQ act-order model on
the GPU against the CPU's greedy tokens.

Written without a GPU at hand (the kernels' logic was checked in Triton's interpreter,
tests/test_w4a16_interpreted.py); on an H200 the first two thirds of the file passed (commit
abaf91b, the same kernels) before that run's time limit.

    .venv/bin/python -m pytest -q tests/test_w4a16_gpu.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.config import W4A16Config  # noqa: E402
from engine_core.models import w4a16_kernels  # noqa: E402
from engine_core.models.layers import Linear  # noqa: E402
from engine_core.models.w4a16 import (  # noqa: E402
    dequantize,
    pack_int4,
    tile_qweight,
    w4a16_linear,
)

# (N, K) of each projection: smollm2-135m (qkv, o, gate/up, down), llama-1b (qkv, gate/up,
# down), llama-8b (qkv, o, gate/up, down), and a width that leaves a partial 64-row tile.
SHAPES = (
    (960, 576), (576, 576), (3072, 576), (576, 1536),
    (3072, 2048), (16384, 2048), (2048, 8192),
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (200, 1024),
)  # fmt: skip
ROWS = (1, 4, 16, 33, 64, 100, 200)  # 100: one 128-row tile; 200: dequantized, then cuBLAS


def layer(
    n: int, k: int, group: int, zeros: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A random W4A16 weight on the GPU in the loaded layout: (qweight [N, K/8], scales, zeros),
    ``group`` columns to a scale (-1: all of K)."""
    gen = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(k // size, n, generator=gen) + 0.5) * (4 / k**0.5) / 8
    z = torch.randint(0, 16, (k // size, n), dtype=torch.uint8, generator=gen) if zeros else None
    return pack_int4(q).cuda(), scales.cuda(), None if z is None else z.cuda()


def reference(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    group: int,
) -> torch.Tensor:  # fmt: skip
    """The weight dequantized and rounded to a's dtype (as the kernel rounds it), multiplied in
    float32."""
    w = dequantize(qweight, scales, zeros, group).to(a.dtype)
    return F.linear(a.float(), w.float())


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the output dtype's rounding, relative to the output's size."""
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert float(error) < tolerance, f"relative error {float(error):.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
# 128-column groups where they divide K, else 64; one group over K; 32.
@pytest.mark.parametrize(("group", "zeros"), [(128, True), (128, False), (-1, True), (32, False)])
def test_the_gemm_matches_the_reference(
    n: int, k: int, group: int, zeros: bool, dtype: torch.dtype
) -> None:
    size = k if group == -1 else group if k % group == 0 else 64  # smollm2's K = 576
    qweight, scales, z = layer(n, k, size, zeros)
    for m in ROWS:
        a = torch.randn(m, k, device="cuda").to(dtype)
        got = w4a16_kernels.w4a16_gemm(a, tile_qweight(qweight), scales, z, size)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_close(got, reference(a, qweight, scales, z, size), dtype)


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (576, 1536)])
def test_every_split_gives_the_unsplit_product(n: int, k: int) -> None:
    """The K splits choose_tiles picks sum to what one program over all of K computes."""
    qweight, scales, z = layer(n, k, 128, zeros=True)
    tiled = tile_qweight(qweight)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 16, 64):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        tiles = w4a16_kernels.choose_tiles(m, n, k, 128, sms)
        assert tiles is not None
        whole = dataclasses.replace(tiles, split_k=1)
        split = w4a16_kernels.run_w4a16(a, tiled, scales, z, 128, tiles)
        unsplit = w4a16_kernels.run_w4a16(a, tiled, scales, z, 128, whole)
        torch.testing.assert_close(split, unsplit, rtol=1e-2, atol=1e-2)


LLAMA_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
@pytest.mark.parametrize(("group", "zeros"), [(128, True), (128, False), (32, True), (-1, False)])
def test_the_decode_kernel_matches_the_reference_at_llama_8b(
    n: int, k: int, group: int, zeros: bool
) -> None:
    """The CUDA-core kernel at 1 to 16 rows of llama-8b's projections in bf16: a program per row
    as the rule has it, and a row tile of all of them over a narrow column tile split in four."""
    size = k if group == -1 else group
    qweight, scales, z = layer(n, k, size, zeros)
    tiled = tile_qweight(qweight)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 3, 8, 16):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        expected = reference(a, qweight, scales, z, size)
        rule = w4a16_kernels.rule_tiles(1, n, k, sms)  # a program per row
        for tiles in (
            dataclasses.replace(rule, split_k=w4a16_kernels.split_k(m, n, k, 1, 128, sms)),
            w4a16_kernels.GemvTiles(w4a16_kernels.row_bucket(m), 16, 4, warps=8, stages=2),
        ):
            got = w4a16_kernels.run_w4a16(a, tiled, scales, z, size, tiles)
            assert_close(got, expected, torch.bfloat16)


# The joined kernel's column tiles (16 a warp), unsplit and split in 4 (uneven over smollm2's 5
# blocks).
JOINED = (
    w4a16_kernels.Tiles(16, 64, 1, warps=4, joined=True),
    w4a16_kernels.Tiles(16, 128, 4, warps=8, stages=3, joined=True),
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), (*LLAMA_8B, (960, 576), (200, 1024)))
@pytest.mark.parametrize(("group", "zeros"), [(128, True), (128, False), (32, True), (-1, False)])
def test_the_joined_kernel_matches_the_reference(
    n: int, k: int, group: int, zeros: bool, dtype: torch.dtype
) -> None:
    """``Tiles.joined`` (not the rule's choice until the sweep has timed it) at 3 to 100 rows of
    llama-8b's projections, a K of 4.5 blocks (smollm2's 576: padded) and a partial column
    tile, against the dequantized weight."""
    size = k if group == -1 else group if k % group == 0 else 64
    qweight, scales, z = layer(n, k, size, zeros)
    tiled = tile_qweight(qweight)
    for m in (3, 16, 33, 64, 100):
        a = torch.randn(m, k, device="cuda").to(dtype)
        expected = reference(a, qweight, scales, z, size)
        block_m = 16 if m <= 16 else 64 if m <= 64 else 128
        for tiles in JOINED:
            tiles = dataclasses.replace(tiles, block_m=block_m)
            got = w4a16_kernels.run_w4a16(a, tiled, scales, z, size, tiles)
            assert got.dtype == dtype and got.shape == (m, n)
            assert_close(got, expected, dtype)


def test_groups_the_kernel_does_not_take_are_dequantized() -> None:
    """Groups of 24 columns straddle the kernel's 16-column slices: the product is the
    dequantized weight's, by cuBLAS."""
    qweight, scales, z = layer(64, 48, 24, zeros=True)
    a = torch.randn(3, 48, device="cuda", dtype=torch.bfloat16)
    assert w4a16_kernels.choose_tiles(3, 64, 48, 24, 132) is None
    assert_close(w4a16_kernels.w4a16_gemm(a, tile_qweight(qweight), scales, z, 24),
                 reference(a, qweight, scales, z, 24), torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize(("n", "k", "m"), [(6144, 4096, 1), (4096, 14336, 32), (3072, 576, 64)])
def test_every_configuration_of_the_sweep_matches_the_reference(n: int, k: int, m: int) -> None:
    """The tiles `python -m benchmarks w4a16` times (so a faster one can go in the table)."""
    from benchmarks.w4a16 import grid

    group = 128 if k % 128 == 0 else 64
    qweight, scales, z = layer(n, k, group, zeros=True)
    tiled = tile_qweight(qweight)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = reference(a, qweight, scales, z, group)
    for tiles in grid(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count):
        got = w4a16_kernels.run_w4a16(a, tiled, scales, z, group, tiles)
        assert_close(got, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_dequantize_kernel_is_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    """The prefill path's weights are the reference's, rounded once to the activations' dtype."""
    for n, k, group, zeros in [(960, 576, 64, True), (6144, 4096, 128, False), (64, 48, 24, True)]:
        qweight, scales, z = layer(n, k, group, zeros)
        got = w4a16_kernels.dequantize_tiled(tile_qweight(qweight), scales, z, group, k, dtype)
        assert torch.equal(got, dequantize(qweight, scales, z, group).to(dtype).t())


def w4a16_layer(n: int, k: int, device: str, act_order: bool) -> Linear:
    """A W4A16 Linear with random packed weights (and a random column order)."""
    config = W4A16Config(source="gptq", group_size=64, zero_points=True, act_order=act_order)
    with torch.device("meta"):
        module = Linear(k, n, bias=False)
        module.make_w4a16(config, "test")
    module.to_empty(device="cpu")
    qweight, scales, z = layer(n, k, 64, zeros=True, seed=3)
    module.qweight.data, module.scales.data, module.zeros.data = (
        qweight.cpu(),
        scales.cpu(),
        z.cpu(),
    )
    if act_order:
        module.perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)).int()
    module.register_parameter("g_idx", None)
    module.to(device)
    module.tile_w4a16_for_cuda()  # as loading does on CUDA
    return module


@pytest.mark.parametrize("act_order", [False, True])
def test_a_w4a16_linear_on_cuda_matches_the_cpu(act_order: bool) -> None:
    cpu = w4a16_layer(1024, 512, "cpu", act_order)
    gpu = w4a16_layer(1024, 512, "cuda", act_order)
    x = torch.randn(7, 512)
    expected = cpu(x)
    assert_close(gpu(x.cuda()).cpu(), expected, torch.float32)
    assert_close(gpu(x.cuda().bfloat16()).cpu(), expected, torch.bfloat16)


def test_a_cuda_graph_replays_the_product() -> None:
    qweight, scales, z = layer(4096, 4096, 128, zeros=True)
    qweight = tile_qweight(qweight)
    a = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    eager = w4a16_linear(a, qweight, scales, z, None, 128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w4a16_linear(a, qweight, scales, z, None, 128)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_linear(a, qweight, scales, z, None, 128)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_an_act_order_model_on_the_gpu_gives_the_cpus_tokens(tmp_path: Path) -> None:
    """The GPTQ act-order fixture in float32: the kernel (ieee float32 products) and the CPU
    reference give the same greedy tokens."""
    from engine_core.loader import load_model
    from tests.paged_harness import generate_greedy, random_prompts
    from tests.quant_fixtures import VOCAB, gptq_tensors, make_hf_model, write_w4a16

    make_hf_model().save_pretrained(tmp_path / "plain")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False}
    make = lambda w, seed: gptq_tensors(w, 64, True, False, False, seed)  # noqa: E731
    folder, _ = write_w4a16(tmp_path / "plain", tmp_path / "gptq", make, qc)
    prompts = random_prompts(VOCAB, (5, 11, 23))
    runs = []
    for device in ("cpu", "cuda"):
        model = load_model(str(folder), torch.device(device), torch.float32).module
        runs.append(generate_greedy(model, prompts, 12))
    assert runs[1].tokens == runs[0].tokens
    for cpu, gpu in zip(runs[0].logits, runs[1].logits, strict=True):
        torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-3, rtol=0)
