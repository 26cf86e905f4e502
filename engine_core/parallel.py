"""The tensor-parallel group of one engine core: this process's rank and the collectives it runs.

An engine core with ``--tensor-parallel-size N`` is N processes: rank 0 is the engine process
itself (it schedules and samples), ranks 1..N-1 are workers it spawns (engine_core/tp_runner.py),
or, with ``--nnodes``, that other hosts' launchers spawn (engine_core/nodes.py). They meet through
a TCPStore bound to the loopback interface (or to ``--master-addr``) and form two
torch.distributed groups:

- the device group (NCCL on CUDA, gloo on the CPU) for the tensors of a forward: the all-reduce
  after every row-parallel layer and the vocabulary-parallel embedding, the gather of the
  logits shards to rank 0, and rank 0's sampled ids to the other ranks. On GPUs that reach each
  other's memory with native atomics (NVLink), contiguous bf16/fp16/fp32 all-reduces of up to
  4 MiB (a decode step's; less on GPUs with under 128 multiprocessors) take the one-shot peer
  all-reduce instead of NCCL (engine_core/peer_all_reduce.py);
- a gloo group for the host side: each step's packed inputs, which rank 0 broadcasts before the
  step (engine_core/tp_runner.py), and the vote on the peer all-reduce at start-up. Workers
  wait in it while the engine is idle, so it gets a long timeout; the device group keeps the
  default one.

The models read the group once, when they are built (``get_tp_group()``), and size their layers
by it; at TP=1 they build plain layers and never call a collective.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine_core.config import ModelConfig
from engine_core.peer_all_reduce import PeerAllReduce, PeerSumArgs, make_peer_all_reduce

HOST = "127.0.0.1"
# Workers block in the header broadcast while the engine has nothing to do; that is not a fault.
IDLE_TIMEOUT = datetime.timedelta(days=7)
STORE_TIMEOUT = datetime.timedelta(minutes=10)  # every rank joins within this, or start-up fails
TEARDOWN_TIMEOUT_S = 20.0

logger = logging.getLogger("tandem.tp")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its engine core's tensor-parallel group (size 1: no group)."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # torch ProcessGroup for the forward's tensors
    cpu_group: Any = None  # gloo ProcessGroup for host-side headers
    peer: PeerAllReduce | None = None  # the one-shot all-reduce for small tensors, or None
    # MoE layers hold whole experts, 1/size of them each, instead of 1/size of every expert.
    expert_parallel: bool = False

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine process, which schedules, broadcasts and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.peer is not None and self.peer.fits(x):
            return self.peer.all_reduce(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into ``x`` on every rank (same shape and dtype everywhere); returns it."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def gather_vocab(
        self, logits: torch.Tensor, vocab_size: int, widen: bool = True
    ) -> torch.Tensor | None:
        """Each rank's [N, V/size] logits -> [N, vocab_size] on rank 0 (float32, or as they
        are with ``widen=False``); None elsewhere.

        Rank r holds the contiguous vocabulary slice r (the last one padded), so the full row is
        the shards side by side, cut back to ``vocab_size``.
        """
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.is_driver else None
        dist.gather(logits, parts, dst=0, group=self.device_group)
        if parts is None:
            return None
        full = torch.cat(parts, dim=-1)[:, :vocab_size]
        return full.float() if widen else full

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. how many KV blocks fit on each GPU)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


@dataclass(frozen=True)
class PendingSum:
    """A row-parallel layer's output before its all-reduce: this rank's share of the sum.

    Only a layer whose output goes straight into an RMSNorm with the residual returns one
    (models/llama.py ``defer_row_parallel_sums``): that norm sums the ranks' rows in its own
    launch where the peer all-reduce's norm kernel takes them, else it all-reduces them first.
    """

    partial: torch.Tensor  # [T, hidden]
    tp: TPGroup

    def reduced(self) -> torch.Tensor:
        return self.tp.all_reduce(self.partial)

    def for_norm(self) -> tuple[torch.Tensor, PeerSumArgs | None]:
        """(this rank's rows, what the norm kernel needs to sum them over the ranks), or (the
        summed rows, None) where the kernel cannot take them."""
        peer = self.tp.peer
        args = (
            peer.norm_args(self.partial) if peer is not None and self.partial.dim() == 2 else None
        )
        return (self.partial, args) if args is not None else (self.reduced(), None)


SINGLE = TPGroup()
_current = SINGLE


def get_tp_group() -> TPGroup:
    """The group models are built for in this process (``SINGLE`` unless an engine joined one)."""
    return _current


def create_store(
    world_size: int, host: str = HOST, port: int = 0, timeout: datetime.timedelta = STORE_TIMEOUT
) -> dist.TCPStore:
    """Rank 0's rendezvous store on ``host``:``port`` (0: a free port; read it from
    ``store.port``), listening on that address only.

    Given a host alone, TCPStore listens on every interface of the machine: an unauthenticated
    port open to the network. So the socket is bound here and handed to it.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses the port
        sock.bind(address)
        sock.listen()
        bound_port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        host, bound_port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
    )  # fmt: skip


