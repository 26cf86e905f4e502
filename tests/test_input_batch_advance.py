"""A steady decode step advances the last step's packed inputs (InputBatch._advance) instead of
packing them anew. Driven by the real scheduler with overlap, through admissions, stops, aborts,
preemptions and block boundaries, every step's inputs must equal both a full pack of the same
plan (every section of the host buffer) and a per-request construction from the plan itself."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine_core import input_batch
from engine_core.attention import base
from engine_core.attention.base import AttentionMetadata
from engine_core.config import EngineConfig
from engine_core.input_batch import InputBatch, PackedInputs
from engine_core.request import Request, SchedulerOutput
from engine_core.scheduler import PLACEHOLDER, Scheduler
from protocol.messages import SamplingParams

BLOCK = 4
MAX_SEQS = 6
MAX_TOKENS = 64
MAX_MODEL_LEN = 96
STOP = 7  # a stop token some requests ask for; sampled now and then


class TwoBatches:
    """Two input batches packing the same plans, one advancing steady steps and one packing
    every step in full, each with its own previous-step state as the runner keeps it."""

    def __init__(
        self,
        device: str = "cpu",
        windows: tuple[int | None, ...] = (None,),
        chunks: tuple[int | None, ...] = (),
    ) -> None:
        self.device = torch.device(device)
        width = MAX_MODEL_LEN // BLOCK
        self.fast, self.full = (
            InputBatch(
                self.device, BLOCK, MAX_TOKENS, MAX_SEQS, width, windows, chunks, orders_rows=True
            )
            for _ in range(2)
        )
        self.full.advance_steady = False
        self.prev = {"fast": [], "full": []}
        self.sampled: torch.Tensor | None = None
        self.advanced = 0
        original = self.fast._advance

        def counted(*args: object) -> PackedInputs | None:
            result = original(*args)  # type: ignore[arg-type]
            self.advanced += result is not None
            return result

        self.fast._advance = counted  # type: ignore[method-assign]

    def pack(self, plan: SchedulerOutput) -> PackedInputs:
        fast = self.fast.pack(plan, self.prev["fast"], self.sampled)
        full = self.full.pack(plan, self.prev["full"], self.sampled)
        assert sections(self.fast) == sections(self.full)  # the same layout and contents
        assert [id(r) for r in fast.sampling_requests] == [id(r) for r in full.sampling_requests]
        np.testing.assert_array_equal(fast.sample_ends, full.sample_ends)
        assert (fast.ids_from is None) == (full.ids_from is None)
        assert fast.ids_from is None or fast.ids_from is self.sampled
        assert fast.meta.seq_lens_cpu == full.meta.seq_lens_cpu
        assert fast.meta.max_seq_len == full.meta.max_seq_len
        self.prev = {"fast": fast.sampling_requests, "full": full.sampling_requests}
        return fast


def sections(batch: InputBatch) -> tuple[tuple[int, ...], dict[str, list[int]]]:
    """The last packed step's layout counts (and its widest block table) and each section's
    values (the bytes between sections, alignment padding, are never written)."""
    counts, data = batch.last_step()
    layout = batch._layout(*counts[:-1])
    buf = np.frombuffer(data, dtype=np.uint8)
    return counts, {name: layout.host_view(buf, name).tolist() for name in layout.sections}


def expected_inputs(plan: SchedulerOutput, sampled: torch.Tensor | None, prev: list) -> dict:
    """The step's inputs built request by request from the plan (placeholders from the ids the
    previous step sampled, found by request)."""
    ids, positions, slots, seq_lens = [], [], [], []
    width = max(len(s.block_ids) for s in plan.scheduled)
    tables = np.zeros((len(plan.scheduled), width), dtype=np.int32)
    prev_row = {id(r): i for i, r in enumerate(prev)}
    for i, s in enumerate(plan.scheduled):
        tables[i, : len(s.block_ids)] = list(s.block_ids)
        for pos in range(s.start, s.start + s.num_new_tokens):
            token = s.request.token_ids[pos]
            if token == PLACEHOLDER:
                assert sampled is not None
                token = int(sampled[prev_row[id(s.request)]])
            ids.append(token)
            positions.append(pos)
            slots.append(int(tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK)
        seq_lens.append(s.start + s.num_new_tokens)
    return {"ids": ids, "positions": positions, "slots": slots, "tables": tables,
            "seq_lens": seq_lens}  # fmt: skip


def check_against_plan(packed: PackedInputs, plan: SchedulerOutput, expected: dict) -> None:
    ids = packed.input_ids.clone()
    if packed.ids_from is not None:
        ids.copy_(packed.ids_from)  # what the forward does (model_runner.py _forward)
    assert ids.tolist() == expected["ids"]
    assert packed.positions.tolist() == expected["positions"]
    assert packed.meta.slot_mapping.tolist() == expected["slots"]
    np.testing.assert_array_equal(packed.meta.block_tables.cpu().numpy(), expected["tables"])
    assert packed.meta.seq_lens.tolist() == expected["seq_lens"]
    assert packed.sampling_requests == [s.request for s in plan.scheduled if s.samples]
    shared = packed.meta.shared_prefix
    got = (0, 0) if shared is None else tuple(shared.tolist())
    assert got == expected_shared_prefix(plan)
    order = packed.meta.row_order
    if all(s.num_new_tokens == 1 for s in plan.scheduled):
        lens = expected["seq_lens"]  # longest first; equal lengths in the batch's order
        assert order is not None
        assert order.tolist() == sorted(range(len(lens)), key=lambda i: -lens[i])
    else:
        assert order is None
    for group, meta in enumerate(packed.group_metadata[1:], start=1):
        check_group(meta, plan, group)


def expected_shared_prefix(plan: SchedulerOutput) -> tuple[int, int]:
    """A step's shared prefix, request by request: over its sequences with one new token, the
    leading block ids every table has alike, before the shortest one's last token (0 with KV
    groups, or under base's minimum rows or tokens), and the first such sequence's index."""
    rows = [i for i, s in enumerate(plan.scheduled) if s.num_new_tokens == 1]
    scheduled = [plan.scheduled[i] for i in rows]
    if len(scheduled) < base.SHARED_PREFIX_MIN_ROWS or scheduled[0].group_block_ids:
        return 0, 0
    tables = [list(s.block_ids) for s in scheduled]
    limit = min(s.start for s in scheduled) // BLOCK  # whole blocks before the shortest's token
    blocks = 0
    while blocks < limit and all(t[blocks] == tables[0][blocks] for t in tables):
        blocks += 1
    if blocks * BLOCK < base.SHARED_PREFIX_MIN_TOKENS:
        return 0, 0
    return blocks * BLOCK, rows[0]


def check_group(meta: AttentionMetadata, plan: SchedulerOutput, group: int) -> None:
    """KV layer group ``group``'s tables and slots are the plan's for that group."""
    width = meta.block_tables.shape[1]
    tables = np.zeros((len(plan.scheduled), width), dtype=np.int32)
    slots = []
    for i, s in enumerate(plan.scheduled):
        table = list(s.group_block_ids[group - 1])
        tables[i, : len(table)] = table
        slots += [
            table[p // BLOCK] * BLOCK + p % BLOCK
            for p in range(s.start, s.start + s.num_new_tokens)
        ]
    np.testing.assert_array_equal(meta.block_tables.cpu().numpy(), tables)
    assert meta.slot_mapping.tolist() == slots


def run_random_steps(
    scheduler: Scheduler,
    batches: TwoBatches,
    rng: random.Random,
    system_prompt: Callable[[], list[int]],
) -> int:
    """400 steps of random arrivals (each prompt opening with ``system_prompt()``), aborts,
    stops and preemptions; every step's packs checked against the plan. Returns the steps."""
    in_flight: tuple[SchedulerOutput, list[int]] | None = None
    names = iter(range(10**6))
    steps = 0
    for step in range(400):
        if step < 300 and (not scheduler.has_unfinished() or rng.random() < 0.04):
            params = SamplingParams(
                max_tokens=rng.randrange(1, 60),
                stop_token_ids=(STOP,) if rng.random() < 0.5 else (),
                ignore_eos=True,
            )
            prompt = system_prompt() + [rng.randrange(10, 100) for _ in range(rng.randrange(1, 24))]
            scheduler.add_request(Request(f"r{next(names)}", prompt, params))
        if rng.random() < 0.02 and scheduler.running:
            scheduler.abort_requests([rng.choice(scheduler.running).request_id])
        plan = scheduler.schedule()
        if plan.is_empty:
            previous, in_flight = in_flight, None
            if previous is not None:
                scheduler.update_from_output(*previous)
            continue
        expected = expected_inputs(plan, batches.sampled, batches.prev["fast"])
        packed = batches.pack(plan)
        check_against_plan(packed, plan, expected)
        steps += 1
        sampled = [STOP if rng.random() < 0.01 else rng.randrange(10, 100) for _ in
                   packed.sampling_requests]  # fmt: skip
        batches.sampled = (
            torch.tensor(sampled, dtype=torch.int64, device=batches.device) if sampled else None
        )
        previous, in_flight = in_flight, (plan, sampled)
        if previous is not None:
            scheduler.update_from_output(*previous)
    return steps


ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


