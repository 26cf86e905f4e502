"""A step's LoRA rows: which rows of the flattened batch use which adapter slot.

Two forms of the same thing. The torch reference (the CPU's) groups the rows by slot
(``groups``). The kernels (triton_lora.py) read a tile table: each slot's rows cut into tiles of
``TILE_ROWS`` rows, the last one padded with -1, and each tile's slot (``NO_SLOT`` for a tile
that is not used). A tile never mixes slots, so a program reads one slot's A or B tile once for
up to ``TILE_ROWS`` rows, and rows of the base model are in no tile.

The table's size is the only thing the kernels' launch grid reads, and it depends on the rows a
step may have and the number of slots, never on which slot each row takes: a CUDA graph captured
for a batch size reads a table of ``tile_capacity(rows, slots)`` tiles from a static buffer,
which each replay overwrites (cuda_graph.py), so one graph serves any mix of adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

NO_SLOT = -1  # a row of the base model; a tile no row uses
TILE_ROWS = 16  # rows of one slot per kernel program


def tile_capacity(rows: int, num_slots: int) -> int:
    """The most tiles a step of ``rows`` rows over ``num_slots`` slots can need (each slot's
    rows fill whole tiles but its last), as a table holds them (``table_tiles``)."""
    return table_tiles(-(-rows // TILE_ROWS) + num_slots)


def table_tiles(tiles: int) -> int:
    """``tiles`` rounded up to a multiple of 4: the tiles' rows then start 16 bytes into the
    table, as their slots do, whatever the step (Triton specializes a kernel on its pointers'
    alignment: a step whose table broke it would compile another variant mid-serving)."""
    return -(-tiles // 4) * 4


@dataclass
class LoraTiles:
    """The kernels' form of a step's LoRA rows: M tiles of ``TILE_ROWS`` rows of one slot."""

    slots: torch.Tensor  # [M] int32, NO_SLOT for a tile no row uses
    rows: torch.Tensor  # [M * TILE_ROWS] int32, -1 past its slot's last row
    # The table the two are views of: the slots of its capacity's tiles, then their rows; a
    # graph's replay copies a step's table into its static one whole.
    table: torch.Tensor

    @property
    def count(self) -> int:  # M: the kernels' grid
        return self.slots.shape[0]


def tiles_of(table: torch.Tensor, tiles: int) -> LoraTiles:
    """The first ``tiles`` tiles of ``table`` (laid out for ``capacity`` tiles: their slots,
    then their rows)."""
    capacity = table.shape[0] // (1 + TILE_ROWS)
    return LoraTiles(table[:tiles], table[capacity : capacity + tiles * TILE_ROWS], table)


@dataclass
class LoraBatch:
    """Which rows of a step use which slot."""

    tiles: LoraTiles
    # [T] int32 on the device, NO_SLOT for the base model's rows: what the MoE experts' LoRA
    # reads (in a captured graph: its static buffer, which each replay writes).
    token_slots: torch.Tensor | None
    row_slots: list[tuple[int, int]] | None  # (rows, slot) per request; None in a graph

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """The torch reference's form: (slot, its rows [n] int64; None: all rows) per slot."""
        if self.row_slots is None or self.token_slots is None:
            raise RuntimeError("a captured graph's LoRA rows have no torch form")
        per_row = _per_row(self.row_slots)
        used = sorted({slot for _, slot in self.row_slots if slot != NO_SLOT})
        device = self.token_slots.device
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in used:
            rows = np.flatnonzero(per_row == slot)
            whole = len(used) == 1 and rows.size == per_row.size
            groups.append((slot, None if whole else torch.from_numpy(rows).to(device)))
        return groups


def _per_row(row_slots: list[tuple[int, int]]) -> np.ndarray:
    """[T] int32: the slot of each row."""
    counts = np.array([rows for rows, _ in row_slots], dtype=np.int64)
    slots = np.array([slot for _, slot in row_slots], dtype=np.int32)
    return np.repeat(slots, counts)


def lora_batch(
    row_slots: list[tuple[int, int]], device: torch.device, min_tiles: int = 0
) -> LoraBatch | None:
    """The batch of a step whose requests, in row order, take ``(rows, slot)`` each; None
    where no row uses an adapter (the projections then add nothing). The tile table has at
    least ``min_tiles`` tiles (a graph's static table: ``tile_capacity`` of its rows)."""
    per_row = _per_row(row_slots)
    used = np.unique(per_row[per_row != NO_SLOT])
    if not used.size:
        return None
    slots, rows = _cut_into_tiles(per_row, used.tolist())
    count = table_tiles(max(slots.size, min_tiles))
    size = count * (1 + TILE_ROWS)
    host = np.full(size + per_row.size, NO_SLOT, dtype=np.int32)
    host[: slots.size] = slots  # the table first (aligned): the tiles' slots, then their rows
    host[count : count + rows.size] = rows
    host[size:] = per_row
    both = _to_device(torch.from_numpy(host), device)  # one copy
    return LoraBatch(tiles_of(both[:size], count), both[size:], row_slots)


def _cut_into_tiles(per_row: np.ndarray, used: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(each tile's slot [M], each tile's rows [M * TILE_ROWS]) for the rows of each slot in
    ``used``, a slot's last tile padded with -1."""
    tile_slots: list[np.ndarray] = []
    tile_rows: list[np.ndarray] = []
    for slot in used:
        rows = np.flatnonzero(per_row == slot).astype(np.int32)
        tiles = -(-rows.size // TILE_ROWS)
        tile_slots.append(np.full(tiles, slot, dtype=np.int32))
        tile_rows.append(np.pad(rows, (0, tiles * TILE_ROWS - rows.size), constant_values=-1))
    return np.concatenate(tile_slots), np.concatenate(tile_rows)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One copy that does not wait for the work queued on the device (pinned on CUDA: the
    next step's inputs are prepared while the current one runs)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
