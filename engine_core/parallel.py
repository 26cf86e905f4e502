"""The parallel groups of one engine core: this process's rank and the collectives it runs.

An engine core with ``--tensor-parallel-size T`` and ``--pipeline-parallel-size P`` is T x P
processes: rank 0 is the engine process itself (it schedules and samples), ranks 1..T*P-1 are
workers it spawns (engine_core/tp_runner.py), or, with ``--nnodes``, that other hosts' launchers
spawn (engine_core/nodes.py). Rank r is tensor-parallel rank r % T of pipeline stage r // T.
They meet through a TCPStore bound to the loopback interface (or to ``--master-addr``) and form
these torch.distributed groups:

- the world group (NCCL on CUDA, gloo on the CPU): rank 0's sampled ids to every rank, and
  between pipeline stages the activations (each rank to its own tensor-parallel rank in the next
  stage) and the last stage's logits to rank 0;
- a stage's device group (the world itself without pipeline parallelism) for the tensors of its
  forward: the all-reduce after every row-parallel layer and the vocabulary-parallel embedding,
  the gather of the logits shards to the stage's first rank. On GPUs that reach each other's
  memory with native atomics (NVLink), contiguous bf16/fp16/fp32 all-reduces of up to 4 MiB (a
  decode step's; less on GPUs with under 128 multiprocessors) take the one-shot peer all-reduce
  instead of NCCL (engine_core/peer_all_reduce.py), without pipeline stages only;
- a gloo group of every rank for the host side: each step's packed inputs, which rank 0
  broadcasts before the step (engine_core/tp_runner.py), and the vote on the peer all-reduce at
  start-up. Workers wait in it while the engine is idle, so it gets a long timeout; the device
  groups keep the default one.

The models read the groups once, when they are built (``get_tp_group()``,
``get_pipeline_stage()``), and size their layers by them; at TP=1 they build plain layers and
never call a collective, and a pipeline stage builds only its own layers.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine_core.config import Fp8Config, ModelConfig, QuantConfig, W4A16Config, is_ignored
from engine_core.kv_groups import model_kv_layout
from engine_core.peer_all_reduce import PeerAllReduce, PeerSumArgs, make_peer_all_reduce

HOST = "127.0.0.1"
# Workers block in the header broadcast while the engine has nothing to do; that is not a fault.
IDLE_TIMEOUT = datetime.timedelta(days=7)
STORE_TIMEOUT = datetime.timedelta(minutes=10)  # every rank joins within this, or start-up fails
TEARDOWN_TIMEOUT_S = 20.0

logger = logging.getLogger("tandem.tp")
# torch 2.13 renamed all_gather_into_tensor (same arguments) and warns on the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its stage's tensor-parallel group (size 1: no group)."""

    rank: int = 0  # within the stage's group
    size: int = 1
    device_group: Any = None  # torch ProcessGroup for the forward's tensors (the stage's ranks)
    cpu_group: Any = None  # gloo ProcessGroup of every rank, for host-side headers
    peer: PeerAllReduce | None = None  # the one-shot all-reduce for small tensors, or None
    # MoE layers hold whole experts, 1/size of them each, instead of 1/size of every expert.
    expert_parallel: bool = False
    world_group: Any = None  # every rank of the engine core: the sampled ids go to all

    @property
    def is_driver(self) -> bool:
        """The stage's first rank (rank 0, the engine process, without pipeline stages), which
        the logits shards are gathered to."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.peer is not None and self.peer.fits(x):
            return self.peer.all_reduce(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_to_all(
        self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows [sum(send_counts), ...], the first send_counts[0] for rank 0, the next for rank
        1, ... -> the rows every rank sent here, [sum(recv_counts), ...] in rank order (the
        counts as every rank agreed them; zero rows either way is fine)."""
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        group = self.device_group
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
        return out

    def all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Each rank's rows [n, ...] (the same n on every rank) -> [size * n, ...], rank 0's
        first."""
        out = rows.new_empty((self.size * rows.shape[0], *rows.shape[1:]))
        _all_gather_single(out, rows.contiguous(), group=self.device_group)
        return out

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into ``x`` on every rank of the engine core (same shape and dtype
        everywhere); returns it."""
        dist.broadcast(x, src=0, group=self.world_group)
        return x

    def gather_vocab(
        self, logits: torch.Tensor, vocab_size: int, widen: bool = True
    ) -> torch.Tensor | None:
        """Each rank's [N, V/size] logits -> [N, vocab_size] on the group's first rank (float32,
        or as they are with ``widen=False``); None elsewhere.

        Rank r holds the contiguous vocabulary slice r (the last one padded), so the full row is
        the shards side by side, cut back to ``vocab_size``.
        """
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.is_driver else None
        dist.gather(logits, parts, group_dst=0, group=self.device_group)
        if parts is None:
            return None
        full = torch.cat(parts, dim=-1)[:, :vocab_size]
        return full.float() if widen else full

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value``, over all stages (e.g. how many KV blocks fit
        on each GPU: one block table is valid on every rank)."""
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


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each pipeline stage's decoder layers: contiguous, num_layers // num_stages each, and the
    remainder one each to the stages just before the last (the last stage also runs the final
    norm, the LM head and the logits). 5 layers over 2 stages: [0, 3), [3, 5)."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages} must be >= 1 and at most the model's number "
            f"of decoder layers ({num_layers}): every stage runs at least one"
        )
    counts = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        counts[num_stages - 2 - i] += 1
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


@dataclass(frozen=True)
class PipelineStage:
    """This process's pipeline stage (size 1: the whole model on every rank).

    A stage's ranks hold its layers only (the first stage the embedding too, the last the final
    norm and LM head). A stage's forward takes the previous stage's activations from the rank of
    the same tensor-parallel rank there and hands its own to the next stage's; the last stage's
    first rank sends rank 0 the logits, which rank 0 samples as it does without stages.
    """

    index: int = 0
    size: int = 1
    rank: int = 0  # this process's rank in the world group
    group: Any = None  # the world device group, which the sends and receives go through
    prev_rank: int | None = None  # the same tensor-parallel rank in the stage before, or None
    next_rank: int | None = None  # ... in the stage after, or None
    logits_rank: int = 0  # the last stage's first rank: it sends rank 0 the logits

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The decoder layers this stage runs (``split_layers``)."""
        return split_layers(num_layers, self.size)[self.index]

    def send_activations(self, activations: torch.Tensor) -> None:
        """This stage's output to the next stage: the hidden state and the residual stream,
        [2, T, hidden]."""
        dist.send(activations, dst=self.next_rank, group=self.group)

    def recv_activations(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden state, residual stream), [T, hidden] each."""
        both = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(both, src=self.prev_rank, group=self.group)
        return both[0], both[1]

    def send_logits(self, logits: torch.Tensor | None, dtype: torch.dtype) -> None:
        """On the last stage's first rank (not rank 0 itself): its logits to rank 0, in the
        ``dtype`` that rank 0 receives them in."""
        if self.size > 1 and logits is not None and self.rank == self.logits_rank:
            dist.send(logits.to(dtype).contiguous(), dst=0, group=self.group)

    def recv_logits(
        self, num_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """On rank 0: the last stage's logits [N, vocab] in ``dtype``; None on other ranks."""
        if self.rank != 0:
            return None
        logits = torch.empty((num_rows, vocab_size), dtype=dtype, device=device)
        dist.recv(logits, src=self.logits_rank, group=self.group)
        return logits


