"""Saved linear-attention states for prefix-cache hits (Qwen3-Next): the snapshot pool's books.

A gated DeltaNet layer's state after token n is a function of every token before it, so a
prefix hit of n tokens on such a model needs that state, saved when some earlier request was
at exactly token n. A snapshot is a copy of one state slot (every linear-attention layer's
convolution inputs and recurrent matrix) kept under the chain hash of the block it ends
(block_manager.py ``hash_block``): the prefix it names is the whole prompt up to that block's
end, the same key the attention layers' cached blocks use.

The pool has a fixed number of snapshots (``--state-snapshots``), each either free or cached
(registered under one hash), evicted least recently used first when a save needs one. A save
registers its snapshot at once and a hit only moves it to the back of the LRU order: no
snapshot is ever held by a request. That is safe because every copy runs on the engine's one
stream in the order the plans were made (``take_copies``): a snapshot evicted and overwritten
by a later save is read by an earlier restore before the overwrite lands, as a freed KV block
is (``Scheduler._finish``).

Saves made during decode (a request's answer, block_manager.py ``_save_state``) take free
snapshots while there are any; in a full pool they evict the least recently used only while
they hold less than half of it (``max_decode``), and past that the oldest decode save: a batch
of long answers never pushes the prompts' states, which many requests share, below the other
half.

The block manager owns this pool (it decides hits and saves); the runner owns the tensors,
where snapshot i is state row ``runner.snapshot_row(i)``, and makes each plan's copies before
the plan's forward. docs/design/qwen3-next.md says why states are saved where they are.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StateCopy:
    """One copy between a request's state slot and a snapshot, made before a step's forward:
    ``save`` copies the slot into the snapshot, else the snapshot into the slot."""

    slot: int
    snapshot: int
    save: bool


@dataclass(frozen=True)
class KeptDraftState:
    """After a verify step that kept ``position`` drafts of a request's K, fewer than all: the
    state after that position (the slot's draft row ``position``, where the step wrote it)
    copied into the slot, before the next step's forward reads it or a save copies it."""

    slot: int
    position: int


StateMove = StateCopy | KeptDraftState


@dataclass
class _Entry:
    block_hash: int
    parent_hash: int
    key: tuple[Any, ...]  # the block's tokens (and image hashes), compared on a hit


# The share of the pool that decode-time saves may hold (the rest is the prompts' at least).
DECODE_SHARE = 0.5


class StateSnapshots:
    """A bounded LRU pool of saved states keyed by the chain hash of the block each ends."""

    def __init__(self, num_snapshots: int) -> None:
        if num_snapshots <= 0:
            raise ValueError(f"a snapshot pool needs at least one snapshot, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self.max_decode = max(1, int(num_snapshots * DECODE_SHARE))
        self._decode: set[int] = set()  # cached snapshots that decode saves took
        self._free: deque[int] = deque(range(num_snapshots))
        self._cached: OrderedDict[int, _Entry] = OrderedDict()  # snapshot -> key, oldest first
        self._by_hash: dict[int, int] = {}  # chain hash -> snapshot
        self._copies: list[StateCopy] = []  # for the next plan, in the order they were asked
        self.num_saved = self.num_restored = self.num_evicted = 0

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def find(self, block_hash: int, parent_hash: int, key: tuple[Any, ...]) -> int | None:
        """The snapshot saved at the end of the block with this hash, or None (also where the
        hash collides with another prefix's: its parent and tokens are compared)."""
        snapshot = self._by_hash.get(block_hash)
        if snapshot is None:
            return None
        entry = self._cached[snapshot]
        if entry.parent_hash != parent_hash or entry.key != key:
            return None
        return snapshot

    @property
    def num_decode(self) -> int:
        """Cached snapshots that decode saves took."""
        return len(self._decode)

    def save(
        self,
        slot: int,
        block_hash: int,
        parent_hash: int,
        key: tuple[Any, ...],
        decode: bool = False,
    ) -> bool:
        """Keep the state that ``slot`` will hold when the next step starts under this block's
        hash; a state already kept there is only refreshed (the same prefix, the same state),
        and counts as a prompt's from now on where a prompt's save refreshes it. ``decode``: a
        save made during decode, which takes a free snapshot if there is one, else, where decode
        saves hold ``max_decode`` already, the oldest decode save's (never a prompt's). True
        where a new snapshot was taken, False where one was refreshed."""
        known = self._by_hash.get(block_hash)
        if known is not None:
            self._cached.move_to_end(known)
            if not decode:
                self._decode.discard(known)
            return False
        if self._free:
            snapshot = self._free.popleft()
        elif decode and len(self._decode) >= self.max_decode:
            snapshot = self._evict(next(s for s in self._cached if s in self._decode))
        else:
            snapshot = self._evict(next(iter(self._cached)))
        self._cached[snapshot] = _Entry(block_hash, parent_hash, key)
        self._by_hash[block_hash] = snapshot
        if decode:
            self._decode.add(snapshot)
        self._copies.append(StateCopy(slot, snapshot, save=True))
        self.num_saved += 1
        return True

    def demote(self, block_hash: int) -> None:
        """Make the snapshot kept under this hash (if still kept) the next one evicted: still
        found by a hit until a save needs its place, never before any other cached one."""
        snapshot = self._by_hash.get(block_hash)
        if snapshot is not None:
            self._cached.move_to_end(snapshot, last=False)

    def restore(self, snapshot: int, slot: int) -> None:
        """Copy ``snapshot`` into ``slot`` before the next step, and mark it recently used."""
        self._cached.move_to_end(snapshot)
        self._copies.append(StateCopy(slot, snapshot, save=False))
        self.num_restored += 1

    def take_copies(self) -> tuple[StateCopy, ...]:
        """The copies the next plan's forward makes first, in order, handed over once."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def _evict(self, snapshot: int) -> int:
        entry = self._cached.pop(snapshot)
        del self._by_hash[entry.block_hash]
        self._decode.discard(snapshot)
        self.num_evicted += 1
        return snapshot

    def check_integrity(self) -> None:
        """Raise AssertionError unless every snapshot is free or cached under exactly one hash."""
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free) or free & cached:
            raise AssertionError(f"snapshots both free and cached: {sorted(free & cached)}")
        lost = set(range(self.num_snapshots)) - free - cached
        if lost:
            raise AssertionError(f"snapshots neither free nor cached: {sorted(lost)}")
        mapped = {entry.block_hash: snapshot for snapshot, entry in self._cached.items()}
        if mapped != self._by_hash:
            raise AssertionError("the snapshot hash map disagrees with the cached snapshots")
        if not self._decode <= cached:
            raise AssertionError(f"decode saves not cached: {sorted(self._decode - cached)}")


def independent_runs(moves: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``moves`` (source row, destination row), in order, cut into the fewest consecutive runs
    that may each be made as one gather of every source, then one scatter: none in a run reads
    a row an earlier one in it wrote (a save, then a restore of the same snapshot), nor writes
    one twice (a scatter's order among equal rows is undefined on CUDA)."""
    runs: list[list[tuple[int, int]]] = []
    written: set[int] = set()
    for src, dst in moves:
        if not runs or src in written or dst in written:
            runs.append([])
            written = set()
        runs[-1].append((src, dst))
        written.add(dst)
    return runs
