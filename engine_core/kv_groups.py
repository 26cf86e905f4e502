"""Layer groups of the KV cache: which layers share a block table, and how the tensors are laid out.

Layers are grouped by kind (today: full attention, or a sliding window of W tokens; a chunked
local-attention group of chunk C or a linear-attention state group would be further kinds). Every
group has the same number of layers (``group_size``), so the cache is ``group_size`` K/V tensor
pairs of ``num_blocks`` blocks each, and layer j of every group uses pair j: one block id names
memory in one layer of each group, and a block held by a group costs that group's layers only. A
window group can therefore give a block back to the shared pool and another group (or request)
reuses the very bytes. The grouping follows vLLM's hybrid allocator (``kv_cache_utils``): the
group size is the fewest layers of any kind (all of the most numerous kind when the counts are
within 25%), and each kind is cut into groups of that size in layer order; a kind whose count is
not a multiple pads its last group (those pairs go unused for its blocks).

A model with one kind is one group of all its layers: the cache is laid out as it always was.

Linear-attention layers (Qwen3-Next's gated DeltaNet) are a state kind: they hold no blocks but a
fixed-size state per request (``KVLayout.state_layers``), in one state slot per running request
that the block manager hands out and takes back; the groups above are then over the model's
attention layers only, ``KVGroup.layers`` counting those (the runner's ``attention_layers()``).
docs/design/kv-layer-groups.md gives the reasons.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine_core.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per request. Its kind decides which positions a
    query sees (``first_seen``); the block manager gives back the blocks before that and the
    prefix cache asks only for the blocks from there. A chunked local-attention kind (chunk C)
    changes ``first_seen`` to ``position // C * C`` and ``peak_blocks`` to match."""

    window: int | None  # the layers' sliding window in tokens; None: full attention
    layers: tuple[int, ...] = ()  # model layer indices, in order; layer k uses cache pair k

    @property
    def gives_back(self) -> bool:
        """Whether blocks fall out of what its queries see as a request advances."""
        return self.window is not None

    def first_seen(self, position: int) -> int:
        """The first position a query at ``position`` attends to (itself and the window - 1
        tokens before it; 0 for full attention)."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens holds in this group at once,
        computed in chunks of at most ``chunk`` tokens: every block for full attention; for a
        window, those of the window behind a chunk's first token and of the chunk (plus one:
        neither need start on a block boundary)."""
        total = math.ceil(num_tokens / block_size)
        if self.window is None:
            return total
        return min(total, math.ceil((self.window - 1 + chunk) / block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    """The model's layer groups and the cache pairs they share."""

    groups: tuple[KVGroup, ...]  # full-attention groups first: group 0 is the plan's main table
    group_size: int  # K/V tensor pairs in the cache; a block id costs this many layers
    # The state kind: model layer indices of the linear-attention layers, each holding one state
    # slot's tensors per running request instead of blocks; empty for most models.
    state_layers: tuple[int, ...] = ()

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, cache pair) of model layer ``layer``."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")


def group_layers(layer_windows: Sequence[int | None]) -> KVLayout:
    """Group layers by their window (see the module's docstring)."""
    if not layer_windows:
        raise ValueError("a model with no attention layer has no KV cache to group")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window <= 0:
            raise ValueError(f"layer {layer}: a sliding window must be positive, got {window}")
        kinds.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    # Full attention first (None sorts before any window), then the windows smallest first.
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = tuple(
        KVGroup(window, tuple(kinds[window][i : i + size]))
        for window in order
        for i in range(0, len(kinds[window]), size)
    )
    return KVLayout(groups, size)


def blocks_for_tokens(
    windows: Sequence[int | None], num_tokens: int, block_size: int, chunk: int
) -> int:
    """The most blocks one sequence of ``num_tokens`` tokens holds at once over groups of these
    windows, computed in chunks of at most ``chunk`` tokens (``KVGroup.peak_blocks``)."""
    return sum(KVGroup(w).peak_blocks(num_tokens, block_size, chunk) for w in windows)


def model_kv_layout(config: ModelConfig) -> KVLayout:
    """The layer groups of a model: its attention layers' windows as the config gives them (the
    attention layers take theirs from ``layer_sliding_window`` too; the runner checks they
    agree), and its linear-attention layers as the state kind."""
    attention = config.attention_layer_ids
    layout = group_layers([config.layer_sliding_window(i) for i in attention])
    state_layers = tuple(i for i in range(config.num_layers) if i not in attention)
    return dataclasses.replace(layout, state_layers=state_layers) if state_layers else layout


def pool_blocks_for_one_sequence(
    layout: KVLayout, num_tokens: int, block_size: int, chunk: int
) -> int:
    """The pool a sequence of ``num_tokens`` tokens needs at its peak: its blocks over every
    group, and the null block where a group has a window (block_manager.py)."""
    has_window = any(w is not None for w in layout.windows)
    return blocks_for_tokens(layout.windows, num_tokens, block_size, chunk) + int(has_window)
