"""The host KV tier's memory and its copies (``--kv-offload-gb``), owned by the model runner.

The block manager decides what moves (engine_core/kv_offload.py); a step's plan carries the
copies (``KVMoves``) and the runner makes them here before the step's forward: every copy out
(device block to host slot), then every copy in. The cache's bytes move as they are (an FP8
cache as e4m3 bytes), through a uint8 view of it.

A host slot holds one block of every layer side by side, ``[slots, layers, 2, block_size,
kv_heads, head_dim bytes]``, so a block is one contiguous run of host memory and a run of
consecutive slots is one copy. The device side is gathered (copy out) or scattered (copy in) with
one ``index_select`` / ``index_copy_`` over every block that moves in the step, not a copy per
layer per block.

On the CPU (the "device" cache is host memory too) the copies are synchronous. On CUDA the host
pool is pinned and the copies run on a side stream: the copies out first, without waiting for the
step in flight (an evicted block is a cached one, full of tokens whose step was collected before
it was registered, so nothing still writes it); then, after the step in flight (a block restored
into may be the freed block of a request whose last row that step still runs), the copies in. The
step's forward waits for both on its own stream: each block evicted was taken by this step, whose
writes must follow the copy out, and each block restored is read by it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine_core.kv_offload import KVMoves


class HostKVPool:
    """``num_slots`` host slots of KV blocks beside the device cache ``kv_cache``
    ([layers, 2, blocks, block_size, kv_heads, head_dim])."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        self._device_kv = kv_cache.view(torch.uint8)  # [L, 2, blocks, bs, kv_heads, bytes]
        layers, pair, _, *rest = self._device_kv.shape
        self._on_cuda = kv_cache.device.type == "cuda"
        self.host = torch.empty(  # [slots, L, 2, bs, kv_heads, bytes]
            (num_slots, layers, pair, *rest), dtype=torch.uint8, pin_memory=self._on_cuda
        )
        self._stream = torch.cuda.Stream(kv_cache.device) if self._on_cuda else None

    @property
    def num_bytes(self) -> int:
        return self.host.numel()

    def apply(self, moves: KVMoves) -> None:
        """Make the step's copies: out, then in (see the module docstring for CUDA's order)."""
        if self._stream is None:
            self._copy_out(self._index(moves.out_blocks), moves.out_slots)
            self._copy_in(moves.in_slots, self._index(moves.in_blocks))
            return
        main = torch.cuda.current_stream(self._device_kv.device)
        with torch.cuda.stream(self._stream):  # the block ids' copies too: ordered before use
            out_blocks, in_blocks = self._index(moves.out_blocks), self._index(moves.in_blocks)
            self._copy_out(out_blocks, moves.out_slots)
            self._stream.wait_stream(main)
            self._copy_in(moves.in_slots, in_blocks)
        main.wait_stream(self._stream)

    def _index(self, blocks: list[int]) -> torch.Tensor:
        """Device block ids [n] int64 on the cache's device; on CUDA sent from pinned memory
        without waiting (a pageable copy would wait for the streams)."""
        index = torch.tensor(blocks, dtype=torch.int64)
        if not self._on_cuda:
            return index
        return index.pin_memory().to(self._device_kv.device, non_blocking=True)

    def _copy_out(self, blocks: torch.Tensor, slots: list[int]) -> None:
        if not slots:
            return
        staged = self._device_kv.index_select(2, blocks).movedim(2, 0)  # [n, L, 2, bs, h, bytes]
        if not self._on_cuda:
            self.host.index_copy_(0, torch.tensor(slots, dtype=torch.int64), staged)
            return
        staged = staged.contiguous()
        for first, slot, count in slot_runs(slots):
            self.host[slot : slot + count].copy_(staged[first : first + count], non_blocking=True)

    def _copy_in(self, slots: list[int], blocks: torch.Tensor) -> None:
        if not slots:
            return
        if not self._on_cuda:
            staged = self.host.index_select(0, torch.tensor(slots, dtype=torch.int64))
        else:
            staged = torch.empty(
                (len(slots), *self.host.shape[1:]), dtype=torch.uint8, device=blocks.device
            )
            for first, slot, count in slot_runs(slots):
                staged[first : first + count].copy_(
                    self.host[slot : slot + count], non_blocking=True
                )
        self._device_kv.index_copy_(2, blocks, staged.movedim(0, 2))


def slot_runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """(first position in ``slots``, first slot, length) of each run of consecutive slots."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i
