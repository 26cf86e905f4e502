"""The work list of the Triton prefill kernel: one (sequence, query tile) pair per program row.

The kernel's grid is (tiles, heads). A step's sequence i owns ``ceil(query_len_i / BLOCK_M)``
tiles of BLOCK_M query rows; listing them flat makes the grid as large as the step's real work,
whatever mix of long prompts and one-token decodes it has (a (sequences, heads, longest query's
tiles) grid launched a program for every sequence times the longest query's tiles, nearly all of
them empty in a step with one prompt among many decodes). A CUDA graph fixes the list's length
at capture, ``capacity(tokens, sequences)``; the rows past the step's tiles name sequence -1 and
do nothing. The engine packs a step's list with its other inputs (engine_core/input_batch.py: no
copy of its own) and a graph copies it on the device. No triton import here.
"""

from __future__ import annotations

import numpy as np
import torch

NO_SEQUENCE = -1


def prefill_block_m(num_tokens: int) -> int:
    """Query rows per tile for a step of ``num_tokens`` new tokens: 16 up to 16 tokens, else 64.

    It depends on the step's token count (not its longest query) so that a CUDA graph captured
    for the next bucket of tokens (16, 32, ...) has the same tile height as the step it runs:
    the engine packs the step's work list once (engine_core/input_batch.py) for both."""
    return 64 if num_tokens > 16 else 16


def capacity(tokens: int, sequences: int, block_m: int) -> int:
    """The most tiles a step of ``tokens`` new tokens over ``sequences`` sequences can have:
    each sequence's last tile may be partial."""
    return -(-tokens // block_m) + min(sequences, tokens)


def tile_list(query_lens: list[int], block_m: int, rows: int | None = None) -> np.ndarray:
    """[rows, 2] int32: (sequence, tile within it) for every tile, then (-1, 0) up to ``rows``
    (default: no padding)."""
    lens = np.asarray(query_lens, dtype=np.int64)
    counts = (lens + block_m - 1) // block_m
    total = int(counts.sum())
    rows = total if rows is None else rows
    if rows < total:
        raise ValueError(f"{total} prefill tiles do not fit a list of {rows}")
    out = np.zeros((rows, 2), dtype=np.int32)
    out[total:, 0] = NO_SEQUENCE
    seq = np.repeat(np.arange(len(lens), dtype=np.int32), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    out[:total, 0] = seq
    out[:total, 1] = np.arange(total) - first
    return out


def query_lens(query_start_loc: list[int]) -> list[int]:
    return [b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)]


def device_tiles(
    query_start_loc: list[int], device: torch.device, block_m: int | None = None
) -> torch.Tensor:
    """The work list of a step given by its host query starts, copied to the device; for a
    caller without the engine's packed list (a kernel test). The copy from pageable memory
    waits for the device's queued work: the engine never takes this path."""
    block_m = block_m or prefill_block_m(query_start_loc[-1])
    tiles = tile_list(query_lens(query_start_loc), block_m)
    return torch.from_numpy(tiles).to(device)
