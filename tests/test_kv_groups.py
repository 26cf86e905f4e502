"""Layer groups in the KV cache: the grouping, window and chunked groups giving blocks back, what a
prefix hit means per group, and the block manager's invariants under random add / advance /
speculate / abort / preempt / resume sequences over full, window and chunked groups, alone and
together."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.block_manager import NULL_BLOCK, ROOT_HASH, BlockManager, hash_block
from engine_core.config import EngineConfig
from engine_core.kv_groups import KVGroup, blocks_for_tokens, group_layers, model_kv_layout
from engine_core.memory_plan import kv_block_bytes, min_kv_bytes
from engine_core.presets import PRESETS
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from engine_core.scheduler import Scheduler
from engine_core.state_snapshots import StateSnapshots
from protocol.messages import LoraRef, SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def first_seen(window: int | None, chunk: int | None, position: int) -> int:
    """The first position a query at ``position`` reads, by the kinds' definitions: the last
    ``window`` positions; the chunk of ``chunk`` positions it lies in; else all."""
    if chunk is not None:
        return position // chunk * chunk
    return 0 if window is None else max(0, position - window + 1)


def kinds(bm: BlockManager) -> list[tuple[int | None, int | None]]:
    """(window, attention chunk) of each of the manager's groups."""
    return list(zip(bm.windows, bm.attention_chunks, strict=True))


# ------------------------------------------------------------------------------------ grouping


def test_one_kind_is_one_group_of_every_layer() -> None:
    layout = group_layers([None] * 4)
    assert layout.groups == (KVGroup(None, (0, 1, 2, 3)),)
    assert layout.group_size == 4
    assert [layout.placement(i) for i in range(4)] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_gemma3_pattern_groups_by_the_fewest_kind() -> None:
    # Gemma 3 1B: 26 layers, every sixth global: 4 full, 22 sliding -> groups of 4 layers.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = group_layers(windows)
    assert layout.group_size == 4
    assert layout.groups[0] == KVGroup(None, (5, 11, 17, 23))
    sliding = [i for i, w in enumerate(windows) if w is not None]
    assert [g.layers for g in layout.groups[1:]] == [
        tuple(sliding[i : i + 4]) for i in range(0, 22, 4)
    ]
    assert layout.windows == (None, 512, 512, 512, 512, 512, 512)
    assert layout.placement(23) == (0, 3) and layout.placement(25) == (6, 1)


def test_alternating_windows_are_two_groups_of_half() -> None:
    windows = [128 if i % 2 == 0 else None for i in range(6)]  # gpt-oss
    layout = group_layers(windows)
    assert layout.group_size == 3
    assert layout.groups == (KVGroup(None, (1, 3, 5)), KVGroup(128, (0, 2, 4)))


def test_counts_within_a_quarter_make_one_group_each() -> None:
    layout = group_layers([None] * 5 + [64] * 6)
    assert layout.group_size == 6
    assert [len(g.layers) for g in layout.groups] == [5, 6]  # the full group is padded


def test_blocks_for_tokens_counts_each_groups_peak() -> None:
    # 1,024 tokens in blocks of 16, chunks of 32: a full group 64 blocks, a window of 64 the
    # blocks of 63 tokens behind a chunk plus the chunk's 32 (ceil(95 / 16) + 1 = 7).
    assert blocks_for_tokens([None], 1024, 16, 32) == 64
    assert blocks_for_tokens([None, 64, 64], 1024, 16, 32) == 64 + 7 + 7
    assert blocks_for_tokens([64], 40, 16, 32) == 3  # never more than the tokens take


def test_memory_plan_counts_one_groups_layers_and_each_groups_peak() -> None:
    """SmolLM2's shape with Gemma 3's pattern: 25 sliding layers (window 512) and 5 full, so
    groups of 5 layers. A block id costs 5 layers' K and V; one 2,000-token sequence in chunks
    of 512 holds 125 blocks in the full group, ceil((511 + 512) / 16) + 1 = 65 in each of the
    5 sliding groups, and the null block."""
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30))
    config = dataclasses.replace(PRESETS["smollm2-135m"], sliding_window=512, layer_types=types)
    per_layer = 16 * 2 * 3 * 64 * 4  # a block of one layer: K and V, 3 heads of 64, float32
    assert kv_block_bytes(config, 3, 16, torch.float32) == 5 * per_layer
    want = (125 + 5 * 65 + 1) * 5 * per_layer  # 60% of the single table's 125 x 30 layers
    assert min_kv_bytes(config, 3, 2000, 16, torch.float32, chunk=512) == want
    plain = PRESETS["smollm2-135m"]  # one kind: every layer in a block, as before groups
    assert kv_block_bytes(plain, 3, 16, torch.float32) == 30 * per_layer
    assert min_kv_bytes(plain, 3, 2000, 16, torch.float32, chunk=512) == 125 * 30 * per_layer


