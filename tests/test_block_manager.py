"""BlockManager: exact block ids for shared prefixes, the hit cap, LRU eviction, integrity."""

from __future__ import annotations

import random

import pytest

from engine_core import block_manager as bm_module
from engine_core.block_manager import BlockManager
from engine_core.kv_offload import KVMoves
from engine_core.request import Request
from protocol.messages import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def admit(bm: BlockManager, request: Request) -> int:
    """Take the cached prefix and room for the rest of the tokens, as the scheduler does."""
    request.num_computed_tokens = bm.allocate_prefix(request)
    assert bm.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    return request.num_computed_tokens


def compute_all(bm: BlockManager, request: Request) -> None:
    request.num_computed_tokens = request.num_tokens
    bm.cache_computed_blocks(request, request.num_computed_tokens)


def test_shared_prefix_gets_the_same_block_ids() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    assert admit(bm, a) == 0
    assert bm.block_ids("a") == [0, 1, 2]
    compute_all(bm, a)  # blocks 0 and 1 are full, block 2 holds 2 tokens

    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(bm, b) == 8
    assert bm.block_ids("b") == [0, 1, 3]

    c = make_request("c", [0, 1, 2, 3, 99, 5, 6, 7, 8])  # differs inside the second block
    assert admit(bm, c) == 4
    assert bm.block_ids("c") == [0, 4, 5]

    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (6, 4, 0)
    bm.check_integrity()


def test_hit_cap_recomputes_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")
    assert bm.num_cached_blocks == 3

    b = make_request("b", list(range(12)))
    assert admit(bm, b) == 8  # 2 of the 3 blocks: the last token must be computed again
    assert bm.block_ids("b") == [0, 1, 3]  # a free block for the rest, cached block 2 kept
    assert bm.num_cached_blocks == 1

    c = make_request("c", list(range(13)))  # one token more: all 3 full blocks are usable
    assert admit(bm, c) == 12
    assert bm.block_ids("c") == [0, 1, 2, 4]
    bm.check_integrity()


def test_free_blocks_first_then_lru_eviction_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(100, 109)))
    for request in (a, b):
        admit(bm, request)
        compute_all(bm, request)
    assert (bm.block_ids("a"), bm.block_ids("b")) == ([0, 1, 2], [3, 4, 5])
    bm.free("a")  # released tail first: cached order 1, 0; partial block 2 is plain free
    bm.free("b")  # then 4, 3; partial block 5 is plain free
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (2, 4)

    d = make_request("d", list(range(200, 224)))  # needs all 6 blocks
    admit(bm, d)
    assert bm.block_ids("d") == [2, 5, 1, 0, 4, 3]
    bm.free("d")
    assert bm.num_cached_blocks == 0  # d computed nothing, and the evicted hashes are gone
    assert bm.allocate_prefix(make_request("a2", list(range(9)))) == 0
    bm.check_integrity()


def test_hit_revives_a_cached_block_so_it_is_not_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")  # free list: 3, 2; cached (LRU first): 1, 0

    b = make_request("b", [0, 1, 2, 3, 77, 78])
    assert admit(bm, b) == 4
    assert bm.block_ids("b") == [0, 3]
    assert bm.num_cached_blocks == 1

    c = make_request("c", list(range(300, 308)))
    admit(bm, c)
    assert bm.block_ids("c") == [2, 1]  # block 1 evicted; block 0 is in use by b
    assert bm.num_free_blocks + bm.num_cached_blocks == 0

    # No room left: refused, and nothing changed.
    d = make_request("d", [5])
    assert bm.allocate_prefix(d) == 0
    assert not bm.allocate_slots(d, 1)
    assert bm.block_ids("d") == [] and bm.num_used_blocks == 4
    bm.check_integrity()


def test_failed_allocate_slots_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(10)))
    admit(bm, a)  # 3 blocks
    b = make_request("b", list(range(50, 59)))  # needs 3, one is left
    assert not bm.allocate_slots(b, b.num_tokens)
    assert bm.block_ids("b") == []
    assert (bm.num_free_blocks, bm.num_used_blocks) == (1, 3)
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2)  # 12 tokens still fit in 3 blocks
    assert not bm.allocate_slots(a, 7)  # 17 tokens need 5 blocks
    assert bm.block_ids("a") == [0, 1, 2]
    bm.check_integrity()


