"""Layer groups of the KV cache: which layers share a block table, and how the tensors are laid out.

Layers are grouped by kind (full attention, a sliding window of W tokens, or chunked local
attention of chunk C, Llama 4's; linear-attention layers are the state kind, below). Every
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
    prefix cache asks only for the blocks from there."""

    window: int | None  # the layers' sliding window in tokens; None: full attention
    layers: tuple[int, ...] = ()  # model layer indices, in order; layer k uses cache pair k
    # Chunked local attention (Llama 4): a query at p sees [p // C * C, p]. None: not chunked.
    attention_chunk: int | None = None

    @property
    def gives_back(self) -> bool:
        """Whether blocks fall out of what its queries see as a request advances."""
        return self.window is not None or self.attention_chunk is not None

    def first_seen(self, position: int) -> int:
        """The first position a query at ``position`` attends to: itself and the window - 1
        tokens before it; the start of its attention chunk; 0 for full attention."""
        if self.attention_chunk is not None:
            return position - position % self.attention_chunk
        return 0 if self.window is None else max(0, position - self.window + 1)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens holds in this group at once,
        computed in chunks of at most ``chunk`` tokens: every block for full attention; for a
        window, those of the window behind a chunk's first token and of the chunk (plus one:
        neither need start on a block boundary); for an attention chunk of C the same with C
        in place of the window (a step's first token is at most C - 1 past its chunk's start)."""
        total = math.ceil(num_tokens / block_size)
        reach = self.window if self.attention_chunk is None else self.attention_chunk
        if reach is None:
            return total
        return min(total, math.ceil((reach - 1 + chunk) / block_size) + 1)


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

    @property
    def attention_chunks(self) -> tuple[int | None, ...]:
        """Each group's attention chunk (None: not chunked), beside ``windows``."""
        return tuple(group.attention_chunk for group in self.groups)

    @property
    def gives_back(self) -> bool:
        """Whether some group gives blocks back (the pool then keeps a null block)."""
        return any(group.gives_back for group in self.groups)

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, cache pair) of model layer ``layer``."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")


def group_layers(
    layer_windows: Sequence[int | None], layer_chunks: Sequence[int | None] = ()
) -> KVLayout:
    """Group layers by their window and attention chunk (see the module's docstring);
    ``layer_chunks`` empty: no layer is chunked."""
    if not layer_windows:
        raise ValueError("a model with no attention layer has no KV cache to group")
    chunks = list(layer_chunks) or [None] * len(layer_windows)
    kinds: dict[tuple[int | None, int | None], list[int]] = {}
    for layer, (window, chunk) in enumerate(zip(layer_windows, chunks, strict=True)):
        if window is not None and window <= 0:
            raise ValueError(f"layer {layer}: a sliding window must be positive, got {window}")
        if chunk is not None and (chunk <= 0 or window is not None):
            raise ValueError(
                f"layer {layer}: an attention chunk must be positive and without a sliding "
                f"window, got chunk {chunk}, window {window}"
            )
        kinds.setdefault((window, chunk), []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    # Full attention first, then the windows smallest first, then the chunks smallest first.
    order = sorted(kinds, key=lambda k: (k[1] is not None, k[0] is not None, k[0] or 0, k[1] or 0))
    groups = tuple(
        KVGroup(window, tuple(kinds[window, chunk][i : i + size]), chunk)
        for window, chunk in order
        for i in range(0, len(kinds[window, chunk]), size)
    )
    return KVLayout(groups, size)


def blocks_for_tokens(
    windows: Sequence[int | None],
    num_tokens: int,
    block_size: int,
    chunk: int,
    attention_chunks: Sequence[int | None] = (),
) -> int:
    """The most blocks one sequence of ``num_tokens`` tokens holds at once over groups of these
    windows (and attention chunks; empty: none), computed in chunks of at most ``chunk`` tokens
    (``KVGroup.peak_blocks``)."""
    kinds = zip(windows, list(attention_chunks) or [None] * len(windows), strict=True)
    return sum(KVGroup(w, (), c).peak_blocks(num_tokens, block_size, chunk) for w, c in kinds)


def model_kv_layout(config: ModelConfig) -> KVLayout:
    """The layer groups of a model: its attention layers' windows and attention chunks as the
    config gives them (the attention layers take theirs from ``layer_sliding_window`` and
    ``layer_attention_chunk`` too; the runner checks they agree), and its linear-attention
    layers as the state kind."""
    attention = config.attention_layer_ids
    layout = group_layers(
        [config.layer_sliding_window(i) for i in attention],
        [config.layer_attention_chunk(i) for i in attention],
    )
    state_layers = tuple(i for i in range(config.num_layers) if i not in attention)
    return dataclasses.replace(layout, state_layers=state_layers) if state_layers else layout


def stage_kv_layout(config: ModelConfig, layers: range) -> KVLayout:
    """The layout of the layers one pipeline stage caches (``layers``; every layer without
    stages): the model's one group, the same windows (so the scheduler's block tables mean the
    same on every stage), over the stage's layers only, its cache pairs those layers in order.
    A stage of a model with several groups or a state kind: ValueError (refused before any
    rank starts, engine_core/parallel.py check_pipeline_parallel)."""
    layout = model_kv_layout(config)
    if len(layers) == config.num_layers:
        return layout
    if len(layout.groups) != 1 or layout.state_layers:
        raise ValueError("only a model whose layers form one KV group splits into stages")
    return KVLayout((dataclasses.replace(layout.groups[0], layers=tuple(layers)),), len(layers))


def pool_blocks_for_one_sequence(
    layout: KVLayout, num_tokens: int, block_size: int, chunk: int
) -> int:
    """The pool a sequence of ``num_tokens`` tokens needs at its peak: its blocks over every
    group, and the null block where a group gives blocks back (block_manager.py)."""
    blocks = blocks_for_tokens(
        layout.windows, num_tokens, block_size, chunk, layout.attention_chunks
    )
    return blocks + int(layout.gives_back)
