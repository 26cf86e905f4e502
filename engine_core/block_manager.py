"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and the prefix cache.

This is the one owner of block state: the free list, the reference counts, the prefix hash map
and the per-request block tables. The scheduler asks it for room (an opaque yes/no) and the model
runner reads block tables; neither touches the structures below.

Every block is in exactly one of three states:

- free: reference count 0, no hash; handed out first.
- cached: reference count 0 but registered in the prefix hash map, so a later request with the
  same prefix can take it back; kept in LRU order and evicted (hash dropped) only when no free
  block is left.
- used: reference count > 0 (appears in that many block tables).

Prefix caching hashes full blocks as a chain, ``h_i = hash_block(h_{i-1}, tokens of block i)``,
so a block's hash names the whole prefix up to its end. A block that holds any of an image's
placeholder tokens hashes the image's hash with its tokens (``block_key``; vLLM's "extra keys"):
the placeholders are the same token whatever the image, so without it two prompts with different
images would share the blocks after the first image.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_core.request import Request

ROOT_HASH = 0  # the parent hash of a request's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: the whole prefix up to the block's end is in it."""
    return hash((parent_hash, token_ids))


def block_key(request: Request, index: int, tokens: tuple[Any, ...]) -> tuple[Any, ...]:
    """What block ``index`` of ``request`` is keyed by: its tokens, then the hash of each image
    whose placeholders it holds (bytes, so never equal to a token)."""
    size = len(tokens)
    lo, hi = index * size, (index + 1) * size
    images = [i.hash for i in request.images if i.offset < hi and i.offset + i.length > lo]
    return tokens + tuple(images) if images else tokens


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix hash map
    # What the hash was computed from, compared on a hit so a collision is never a false hit.
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()

    def reset_hash(self) -> None:
        self.hash, self.parent_hash, self.token_ids = None, ROOT_HASH, ()


