"""Per-forward state (attention metadata and backend, the step's LoRA rows) in a scoped context,
not loose globals.

The model runner enters ``forward_context(...)`` around each forward; attention layers read it with
``get_forward_context()``, LoRA projections with ``current_lora_batch()``. Layers therefore keep
the plain ``forward(positions, hidden)`` shape that CUDA-graph capture needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_core.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine_core.lora.batch import LoraBatch


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata  # layer group 0's (the only one of most models)
    backend: AttentionBackend
    lora: LoraBatch | None = None  # which rows use which adapter slot; None: no row does
    # Every layer group's metadata, group 0's first (engine_core/kv_groups.py): they share all
    # but the block tables and the slot mapping. Empty where the model has one group.
    group_metadata: Sequence[AttentionMetadata] = ()


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    meta: AttentionMetadata,
    backend: AttentionBackend,
    lora: LoraBatch | None = None,
    group_metadata: Sequence[AttentionMetadata] = (),
) -> Iterator[None]:
    global _current
    previous, _current = _current, ForwardContext(meta, backend, lora, group_metadata)
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current


def current_lora_batch() -> LoraBatch | None:
    """The step's LoRA rows; None outside a forward or where no row uses an adapter."""
    return None if _current is None else _current.lora
