"""The LoRA segment kernels (engine_core/lora/triton_lora.py) on the CPU, through Triton's
interpreter, against the torch reference (layers.add_lora_reference): rows of three slots and of
the base model interleaved, segments longer than a tile, ranks and widths that are not multiples
of the tiles, an output added to in place (on a GPU: tests/test_lora_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton installed):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_lora_triton_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.lora.batch import NO_SLOT, lora_batch  # noqa: E402
from engine_core.lora.layers import add_lora_reference  # noqa: E402
from engine_core.lora.triton_lora import add_lora_segments  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("row_slots", "inp", "rank", "out"),
    [
        ([(1, 0)], 64, 16, 64),  # one decode row
        ([(3, 1), (1, NO_SLOT), (20, 0), (2, 2), (5, 1), (4, NO_SLOT)], 96, 48, 80),
        ([(17, 2), (17, 2), (1, 0)], 130, 24, 200),  # neighbours of one slot merged
    ],
)
def test_segments_match_the_reference(
    row_slots: list[tuple[int, int]], inp: int, rank: int, out: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = sum(n for n, _ in row_slots)
    x = torch.randn(rows, inp, generator=gen)
    a = torch.randn(3, rank, inp, generator=gen) / inp**0.5
    b = torch.randn(3, out, rank, generator=gen) / rank**0.5
    base = torch.randn(rows, out, generator=gen)
    batch = lora_batch(row_slots, CPU)
    assert batch is not None
    want = add_lora_reference(base.clone(), x, a, b, batch)
    got = add_lora_segments(base.clone(), x, a, b, batch.segments)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    untouched = torch.tensor([s == NO_SLOT for n, s in row_slots for _ in range(n)])
    assert torch.equal(got[untouched], base[untouched])


def test_segments_merge_neighbours_of_one_slot() -> None:
    batch = lora_batch([(2, 1), (3, 1), (1, NO_SLOT), (4, 1), (2, 0)], CPU)
    assert batch is not None
    segs = batch.segments
    assert segs.starts.tolist() == [0, 6, 10]
    assert segs.lengths.tolist() == [5, 4, 2]
    assert segs.slots.tolist() == [1, 1, 0]
    assert (segs.count, segs.max_rows) == (3, 5)
