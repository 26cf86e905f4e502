"""The Triton side of the one-shot peer all-reduce (engine_core/peer_all_reduce.py).

Importing this module imports triton: only CUDA code paths may do so.

``peer_sum`` is the protocol, shared by the plain all-reduce kernel here and by the RMSNorm
kernel that sums its input rows over the ranks first (models/triton_ops.py). Each program owns a
fixed slot of the symmetric buffer's data area, the same bytes on every rank. Program p of every
rank stores its values in its slot of its own buffer, tells program p of every other rank so (a
flag written into that rank's signal slots over NVLink), waits for their flags, then sums the
slot of every rank, in rank order, so that every rank gets the same bits. Only programs with the
same index meet, and every program of a launch is resident at once (the callers cap their
number), so no program waits for one that cannot run.

No closing barrier: each program alternates between two halves of the data area, by the parity
of its own call count, which it keeps in device memory (so it survives CUDA-graph replays, whose
arguments are fixed). Program p writes a half again two calls later, and by then every peer's
program p has passed the barrier of the call in between, so that peer's previous kernel, the one
that read this half, has finished. The plain kernel and the norm kernel are two families, each
with its own data area, flags and counts, so that program p of one never writes where program p
of the other reads.

The flags are call counts: they only grow (int64), so a peer that already moved on to its next
call leaves a larger flag, which satisfies the wait as well.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 8192  # a plain program's slot: 4,096 bfloat16 or 2,048 float32 elements
ROW_BYTES = 16384  # a norm program's slot: one row of up to 8,192 bfloat16 elements
NUM_WARPS = 4


@triton.jit
def peer_sum(
    x,  # this rank's values (a block, masked lanes whatever)
    offs,  # their element offsets within this program's slot of the data area
    mask,
    slot,  # this program's index in its family: its count and its flags
    Peers,  # [WORLD] int64: the address of every rank's symmetric buffer
    Counters,  # [programs] int64: this rank's call count per program of the family
    half_elems,  # elements of x's dtype in each half of the family's data area
    data_offset,  # bytes from a buffer's start to the family's data area
    signal_offset,  # bytes from a buffer's start to the family's flags [programs, WORLD] int64
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
):
    """The sum of x over the ranks, float32, added in rank order (see the module docstring)."""
    flag = tl.load(Counters + slot) + 1
    offs = offs + (flag % 2) * half_elems
    mine = (tl.load(Peers + RANK) + data_offset).to(tl.pointer_type(x.dtype))
    tl.store(mine + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's part is written before the flag says so
    for r in tl.static_range(WORLD):
        if r != RANK:
            flags = (tl.load(Peers + r) + signal_offset).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + slot * WORLD + RANK, flag, sem="release", scope="sys")
    own = (tl.load(Peers + RANK) + signal_offset).to(tl.pointer_type(tl.int64)) + slot * WORLD
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(own + r, 0, sem="acquire", scope="sys")
            while seen < flag:
                seen = tl.atomic_add(own + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads a peer's values before the flags are in
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            peer = (tl.load(Peers + r) + data_offset).to(tl.pointer_type(x.dtype))
            # Masked lanes read 0, as a caller's own masked loads do (the norm sums them all).
            acc += tl.load(peer + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    tl.store(Counters + slot, flag)
    return acc


@triton.jit
def _one_shot_all_reduce_kernel(
    X,  # [n] this rank's tensor, flat
    Out,  # [n] the sum (may be X)
    Peers,
    Counters,
    n,
    half_elems,
    signal_offset,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask)
    acc = peer_sum(x, offs, mask, pid, Peers, Counters, half_elems, 0, signal_offset, RANK, WORLD)
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=mask)


def programs_for(nbytes: int) -> int:
    return triton.cdiv(nbytes, CHUNK_BYTES)


class BufferLayout(NamedTuple):
    """Byte offsets in a rank's symmetric buffer: [plain data: 2 halves of max_bytes | norm data:
    2 halves of norm_rows slots | plain flags | norm flags], the flags [programs, world] int64."""

    programs: int  # plain programs (and flag rows) at most
    norm_data_offset: int
    signal_offset: int
    norm_signal_offset: int
    total: int

    @classmethod
    def of(cls, max_bytes: int, world: int, norm_rows: int) -> BufferLayout:
        programs = programs_for(max_bytes)
        norm_data = 2 * max_bytes
        signals = norm_data + 2 * norm_rows * ROW_BYTES
        norm_signals = signals + programs * world * 8
        return cls(programs, norm_data, signals, norm_signals, norm_signals + norm_rows * world * 8)


def one_shot_all_reduce(
    x: torch.Tensor,
    peers: torch.Tensor,
    counters: torch.Tensor,
    half_elems: int,
    signal_offset: int,
    rank: int,
    world: int,
) -> torch.Tensor:
    """Sum the contiguous ``x`` over the ranks in place (see the module docstring); returns x.
    ``half_elems`` counts elements of x's dtype; the data area starts at the buffer's start."""
    flat = x.view(-1)
    grid = (programs_for(flat.numel() * flat.element_size()),)
    _one_shot_all_reduce_kernel[grid](
        flat,
        flat,
        peers,
        counters,
        flat.numel(),
        half_elems,
        signal_offset,
        RANK=rank,
        WORLD=world,
        CHUNK=CHUNK_BYTES // flat.element_size(),
        num_warps=NUM_WARPS,
    )
    return x