def test_memory_plan_counts_llama4_scouts_chunked_groups() -> None:
    """The llama4-scout preset (24 layers: 6 NoPE global, 18 chunked over 8,192): groups of 6
    layers, one full and three chunked. One 32,768-token sequence in steps of 8,192 holds 2,048
    blocks of 16 in the full group and ceil((8,191 + 8,192) / 16) + 1 = 1,025 in each chunked
    one, plus the null block: 5,124 blocks of 6 layers, 63% of the single table's 2,048 x 24
    (a chunked layer holds up to a chunk behind a step and the step: the share falls as the
    context grows past the chunk)."""
    config = PRESETS["llama4-scout"]
    layout = model_kv_layout(config)
    assert layout.group_size == 6 and layout.attention_chunks == (None, 8192, 8192, 8192)
    per_layer = 16 * 2 * 8 * 128 * 2  # a block of one layer: K and V, 8 heads of 128, bf16
    assert kv_block_bytes(config, 8, 16, torch.bfloat16) == 6 * per_layer
    want = (2048 + 3 * 1025 + 1) * 6 * per_layer
    assert min_kv_bytes(config, 8, 32768, 16, torch.bfloat16, chunk=8192) == want
    assert want == 30744 * per_layer and 30744 / (2048 * 24) < 0.63


# --------------------------------------------------------------------------------- by hand


def test_a_window_group_gives_back_the_blocks_behind_its_window() -> None:
    bm = BlockManager(num_blocks=20, block_size=4, windows=(None, 6))
    assert bm.num_blocks == 19  # block 0 is the null block
    request = make_request("a", list(range(10)))
    assert bm.allocate_prefix(request) == 0
    assert bm.allocate_slots(request, 10)
    assert bm.block_ids("a") == [1, 2, 3] and bm.block_ids("a", 1) == [4, 5, 6]
    request.num_computed_tokens = 10
    request.token_ids.append(10)
    # The token at 10 sees positions 5..10: block 0 (positions 0..3) is wholly behind.
    assert bm.allocate_slots(request, 1)
    assert bm.block_ids("a", 1) == [NULL_BLOCK, 5, 6]
    assert bm.block_ids("a") == [1, 2, 3]  # the full group keeps everything
    # Given back registered: block 4 holds the prefix 0..3 in group 1, evictable.
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks) == (13, 1, 5)
    request.num_computed_tokens = 11
    request.token_ids.append(11)
    assert bm.allocate_slots(request, 1)  # 11 sees 6..11: block 1 (4..7) still needed
    assert bm.block_ids("a", 1) == [NULL_BLOCK, 5, 6]
    bm.check_integrity()
    bm.free("a")
    # Block 1 (full group) registered with block 4 when it fell behind: 2 cached, 17 free.
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks) == (17, 2, 0)
    bm.check_integrity()


def test_a_window_hit_needs_only_the_blocks_the_window_sees() -> None:
    """Prompt of 17 tokens, blocks of 4, window 6: a hit of n blocks needs every full block
    0..n-1 and the window's blocks from position 4n - 5 on."""
    bm = BlockManager(num_blocks=40, block_size=4, windows=(None, 6))
    first = make_request("a", list(range(17)))
    bm.allocate_prefix(first)
    assert bm.allocate_slots(first, 17)
    first.num_computed_tokens = 17
    bm.cache_computed_blocks(first, 17)
    full, window = bm.block_ids("a"), bm.block_ids("a", 1)
    bm.free("a")
    second = make_request("b", list(range(17)) + [99])
    # 18 tokens: at most 4 blocks (16 tokens) hit; token 16 sees 11..16: blocks 2 and 3.
    assert bm.allocate_prefix(second) == 16
    assert bm.block_ids("b") == full[:4]
    assert bm.block_ids("b", 1) == [NULL_BLOCK, NULL_BLOCK, window[2], window[3]]
    bm.check_integrity()
    bm.free("b")
    bm.check_integrity()


def test_a_lora_adapter_shares_no_group_block_with_the_base_or_another_adapter() -> None:
    """The group path's hash chain starts from the request's adapter, as the one-table path's
    does: the same tokens under another adapter (or none) hit nothing; under the same one, all."""
    bm = BlockManager(num_blocks=60, block_size=4, windows=(None, 6))
    tokens = list(range(17))

    def run(request_id: str, lora: LoraRef | None) -> int:
        request = make_request(request_id, tokens)
        request.lora = lora
        hit = bm.allocate_prefix(request)
        assert bm.allocate_slots(request, 17 - hit)
        request.num_computed_tokens = 17
        bm.cache_computed_blocks(request, 17)
        return hit

    assert run("base", None) == 0
    assert run("a", LoraRef("a", "/adapters/a")) == 0
    assert run("b", LoraRef("b", "/adapters/b")) == 0
    assert run("a-again", LoraRef("a", "/adapters/a")) == 16
    assert run("base-again", None) == 16
    bm.check_integrity()