def test_table_covering_grows_a_table_as_allocate_slots_would() -> None:
    """The scheduler's one call for a row's table: a copy as it is while it covers the chunk,
    grown by a block (a free one first, then the least recently used cached one) where the last
    block filled, by allocate_slots where it needs more; None and nothing changed without
    room."""
    bm = BlockManager(num_blocks=4, block_size=4)
    old = make_request("old", list(range(100, 104)))  # one full block, cached once freed
    admit(bm, old)
    compute_all(bm, old)
    bm.free("old")
    a = make_request("a", list(range(4)))
    admit(bm, a)
    a.num_computed_tokens = 4
    assert list(bm.table_covering(a, 0)) == bm.block_ids("a") == [1]
    assert list(bm.table_covering(a, 1)) == bm.block_ids("a") == [1, 2]  # a free block
    a.num_computed_tokens = 8
    assert list(bm.table_covering(a, 1)) == bm.block_ids("a") == [1, 2, 3]
    a.num_computed_tokens = 12
    assert list(bm.table_covering(a, 1)) == bm.block_ids("a") == [1, 2, 3, 0]  # evicted
    assert bm.num_cached_blocks == 0
    a.num_computed_tokens = 16
    assert bm.table_covering(a, 1) is None  # no block left
    assert bm.block_ids("a") == [1, 2, 3, 0] and bm.num_free_blocks == 0
    table = bm.table_covering(a, 0)
    table.append(9)  # a copy: the block manager's table is not touched
    assert bm.block_ids("a") == [1, 2, 3, 0]
    bm.check_integrity()

    bm = BlockManager(num_blocks=4, block_size=4)
    b = make_request("b", list(range(3)))
    admit(bm, b)
    b.num_computed_tokens = 3
    assert list(bm.table_covering(b, 9)) == bm.block_ids("b") == [0, 1, 2]  # two more blocks
    assert bm.table_covering(b, 14) is None and bm.block_ids("b") == [0, 1, 2]
    bm.check_integrity()


def test_hash_collision_is_never_a_false_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 7)  # everything collides
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)

    b = make_request("b", [9, 9, 9, 9, 5])  # same hash, other tokens
    assert admit(bm, b) == 0
    compute_all(bm, b)  # must not take over a's hash entry
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 1
    assert admit(bm, make_request("c", [1, 2, 3, 4, 6])) == 4
    assert bm.block_ids("c")[0] == 0
    bm.check_integrity()


def test_prefix_caching_disabled_never_hits_or_caches() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (8, 0)
    assert admit(bm, make_request("b", list(range(9)))) == 0
    bm.check_integrity()


def test_no_leaks_after_aborts() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    rng = random.Random(3)
    requests = [
        make_request(f"r{i}", [rng.randrange(4) for _ in range(rng.randint(1, 20))])
        for i in range(8)
    ]
    for request in requests:
        admit(bm, request)
        request.num_computed_tokens = rng.randint(request.num_computed_tokens, request.num_tokens)
        bm.cache_computed_blocks(request, request.num_computed_tokens)
    assert bm.num_used_blocks > 0
    for request in requests:
        bm.free(request.request_id)
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == 32
    bm.check_integrity()


def test_integrity_check_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    admit(bm, make_request("a", [1, 2, 3]))
    bm.check_integrity()
    bm._blocks[0].ref_count += 1  # a reference held by no table
    with pytest.raises(AssertionError):
        bm.check_integrity()


def copy_tokens(
    moves: KVMoves,
    slots: dict[int, int],
    host: dict[tuple[int, int], int | None],
    block_size: int,
) -> None:
    """The host tier's copies of a step over token-tracking fakes, as the runner makes them:
    every copy out, then every copy in (engine_core/kv_offload.py)."""
    for block, slot in zip(moves.out_blocks, moves.out_slots, strict=True):
        for offset in range(block_size):
            host[slot, offset] = slots.get(block * block_size + offset)
    for slot, block in zip(moves.in_slots, moves.in_blocks, strict=True):
        for offset in range(block_size):
            token = host[slot, offset]
            if token is not None:
                slots[block * block_size + offset] = token


