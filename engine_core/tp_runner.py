"""Tensor (and pipeline) parallelism inside one engine core: rank 0 drives, the others follow.

    rank 0: the engine process (TPModelRunner)      ranks 1..N-1: spawned workers (TPWorker)
      EngineCore schedules
      prepare_inputs ── packed host bytes ────────►  the same ModelInputs
      forward  ◄──────── all-reduces ─────────────►  forward
      logits   ◄──────── vocabulary shards ────────  compute_logits (rows that sample, drafts)
      sample ──────────── sampled ids ────────────►  the next step's placeholders
      update requests

Every rank holds its share of the weights (sharded at load from the same checkpoint, see
engine_core/models/layers.py) and its own KV cache for its share of the KV heads, with the same
number of blocks, so the scheduler's block tables are valid on every rank. Workers are started
with the 'spawn' method (never fork a process that has initialised torch) and are daemons that
also die with the engine process (PR_SET_PDEATHSIG); ``shutdown()`` stops them cleanly, and runs
by itself at interpreter exit. On CUDA each rank captures its own decode graphs (the collectives
inside them), in the same order, since every rank runs the same ModelRunner set-up.

With pipeline stages (engine_core/parallel.py) the same steps reach every rank; a rank's forward
runs its stage's layers only, receiving the previous stage's output inside the model
(models/llama.py) and handing its own on: a worker right after its forward, rank 0 once it has
taken the oldest step's logits where P - 1 steps are in the later stages (engine_core/core.py
``_step_pipelined``). The last stage's ``compute_logits`` sends rank 0 the logits that rank 0's
``compute_logits`` receives. The KV blocks are as many on every rank (the fewest that fit on
any), its stage's layers each. No step has placeholders with stages, so the sampled ids below
are not broadcast then, and rank 0 sends each worker its step headers in the background, up to
P - 1 ahead of the last stage (``StepChannel``).

Each step's inputs cross as the host bytes rank 0 packed them in (engine_core/input_batch.py),
in one msgpack message broadcast over the gloo group while the GPUs still run the step before;
each worker copies them to its own GPU as rank 0 does, so no input broadcast waits on the
devices. The one thing that exists only on rank 0's GPU, the ids it sampled (the next step's
placeholder tokens, with overlap), follows right after its sampler as one [S] int64 broadcast
over the world group, which each worker gathers its placeholders from, as rank 0 does. The
host KV tier's copies of the step (``--kv-offload-gb``) travel with its inputs, and each rank
makes them in its own shard before its forward. With LoRA, so do the adapter reads rank 0
started and the slots it wrote since the step before, and each request's slot
(engine_core/lora/manager.py ``LoraChanges``): a worker reads the same folders and writes its
own share into the same slots before the forward. No pickle: the header is plain msgpack data,
and a worker's start-up arguments are plain values (the EngineConfig as a dict).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from multiprocessing.process import BaseProcess
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from common.processes import set_parent_death_signal
from engine_core.config import EngineConfig
from engine_core.forward_context import StateRows
from engine_core.kv_offload import KVMoves
from engine_core.loader import peek_model_config
from engine_core.lora.manager import LoraChanges
from engine_core.memory_plan import check_max_model_len
from engine_core.model_runner import (
    PROMPT_LOGITS_ROWS,
    ModelInputs,
    ModelRunner,
    drafted_row_indices,
    model_inputs,
    prompt_rows_on,
    resolve_device,
    resolve_max_num_seqs,
)
from engine_core.nodes import (
    NodeLayout,
    NodeWatch,
    admit_nodes,
    open_session,
    read_secret,
    rendezvous_host,
)
from engine_core.parallel import (
    STORE_TIMEOUT,
    TPGroup,
    check_pipeline_parallel,
    check_tensor_parallel,
    connect_store,
    create_store,
    join_tp_group,
    leave_tp_group,
)
from engine_core.request import SchedulerOutput
from engine_core.state_snapshots import KeptDraftState, StateCopy, StateMove
from protocol.messages import LoraRef

logger = logging.getLogger("tandem.tp")

_STOP, _STEP = 0, 1
_STOP_TIMEOUT_S = 10.0
_WORKER_KEY = "tandem/worker{}"
_RENDEZVOUS_POLL_S = 0.05
_WATCH_POLL_S = 0.2
_NAME_THE_LOSS_S = 3.0  # a failed step waits this long for the watch to name a lost rank
WORKER_LOST_EXIT_CODE = 70  # EX_SOFTWARE: the engine core ended itself, a worker being gone


# ---- the step channel -------------------------------------------------------------------------


class StepChannel:
    """Rank 0 -> workers, over the gloo group: each step's packed inputs (the layout's counts and
    the host bytes, ``InputBatch.last_step``), the rows that score prompt tokens, and the host
    KV tier's copies (engine_core/kv_offload.py), which every rank makes in its own shard.

    One stage: a broadcast that rank 0 waits for. ``stages`` > 1: rank 0 sends each worker its
    header on its own (``isend``) and goes on, leaving up to ``stages`` - 1 headers not yet
    taken. A later stage takes step N's header only once it finishes N-1, which it does only
    once rank 0 takes N-1's logits (core.py ``_step_pipelined``): with P micro-batches in
    flight the last stage is P - 2 headers behind when rank 0 sends the next. Sent one by one
    rather than broadcast so that stage 1 takes its header as soon as it is ready: gloo runs a
    group's background collectives on two threads, so a third broadcast waits until the last
    stage has taken the first (docs/design/multi-node.md)."""

    def __init__(self, tp: TPGroup, stages: int = 1) -> None:
        self.tp = tp
        self.stages = stages
        # Headers sent in the background, oldest first: their works, and the tensors they send
        # (which must live until then).
        self._sending: deque[list[tuple[Any, torch.Tensor]]] = deque()

    def send(
        self,
        counts: tuple[int, ...],
        data: bytes,
        prompt_rows: list[int] | None,
        moves: KVMoves | None = None,
        lora: LoraStep | None = None,
        state: StateStep | None = None,
        drafted_rows: list[int] | None = None,
    ) -> None:
        copies = None if moves is None else dataclasses.astuple(moves)
        adapters = None if lora is None else lora.pack()
        states = None if state is None else state.pack()
        header = [list(counts), data, prompt_rows, copies, adapters, states, drafted_rows]
        self._send_header(_STEP, msgpack.packb(header))

    def send_stop(self) -> None:
        self._send_header(_STOP, b"")

    def recv(self) -> StepMessage | None:
        """The next step as rank 0 sent it; None when rank 0 stops."""
        header = self._recv_header()
        if header is None:
            return None
        counts, data, prompt_rows, copies, adapters, states, drafted = msgpack.unpackb(header)
        moves = None if copies is None else KVMoves(*copies)
        lora = None if adapters is None else LoraStep.unpack(adapters)
        state = None if states is None else StateStep.unpack(states)
        return StepMessage(tuple(counts), data, prompt_rows, moves, lora, state, drafted)

    def _send_header(self, kind: int, payload: bytes) -> None:
        tensors = [torch.tensor([kind, len(payload)], dtype=torch.int64)]
        if payload:
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        group = self.tp.cpu_group
        if self.stages == 1:
            for tensor in tensors:
                dist.broadcast(tensor, src=0, group=group)
            return
        while len(self._sending) > self.stages - 2:
            self._wait_oldest()
        ranks = range(1, dist.get_world_size(group))
        self._sending.append(
            [(dist.isend(t, dst=r, group=group), t) for r in ranks for t in tensors]
        )

    def _wait_oldest(self) -> None:
        for work, _ in self._sending.popleft():
            work.wait()

    def _recv_header(self) -> bytes | None:
        size = torch.empty(2, dtype=torch.int64)
        self._take(size)
        kind, length = size.tolist()
        if kind == _STOP:
            return None
        buf = torch.empty(length, dtype=torch.uint8)
        self._take(buf)
        return buf.numpy().tobytes()

    def _take(self, tensor: torch.Tensor) -> None:
        if self.stages == 1:
            dist.broadcast(tensor, src=0, group=self.tp.cpu_group)
        else:
            dist.recv(tensor, src=0, group=self.tp.cpu_group)


@dataclasses.dataclass(frozen=True)
class LoraStep:
    """A step's LoRA part: what rank 0's adapter manager did since the step before, and the
    slot of each scheduled request in row order (NO_SLOT: the base model)."""

    changes: LoraChanges
    slots: list[int]

    def pack(self) -> list[Any]:
        reads = [[ref.name, ref.path] for ref in self.changes.reads]
        writes = [[slot, ref.name, ref.path] for slot, ref in self.changes.writes]
        return [reads, writes, self.slots]

    @staticmethod
    def unpack(fields: list[Any]) -> LoraStep:
        reads, writes, slots = fields
        changes = LoraChanges(
            [LoraRef(name, path) for name, path in reads],
            [(slot, LoraRef(name, path)) for slot, name, path in writes],
        )
        return LoraStep(changes, slots)


@dataclasses.dataclass(frozen=True)
class StateStep:
    """A step's linear-attention part (Qwen3-Next): each scheduled request's state slot and
    whether its chunk starts it afresh, in row order, and the copies between slots and saved
    states rank 0's block manager planned; every rank keeps its heads' share of each slot."""

    slots: list[int]
    fresh: list[bool]
    copies: list[StateMove]
    drafts: list[int]  # speculation: each row's drafts (its verify positions but the first)

    @staticmethod
    def of(out: SchedulerOutput) -> StateStep:
        scheduled = out.scheduled
        slots, fresh = [s.state_slot for s in scheduled], [s.start == 0 for s in scheduled]
        drafts = [len(s.drafts) for s in scheduled]
        return StateStep(slots, fresh, list(out.state_copies), drafts)

    def pack(self) -> list[Any]:
        copies = [
            [c.slot, c.position] if isinstance(c, KeptDraftState) else [c.slot, c.snapshot, c.save]
            for c in self.copies
        ]
        return [self.slots, self.fresh, copies, self.drafts]

    @staticmethod
    def unpack(fields: list[Any]) -> StateStep:
        slots, fresh, copies, drafts = fields
        moves: list[StateMove] = [
            KeptDraftState(*c) if len(c) == 2 else StateCopy(*c) for c in copies
        ]
        return StateStep(slots, fresh, moves, drafts)


@dataclasses.dataclass(frozen=True)
class StepMessage:
    counts: tuple[int, ...]  # the packed step's layout, its widest table (InputBatch.unpack)
    data: bytes  # its host bytes
    prompt_rows: list[int] | None  # rows whose logits score prompt tokens, or None
    moves: KVMoves | None = None  # the host KV tier's copies, made before the forward
    lora: LoraStep | None = None  # with --enable-lora: the adapters' changes, the rows' slots
    state: StateStep | None = None  # with linear-attention layers: the rows' state slots
    # With speculation: the rows whose logits check drafts (model_runner.py drafted_row_indices),
    # whose logits come before the sampling rows' in the step's one product.
    drafted_rows: list[int] | None = None


# ---- the runners ------------------------------------------------------------------------------


class _ShardedRunner(ModelRunner):
    """A ModelRunner on one rank of a group: its KV cache holds as many blocks as fit on the
    tightest rank, so one block table is valid everywhere."""

    tp: TPGroup

    def _kv_blocks_that_fit(self) -> int:
        return self.tp.min_over_ranks(super()._kv_blocks_that_fit())


class TPModelRunner(_ShardedRunner):
    """Rank 0 of a tensor-parallel engine core: spawns ranks 1..N-1, then runs as a ModelRunner
    whose every step's inputs are broadcast to them before the forward."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.world_size
        model_config = peek_model_config(config.model)
        if model_config is not None:  # before any process starts
            ep = config.enable_expert_parallel
            check_tensor_parallel(model_config, config.tensor_parallel_size, ep)
            check_pipeline_parallel(model_config, config.pipeline_parallel_size)
            check_max_model_len(config, model_config)
        # Decided once, here, so that every rank starts from the same number.
        config = resolve_max_num_seqs(config, model_config)
        store = open_store(config)
        layout = NodeLayout.of(config)
        self.workers = spawn_workers(config, store.port, layout.ranks[1:])
        self.watch: WorkerWatch | None = None
        try:
            nodes = meet_nodes(store, config, self.workers) if config.nnodes > 1 else None
            wait_for_workers(store, self.workers, size, nodes)
            self.watch = WorkerWatch(self.workers, nodes)  # from here on, collectives with them
            device = resolve_device(config.device)
            self.tp = join_group(store, 0, config, device)
            super().__init__(config)
            # The engine core's warm-up steps go through it.
            self.channel = StepChannel(self.tp, self.stage.size)
        except BaseException:
            self._abandon_workers()
            raise
        # A weak reference: the finalizer must not keep the runner alive (it runs at exit too).
        args = (weakref.ref(self), self.channel, self.workers, self.watch)
        self._finalizer = weakref.finalize(self, shut_down, *args)
        logger.info(
            "%d ranks: tensor parallel %d x pipeline parallel %d (pids %s)",
            size, config.tensor_parallel_size, config.pipeline_parallel_size,
            [p.pid for p in self.workers],
        )  # fmt: skip

    def warm_up(self) -> None:
        """Rank 0's warm-up steps, which the workers follow through the channel as any step.
        If one fails (a step too large for some rank), the workers are stopped at once: they
        may wait in a collective that rank 0 will never join."""
        try:
            super().warm_up()
        except BaseException:
            self._finalizer.detach()
            self._abandon_workers()
            raise

    def can_step_after_a_cut(self) -> bool:
        """No: some ranks may wait in a collective that rank 0 left. The workers are stopped
        (without the stop handshake, which they could not answer)."""
        self._finalizer.detach()
        self._abandon_workers()
        return False

    def _abandon_workers(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        stop_processes(self.workers, timeout=0.0)  # they would wait for rank 0 forever
        leave_tp_group()

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        inputs = super().prepare_inputs(out)
        lora = None
        if self.loras is not None:
            lora = LoraStep(self.loras.take_changes(), self._lora_slots(out))
        state = StateStep.of(out) if self.num_state_slots else None
        step = self.input_batch.last_step()
        drafted = drafted_row_indices(out, inputs.meta.query_start_loc_cpu) or None
        self.channel.send(*step, inputs.prompt_rows_cpu, out.kv_moves, lora, state, drafted)
        return inputs

    def step_failed(self, error: BaseException) -> None:
        """A step that raised left the ranks out of step: some wait in a collective that rank 0
        left (or that a lost rank broke), so no later step can run. Failing the requests would
        keep a dead group serving errors; the process ends instead, and `tandem serve` starts a
        new engine core, to which the requests in flight move (docs/reliability.md). A lost
        rank is the usual cause; the watch is given a moment to name it."""
        cause = self.watch.wait_for_loss(_NAME_THE_LOSS_S) if self.watch is not None else None
        logger.critical(
            "a tensor-parallel step failed (%s); the group cannot run another, so this engine "
            "core exits (code %d)",
            cause or first_line(error), WORKER_LOST_EXIT_CODE,
        )  # fmt: skip
        logging.shutdown()
        os._exit(WORKER_LOST_EXIT_CODE)

    def _share_sampled(self, token_ids: torch.Tensor) -> None:
        # The workers' next placeholders. With pipeline stages no step has any (a request's
        # next step is planned once its token is in: core.py), and the ids are not sent.
        if self.stage.size == 1:
            self.tp.broadcast_from_driver(token_ids)

    def announce_stop(self) -> None:
        """Other nodes exit with this engine instead of waiting for its restart."""
        if self.watch is not None and self.watch.nodes is not None:
            self.watch.nodes.announce_stop()

    def shutdown(self) -> None:
        """Stop the workers and leave the group (idempotent; also runs at interpreter exit)."""
        self._finalizer()


class TPWorker(_ShardedRunner):
    """Ranks 1..N-1: load this rank's shard and KV cache, then run every step rank 0 sends."""

    def __init__(self, config: EngineConfig, rank: int, store: dist.TCPStore) -> None:
        device = resolve_device(config.device)
        self.tp = join_group(store, rank, config, device)
        super().__init__(config)
        self.channel = StepChannel(self.tp, self.stage.size)

    def serve(self) -> None:
        while (step := self.channel.recv()) is not None:
            self.follow(step)

    @torch.inference_mode()
    def follow(self, step: StepMessage) -> None:
        """Rank 0's launch() without the sampling: the same collectives in the same order."""
        if step.moves is not None:
            assert self.host_kv is not None  # every rank built its tier from the same config
            self.host_kv.apply(step.moves)  # this rank's shard of the blocks rank 0 moves
        packed = self.input_batch.unpack(step.counts, step.data, self._prev_sampled)
        # Copied before the forward is queued: a pageable copy after it would wait for it.
        prompt_rows = prompt_rows_on(step.prompt_rows, self.device)
        inputs = model_inputs(packed, prompt_rows, step.prompt_rows)
        if step.lora is not None:
            assert self.loras is not None  # every rank built its slots from the same config
            self.loras.follow(step.lora.changes)  # before the forward that may read them
            inputs.lora = self._lora_rows(step.lora.slots, packed.meta.query_start_loc_cpu)
        if step.state is not None:
            self._copy_states(step.state.copies)  # before this step reads the slots
            starts = packed.meta.query_start_loc_cpu
            state = step.state
            inputs.state = StateRows.plan(
                state.slots, state.fresh, starts, self.device, state.drafts, self.draft_state_row
            )
        hidden = self._forward(inputs)  # [T, hidden]
        if not self.stage.is_last:  # [2, T, hidden]: the stage's output, for the next one
            self.stage.send_activations(hidden)
            hidden = hidden[0]  # its rows, which only count for the logits on this stage
        if prompt_rows is not None:  # rank 0 scores prompt tokens in these slices
            for part in prompt_rows.split(PROMPT_LOGITS_ROWS):
                self.model.compute_logits(hidden[part])
        num_sampled = packed.logits_indices.numel()
        self._prev_sampled = None
        if step.drafted_rows:  # rank 0's one product over the drafted and the sampling rows
            drafted = torch.tensor(step.drafted_rows, dtype=torch.int64).to(self.device)
            rows = torch.cat((drafted, packed.logits_indices))
            self.model.compute_logits(hidden[rows], widen=False)
        elif num_sampled:
            self.model.compute_logits(hidden[packed.logits_indices], widen=False)
        if num_sampled and self.stage.size == 1:
            ids = torch.empty(num_sampled, dtype=torch.int64, device=self.device)
            self._prev_sampled = self.tp.broadcast_from_driver(ids)  # rank 0's sampled ids


def shut_down(
    runner: weakref.ref[ModelRunner],
    channel: StepChannel,
    workers: list[BaseProcess],
    watch: WorkerWatch,
) -> None:
    watch.stop()  # the workers are about to exit, as asked
    try:
        channel.send_stop()
    except Exception as exc:  # a worker already gone: stop the rest by signal
        logger.warning("could not tell the tensor-parallel workers to stop: %s", exc)
        stop_processes(workers, timeout=0.0)
    # Every rank tears its groups down at the same time (NCCL's teardown waits for the peers),
    # each after dropping its CUDA graphs, which hold NCCL work captured on the group.
    release_graphs(runner())
    leave_tp_group()
    stop_processes(workers)


def release_graphs(runner: ModelRunner | None) -> None:
    if runner is None or getattr(runner, "graph_runner", None) is None:
        return
    runner.graph_runner = None
    gc.collect()
    torch.cuda.synchronize()


def join_group(
    store: dist.TCPStore, rank: int, config: EngineConfig, device: torch.device
) -> TPGroup:
    """This rank's place in the engine's groups. The peer all-reduce reaches the GPUs of one
    host only, and is set up for one group: over several nodes, or with pipeline stages, NCCL
    does them all."""
    one_group = config.nnodes == 1 and config.pipeline_parallel_size == 1
    all_reduce = config.tp_all_reduce if one_group else "nccl"
    local_rank = NodeLayout.of(config).local_rank(rank)
    return join_tp_group(
        store, rank, config.world_size, device, all_reduce, local_rank,
        config.enable_expert_parallel, config.pipeline_parallel_size,
    )  # fmt: skip


# ---- worker processes -------------------------------------------------------------------------


def open_store(config: EngineConfig) -> dist.TCPStore:
    """Rank 0's store: on a free loopback port, or on --master-addr:--master-port for nodes."""
    if config.nnodes == 1:
        return create_store(config.world_size)
    read_secret(config.dist_secret_file)  # a bad file fails before any port opens
    timeout = datetime.timedelta(seconds=config.dist_timeout)
    host, port = rendezvous_host(config), config.master_port
    store = create_store(config.world_size, host, port, timeout)
    logger.warning(
        "rendezvous for %d nodes on %s:%d; torch.distributed's store and collectives are "
        "neither authenticated nor encrypted past it: keep this network private "
        "(docs/security.md)",
        config.nnodes, host, port,
    )  # fmt: skip
    return store


def meet_nodes(store: dist.TCPStore, config: EngineConfig, workers: list[BaseProcess]) -> NodeWatch:
    """Admit the other nodes (engine_core/nodes.py) and start watching them."""
    session = open_session(store)
    admit_nodes(store, config, session, lambda: check_started(workers))
    return NodeWatch(config, store.port)


def spawn_workers(config: EngineConfig, port: int, ranks: range) -> list[BaseProcess]:
    """This node's worker processes for ``ranks``, meeting at the store on ``port``."""
    ctx = torch.multiprocessing.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    workers = []
    for rank in ranks:
        args = (dataclasses.asdict(config), rank, port, os.getpid(), level)
        p = ctx.Process(target=run_worker, args=args, name=f"tandem-tp{rank}", daemon=True)
        p.start()
        workers.append(p)
    return workers


def wait_for_workers(
    store: dist.TCPStore, workers: list[BaseProcess], size: int, nodes: NodeWatch | None = None
) -> None:
    """Wait until ranks 1..size-1 reached the store, failing fast if one of ours exits first
    or another node is lost."""
    keys = [_WORKER_KEY.format(rank) for rank in range(1, size)]
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while not store.check(keys):
        check_started(workers)
        lost = nodes.lost() if nodes is not None else None
        if lost is not None:
            raise RuntimeError(f"{lost} during start-up (see its log)")
        if time.monotonic() > deadline:
            raise TimeoutError("tensor-parallel workers did not start within the store timeout")
        time.sleep(_RENDEZVOUS_POLL_S)


def check_started(workers: list[BaseProcess]) -> None:
    dead = [p for p in workers if p.exitcode is not None]
    if dead:
        raise RuntimeError(
            f"tensor-parallel worker {dead[0].name} exited with {dead[0].exitcode} "
            "during start-up (see its log above)"
        )


class WorkerWatch:
    """Ends rank 0's process when a worker exits before shutdown, or another node is lost.

    Rank 0's next collective would wait for the lost rank as long as the group's timeout
    allows (days on the header group, which must outwait an idle engine), and no exception can
    reach a thread blocked inside one: the engine core would hang, holding its GPU, with no
    error anywhere. Exiting instead makes the loss visible: `tandem serve` sees its engine
    process end and starts a new one, a script sees its engine's exit code. The offline LLM
    API on several GPUs exits too, for the same reason.
    """

    def __init__(self, workers: list[BaseProcess], nodes: NodeWatch | None = None) -> None:
        self.workers = workers
        self.nodes = nodes
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-worker-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(_WATCH_POLL_S):
            lost = self._lost()
            if lost is not None and not self._stopped.is_set():
                logger.critical(
                    "%s; this engine core cannot run without it and exits (code %d)",
                    lost, WORKER_LOST_EXIT_CODE,
                )  # fmt: skip
                logging.shutdown()
                os._exit(WORKER_LOST_EXIT_CODE)

    def wait_for_loss(self, timeout: float) -> str | None:
        """Why a worker or node is lost, polled for up to ``timeout`` s (None: none seen)."""
        deadline = time.monotonic() + timeout
        while (lost := self._lost()) is None and time.monotonic() < deadline:
            time.sleep(_WATCH_POLL_S)
        return lost

    def _lost(self) -> str | None:
        dead = next((p for p in self.workers if p.exitcode is not None), None)
        if dead is not None:
            code = dead.exitcode
            return f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with {code}"
        return self.nodes.lost() if self.nodes is not None else None


def first_line(error: BaseException) -> str:
    """torch.distributed's errors carry a C++ stack after their first line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def stop_processes(workers: list[BaseProcess], timeout: float = _STOP_TIMEOUT_S) -> None:
    for p in workers:
        p.join(timeout)
        if p.is_alive():
            logger.warning("%s did not stop within %.0f s: killing it", p.name, timeout)
            p.kill()
            p.join()


def run_worker(fields: dict[str, Any], rank: int, port: int, parent: int, log_level: int) -> None:
    """A worker process's entry point (spawned: it imports everything afresh). SIGINT and
    SIGTERM are rank 0's to act on: a terminal's Ctrl-C or a stop of the whole process group
    (systemd's) reaches the workers too, and rank 0 stops them once its own stop is due (a
    supervised engine after its parent's drain); its death takes them with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_parent_death_signal(parent)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s"
    )
    config = EngineConfig(**fields)
    if resolve_device(config.device).type == "cpu":
        # The node's cores are shared by its ranks; more threads each only oversubscribe them.
        per_node = NodeLayout.of(config).ranks_per_node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    store = connect_store(port, config.world_size, rendezvous_host(config))
    store.set(_WORKER_KEY.format(rank), "up")
    worker = TPWorker(config, rank, store)
    worker.serve()
    release_graphs(worker)
    leave_tp_group()  # with rank 0, which does the same after the stop
    logging.shutdown()
    # Nothing is left to do: skip the interpreter's teardown (CUDA graphs, NCCL handles).
    os._exit(0)
