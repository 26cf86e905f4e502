"""The host KV tier's bookkeeping (engine_core/kv_offload.py) through the block manager: exact
block ids, slots and copies for eviction, restore, host LRU, pins and given-up restores."""

from __future__ import annotations

import pytest

from engine_core.block_manager import BlockManager
from engine_core.kv_offload import HostTier, KVMoves
from engine_core.request import Request
from protocol.messages import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def run_and_free(bm: BlockManager, request_id: str, token_ids: list[int]) -> int:
    """Admit a request, compute all its tokens (registering its full blocks), free it; the
    tokens its prefix lookup found."""
    request = make_request(request_id, token_ids)
    hit = bm.allocate_prefix(request)
    request.num_computed_tokens = hit
    assert bm.allocate_slots(request, request.num_tokens - hit)
    request.num_computed_tokens = request.num_tokens
    bm.cache_computed_blocks(request, request.num_tokens)
    bm.free(request_id)
    bm.check_integrity()
    return hit


def moves(bm: BlockManager) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The pending copies as (device block, host slot) pairs: out, then in."""
    taken = bm.take_moves() or KVMoves()
    return (
        list(zip(taken.out_blocks, taken.out_slots, strict=True)),
        list(zip(taken.in_blocks, taken.in_slots, strict=True)),
    )


A = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 cached, the 13th recomputed
B = list(range(200, 217))  # 17 tokens: 4 full blocks


def test_evicted_prefix_is_copied_out_and_restored_into_new_blocks() -> None:
    bm = BlockManager(num_blocks=5, block_size=4, host_blocks=8)
    assert run_and_free(bm, "a", A) == 0  # blocks 0..3; 0, 1, 2 cached (freed tail first)
    assert moves(bm) == ([], [])
    assert run_and_free(bm, "b", B) == 0  # block 4, then evicts 2, 1, 0, and 3 (no hash)
    # The cached blocks went to the host as they were evicted, least recently used first.
    assert moves(bm) == ([(2, 0), (1, 1), (0, 2)], [])
    assert bm.num_host_used_blocks == 3

    # a again: the device lost its prefix; the host holds all three blocks. b left block 0
    # free (its partial last block) and 1, 2, 3, 4 cached, least recently used first.
    assert run_and_free(bm, "a2", A) == 12
    out, restored = moves(bm)
    # Block 0 and then evicted 1 and 2 take a's blocks back from slots 2, 1, 0; evicted 3
    # holds a2's last token. Block 1 and 2 are copied out before they are copied into.
    assert out == [(1, 3), (2, 4), (3, 5)]
    assert restored == [(0, 2), (1, 1), (2, 0)]
    tier = bm.host_tier
    assert tier is not None
    assert (tier.num_stored, tier.num_restored) == (6, 3)


def test_host_lru_drops_the_least_recently_used_and_never_exceeds_its_slots() -> None:
    tier = HostTier(2)
    tier.offload(10, 1, 0, (1,))
    tier.offload(11, 2, 0, (2,))
    assert tier.claim(1, 0, (1,)) == 0  # used again: now the most recent
    tier.restore(0, 12)
    tier.take_moves()
    tier.offload(13, 3, 0, (3,))  # full: hash 2, least recently used, goes
    assert tier.num_used_slots == 2
    assert tier.claim(2, 0, (2,)) is None
    assert tier.claim(1, 0, (1,)) == 0 and tier.claim(3, 0, (3,)) == 1
    assert tier.claim(3, 9, (3,)) is None  # a hash collision is never a hit
    tier.offload(14, 3, 0, (3,))  # held already: nothing copied
    tier.take_moves()
    assert tier.num_stored == 3
    tier.check_integrity()


def test_a_slot_a_pending_copy_reads_is_never_overwritten() -> None:
    bm = BlockManager(num_blocks=2, block_size=4, host_blocks=1)
    run_and_free(bm, "a", [1, 2, 3, 4, 5])
    run_and_free(bm, "b", [6, 7, 8, 9, 10])  # evicts a's block into slot 0
    assert moves(bm) == ([(0, 0)], [])
    run_and_free(bm, "c", [11, 12, 13, 14, 15])  # evicts b's: the one slot goes to b
    assert moves(bm) == ([(1, 0)], [])
    run_and_free(bm, "b2", [6, 7, 8, 9, 10])  # b from slot 0; c's block evicted, dropped:
    out, restored = moves(bm)  # the only slot is read by this step's copy back
    assert out == [] and [slot for _, slot in restored] == [0]
    bm.check_integrity()


def test_a_restore_given_up_before_its_step_is_never_made() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, host_blocks=2)
    run_and_free(bm, "a", [1, 2, 3, 4, 5])
    run_and_free(bm, "b", [6, 7, 8, 9, 10, 11, 12, 13, 14])  # evicts a's block to the host
    moves(bm)
    a = make_request("a2", [1, 2, 3, 4, 5])
    assert bm.allocate_prefix(a) == 4  # restored into a new block, copy pending
    restored_into = bm.block_ids("a2")[0]
    bm.free("a2")  # as a refused admission does: the block stays cached, copy still due
    c = make_request("c", list(range(50, 62)))  # takes every block, evicting the restored one
    bm.allocate_prefix(c)
    assert bm.allocate_slots(c, 12)
    assert restored_into in bm.block_ids("c")
    out, restored = moves(bm)
    assert restored == []  # the copy back would have landed in c's block
    assert restored_into not in [block for block, _ in out]  # the host holds that prefix
    assert (bm.num_host_hit_blocks, bm.num_host_restored_blocks) == (1, 0)  # found, not copied
    bm.check_integrity()


def test_integrity_check_detects_a_lost_host_slot() -> None:
    tier = HostTier(2)
    tier.offload(5, 111, 0, (1, 2))
    tier.check_integrity()
    tier._free.clear()  # slot 1 neither free nor holding a block
    with pytest.raises(AssertionError):
        tier.check_integrity()


def test_a_model_the_tier_cannot_keep_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--kv-offload-gb"):
        BlockManager(num_blocks=8, block_size=4, windows=(None, 8), host_blocks=2)
    with pytest.raises(ValueError, match="--kv-offload-gb"):
        BlockManager(num_blocks=8, block_size=4, state_slots=2, host_blocks=2)
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, host_blocks=2)