class BlockManager:
    """Reference-counted KV blocks with block tables per request and an LRU prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self._hash_to_block: dict[int, int] = {}
        # Block tables as int32 arrays, not lists: the scheduler copies each running request's
        # table every step and the runner flattens them all, both a memcpy for an array but a
        # per-element conversion for a list (thousands of ids a step at a large batch).
        self._tables: dict[str, array[int]] = {}
        # Chain hashes of the request's leading full blocks that are already accounted for.
        self._chain: dict[str, list[int]] = {}

    # ----------------------------------------------------------------------------- counters

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with no user that still hold a prefix (evictable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds no blocks)."""
        return self._tables.get(request_id, _EMPTY_TABLE).tolist()

    def table_covering(self, request: Request, num_new_tokens: int) -> array[int] | None:
        """A copy of the request's block table once it covers ``num_computed_tokens +
        num_new_tokens`` tokens: as it is in the common decode step (the last block still has
        room), grown by ``allocate_slots`` where it must be (every block_size-th step); None,
        changing nothing, where free plus evictable blocks are too few. One call where the
        scheduler's hot loop would make two (``allocate_slots``, then ``block_table``)."""
        table = self._tables.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if table is not None:
            room = len(table) * self.block_size
            if num_tokens <= room:
                return table[:]
            if num_tokens <= room + self.block_size and (self._free or self._cached):
                # The decode step after its last block filled: one more block, as
                # allocate_slots would take it, without its general case's bookkeeping.
                table.append(self._take_new())
                return table[:]
        if not self.allocate_slots(request, num_new_tokens):
            return None
        return self._tables[request.request_id][:]

    def block_table(self, request_id: str) -> array[int]:
        """A copy of the request's block table as an int32 array (what a step's plan carries)."""
        return self._tables.get(request_id, _EMPTY_TABLE)[:]

    # --------------------------------------------------------------------------- allocation

    def allocate_prefix(self, request: Request, use_cache: bool = True) -> int:
        """Give a request with no blocks the cached blocks of its longest cached prefix.

        Returns how many of its tokens are already computed (a multiple of block_size). At most
        ``(num_tokens - 1) // block_size`` blocks are reused, so at least the last token is
        recomputed and yields logits to sample from. ``use_cache=False``: no hit, an empty table
        (a request that needs every prompt position's logits).
        """
        rid = request.request_id
        if self._tables.get(rid):
            raise ValueError(f"request {rid!r} already holds blocks")
        table = _new_table()
        chain: list[int] = []
        self._tables[rid], self._chain[rid] = table, chain
        if not self.enable_prefix_caching or not use_cache:
            return 0
        parent = ROOT_HASH
        max_hits = (request.num_tokens - 1) // self.block_size
        for index, tokens in enumerate(self._full_blocks(request.token_ids, max_hits)):
            if request.images:
                tokens = block_key(request, index, tokens)
            block_hash = hash_block(parent, tokens)
            block = self._lookup(block_hash, parent, tokens)
            if block is None:
                break
            self._take_cached(block)
            table.append(block.block_id)
            chain.append(block_hash)
            parent = block_hash
        return len(table) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table to cover ``num_computed_tokens + num_new_tokens`` tokens.

        Returns False, changing nothing, when free plus evictable blocks are too few.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if table is not None and num_tokens <= len(table) * self.block_size:
            return True  # the common decode step: the last block still has room
        if table is None:
            table = _new_table()
        num_needed = -(-num_tokens // self.block_size) - len(table)
        if num_needed > len(self._free) + len(self._cached):
            return False
        if rid not in self._tables:
            self._tables[rid], self._chain[rid] = table, []
        for _ in range(num_needed):
            table.append(self._take_new())
        return True

    def cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks that became full of computed tokens, so others can share them."""
        if not self.enable_prefix_caching:
            return
        chain = self._chain[request.request_id]
        num_full = min(num_computed_tokens, len(request.token_ids)) // self.block_size
        if num_full <= len(chain):
            return  # most steps: no block became full
        table = self._tables[request.request_id]
        token_ids, size = request.token_ids, self.block_size
        parent = chain[-1] if chain else ROOT_HASH
        # Block by block, slicing each from the token list: a decode step fills one block, and
        # building the list of the full blocks first cost that common case twice as much.
        for index in range(len(chain), num_full):
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            if request.images:
                tokens = block_key(request, index, tokens)
            block_hash = hash_block(parent, tokens)
            self._register(self._blocks[table[index]], block_hash, parent, tokens)
            chain.append(block_hash)
            parent = block_hash

    def free(self, request_id: str) -> None:
        """Release all the request's blocks; unknown ids are ignored.

        Blocks are released tail first, so the tail of a prefix is the first to be evicted and
        the shared head of a prefix stays longest.
        """
        table = self._tables.pop(request_id, _EMPTY_TABLE)
        self._chain.pop(request_id, None)
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is None:
                self._free.append(block_id)
            else:
                self._cached[block_id] = None

    # ------------------------------------------------------------------------------ helpers

    def _full_blocks(self, token_ids: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        size = self.block_size
        count = min(limit, len(token_ids) // size)
        return [tuple(token_ids[i * size : (i + 1) * size]) for i in range(count)]

    def _lookup(self, block_hash: int, parent: int, tokens: tuple[int, ...]) -> _Block | None:
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.parent_hash != parent or block.token_ids != tokens:
            return None  # a hash collision: not the same prefix
        return block

    def _take_cached(self, block: _Block) -> None:
        if block.ref_count == 0:
            del self._cached[block.block_id]  # revived: no longer evictable
        block.ref_count += 1

    def _take_new(self) -> int:
        """A block for new tokens: a free one if any, else evict the least recently used."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)
            block = self._blocks[block_id]
            del self._hash_to_block[block.hash]
            block.reset_hash()
        self._blocks[block_id].ref_count = 1
        return block_id

    def _register(
        self, block: _Block, block_hash: int, parent: int, tokens: tuple[int, ...]
    ) -> None:
        # When the hash is taken (the same prefix computed twice at once, or a collision) the
        # first block keeps it; this one stays unhashed and goes to the free list when released.
        if block.hash is not None or block_hash in self._hash_to_block:
            return
        block.hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
        self._hash_to_block[block_hash] = block.block_id

    # ---------------------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError when any two views of the block state disagree."""
        refs = Counter(b for table in self._tables.values() for b in table)
        free, cached = set(self._free), set(self._cached)
        _require(len(free) == len(self._free), "duplicate block in the free list")
        _require(not free & cached, f"blocks both free and cached: {sorted(free & cached)}")
        for table in self._tables.values():
            _require(len(set(table)) == len(table), f"block twice in one table: {table}")
        for request_id, chain in self._chain.items():
            _require(len(chain) <= len(self._tables[request_id]), f"chain too long: {request_id}")
        for block in self._blocks:
            self._check_block(block, refs[block.block_id], free, cached)
        for block_hash, block_id in self._hash_to_block.items():
            _require(self._blocks[block_id].hash == block_hash, f"stale hash entry {block_id}")
        used = sum(1 for b in self._blocks if b.ref_count > 0)
        _require(
            len(free) + len(cached) + used == self.num_blocks,
            f"free {len(free)} + cached {len(cached)} + used {used} != {self.num_blocks}",
        )

    def _check_block(self, block: _Block, refs: int, free: set[int], cached: set[int]) -> None:
        bid = block.block_id
        _require(block.ref_count == refs, f"block {bid}: ref {block.ref_count}, in {refs} tables")
        if block.hash is not None:
            _require(self._hash_to_block.get(block.hash) == bid, f"block {bid}: hash not mapped")
        if bid in free:
            _require(block.ref_count == 0 and block.hash is None, f"free block {bid} in use")
        elif bid in cached:
            _require(block.ref_count == 0 and block.hash is not None, f"cached block {bid} bad")
        else:
            _require(block.ref_count > 0, f"block {bid} leaked: unused yet neither free nor cached")


_EMPTY_TABLE: array[int] = array("i")  # never mutated: the default of lookups


def _new_table() -> array[int]:
    return array("i")


def _require(condition: bool, message: str) -> None:
    # Explicit raise rather than assert: the check must also hold under python -O.
    if not condition:
        raise AssertionError(message)