# On CUDA the host buffers are pinned and used in a ring of three: a step advances another
# buffer than the one it copies; on the CPU a ring of one advances in place.
# KV layer groups (engine_core/kv_groups.py): a full group beside a window group, whose tables
# lose a block to the null block as each row's window moves past it, and a pool twice as large
# (a block is one group's layers).
GROUPED = pytest.param((None, 6), (), 60, id="groups")
# Llama 4's: a full group beside a chunked one (chunk 8), whose tables lose every block before
# the chunk as a row enters it (that step is packed in full).
CHUNKED = pytest.param((None, None), (None, 8), 60, id="chunked")


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("windows", "chunks", "num_blocks"), [((None,), (), 30), GROUPED, CHUNKED])
def test_advanced_steps_equal_full_packs_and_the_plan(
    seed: int,
    device: str,
    windows: tuple[int | None, ...],
    chunks: tuple[int | None, ...],
    num_blocks: int,
) -> None:
    rng = random.Random(seed)
    config = EngineConfig(
        block_size=BLOCK, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS
    )
    # A pool that cannot hold every request at full length: preemptions happen.
    scheduler = Scheduler(
        config, num_blocks, MAX_MODEL_LEN, [0], kv_windows=windows, kv_attention_chunks=chunks
    )
    batches = TwoBatches(device, windows, chunks)
    steps = run_random_steps(scheduler, batches, rng, lambda: [])
    assert steps > 200
    # Most steps are steady decodes: the advance must have been taken, not only the full pack.
    assert batches.advanced > steps // 3


