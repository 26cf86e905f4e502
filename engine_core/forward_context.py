"""Per-forward state (attention metadata and backend, the step's LoRA rows) in a scoped context,
not loose globals.

The model runner enters ``forward_context(...)`` around each forward; attention layers read it with
``get_forward_context()``, LoRA projections with ``current_lora_batch()``. Layers therefore keep
the plain ``forward(positions, hidden)`` shape that CUDA-graph capture needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_core.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine_core.lora.batch import LoraBatch


@dataclass
class VerifyPosition:
    """Position j of a step's verify sequences (speculation: the last known token and its
    drafts), one recurrent step for all of them that have it: each reads the state after
    position j - 1 (the slot's own for j = 0) and writes the state after j to its own row, a
    draft row of the slot (``draft_row``) or, for the last position, the slot, so the state
    after any kept draft can become the slot's (state_snapshots.py KeptDraftState)."""

    token_rows: torch.Tensor  # [N] int64: each sequence's token row at position j
    read_rows: torch.Tensor  # [N] int64: the state rows holding the state before it
    write_rows: torch.Tensor  # [N] int64: the state rows the state after it goes to

    @staticmethod
    def plan(
        verify: list[tuple[int, int, int]],
        starts: Sequence[int],
        draft_row: Callable[[int, int], int],
        device: torch.device,
    ) -> list[VerifyPosition]:
        """``verify``: (sequence, slot, drafts) of each verify sequence."""

        def row(slot: int, drafts: int, j: int) -> int:  # the state after position j
            return slot if j == drafts else draft_row(slot, j)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        positions = []
        for j in range(max(drafts for _, _, drafts in verify) + 1):
            now = [(seq, slot, drafts) for seq, slot, drafts in verify if drafts >= j]
            positions.append(
                VerifyPosition(
                    tensor([starts[seq] + j for seq, _, _ in now]),
                    tensor([slot if j == 0 else row(slot, d, j - 1) for _, slot, d in now]),
                    tensor([row(slot, d, j) for _, slot, d in now]),
                )
            )
        return positions


@dataclass
class StateRows:
    """Linear-attention layers' view of a step (Qwen3-Next): each sequence's state slot,
    split once per step into the one-token sequences (decodes, run together), the verify
    sequences (speculation: one position at a time, every position's state kept) and the
    longer chunks (run one by one), and the slots to zero first (sequences whose chunk starts
    at position 0: a new, preempted or resumed request recomputes its state from nothing)."""

    decode_rows: torch.Tensor | None  # [N] int64: the token row of each one-token sequence
    decode_slots: torch.Tensor | None  # [N] int64: their slots
    chunk_slots: list[tuple[int, int]]  # (sequence, slot) of each longer chunk
    fresh_slots: torch.Tensor | None  # [F] int64
    # The longer chunks as one variable-length batch (the CUDA kernels' form): their token
    # rows [M], their slots [n] and cumulative lengths [n + 1], int64 on the device.
    chunk_rows: torch.Tensor | None = None
    chunk_slot_ids: torch.Tensor | None = None
    chunk_cu_seqlens: torch.Tensor | None = None
    verify: list[VerifyPosition] = field(default_factory=list)  # by position; empty: none

    @classmethod
    def plan(
        cls,
        slots: Sequence[int],
        fresh: Sequence[bool],
        starts: Sequence[int],
        device: torch.device,
        drafts: Sequence[int] = (),
        draft_row: Callable[[int, int], int] | None = None,
    ) -> StateRows:
        """``slots``, ``fresh`` and (with speculation) ``drafts`` per sequence; ``starts`` the
        step's query_start_loc; ``draft_row(slot, j)``: the state row after draft position j."""
        drafted = [(i, slots[i], d) for i, d in enumerate(drafts) if d]
        verifying = {i for i, _, _ in drafted}
        one = [i for i in range(len(slots)) if starts[i + 1] - starts[i] == 1]
        singles = set(one)

        def tensor(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.int64).to(device) if values else None

        chunks = [(i, slots[i]) for i in range(len(slots)) if i not in singles | verifying]
        lengths = [starts[i + 1] - starts[i] for i, _ in chunks]
        verify = []
        if drafted:
            assert draft_row is not None, "verify sequences need the draft rows' layout"
            verify = VerifyPosition.plan(drafted, starts, draft_row, device)
        return cls(
            tensor([starts[i] for i in one]),
            tensor([slots[i] for i in one]),
            chunks,
            tensor([s for s, new in zip(slots, fresh, strict=True) if new]),
            tensor([r for i, _ in chunks for r in range(starts[i], starts[i + 1])]),
            tensor([slot for _, slot in chunks]),
            tensor([0, *itertools.accumulate(lengths)]) if chunks else None,
            verify,
        )

    def zero_fresh(self, *states: torch.Tensor) -> None:
        """Zero the fresh sequences' slots in each of a layer's state tensors [slots, ...]."""
        if self.fresh_slots is not None:
            for state in states:
                state.index_fill_(0, self.fresh_slots, 0)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata  # layer group 0's (the only one of most models)
    backend: AttentionBackend
    lora: LoraBatch | None = None  # which rows use which adapter slot; None: no row does
    # Every layer group's metadata, group 0's first (engine_core/kv_groups.py): they share all
    # but the block tables and the slot mapping. Empty where the model has one group.
    group_metadata: Sequence[AttentionMetadata] = ()
    state: StateRows | None = None  # the linear-attention slots; None: the model has none
    # [T] int32: one past the last position each row attends to, where some rows see past
    # themselves (an image's tokens in Gemma 3, engine_core/multimodal.py); None: causal.
    key_ends: torch.Tensor | None = None


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    meta: AttentionMetadata,
    backend: AttentionBackend,
    lora: LoraBatch | None = None,
    group_metadata: Sequence[AttentionMetadata] = (),
    state: StateRows | None = None,
    key_ends: torch.Tensor | None = None,
) -> Iterator[None]:
    global _current
    context = ForwardContext(meta, backend, lora, group_metadata, state, key_ends)
    previous, _current = _current, context
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
