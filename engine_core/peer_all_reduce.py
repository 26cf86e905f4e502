"""One-shot all-reduce over peer-to-peer device memory, for the small tensors of decode.

A tensor-parallel decode step all-reduces a [batch, hidden] activation twice a layer (llama-8b:
64 times a step, 512 KiB each at batch 64). NCCL's ring all-reduce spends most of its time on
latency at that size (16-18 us between two GPUs, inside a CUDA graph, against 7.3 us for the
kernel here: docs/design/kernels-and-limits.md, "Peer all-reduce"). Here each rank copies its
tensor into a buffer that every rank of the group has mapped, the ranks meet at a barrier on
flags in that memory, and each rank sums every rank's copy straight over NVLink: one kernel with
one barrier (engine_core/peer_all_reduce_kernel.py), whose addresses are fixed at start-up, so
it is captured in the CUDA graphs.

The buffer and its mappings are PyTorch's symmetric memory (``torch.distributed.
_symmetric_memory``: CUDA IPC handles exchanged once through the group's store). NVLink
multicast is never used, nor asked for: it can take a shared host's GPUs out of service, and
the kernel needs only peer loads and stores.

Tensors over ``max_bytes``, other dtypes, non-contiguous ones, and groups whose GPUs cannot reach
each other's memory take NCCL (``TPGroup.all_reduce``).

The same protocol also runs inside the RMSNorm kernel (``norm_args``): a row-parallel layer
whose output feeds the next residual add and norm leaves its sum to that norm (a ``PendingSum``,
engine_core/parallel.py), which adds the ranks' rows, the residual, and normalizes in one launch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

logger = logging.getLogger("tandem.tp")

# The largest tensor the plain kernel sums: 512 programs of 8 KiB. Every program of a launch
# must be resident at once (a program waits for its peers, never for a program of its own rank
# that could not be scheduled): so also at most 4 a multiprocessor (4 warps each, few registers).
DEFAULT_MAX_BYTES = 4 * 2**20
PLAIN_PROGRAMS_PER_SM = 4
# The most rows the norm kernel sums, one program (up to 8 warps) a row: also at most one a
# multiprocessor, for the same reason (on 132 multiprocessors, decode batches up to 132 fuse).
MAX_NORM_ROWS = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PeerSumArgs(NamedTuple):
    """What a kernel calling ``peer_sum`` (peer_all_reduce_kernel.py) needs for one family."""

    peers: torch.Tensor  # [world] int64 buffer addresses
    counters: torch.Tensor  # [programs] int64
    half_elems: int  # elements of the tensor's dtype in each half of the family's data area
    data_offset: int  # bytes
    signal_offset: int  # bytes
    slot_elems: int  # elements of one program's slot (the norm family: one row's)
    rank: int
    world: int


class UnevenBuffers(RuntimeError):
    """The ranks' symmetric buffers do not line up (every rank raises it alike)."""