@pytest.mark.parametrize("seed", [0, 1])
def test_a_shared_system_prompt_is_found_in_full_and_advanced_packs(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Every request opens with the same system prompt (3 blocks), which the prefix cache
    gives them in the same blocks: steps name those tokens as their one-token sequences'
    shared prefix, the advanced steps as the full packs do, steps with prompt rows too
    (thresholds lowered to this test's small batches)."""
    monkeypatch.setattr(base, "SHARED_PREFIX_MIN_ROWS", 2)
    monkeypatch.setattr(input_batch, "SHARED_PREFIX_MIN_ROWS", 2)
    monkeypatch.setattr(base, "SHARED_PREFIX_MIN_TOKENS", BLOCK)
    rng = random.Random(seed)
    config = EngineConfig(
        block_size=BLOCK, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS
    )
    scheduler = Scheduler(config, 60, MAX_MODEL_LEN, [0])
    batches = TwoBatches()
    seen: list[int] = []
    with_prompts: list[tuple[int, int]] = []  # the shared prefixes of steps with prompt rows
    original = batches.pack

    def pack(plan: SchedulerOutput) -> PackedInputs:
        packed = original(plan)
        shared = packed.meta.shared_prefix
        seen.append(0 if shared is None else int(shared[0]))
        if not plan.decode_only and shared is not None:
            with_prompts.append(tuple(shared.tolist()))
        return packed

    batches.pack = pack  # type: ignore[method-assign]
    system = [rng.randrange(10, 100) for _ in range(3 * BLOCK)]
    steps = run_random_steps(scheduler, batches, rng, lambda: list(system))
    assert steps > 200 and batches.advanced > steps // 3
    assert seen.count(3 * BLOCK) > steps // 4  # the system prompt's blocks, found often
    # Among the decodes of steps with prompt rows too (the scheduler lists running decodes
    # first: their first row is 0 here; a prompt first is test_..._names_a_one_token_row).
    assert any(tokens == 3 * BLOCK for tokens, _ in with_prompts), with_prompts


@pytest.mark.parametrize("room", [1, input_batch.TABLE_ROOM])
def test_a_step_is_packed_in_full_when_a_table_outgrows_the_layout(
    monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """Rows that all enter a new block at once widen the block tables. Within the layout's room
    (TABLE_ROOM blocks) that step advances like any other; past it (a room of one block here)
    it is packed in full (a new layout), and the steps after it advance again. Either way the
    metadata's block tables are as wide as the widest table."""
    monkeypatch.setattr(input_batch, "TABLE_ROOM", room)
    config = EngineConfig(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=MAX_TOKENS)
    scheduler = Scheduler(config, 64, MAX_MODEL_LEN, [0])
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for name in ("a", "b"):  # the same length: their tables grow at the same step
        scheduler.add_request(Request(name, [11, 12, 13], params))
    batches = TwoBatches()
    in_flight = None
    widths, advanced = [], []
    for _ in range(12):
        plan = scheduler.schedule()
        before = batches.advanced
        expected = expected_inputs(plan, batches.sampled, batches.prev["fast"])
        packed = batches.pack(plan)
        check_against_plan(packed, plan, expected)
        widths.append(packed.meta.block_tables.shape[1])
        advanced.append(batches.advanced > before)
        sampled = [50] * len(packed.sampling_requests)
        batches.sampled = torch.tensor(sampled, dtype=torch.int64)
        previous, in_flight = in_flight, (plan, sampled)
        if previous is not None:
            scheduler.update_from_output(*previous)
    # Positions 2 (the prompt's last token), then 3, 4, ...: the tables widen at 4, 8, 12.
    assert widths == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    # The prefill and the first decode (its ids gathered after a prefill) are packed in full;
    # so is each step that widens the tables past the room.
    if room == 1:
        assert advanced == [False, False, False, True, True, True, False, True, True, True,
                            False, True]  # fmt: skip
    else:
        assert advanced == [False, False] + [True] * 10


def test_a_batch_for_a_backend_that_launches_in_batch_order_packs_no_row_order() -> None:
    """Without orders_rows (the CPU backend's), a decode step has no row order to sort."""
    config = EngineConfig(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=MAX_TOKENS)
    scheduler = Scheduler(config, 64, MAX_MODEL_LEN, [0])
    for name, prompt in (("a", [11, 12, 13]), ("b", [11, 12, 13, 14, 15])):
        scheduler.add_request(Request(name, prompt, SamplingParams(max_tokens=4)))
    batch = InputBatch(torch.device("cpu"), BLOCK, MAX_TOKENS, 2, MAX_MODEL_LEN // BLOCK)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, [50, 51])
    packed = batch.pack(plan, [], None)
    decode = scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in decode.scheduled)
    packed = batch.pack(decode, packed.sampling_requests, torch.tensor([50, 51]))
    assert packed.meta.is_decode_only and packed.meta.row_order is None


def test_room_rounds_the_widest_table_up_within_the_longest() -> None:
    """A layout's block tables have room for the widest table rounded up to whole TABLE_ROOM
    blocks, but never past max_blocks_per_seq (here 20, and 7: not a multiple of the room)."""
    room = input_batch.TABLE_ROOM
    wide = InputBatch(torch.device("cpu"), BLOCK, MAX_TOKENS, MAX_SEQS, 20)
    assert [wide._room(w) for w in (1, room, room + 1, 2 * room + 1)] == [room, room, 2 * room, 20]
    narrow = InputBatch(torch.device("cpu"), BLOCK, MAX_TOKENS, MAX_SEQS, 7)
    assert [narrow._room(w) for w in (1, 7)] == [7, 7]


def test_shared_prefix_tokens_by_hand() -> None:
    """Eight rows of blocks of 4: the first two columns alike (8 tokens), the third not; with
    the minimum lowered to 8 tokens. Fewer rows, a first column that differs, or a shortest
    sequence whose last token sits in the second block give none; a row differing at the
    second column leaves one block, under the minimum."""
    tables = np.array([[5, 6, 10 + r, 0] for r in range(8)], dtype=np.int32)
    lens = np.full(8, 14)
    at = base.shared_prefix_tokens
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base, "SHARED_PREFIX_MIN_TOKENS", 8)
        assert at(tables, lens, 4) == 8
        assert at(tables[:7], lens[:7], 4) == 0  # under SHARED_PREFIX_MIN_ROWS
        assert at(tables, np.array([14] * 7 + [8]), 4) == 0  # its last token (7) in block 1
        assert at(tables, np.array([14] * 7 + [9]), 4) == 8  # its last token in block 2
        other = tables.copy()
        other[3, 0] = 7
        assert at(other, lens, 4) == 0
        other = tables.copy()
        other[6, 1] = 7
        assert at(other, lens, 4) == 0  # one block alike: 4 tokens
        patch.setattr(base, "SHARED_PREFIX_MIN_TOKENS", 4)
        assert at(other, lens, 4) == 4


def test_a_mixed_steps_shared_prefix_names_a_one_token_row() -> None:
    """A step whose first sequence is a prompt: the shared prefix is found over its one-token
    sequences alone (the prompt's table differs) and names the first of them, whose table
    row holds the pages (the kernel reads them there)."""
    batch = InputBatch(torch.device("cpu"), BLOCK, MAX_TOKENS, MAX_SEQS, 20)
    tables = np.array([[9, 8, 7, 0]] + [[5, 6, 10 + r, 0] for r in range(8)], dtype=np.int32)
    seq_lens = np.array([12] + [11] * 8)
    lens = np.array([12] + [1] * 8)  # the prompt's 12 new tokens, then one each
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base, "SHARED_PREFIX_MIN_TOKENS", 8)
        assert batch._shared_prefix(tables, seq_lens, lens, decode_only=False) == (8, 1)
        assert batch._shared_prefix(tables[:8], seq_lens[:8], lens[:8], False) == (0, 0)
