"""The draft model's proposal chain (engine_core/draft_graphs.py), on the CPU: each forward's
positions, slots and lengths computed on the device equal a hand computation from the rows'
tables, a row past its draft count is inert (no KV write, nothing out of range), and a batched
proposal writes exactly its rows' slots and gives each row the drafts it gets alone. The CUDA
graphs that capture the same chain are tested on the GPU (tests/test_speculative_draft_gpu.py);
exactness through the engine in tests/test_speculative_draft.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.draft_graphs import ChainRows, chain_step_inputs
from engine_core.input_batch import InputBatch
from engine_core.llm import LLM
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from engine_core.speculative import DraftRow
from protocol.messages import SamplingParams
from tests.test_speculative_draft import OPTIONS, draft_config

BS = 4  # OPTIONS' block size


def chain_rows(tables: list[list[int]], positions: list[int], counts: list[int]) -> ChainRows:
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return ChainRows(
        tokens=torch.zeros(len(tables), dtype=torch.int64),
        positions=torch.tensor(positions),
        counts=torch.tensor(counts),
        tables=torch.tensor(padded, dtype=torch.int32),
        query_start=torch.arange(len(tables) + 1, dtype=torch.int32),
    )


def test_each_forwards_inputs_are_the_hand_computed_ones_and_dead_rows_are_inert() -> None:
    # Row 0 at position 5 wants 3 drafts (its chunk 5..8 spans blocks 30, 31 and 32); row 1 at
    # position 2 wants 1 (block 7); row 2 is padding (count 0).
    rows = chain_rows([[30, 31, 32], [7], [0]], [5, 2, 0], [3, 1, 0])
    host = [(5, 3), (2, 1), (0, 0)]
    want = {
        # j: (positions, slots, lengths)
        0: ([5, 2, 0], [31 * BS + 1, 7 * BS + 2, -1], [6, 3, 1]),
        1: ([6, 0, 0], [31 * BS + 2, -1, -1], [7, 1, 1]),
        2: ([7, 0, 0], [31 * BS + 3, -1, -1], [8, 1, 1]),
        # Past every count: row 0's column (8 // 4 = 2) is in its table, row 1's (5 // 4 = 1)
        # is past it (clamped), and all are dead.
        3: ([0, 0, 0], [-1, -1, -1], [1, 1, 1]),
    }
    for j, (positions, slots, lengths) in want.items():
        got_positions, meta = chain_step_inputs(rows, j, BS, 64, host)
        assert got_positions.tolist() == positions
        assert meta.slot_mapping.tolist() == slots
        assert meta.seq_lens.tolist() == lengths
        assert meta.seq_lens_cpu == lengths  # the host lists agree with the device's
        assert meta.max_seq_len == max(lengths)
        assert meta.query_start_loc_cpu == [0, 1, 2, 3] and meta.is_decode_only
    _, placeholders = chain_step_inputs(rows, 0, BS, 64)  # in a graph: no host values
    assert placeholders.seq_lens_cpu == [64] * 3 and placeholders.max_seq_len == 64


def test_each_live_forward_has_the_general_builders_decode_inputs() -> None:
    """Forward j of a chain equals, on its live rows, the decode step the input batch packs for
    the same rows (engine_core/input_batch.py: each row's one token at position + j)."""
    tables = [[30, 31, 32], [7, 8], [12]]
    positions, counts = [5, 2, 1], [4, 3, 2]
    rows = chain_rows(tables, positions, counts)
    params = SamplingParams(max_tokens=8)
    for j in range(max(counts)):
        live = [i for i in range(3) if counts[i] > j]
        plan = []
        for i in live:
            request = Request(f"r{i}", [3] * (positions[i] + j + 1), params)
            request.num_computed_tokens = positions[i] + j
            plan.append(ScheduledRequest.plan(request, 1, tables[i]))
        batch = InputBatch(torch.device("cpu"), BS, 64, 8, 16)
        packed = batch.pack(SchedulerOutput(plan), [], None)
        got_positions, meta = chain_step_inputs(rows, j, BS, 64)
        assert got_positions[live].tolist() == packed.positions.tolist()
        assert meta.slot_mapping[live].tolist() == packed.meta.slot_mapping.tolist()
        assert meta.seq_lens[live].tolist() == packed.meta.seq_lens.tolist()


@pytest.fixture(scope="module")
def drafter(tiny_model_dir: Path) -> Any:
    llm = LLM(str(tiny_model_dir), speculative_config=draft_config(tiny_model_dir), **OPTIONS)
    return llm.engine.runner.drafter


# Three rows, the verify chunk of each (its position .. position + count) inside its table.
ROWS = [
    DraftRow(token=7, position=5, block_ids=(3, 4, 6), count=4),  # writes 5, 6, 7, 8
    DraftRow(token=11, position=2, block_ids=(9,), count=1),  # writes 2, then is dead
    DraftRow(token=13, position=9, block_ids=(20, 21, 22, 23), count=3),  # writes 9, 10, 11
]
# The slots each row's forwards write: its positions .. position + count - 1.
WRITTEN = [
    [4 * BS + 1, 4 * BS + 2, 4 * BS + 3, 6 * BS + 0],
    [9 * BS + 2],
    [22 * BS + 1, 22 * BS + 2, 22 * BS + 3],
]


def flat_slots(cache: torch.Tensor) -> torch.Tensor:
    return cache.reshape(-1, *cache.shape[2:])  # [blocks * block_size, heads, head_dim]


def test_a_batched_proposal_writes_only_its_rows_slots_and_equals_each_row_alone(
    drafter: Any,
) -> None:
    torch.manual_seed(0)
    for tensor in drafter.cache:  # a context of random K/V, so attention is not trivial
        tensor.normal_()
    before = [t.clone() for t in drafter.cache]
    batched = drafter.propose_batch(ROWS)
    assert [len(d) for d in batched] == [4, 1, 3]
    after = [t.clone() for t in drafter.cache]
    for old, new in zip(before, after, strict=True):
        changed = (flat_slots(old) != flat_slots(new)).flatten(1).any(dim=1)
        assert changed.nonzero().flatten().tolist() == sorted(sum(WRITTEN, []))
    for i, row in enumerate(ROWS):
        for tensor, old in zip(drafter.cache, before, strict=True):
            tensor.copy_(old)
        assert drafter.propose_batch([row]) == [batched[i]]
        slots = torch.tensor(WRITTEN[i])
        for tensor, new in zip(drafter.cache, after, strict=True):
            alone, together = flat_slots(tensor)[slots], flat_slots(new)[slots]
            assert torch.allclose(alone, together, atol=1e-5)  # as the batch wrote them