class PeerAllReduce:
    """Sum a tensor over the ranks of ``group`` in place, through symmetric memory.

    Building one is a collective: every rank of the group must build it, in the same order
    relative to the group's other collectives.
    """

    def __init__(
        self, group: Any, device: torch.device, sms: int, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from engine_core import peer_all_reduce_kernel as kernel

        # Never NVLink multicast (see the module docstring), whatever the environment says;
        # torch reads this at rendezvous.
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # registers the group's store (deprecated, still needed in 2.13)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group.group_name)
        self.rank, self.world = group.rank(), group.size()
        # ``sms``: the fewest multiprocessors of any rank, so that every rank caps alike.
        self.max_bytes = min(max_bytes, PLAIN_PROGRAMS_PER_SM * sms * kernel.CHUNK_BYTES)
        self.max_norm_rows = min(MAX_NORM_ROWS, sms)
        self.layout = kernel.BufferLayout.of(self.max_bytes, self.world, MAX_NORM_ROWS)
        self.buffer = symm_mem.empty(self.layout.total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group)  # maps every peer's buffer
        # The buffer's start within torch's allocation, which every rank must share.
        shift = self.buffer.data_ptr() - handle.buffer_ptrs[self.rank]
        shifts = torch.tensor([shift, -shift], dtype=torch.int64, device=device)
        dist.all_reduce(shifts, op=dist.ReduceOp.MAX, group=group)
        if shifts.tolist() != [shift, -shift]:
            raise UnevenBuffers(f"symmetric buffers at different offsets across ranks ({shift})")
        self.peers = torch.tensor(
            [ptr + shift for ptr in handle.buffer_ptrs], dtype=torch.int64, device=device
        )  # [world]
        programs = self.layout.programs
        self.counters = torch.zeros(programs, dtype=torch.int64, device=device)  # [programs]
        self.norm_counters = torch.zeros(MAX_NORM_ROWS, dtype=torch.int64, device=device)
        self.buffer[self.layout.signal_offset :].zero_()
        # Every rank's flags are zero before any rank's first flag can land in them.
        torch.cuda.synchronize(device)
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        torch.cuda.synchronize(device)
        self._kernel = kernel.one_shot_all_reduce
        self._row_bytes = kernel.ROW_BYTES

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes this path (the same answer on every rank for the same shape)."""
        nbytes = x.numel() * x.element_size()
        return x.dtype in DTYPES and 0 < nbytes <= self.max_bytes and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it. Only for tensors that ``fits``."""
        half_elems = self.max_bytes // x.element_size()
        signals = self.layout.signal_offset
        return self._kernel(
            x, self.peers, self.counters, half_elems, signals, self.rank, self.world
        )

    def norm_args(self, rows: torch.Tensor) -> PeerSumArgs | None:
        """What the RMSNorm kernel needs to sum ``rows`` [T, N] over the ranks first, or None
        where they do not fit it (too many rows, too wide, a dtype it lacks)."""
        fits = (
            rows.dtype in DTYPES
            and 0 < rows.shape[0] <= self.max_norm_rows
            and rows.shape[1] * rows.element_size() <= self._row_bytes
        )
        if not fits:
            return None
        size = rows.element_size()
        return PeerSumArgs(
            self.peers,
            self.norm_counters,
            MAX_NORM_ROWS * self._row_bytes // size,
            self.layout.norm_data_offset,
            self.layout.norm_signal_offset,
            self._row_bytes // size,
            self.rank,
            self.world,
        )


# torch's symmetric memory keeps the store of a group by the group's name, and a group made after
# the first is destroyed gets the same name ("0"): a second rendezvous in this process would wait
# on the old store for ever. So one per process; a later group takes NCCL (make_peer_all_reduce).
_rendezvous_done = False


def peers_reachable(size: int) -> bool:
    """Whether every GPU of ranks 0..size-1 can reach every other's memory with native atomics:
    the kernel's flags are system-scope atomic stores into peer memory, which NVLink carries and
    PCIe peer access mostly does not."""
    if torch.cuda.device_count() < size:
        return False
    pairs = [(a, b) for a in range(size) for b in range(size) if a != b]
    return all(
        torch.cuda.can_device_access_peer(a, b) and native_p2p_atomics(a, b) for a, b in pairs
    )


def native_p2p_atomics(src: int, dst: int) -> bool:
    """CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED of the link between two CUDA devices,
    from the driver API (torch does not expose it); False if the driver cannot say."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        devices = (ctypes.c_int(), ctypes.c_int())
        value = ctypes.c_int(0)
        ok = driver.cuInit(0) == 0
        ok = ok and driver.cuDeviceGet(ctypes.byref(devices[0]), src) == 0
        ok = ok and driver.cuDeviceGet(ctypes.byref(devices[1]), dst) == 0
        # 3: CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
        ok = ok and driver.cuDeviceGetP2PAttribute(ctypes.byref(value), 3, *devices) == 0
    except OSError:
        return False
    return ok and value.value == 1


def agree(able: bool, sms: int, cpu_group: Any) -> tuple[bool, int]:
    """(every rank is able, the fewest multiprocessors of any rank): the same on every rank."""
    votes = torch.tensor([int(able), sms], dtype=torch.int64)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=cpu_group)
    every, fewest = votes.tolist()
    return bool(every), fewest


def make_peer_all_reduce(
    group: Any, cpu_group: Any, device: torch.device, size: int
) -> PeerAllReduce | None:
    """A PeerAllReduce for ``group`` where every rank can have one, else None (NCCL does it all).

    The ranks vote over ``cpu_group`` first, so that either all build one (a collective) or none
    does: a rank whose GPUs lack peer atomics, or whose process already set one up (see
    ``_rendezvous_done``), makes them all take NCCL. The buffer is sized for the rank with the
    fewest multiprocessors, so that every rank sends the same tensors the same way.
    """
    global _rendezvous_done
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    able, fewest_sms = agree(peers_reachable(size) and not _rendezvous_done, sms, cpu_group)
    if not able:
        logger.info(
            "the peer all-reduce is off on some rank (GPUs without peer atomics, or a second "
            "tensor-parallel group in one process): every all-reduce goes through NCCL"
        )
        return None
    _rendezvous_done = True
    try:
        peer = PeerAllReduce(group, device, sms=fewest_sms)
    except UnevenBuffers as exc:
        logger.warning("%s: every all-reduce goes through NCCL", exc)
        return None
    logger.info("one-shot peer all-reduce up to %d KiB, NCCL above", peer.max_bytes // 1024)
    return peer