def test_a_window_hit_is_shortened_to_where_its_blocks_remain() -> None:
    """The window group gave back block 1 while the full group kept it: a later request whose
    hit would need window block 1 takes a shorter hit."""
    bm = BlockManager(num_blocks=40, block_size=4, windows=(None, 6))
    first = make_request("a", list(range(17)))
    bm.allocate_prefix(first)
    assert bm.allocate_slots(first, 17)
    first.num_computed_tokens = 17
    bm.cache_computed_blocks(first, 17)
    first.token_ids.append(17)
    assert bm.allocate_slots(first, 1)  # 17 sees 12..17: window blocks 0..2 go back
    assert bm.block_ids("a", 1)[:3] == [NULL_BLOCK] * 3
    # Evict what the window group gave back (cached, evictable): take every block left.
    room = bm.num_free_blocks + bm.num_cached_blocks
    assert (room, bm.num_cached_blocks) == (32, 3)
    hog = make_request("hog", [1000 + i for i in range(4 * (room // 2))])
    bm.allocate_prefix(hog, use_cache=False)
    assert bm.allocate_slots(hog, hog.num_tokens)
    bm.free("hog")
    assert bm.num_cached_blocks == 0
    bm.free("a")  # the full group's blocks 0..3 and the window's block 3 are cached now
    b = make_request("b", list(range(9)) + [77])
    # 10 tokens: up to 2 blocks; a hit of 2 needs window blocks from (8 - 5) // 4 = 0: gone.
    # A hit of 1 needs window blocks from max(0, 4 - 5) // 4 = 0: gone too. No hit.
    assert bm.allocate_prefix(b) == 0
    c = make_request("c", list(range(17)) + [88])
    # 18 tokens: a hit of 4 needs window blocks 2..3; block 3 remains but block 2 is gone.
    # A hit of 3 needs window blocks (12 - 5) // 4 = 1..2: gone. 2 and 1: block 0, gone.
    assert bm.allocate_prefix(c) == 0
    bm.check_integrity()


def test_no_window_keeps_todays_block_ids() -> None:
    """One full group: no null block, and the same ids a single-table manager hands out."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    bm.allocate_prefix(a)
    assert bm.allocate_slots(a, 10)
    assert bm.block_ids("a") == [0, 1, 2] and bm.group_tables("a") == ()
    assert bm.max_tokens_per_sequence(chunk=8, limit=1000) == 40
    assert bm.max_tokens_per_sequence(chunk=8, limit=30) == 30


def test_max_tokens_per_sequence_counts_every_group() -> None:
    bm = BlockManager(num_blocks=41, block_size=4, windows=(None, 8))
    # 40 blocks: a full group holding n blocks beside a window group's at most
    # ceil((7 + 8) / 4) + 1 = 5 blocks: n = 35, 140 tokens.
    assert bm.max_tokens_per_sequence(chunk=8, limit=1000) == 140
    # Windows only (Mistral-style): a window's peak of 5 blocks fits 9, at any length.
    windowed = BlockManager(num_blocks=10, block_size=4, windows=(8,))
    assert windowed.max_tokens_per_sequence(chunk=8, limit=10_000) == 10_000
    assert blocks_for_tokens(bm.windows, 140, 4, 8) <= 40 < blocks_for_tokens(bm.windows, 141, 4, 8)


def test_llama4_pattern_is_a_full_group_beside_chunked_ones() -> None:
    # Llama 4: every fourth layer global (no rope), the others chunked: 2 full, 6 chunked.
    chunks = [None if (i + 1) % 4 == 0 else 16 for i in range(8)]
    layout = group_layers([None] * 8, chunks)
    assert layout.group_size == 2
    assert layout.groups == (
        KVGroup(None, (3, 7)),
        KVGroup(None, (0, 1), 16),
        KVGroup(None, (2, 4), 16),
        KVGroup(None, (5, 6), 16),
    )
    assert layout.attention_chunks == (None, 16, 16, 16) and layout.gives_back
    with pytest.raises(ValueError, match="attention chunk"):
        group_layers([8, None], [16, None])  # a window and a chunk on one layer: no such kind


def test_a_chunked_group_gives_back_the_blocks_before_its_chunk() -> None:
    """Chunks of 6 tokens, blocks of 4: the token at p sees [p // 6 * 6, p]. Nothing goes back
    until a query enters chunk 1 (at 6), which needs block 1 (4..7) on; then at 12, block 3
    (12..15) on: blocks 1 and 2 go back together (the bound jumps at chunk edges)."""
    bm = BlockManager(num_blocks=20, block_size=4, windows=(None, None), attention_chunks=(None, 6))
    request = make_request("a", list(range(5)))
    bm.allocate_prefix(request)
    assert bm.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    request.token_ids.append(5)
    assert bm.allocate_slots(request, 1)  # the token at 5 is in chunk 0: all kept
    assert NULL_BLOCK not in bm.block_ids("a", 1)
    request.num_computed_tokens = 6
    request.token_ids += [6, 7, 8, 9, 10, 11]
    assert bm.allocate_slots(request, 6)  # from 6: chunk 1 starts in block 1
    assert bm.block_ids("a", 1)[0] == NULL_BLOCK and NULL_BLOCK not in bm.block_ids("a", 1)[1:]
    request.num_computed_tokens = 12
    request.token_ids.append(12)
    assert bm.allocate_slots(request, 1)  # from 12: chunk 2 starts at block 3
    assert bm.block_ids("a", 1)[:3] == [NULL_BLOCK] * 3
    assert len(bm.block_ids("a", 1)) == 4 and bm.block_ids("a")[0] != NULL_BLOCK
    bm.check_integrity()
    bm.free("a")
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_a_chunked_hit_needs_the_blocks_from_its_chunk_start() -> None:
    """A hit of n blocks (first recomputed token at L = 4n) needs the chunked group's blocks
    from C * floor(L / C) // 4 to n - 1: chunks of 8 and a 21-token prompt cached, a
    22-token request hits 5 blocks (L = 20, chunk start 16: block 4 only)."""
    bm = BlockManager(num_blocks=40, block_size=4, windows=(None, None), attention_chunks=(None, 8))
    first = make_request("a", list(range(21)))
    bm.allocate_prefix(first)
    assert bm.allocate_slots(first, 21)
    first.num_computed_tokens = 21
    bm.cache_computed_blocks(first, 21)
    full, chunked = bm.block_ids("a"), bm.block_ids("a", 1)
    bm.free("a")
    second = make_request("b", list(range(21)) + [99])
    assert bm.allocate_prefix(second) == 20
    assert bm.block_ids("b") == full[:5]
    assert bm.block_ids("b", 1) == [NULL_BLOCK] * 4 + [chunked[4]]
    # A hit ending on a chunk edge (L = 16) needs no chunked block at all.
    bm.free("b")
    third = make_request("c", list(range(16)) + [77])
    assert bm.allocate_prefix(third) == 16
    assert bm.block_ids("c", 1) == [NULL_BLOCK] * 4
    bm.check_integrity()


def test_a_chunked_hit_is_shortened_to_where_its_blocks_remain() -> None:
    """Only the chunked group's block 4 is evicted: a hit of 5 blocks (needs it) becomes a hit
    of 4, on the chunk edge at 16, which needs no chunked block."""
    bm = BlockManager(num_blocks=40, block_size=4, windows=(None, None), attention_chunks=(None, 8))
    first = make_request("a", list(range(21)))
    bm.allocate_prefix(first)
    assert bm.allocate_slots(first, 21)
    first.num_computed_tokens = 21
    bm.cache_computed_blocks(first, 21)
    block = bm.block_ids("a", 1)[4]
    bm.free("a")
    bm._hash_to_block[1].pop(bm._blocks[block].hash)  # evicted: as _take_new would drop it
    bm._blocks[block].reset_hash()
    del bm._cached[block]
    bm._free.append(block)
    second = make_request("b", list(range(21)) + [99])
    assert bm.allocate_prefix(second) == 16
    bm.check_integrity()


def test_chunked_peak_and_sequence_cap() -> None:
    # Chunk 8, blocks of 4, steps of 8 tokens: a step's first token at most 7 past its chunk's
    # start, so ceil((7 + 8) / 4) + 1 = 5 blocks at most.
    assert blocks_for_tokens([None], 1000, 4, 8, [8]) == 5
    assert blocks_for_tokens([None, None], 1000, 4, 8, [None, 8]) == 250 + 5
    chunked = BlockManager(num_blocks=10, block_size=4, windows=(None,), attention_chunks=(8,))
    assert chunked.max_tokens_per_sequence(chunk=8, limit=10_000) == 10_000


def test_a_state_slot_is_taken_with_the_first_blocks_and_given_back_on_free() -> None:
    """Two slots: a third request is refused (nothing taken) until one is freed; a request
    that asks again keeps its slot; no prefix is hit with a state kind and no saved states."""
    bm = BlockManager(num_blocks=20, block_size=4, state_slots=2)
    assert not bm.enable_prefix_caching
    requests = [make_request(name, list(range(9))) for name in "abc"]
    for request in requests[:2]:
        assert bm.allocate_prefix(request) == 0
        assert bm.allocate_slots(request, 9)
    assert (bm.state_slot("a"), bm.state_slot("b"), bm.num_free_state_slots) == (0, 1, 0)
    free_blocks = bm.num_free_blocks
    assert bm.allocate_prefix(requests[2]) == 0
    assert not bm.allocate_slots(requests[2], 9)
    assert bm.num_free_blocks == free_blocks and bm.block_ids("c") == []
    requests[0].num_computed_tokens = 9
    assert bm.allocate_slots(requests[0], 4) and bm.state_slot("a") == 0
    bm.check_integrity()
    bm.free("a")
    assert bm.allocate_slots(requests[2], 9) and bm.state_slot("c") == 0
    bm.cache_computed_blocks(requests[2], 9)
    assert bm.num_cached_blocks == 0
    bm.check_integrity()
    bm.free("b")
    bm.free("c")
    assert bm.num_free_state_slots == 2 and bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


def test_decode_saves_a_state_per_block_and_keeps_the_latest_in_its_place() -> None:
    """Block 4, three saved states. A 6-token prompt saves at 4 (its last boundary before its
    last token); its 16-token answer saves at 8, 12, 16 and 20 as decode reaches each boundary,
    each copy from the request's slot before the step that starts there. Each decode save
    demotes the one before it, so the pool's evictions take the answer's older states (12,
    16) and never the prompt's: 4, 8 and 20 are left. A next turn (the 21 tokens computed, new
    text) resumes at 20 from a restore of that state into its own slot."""
    config = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    scheduler = Scheduler(config, 32, 64, (1,), state_slots=2, state_snapshots=3)
    bm = scheduler.block_manager
    assert bm.snapshots is not None
    first = Request("a", list(range(10, 16)), SamplingParams(max_tokens=16, ignore_eos=True))
    scheduler.add_request(first)
    saved_at = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        for copy in plan.state_copies:
            assert copy.save and copy.slot == bm.state_slot("a")
            saved_at.append(first.num_computed_tokens - plan.scheduled[0].num_new_tokens)
        scheduler.update_from_output(plan, [20 + len(first.token_ids)])
        bm.check_integrity()
    assert saved_at == [4, 8, 12, 16, 20]
    assert bm.snapshots.num_saved == 5 and bm.snapshots.num_evicted == 2
    parent, kept = ROOT_HASH, []
    for index in range(5):
        block = tuple(first.token_ids[4 * index : 4 * index + 4])
        kept.append(bm.snapshots.find(hash_block(parent, block), parent, block) is not None)
        parent = hash_block(parent, block)
    assert kept == [True, True, False, False, True]  # ends at 4, 8, 12, 16, 20
    turn = Request("b", first.token_ids[:21] + [3, 4, 5], SamplingParams(max_tokens=1))
    scheduler.add_request(turn)
    plan = scheduler.schedule()
    assert plan.scheduled[0].start == 20
    (restore,) = plan.state_copies
    assert not restore.save and restore.slot == bm.state_slot("b")
    scheduler.abort_requests(["b"])
    bm.check_integrity()


# ------------------------------------------------------------------------------ property tests


class _KVContent:
    """What each physical slot holds: (group, token) of the last write. A block id is memory in
    one layer of each group, so a block given to another group is overwritten by it, and a
    request reading a slot expects its own group's write of its own token."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[int, tuple[int, int]] = {}

    def write(self, request: Request, end: int) -> None:
        size = self.bm.block_size
        for group in range(self.bm.num_groups):
            table = self.bm.block_ids(request.request_id, group)
            for pos in range(request.num_computed_tokens, end):
                block = table[pos // size]
                assert block != self.bm.null_block, "a token written where its table has no block"
                self.slots[block * size + pos % size] = (group, request.token_ids[pos])

    def verify(self, request: Request) -> None:
        """Every position a query at or after ``num_computed_tokens`` may read holds the
        request's own token, written by the same group."""
        size, computed = self.bm.block_size, request.num_computed_tokens
        for group, (window, chunk) in enumerate(kinds(self.bm)):
            table = self.bm.block_ids(request.request_id, group)
            for pos in range(first_seen(window, chunk, computed), computed):
                slot = table[pos // size] * size + pos % size
                assert self.slots.get(slot) == (group, request.token_ids[pos]), (group, pos)


class _Driver:
    """Random admissions (with prefix hits), prompt chunks, decodes, speculative steps with
    rollback, aborts, preemptions (recompute) and resumes of the preempted requests."""

    def __init__(
        self,
        seed: int,
        windows: tuple[int | None, ...],
        chunks: tuple[int | None, ...] = (),
        state_slots: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.bm = BlockManager(
            num_blocks=64,
            block_size=4,
            windows=windows,
            attention_chunks=chunks,
            state_slots=state_slots,
        )
        self.kv = _KVContent(self.bm)
        self.live: list[Request] = []
        self.preempted: list[Request] = []
        self.next_id = 0
        self.stats = dict.fromkeys(("hits", "refused", "released", "rollbacks", "resumed"), 0)
        self.prefixes = [[self.rng.randrange(50) for _ in range(24)] for _ in range(3)]

    def admit(self, request: Request | None = None) -> None:
        if request is None:
            prompt = self.rng.choice(self.prefixes)[: self.rng.randint(0, 24)]
            prompt += [self.rng.randrange(50) for _ in range(self.rng.randint(1, 12))]
            request = make_request(f"r{self.next_id}", prompt)
            self.next_id += 1
        request.num_computed_tokens = self.bm.allocate_prefix(request)
        self.stats["hits"] += request.num_computed_tokens // 4
        self.kv.verify(request)  # a prefix hit holds exactly this prompt's tokens, per group
        if self._allocate(request, self.rng.randint(1, request.num_tokens)):
            self.live.append(request)
        else:
            self.bm.free(request.request_id)
            request.num_computed_tokens = 0

    def compute(self) -> None:
        request = self.rng.choice(self.live)
        if request.num_computed_tokens < request.num_tokens:
            end = self.rng.randint(request.num_computed_tokens + 1, request.num_tokens)
            if self._allocate(request, end - request.num_computed_tokens):
                self._write(request, end)
        elif self.rng.random() < 0.3 and not self.bm.num_state_slots:  # no state rollback
            self.speculate(request)
        elif self._allocate(request, 1):  # fully computed: it "samples" and appends a token
            request.token_ids.append(self.rng.randrange(50))
        else:
            self.preempt(request)

    def speculate(self, request: Request) -> None:
        """Plan the last token with k drafts, compute them all, keep a random run: the
        computed count moves back and the rejected drafts' KV is overwritten later."""
        drafts = [self.rng.randrange(50) for _ in range(self.rng.randint(1, 4))]
        request.token_ids.append(self.rng.randrange(50))  # the token the last step sampled
        start = request.num_computed_tokens
        request.token_ids.extend(drafts)
        if not self._allocate(request, 1 + len(drafts)):
            del request.token_ids[start + 1 :]
            return
        end = request.num_tokens
        self.kv.write(request, end)
        request.num_computed_tokens = end
        kept = self.rng.randint(0, len(drafts))
        del request.token_ids[start + 1 + kept :]
        request.token_ids.append(self.rng.randrange(50))  # the target's token after them
        request.num_computed_tokens = start + 1 + kept
        self.bm.cache_computed_blocks(request, request.num_computed_tokens)
        self.stats["rollbacks"] += kept < len(drafts)

    def preempt(self, request: Request) -> None:
        self.live.remove(request)
        self.bm.free(request.request_id)
        request.num_computed_tokens = 0
        self.preempted.append(request)

    def resume(self) -> None:
        """A preempted request comes back (or, as after an engine's death, a new request of
        its prompt and outputs): recomputed, with whatever prefix the cache still holds."""
        request = self.preempted.pop(self.rng.randrange(len(self.preempted)))
        if self.rng.random() < 0.5:
            request = Request.resumed(
                f"r{self.next_id}", list(request.token_ids), 1, request.params
            )
            self.next_id += 1
        self.stats["resumed"] += 1
        self.admit(request)

    def abort(self) -> None:
        request = self.rng.choice(self.live)
        self.live.remove(request)
        self.bm.free(request.request_id)

    def _write(self, request: Request, end: int) -> None:
        self.kv.write(request, end)
        request.num_computed_tokens = end
        self.bm.cache_computed_blocks(request, end)

    def _allocate(self, request: Request, num_new: int) -> bool:
        nulls_before = self._nulls(request)
        ok = self.bm.allocate_slots(request, num_new)
        self.stats["refused"] += not ok
        self.stats["released"] += self._nulls(request) > nulls_before
        if ok:
            self._check_window_bound(request)
        return ok

    def _nulls(self, request: Request) -> int:
        return sum(
            self.bm.block_ids(request.request_id, g).count(NULL_BLOCK)
            for g, (w, c) in enumerate(kinds(self.bm))
            if w is not None or c is not None
        )

    def _check_window_bound(self, request: Request) -> None:
        """A window group holds exactly the blocks from the one its next query's window starts
        in to its table's end (which covers the chunk just allocated, or more: a chunk may have
        been allocated and computed only in part, a speculative rollback leaves blocks); a
        chunked group likewise from the block its next query's attention chunk starts in."""
        first = request.num_computed_tokens
        for group, (window, chunk) in enumerate(kinds(self.bm)):
            if window is None and chunk is None:
                continue
            table = self.bm.block_ids(request.request_id, group)
            behind = first_seen(window, chunk, first) // 4
            assert table[:behind] == [NULL_BLOCK] * behind, (table, behind)
            assert NULL_BLOCK not in table[behind:], (table, behind)

    def step(self) -> None:
        roll = self.rng.random()
        if self.preempted and roll < 0.08:
            self.resume()
        elif not self.live or roll < 0.3:
            self.admit()
        elif roll < 0.88:
            self.compute()
        elif roll < 0.94:
            self.preempt(self.rng.choice(self.live))
        else:
            self.abort()

    def check(self) -> None:
        bm = self.bm
        bm.check_integrity()
        assert bm.num_free_blocks + bm.num_cached_blocks + bm.num_used_blocks == bm.num_blocks
        held = sum(bm.num_held_blocks(r.request_id) for r in self.live)
        assert held >= bm.num_used_blocks  # shared prefix blocks count once in the pool
        for request in self.live:
            self.kv.verify(request)  # nobody overwrote a block this request still reads
        if bm.num_state_slots:  # one slot of its own for each live request, none for the rest
            slots = [bm.state_slot(r.request_id) for r in self.live]
            assert len(set(slots)) == len(slots)
            assert bm.num_free_state_slots == bm.num_state_slots - len(slots)


# Groups as (windows, attention chunks); Llama 4 is a full group beside chunked ones.
WINDOW_CASES = {
    "full": ((None,), ()),
    "window": ((6,), ()),
    "full+window": ((None, 6), ()),
    "full+two windows": ((None, 9, 9), ()),
    "chunked": ((None,), (6,)),
    "full+chunked": ((None, None), (None, 8)),
    "full+window+chunked": ((None, 6, None), (None, None, 5)),
    "full+two chunked": ((None, None, None), (None, 12, 12)),
}


@pytest.mark.parametrize("state_slots", [0, 3], ids=["blocks", "blocks+state"])
@pytest.mark.parametrize("kinds", list(WINDOW_CASES.values()), ids=list(WINDOW_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_every_invariant(
    seed: int, kinds: tuple[tuple[int | None, ...], tuple[int | None, ...]], state_slots: int
) -> None:
    """With a state kind (3 slots: fewer than the requests that would run), admissions are
    also refused for want of a slot, and no prefix is ever hit."""
    windows, chunks = kinds
    driver = _Driver(seed, windows, chunks, state_slots)
    for _ in range(1500):
        driver.step()
        driver.check()
    for request in list(driver.live):
        driver.bm.free(request.request_id)
    driver.live.clear()
    driver.check()
    assert driver.bm.num_used_blocks == 0
    assert driver.bm.num_free_blocks + driver.bm.num_cached_blocks == driver.bm.num_blocks
    # The run exercised what it claims to: hits, refusals, rollbacks, resumes, and (with a
    # window group) blocks given back.
    assert driver.bm.num_free_state_slots == state_slots
    stats = dict(driver.stats)
    if all(w is None for w in windows) and all(c is None for c in chunks):
        assert stats.pop("released") == 0
    if state_slots:  # no saved state: no hit; no rollback of a state: no speculation
        assert stats.pop("hits") == 0 and stats.pop("rollbacks") == 0
    assert min(stats.values()) > 0, stats


# ------------------------------------------------------------------------ through the scheduler


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    kinds=st.sampled_from(
        [
            ((None, 6), ()),
            ((6,), ()),
            ((None, 5, 9), ()),
            ((None,), ()),
            ((None, None), (None, 8)),
            ((None, None, 6), (None, 5, None)),
        ]
    ),
    num_blocks=st.integers(20, 60),
    budget=st.integers(8, 40),
    overlap=st.booleans(),
    stateful=st.booleans(),
    snapshots=st.sampled_from([0, 2, 8]),
)
def test_scheduler_with_groups_keeps_the_invariants(
    seed: int,
    kinds: tuple[tuple[int | None, ...], tuple[int | None, ...]],
    num_blocks: int,
    budget: int,
    overlap: bool,
    stateful: bool,
    snapshots: int,
) -> None:
    """Random requests (shared prefixes, prompt logprobs, stops) through the real scheduler on
    a small pool (preemptions), with aborts, planned ahead of the last step's tokens (overlap)
    or not: every plan carries a table per group, as long as group 0's, with a real block
    wherever the step's queries look; the manager's integrity holds at every step; at the end
    every block is free or cached. With state slots and saved states (prompt chunks' and
    decode steps'), every row's slot holds (after the plan's copies) the state of exactly the
    tokens before its chunk, and every save that of a block boundary."""
    rng = random.Random(seed)
    config = EngineConfig(block_size=4, max_num_seqs=min(6, budget), max_num_batched_tokens=budget)
    windows, chunks = kinds
    slots = config.max_num_seqs if stateful else 0  # as the engine sizes them: one per running
    scheduler = Scheduler(
        config,
        num_blocks,
        128,
        (1,),
        kv_windows=windows,
        kv_attention_chunks=chunks,
        state_slots=slots,
        state_snapshots=snapshots if stateful else 0,
    )
    bm = scheduler.block_manager
    states = _SlotStates(config.block_size)
    prefixes = [[rng.randrange(2, 40) for _ in range(16)] for _ in range(2)]
    pending: SchedulerOutput | None = None
    for step in range(150):
        if step < 80 and rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randint(0, 16)]
            prompt += [rng.randrange(2, 40) for _ in range(rng.randint(1, 20))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 30), prompt_logprobs=rng.choice([None, None, 0])
            )
            if len(prompt) < scheduler.max_model_len:  # longer ones are refused: a small pool
                scheduler.add_request(Request(f"r{step}", prompt, params))
        live = list(scheduler.requests)
        if live and rng.random() < 0.04:
            scheduler.abort_requests([rng.choice(live)])
        plan = scheduler.schedule()
        for row in plan.scheduled:
            check_row_tables(row, bm)
        check_state_slots(plan, scheduler, slots)
        if stateful:
            states.run(plan)
        settle, pending = (pending, plan) if overlap else (plan, None)
        if settle is not None:
            count = sum(s.samples for s in settle.scheduled)
            scheduler.update_from_output(settle, [rng.randrange(1, 40) for _ in range(count)])
        bm.check_integrity()
    if pending is not None:
        scheduler.update_from_output(pending, [2] * sum(s.samples for s in pending.scheduled))
    scheduler.abort_requests(list(scheduler.requests))
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks
    assert bm.num_free_state_slots == slots


class _SlotStates:
    """What each state slot and saved state holds, as (request, n): the state after that
    request's first n tokens, moved by each plan's copies and chunks in the order the runner
    makes them. A state is right for a chunk from ``start`` when it is that of ``start``
    tokens equal to the chunk's request's (the same request's, or a hit's donor's prefix)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[Request, int]] = {}
        self.saved: dict[int, tuple[Request, int]] = {}

    def run(self, plan: SchedulerOutput) -> None:
        for copy in plan.state_copies:
            if copy.save:  # a prompt chunk's or a decode step's start on a block boundary
                _, length = self.saved[copy.snapshot] = self.slots[copy.slot]
                assert length and not length % self.block_size, length
            else:
                self.slots[copy.slot] = self.saved[copy.snapshot]
        for row in plan.scheduled:
            request, start = row.request, row.start
            if start == 0:
                self.slots[row.state_slot] = (request, 0)  # a fresh chunk zeroes its slot
            donor, length = self.slots[row.state_slot]
            assert length == start, (request.request_id, length, start)
            if donor is not request:
                assert donor.token_ids[:start] == request.token_ids[:start]
            self.slots[row.state_slot] = (request, start + row.num_new_tokens)


def check_state_slots(plan: SchedulerOutput, scheduler: Scheduler, slots: int) -> None:
    """Each row carries the slot its request holds (-1 without a state kind), no two rows one
    slot; every running request holds a slot, and a waiting (or preempted) one none."""
    rows = [row.state_slot for row in plan.scheduled]
    if not slots:
        assert set(rows) <= {-1}
        return
    assert len(set(rows)) == len(rows) and all(0 <= s < slots for s in rows)
    bm = scheduler.block_manager
    assert {bm.state_slot(r.request_id) for r in scheduler.running} >= set(rows)
    assert bm.num_free_state_slots == slots - len(scheduler.running)
    for request in scheduler.waiting:
        with pytest.raises(KeyError):
            bm.state_slot(request.request_id)


def check_row_tables(row: ScheduledRequest, bm: BlockManager) -> None:
    """The row's tables: one per group, all as long, covering its chunk; in a window group a
    real block from the one its first query's window (or attention chunk) starts in."""
    tables = [row.block_ids, *row.group_block_ids]
    assert len(tables) == bm.num_groups
    assert {len(t) for t in tables} == {len(row.block_ids)}
    assert len(row.block_ids) * bm.block_size >= row.start + row.num_new_tokens
    for table, (window, chunk) in zip(tables, kinds(bm), strict=True):
        first = first_seen(window, chunk, row.start) // bm.block_size
        assert NULL_BLOCK not in list(table)[first:] or bm.null_block is None


def test_decode_saves_never_push_the_prompts_states_below_half_the_pool() -> None:
    """Four snapshots: two prompts' states (the least recently used), then six decode saves.
    The first two take the free snapshots; from the third on, decode saves hold half the pool,
    so each takes the oldest decode save's snapshot and both prompts' states stay (plain LRU
    would have evicted them first). A prompt's save that refreshes a decode save's state makes
    it a prompt's: the next decode save may then evict a prompt's state again (the LRU one)."""
    pool = StateSnapshots(4)
    entry = {name: (hash(name), 0, (name,)) for name in ("p1", "p2", *(f"d{i}" for i in range(6)))}
    for name in ("p1", "p2"):
        assert pool.save(0, *entry[name])
    for i in range(6):
        assert pool.save(1, *entry[f"d{i}"], decode=True)
        assert pool.num_decode == min(i + 1, pool.max_decode) == min(i + 1, 2)
        pool.check_integrity()
    kept = {name for name, e in entry.items() if pool.find(*e) is not None}
    assert kept == {"p1", "p2", "d4", "d5"} and pool.num_evicted == 4
    assert not pool.save(0, *entry["d5"])  # a prompt reaching the same boundary
    assert pool.num_decode == 1
    assert pool.save(1, hash("d6"), 0, ("d6",), decode=True)
    assert pool.find(*entry["p1"]) is None and pool.find(*entry["d4"]) is not None
    pool.check_integrity()
