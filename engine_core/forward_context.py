"""Per-forward state (attention metadata and backend) in a scoped context, not loose globals.

The model runner enters ``forward_context(...)`` around each forward; attention layers read it with
``get_forward_context()``. Layers therefore keep the plain ``forward(positions, hidden)`` shape
that CUDA-graph capture needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine_core.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    backend: AttentionBackend


_current: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, backend: AttentionBackend) -> Iterator[None]:
    global _current
    previous, _current = _current, ForwardContext(meta, backend)
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current
