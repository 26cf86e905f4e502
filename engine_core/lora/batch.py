"""A step's LoRA rows: which rows of the flattened batch use which adapter slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_SLOT = -1  # a row of the base model


@dataclass
class LoraSegments:
    """The rows that use an adapter as segments of contiguous rows of one slot (a request's
    rows, neighbours of the same slot merged), for the segment kernels (triton_lora.py)."""

    starts: torch.Tensor  # [N] int32 on the device: each segment's first row
    lengths: torch.Tensor  # [N] int32
    slots: torch.Tensor  # [N] int32
    count: int  # N
    max_rows: int  # the longest segment's rows (the kernels' grid)


@dataclass
class LoraBatch:
    """Which rows of a step use which slot."""

    token_slots: torch.Tensor  # [T] int32 on the device, NO_SLOT for the base model's rows
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, its rows [n] int64; None: all rows)
    segments: LoraSegments


def lora_batch(row_slots: list[tuple[int, int]], device: torch.device) -> LoraBatch | None:
    """The batch of a step whose requests, in row order, take ``(rows, slot)`` each; None
    where no row uses an adapter (the projections then add nothing)."""
    slots: list[int] = []
    for rows, slot in row_slots:
        slots += [slot] * rows
    used = sorted({slot for _, slot in row_slots if slot != NO_SLOT})
    if not used:
        return None
    token_slots = torch.tensor(slots, dtype=torch.int32)
    groups: list[tuple[int, torch.Tensor | None]] = []
    for slot in used:
        rows = (token_slots == slot).nonzero().flatten()
        whole = len(used) == 1 and rows.numel() == len(slots)
        groups.append((slot, None if whole else rows.to(device)))
    return LoraBatch(token_slots.to(device), groups, lora_segments(row_slots, device))


def lora_segments(row_slots: list[tuple[int, int]], device: torch.device) -> LoraSegments:
    """The runs of rows of one slot, in row order (rows of the base model in none)."""
    starts: list[int] = []
    lengths: list[int] = []
    slots: list[int] = []
    row = 0
    for rows, slot in row_slots:
        if slot != NO_SLOT and slots and slots[-1] == slot and starts[-1] + lengths[-1] == row:
            lengths[-1] += rows
        elif slot != NO_SLOT and rows:
            starts.append(row)
            lengths.append(rows)
            slots.append(slot)
        row += rows
    table = torch.tensor([starts, lengths, slots], dtype=torch.int32).to(device)  # one copy
    return LoraSegments(table[0], table[1], table[2], len(starts), max(lengths, default=0))
