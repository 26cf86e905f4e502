"""GPU tests of the LoRA segment kernels (engine_core/lora/triton_lora.py) against the torch
reference (layers.add_lora_reference) over llama-8b's projection shapes: decode batches whose rows
take eight adapters and the base model in turn, a prefill batch of long runs, bf16 and fp16, ranks
8 to 64; and a CUDA graph replay of the kernels against eager.

    .venv/bin/python -m pytest -q tests/test_lora_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.lora.batch import NO_SLOT, lora_batch  # noqa: E402
from engine_core.lora.layers import add_lora_reference  # noqa: E402
from engine_core.lora.triton_lora import add_lora_segments  # noqa: E402

CUDA = torch.device("cuda")
SLOTS = 8
# (input, output) of llama-8b's fused qkv, o, fused gate/up and down projections.
SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))


def decode_rows(streams: int) -> list[tuple[int, int]]:
    """One row per stream, the streams taking the slots and the base model in turn."""
    return [(1, NO_SLOT if i % (SLOTS + 1) == SLOTS else i % (SLOTS + 1)) for i in range(streams)]


PREFILL_ROWS = [(300, 3), (77, NO_SLOT), (129, 0), (1, 7), (64, 3)]


def check(row_slots: list[tuple[int, int]], inp: int, out: int, rank: int, dtype: torch.dtype):
    gen = torch.Generator(device=CUDA).manual_seed(inp + out + rank)
    rows = sum(n for n, _ in row_slots)
    x = torch.randn(rows, inp, generator=gen, device=CUDA, dtype=dtype)
    a = (torch.randn(SLOTS, rank, inp, generator=gen, device=CUDA) / inp**0.5).to(dtype)
    b = (torch.randn(SLOTS, out, rank, generator=gen, device=CUDA) / rank**0.5).to(dtype)
    base = torch.randn(rows, out, generator=gen, device=CUDA, dtype=dtype)
    batch = lora_batch(row_slots, CUDA)
    assert batch is not None
    want = add_lora_reference(base.float(), x.float(), a.float(), b.float(), batch)
    got = add_lora_segments(base.clone(), x, a, b, batch.segments)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=3e-2)
    untouched = torch.tensor([s == NO_SLOT for n, s in row_slots for _ in range(n)], device=CUDA)
    assert torch.equal(got[untouched], base[untouched])


@pytest.mark.parametrize(("inp", "out"), SHAPES)
@pytest.mark.parametrize("streams", [1, 9, 64])
def test_decode_batches_match_the_reference(inp: int, out: int, streams: int) -> None:
    check(decode_rows(streams), inp, out, 16, torch.bfloat16)


@pytest.mark.parametrize(("inp", "out"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_runs_match_the_reference(inp: int, out: int, dtype: torch.dtype) -> None:
    check(PREFILL_ROWS, inp, out, 16, dtype)


@pytest.mark.parametrize("rank", [8, 24, 64])
def test_ranks_match_the_reference(rank: int) -> None:
    check(decode_rows(33), 4096, 6144, rank, torch.bfloat16)


def test_graph_replay_matches_eager() -> None:
    row_slots = decode_rows(64)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(64, 4096, generator=gen, device=CUDA, dtype=torch.bfloat16)
    a = (torch.randn(SLOTS, 16, 4096, generator=gen, device=CUDA) / 64).to(torch.bfloat16)
    b = (torch.randn(SLOTS, 4096, 16, generator=gen, device=CUDA) / 4).to(torch.bfloat16)
    base = torch.zeros(64, 4096, device=CUDA, dtype=torch.bfloat16)
    batch = lora_batch(row_slots, CUDA)
    assert batch is not None
    eager = add_lora_segments(base.clone(), x, a, b, batch.segments)
    out = base.clone()
    add_lora_segments(out, x, a, b, batch.segments)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.zero_()
        add_lora_segments(out, x, a, b, batch.segments)
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)