SINGLE = TPGroup()
WHOLE_MODEL = PipelineStage()
_current = SINGLE
_stage = WHOLE_MODEL


def get_tp_group() -> TPGroup:
    """The group models are built for in this process (``SINGLE`` unless an engine joined one)."""
    return _current


def get_pipeline_stage() -> PipelineStage:
    """The stage models are built for in this process (``WHOLE_MODEL`` without stages)."""
    return _stage


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
    pipeline_size: int = 1,
) -> TPGroup:
    """Join the engine core's groups (blocks until every rank has joined) and make this rank's
    tensor-parallel group and pipeline stage current.

    ``world_size``: every rank, tensor-parallel size x ``pipeline_size``. ``all_reduce``: "auto"
    sets up the one-shot peer all-reduce where the GPUs allow it (a collective: every rank
    passes the same value), "nccl" leaves every all-reduce to NCCL. ``local_rank``: the rank's
    GPU on its host (default: ``rank``, every rank on one host). ``expert_parallel``: how the
    models built for the group split MoE experts.
    """
    global _current, _stage
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
    tp_size = world_size // pipeline_size
    stage_group = stage_device_group(rank, tp_size, pipeline_size)
    peer = None
    if device.type == "cuda" and all_reduce == "auto" and pipeline_size == 1:
        peer = make_peer_all_reduce(stage_group, cpu_group, device, tp_size)
    world = dist.group.WORLD
    _current = TPGroup(
        rank % tp_size, tp_size, stage_group, cpu_group, peer, expert_parallel, world
    )
    _stage = pipeline_stage(rank, tp_size, pipeline_size)
    return _current


