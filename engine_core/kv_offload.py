"""The host-memory KV tier's bookkeeping (``--kv-offload-gb``): which prefix blocks the host holds,
and the copies between the device pool and the host that the next step must make.

The block manager owns one ``HostTier`` and is its only caller: when it evicts a cached block
(full, hashed) from the device pool to reuse it, the block's contents go to a host slot under the
same chain hash (``offload``); when a prefix lookup misses the device pool, the chain goes on in
the host tier, and each consecutive block found there is given a new device block and copied back
(``claim`` then ``restore``), counted as computed. The tier only records the copies; the model
runner makes them at the start of the next step's forward (``take_moves``, carried by the step's
plan as ``SchedulerOutput.kv_moves``; engine_core/kv_offload_pool.py), every copy out before
every copy in. That order is what the device side needs: a block evicted and handed to a request
that restores another block into it is read out before it is overwritten.

The host side needs the other order where one slot is both read and written in one batch, so a
slot that a pending copy reads or writes is pinned: it is never chosen for eviction, and a copy out
that finds every slot full and pinned is dropped (the block is lost from both tiers, as it would
be without the tier). A host slot keeps its block after a restore (the tiers are inclusive), so
the block evicted from the device again later costs no copy.

Slots are kept in LRU order by use: stored, restored, or found again when the device evicts a
block the host already holds. ``check_integrity`` holds the accounting: every slot free or holding
exactly one block, pins exactly the pending copies, never more entries than slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVMoves:
    """The copies a step makes before its forward: ``out_blocks[i]`` (device) to
    ``out_slots[i]`` (host) first, then ``in_slots[i]`` (host) to ``in_blocks[i]`` (device)."""

    out_blocks: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)
    in_slots: list[int] = field(default_factory=list)
    in_blocks: list[int] = field(default_factory=list)


@dataclass
class _HostEntry:
    slot: int
    # What the hash was computed from, compared on a hit so a collision is never a false hit.
    parent_hash: int
    token_ids: tuple[Any, ...]


class HostTier:
    """``num_slots`` host slots of one KV block each, keyed by chain hash, LRU."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._entries: OrderedDict[int, _HostEntry] = OrderedDict()  # by hash, oldest first
        # Pending copies, by device block: block -> host slot.
        self._outs: dict[int, int] = {}
        self._ins: dict[int, int] = {}
        self._pins: Counter[int] = Counter()  # slot -> pending copies that read or write it
        # Since start: blocks found for a prefix lookup, and the copies handed to the runner
        # each way (a copy back given up before its step is not made, so not counted).
        self.num_hits = 0
        self.num_stored = 0
        self.num_restored = 0

    @property
    def num_used_slots(self) -> int:
        return len(self._entries)

    def offload(self, block_id: int, block_hash: int, parent: int, tokens: tuple[Any, ...]) -> None:
        """Device block ``block_id``, holding the prefix ``block_hash`` names, is evicted: keep
        its contents in a host slot (none copied where the host holds that prefix already)."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            if entry.parent_hash == parent and entry.token_ids == tokens:
                self._entries.move_to_end(block_hash)
            return  # the same prefix, or a collision: the first block keeps the hash
        slot = self._take_slot()
        if slot is None:
            return  # every slot is pinned by this step's copies: the block is dropped
        self._entries[block_hash] = _HostEntry(slot, parent, tokens)
        self._outs[block_id] = slot
        self._pins[slot] += 1

    def claim(self, block_hash: int, parent: int, tokens: tuple[Any, ...]) -> int | None:
        """The host slot holding this prefix block, pinned for the copy back that must follow
        (``restore``); None where the host does not hold it."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.parent_hash != parent or entry.token_ids != tokens:
            return None
        self._entries.move_to_end(block_hash)
        self._pins[entry.slot] += 1
        return entry.slot

    def restore(self, slot: int, block_id: int) -> None:
        """Copy claimed ``slot`` back into device block ``block_id`` before the next forward."""
        self._ins[block_id] = slot
        self.num_hits += 1

    def forget_block(self, block_id: int) -> None:
        """Device block ``block_id`` has a new owner: a copy back into it not made yet is void
        (whoever restored it gave it up before any step read it)."""
        slot = self._ins.pop(block_id, None)
        if slot is not None:
            self._unpin(slot)

    def take_moves(self) -> KVMoves:
        """The pending copies, handed to the runner (and unpinned: the runner makes them before
        any later copy is recorded against those slots)."""
        moves = KVMoves(
            list(self._outs), list(self._outs.values()), list(self._ins.values()), list(self._ins)
        )
        self.num_stored += len(self._outs)
        self.num_restored += len(self._ins)
        self._outs.clear()
        self._ins.clear()
        self._pins.clear()
        return moves

    @property
    def has_moves(self) -> bool:
        return bool(self._outs or self._ins)

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one that no pending copy pins."""
        if self._free:
            return self._free.popleft()
        for block_hash, entry in self._entries.items():
            if not self._pins[entry.slot]:
                del self._entries[block_hash]
                return entry.slot
        return None

    def _unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]

    def check_integrity(self) -> None:
        """Raise AssertionError when the tier's views of its slots disagree."""
        used = [entry.slot for entry in self._entries.values()]
        slots = sorted(used + list(self._free))
        _require(slots == list(range(self.num_slots)), f"host slots lost or shared: {slots}")
        _require(len(self._entries) <= self.num_slots, "more host entries than slots")
        pending = Counter(self._outs.values()) + Counter(self._ins.values())
        _require(pending == +self._pins, f"pins {dict(self._pins)} != copies {dict(pending)}")
        _require(set(pending) <= set(used), "a pending copy reads or writes a free host slot")


def _require(condition: bool, message: str) -> None:
    # Explicit raise rather than assert: the check must also hold under python -O.
    if not condition:
        raise AssertionError(message)
