"""A step's LoRA rows: which rows of the flattened batch use which adapter slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_SLOT = -1  # a row of the base model


@dataclass
class LoraBatch:
    """Which rows of a step use which slot."""

    token_slots: torch.Tensor  # [T] int32 on the device, NO_SLOT for the base model's rows
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, its rows [n] int64; None: all rows)


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
    return LoraBatch(token_slots.to(device), groups)