def stage_device_group(rank: int, tp_size: int, pipeline_size: int) -> Any:
    """The device group of ``rank``'s stage. Every rank creates every stage's group, in the same
    order (torch.distributed requires it); without stages it is the world group."""
    if pipeline_size == 1:
        return dist.group.WORLD
    groups = [
        dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        for stage in range(pipeline_size)
    ]
    return groups[rank // tp_size]


def pipeline_stage(rank: int, tp_size: int, pipeline_size: int) -> PipelineStage:
    if pipeline_size == 1:
        return PipelineStage(rank=rank, group=dist.group.WORLD)
    index = rank // tp_size
    return PipelineStage(
        index=index,
        size=pipeline_size,
        rank=rank,
        group=dist.group.WORLD,
        prev_rank=rank - tp_size if index > 0 else None,
        next_rank=rank + tp_size if index < pipeline_size - 1 else None,
        logits_rank=(pipeline_size - 1) * tp_size,
    )


def check_tensor_parallel(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """ValueError unless ``config``'s heads, KV heads and MLP split evenly over ``size`` ranks
    (and, with ``expert_parallel``, its experts)."""
    if expert_parallel and not config.num_experts:
        raise ValueError("--enable-expert-parallel is for mixture-of-experts models; this has none")
    parts = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads}
    if config.linear_attention is not None:  # split by key-head groups (models/qwen3_next.py)
        parts["linear-attention key heads"] = config.linear_attention.num_key_heads
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
    if size > 1:
        check_quantized_split(config, size, expert_parallel)


def check_quantized_split(config: ModelConfig, size: int, expert_parallel: bool) -> None:
    """ValueError, naming the sizes, unless each rank's share of the quantized layers is whole
    quantization units: W4A16's words of 8 columns and groups along a row-parallel layer's
    input; block FP8's row blocks along a column-parallel layer's output and column blocks
    along a row-parallel one's input (models/layers.py, models/moe.py split them so)."""
    quant = config.quantization
    if quant is None:
        return
    split_inputs, split_outputs = split_widths(config, expert_parallel)
    inputs = quantized_widths(split_inputs, config, quant)
    outputs = quantized_widths(split_outputs, config, quant)
    if isinstance(quant, W4A16Config):
        unit = PACK_COLUMNS if quant.group_size == -1 else math.lcm(PACK_COLUMNS, quant.group_size)
        bad = [f"{name} {value} / {size}" for name, value in inputs.items() if value // size % unit]
        what = f"whole groups of {quant.group_size} columns (and words of 8)"
    elif isinstance(quant, Fp8Config) and quant.block is not None:
        rows, cols = quant.block
        bad = [f"{name} {value} / {size}" for name, value in inputs.items() if value // size % cols]
        bad += [
            f"{name} {value} / {size}" for name, value in outputs.items() if value // size % rows
        ]
        what = f"whole {rows} x {cols} blocks"
    else:
        return
    if bad:
        raise ValueError(
            f"--tensor-parallel-size {size} splits this checkpoint's quantized layers into "
            f"shares that are not {what}: {', '.join(bad)}"
        )


PACK_COLUMNS = 8  # W4A16's 4-bit values per int32 word (models/w4a16.py PACK)


# A width check: (the width, the checkpoint module, within a decoder layer, whose rows or
# columns it is: what the checkpoint's ignore list may leave unquantized).
Width = tuple[int, str]


def split_widths(
    config: ModelConfig, expert_parallel: bool
) -> tuple[dict[str, Width], dict[str, Width]]:
    """({name: the input width of a row-parallel layer}, {name: the output width of a
    column-parallel one}) of the layers that tensor parallelism splits and a checkpoint may
    quantize (experts whole under expert parallelism, which refuses quantized ones as they are
    built)."""
    inputs, outputs = attention_widths(config)
    if config.has_dense_mlp:
        inputs["MLP width (intermediate_size)"] = (config.intermediate_size, "mlp.down_proj")
        outputs["MLP width (intermediate_size)"] = (config.intermediate_size, "mlp.gate_proj")
    if config.num_experts and not expert_parallel:
        width = (config.moe_intermediate_size, "mlp.experts")
        inputs["expert width (moe_intermediate_size)"] = width
        outputs["expert width (moe_intermediate_size)"] = width
    return inputs, outputs


def attention_widths(config: ModelConfig) -> tuple[dict[str, Width], dict[str, Width]]:
    """``split_widths``' attention part: o_proj's input; q/k/v's outputs, or with latent
    attention (DeepSeek, models/deepseek.py) q_b's (or q's) and kv_b's, whose rows are
    head-major (q_a and kv_a are every rank's, not split)."""
    heads, mla = config.num_heads, config.mla
    if mla is not None:
        query = "self_attn.q_proj" if mla.q_lora_rank is None else "self_attn.q_b_proj"
        qk_dims, up_dims = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim
        return (
            {"attention output (heads x v_head_dim)": (heads * mla.v_head_dim, "self_attn.o_proj")},
            {
                "query width (heads x qk head dim)": (heads * qk_dims, query),
                "latent up-projection width (heads x (qk_nope + v) dims)": (
                    heads * (up_dims + mla.v_head_dim),
                    "self_attn.kv_b_proj",
                ),
            },
        )
    attention = heads * config.head_dim
    return (
        {"attention output (heads x head_dim)": (attention, "self_attn.o_proj")},
        {
            "query width (heads x head_dim)": (attention, "self_attn.q_proj"),
            "key/value width (KV heads x head_dim)": (
                config.num_kv_heads * config.head_dim,
                "self_attn.k_proj",
            ),
        },
    )


def quantized_widths(
    widths: dict[str, Width], config: ModelConfig, quant: QuantConfig
) -> dict[str, int]:
    """The widths of ``widths`` whose layer the checkpoint quantizes in some decoder layer
    (its ignore list may leave, say, the attention in float, as Kimi-K2's INT4 does)."""
    layers = range(config.num_layers)
    return {
        name: width
        for name, (width, leaf) in widths.items()
        if not all(is_ignored(f"model.layers.{i}.{leaf}", quant) for i in layers)
    }


# The families whose layers take a stage's input and hand on its output (models/llama.py):
# Llama 2/3, Mistral, Qwen2/3, Phi-3, and the Mixtral and Qwen3-MoE mixtures of experts.
PIPELINE_ARCHITECTURES = ("llama",)


def check_pipeline_parallel(config: ModelConfig, size: int) -> None:
    """ValueError, naming what, unless ``config`` splits into ``size`` pipeline stages: a
    Llama-family text model with at least one layer per stage, whose layers are one KV group."""
    if size == 1:
        return
    flag = f"--pipeline-parallel-size {size}"
    if config.architecture not in PIPELINE_ARCHITECTURES or config.vision is not None:
        raise ValueError(
            f"{flag}: only Llama-family text models (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, "
            f"Qwen3-MoE) split into pipeline stages for now, not this {config.architecture} "
            "model"
        )
    split_layers(config.num_layers, size)  # ValueError: fewer layers than stages
    layout = model_kv_layout(config)
    if len(layout.groups) > 1 or layout.state_layers:
        raise ValueError(
            f"{flag}: a model whose layers form several KV layer groups (sliding-window layers "
            "beside full ones) does not split into pipeline stages yet"
        )


def leave_tp_group(timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Destroy this process's groups; models built afterwards are single-process again.

    The teardown runs in a helper thread, waited for at most ``timeout_s``: a peer that died
    mid-way can make NCCL's wait forever, and shutting down must not.
    """
    global _current, _stage
    _current, _stage = SINGLE, WHOLE_MODEL
    if not dist.is_initialized():
        return
    thread = threading.Thread(target=dist.destroy_process_group, name="tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("torch.distributed teardown still waits after %.0f s; going on", timeout_s)