def connect_store(
    port: int, world_size: int, host: str = HOST, timeout: datetime.timedelta = STORE_TIMEOUT
) -> dist.TCPStore:
    """A worker's handle on rank 0's store (it retries the connection for ``timeout``)."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def join_tp_group(
    store: dist.TCPStore,
    rank: int,
    world_size: int,
    device: torch.device,
    all_reduce: str = "auto",
    local_rank: int | None = None,
    expert_parallel: bool = False,
) -> TPGroup:
    """Join the engine core's group (blocks until every rank has joined) and make it current.

    ``all_reduce``: "auto" sets up the one-shot peer all-reduce where the GPUs allow it (a
    collective: every rank passes the same value), "nccl" leaves every all-reduce to NCCL.
    ``local_rank``: the rank's GPU on its host (default: ``rank``, every rank on one host).
    ``expert_parallel``: how the models built for the group split MoE experts.
    """
    global _current
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group; one tensor-parallel "
            "engine core per process (shut the previous one down first)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    peer = None
    if device.type == "cuda" and all_reduce == "auto":
        peer = make_peer_all_reduce(dist.group.WORLD, cpu_group, device, world_size)
    _current = TPGroup(rank, world_size, dist.group.WORLD, cpu_group, peer, expert_parallel)
    return _current


def check_tensor_parallel(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """ValueError unless ``config``'s heads, KV heads and MLP split evenly over ``size`` ranks
    (and, with ``expert_parallel``, its experts)."""
    if expert_parallel and not config.num_experts:
        raise ValueError("--enable-expert-parallel is for mixture-of-experts models; this has none")
    parts = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads}
    if config.has_dense_mlp:
        parts["MLP width (intermediate_size)"] = config.intermediate_size
    if expert_parallel:  # whole experts, 1/size of them on each rank
        parts["number of experts (num_experts)"] = config.num_experts
    elif config.num_experts:  # every expert is split along its own width
        parts["expert width (moe_intermediate_size)"] = config.moe_intermediate_size
    uneven = [f"{name} ({value})" for name, value in parts.items() if value % size]
    if size < 1 or uneven:
        raise ValueError(
            f"--tensor-parallel-size {size} must be >= 1 and divide the model's number of "
            f"attention heads and KV heads (and its MLP width); it does not divide: "
            f"{', '.join(uneven) or size}"
        )


def leave_tp_group(timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Destroy this process's groups; models built afterwards are single-process again.

    The teardown runs in a helper thread, waited for at most ``timeout_s``: a peer that died
    mid-way can make NCCL's wait forever, and shutting down must not.
    """
    global _current
    _current = SINGLE
    if not dist.is_initialized():
        return
    thread = threading.Thread(target=dist.destroy_process_group, name="tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("torch.distributed teardown still waits after %.0f s; going on", timeout_s)