class _KVContent:
    """Which token each slot's K/V was computed from, to prove that shared or reused blocks hold
    exactly the tokens of every request that reads them."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.host: dict[tuple[int, int], int | None] = {}  # (host slot, offset) -> token

    def move(self, bm: BlockManager) -> None:
        """Make the copies to and from the host tier that a step's forward makes first: every
        copy out, then every copy in (engine_core/kv_offload.py)."""
        moves = bm.take_moves()
        if moves is not None:
            copy_tokens(moves, self.slots, self.host, self.block_size)

    def write(self, bm: BlockManager, request: Request, end: int) -> None:
        self.move(bm)
        table = bm.block_ids(request.request_id)
        for pos in range(request.num_computed_tokens, end):
            self.slots[self._slot(table, pos)] = request.token_ids[pos]
        request.num_computed_tokens = end
        bm.cache_computed_blocks(request, end)

    def verify(self, bm: BlockManager, request: Request) -> None:
        self.move(bm)
        table = bm.block_ids(request.request_id)
        for pos in range(request.num_computed_tokens):
            assert self.slots.get(self._slot(table, pos)) == request.token_ids[pos]

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


class _RandomDriver:
    """Random admissions, chunk computations, appends and frees over a small pool."""

    def __init__(self, seed: int, host_blocks: int = 0):
        self.rng = random.Random(seed)
        self.bm = BlockManager(num_blocks=24, block_size=4, host_blocks=host_blocks)
        self.kv = _KVContent(4)
        self.live: list[Request] = []
        self.next_id = 0
        self.stats = {"hits": 0, "refused": 0, "evictions": 0}
        self.prefixes = [[self.rng.randrange(50) for _ in range(12)] for _ in range(3)]

    def admit(self) -> None:
        prompt = self.rng.choice(self.prefixes)[: self.rng.randint(0, 12)]
        prompt += [self.rng.randrange(50) for _ in range(self.rng.randint(1, 10))]
        request = make_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        request.num_computed_tokens = self.bm.allocate_prefix(request)
        self.stats["hits"] += request.num_computed_tokens // 4
        self.kv.verify(self.bm, request)  # a prefix hit holds exactly this prompt's tokens
        if self._allocate(request, self.rng.randint(1, request.num_tokens)):
            self.live.append(request)
        else:
            self.bm.free(request.request_id)

    def compute(self) -> None:
        request = self.rng.choice(self.live)
        if request.num_computed_tokens < request.num_tokens:
            end = self.rng.randint(request.num_computed_tokens + 1, request.num_tokens)
            if self._allocate(request, end - request.num_computed_tokens):
                self.kv.write(self.bm, request, end)
        elif self._allocate(request, 1):  # fully computed: it "samples" and appends a token
            request.token_ids.append(self.rng.randrange(50))
        else:
            self.free(request)  # as a preemption would

    def free(self, request: Request) -> None:
        self.live.remove(request)
        self.bm.free(request.request_id)

    def _allocate(self, request: Request, num_new: int) -> bool:
        cached_before = self.bm.num_cached_blocks
        free_before = self.bm.num_free_blocks
        ok = self.bm.allocate_slots(request, num_new)
        if not ok:
            self.stats["refused"] += 1
        elif free_before == 0 and self.bm.num_cached_blocks < cached_before:
            self.stats["evictions"] += 1
        return ok

    def step(self) -> None:
        roll = self.rng.random()
        if not self.live or roll < 0.3:
            self.admit()
        elif roll < 0.85:
            self.compute()
        else:
            self.free(self.rng.choice(self.live))

    def check(self) -> None:
        bm = self.bm
        bm.check_integrity()
        assert bm.num_free_blocks + bm.num_cached_blocks + bm.num_used_blocks == bm.num_blocks
        for request in self.live:
            self.kv.verify(bm, request)  # nobody overwrote a block this request still reads


@pytest.mark.parametrize("host_blocks", [0, 6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_every_invariant(seed: int, host_blocks: int) -> None:
    """Also with a host KV tier smaller than the device pool: restored blocks hold exactly
    their prompt's tokens once the step's copies are made, and both pools stay accounted for."""
    driver = _RandomDriver(seed, host_blocks)
    for _ in range(1500):
        driver.step()
        driver.check()
    for request in list(driver.live):
        driver.free(request)
    driver.check()
    assert driver.bm.num_used_blocks == 0
    # The run exercised what it claims to: prefix hits, refusals and LRU evictions.
    assert min(driver.stats.values()) > 0, driver.stats
    tier = driver.bm.host_tier
    if host_blocks:
        assert tier is not None
        assert tier.num_restored > 0 and tier.num_stored > tier.num_slots  # reused its slots
        assert driver.bm.num_host_used_blocks == host_blocks  # full, never more
    else:
        assert tier is None
