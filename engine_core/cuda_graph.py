"""CUDA graphs: the model's forward captured at start-up, replayed with padded inputs.

A decode step of a small model is hundreds of short kernels, and so is a short prefill; launching
them one by one from Python costs more than running them (an idle llama-1b's 128-token prefill
enqueued eagerly: about 7 ms of host time for under 2 ms of kernels). Three kinds of graph, all
in one memory pool, captured largest first so that the smaller ones reuse its memory (the
prefill graphs a host-bound model adds past the default come after, see below):

- **decode**: batches of 1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs`` sequences of one new
  token each. A step with n sequences pads to the next size (slot -1: no KV write; seq_len 0: no
  attention).
- **verify** (with speculation, ``verify_queries`` = K + 1): batches of the decode sizes whose
  every sequence has exactly K + 1 new tokens (its last known token and K drafts), attended by
  the backend's verify kernel (attention/triton_kernels.py ``paged_verify_attention``), so no
  step pads to a prefill size (5 tokens at batch 1 to 16) and no work list is read. A step
  with n sequences pads to the next batch size with sequences of length 0 (slots -1).
- **prefill**: any other step (whole prompts, prompt chunks, prefix-cached prompts, decodes mixed
  in, verify steps with other draft counts, up to ``max_num_seqs`` sequences) of 16, 32, ...
  256, then 320, 384, 448, 512, 640, ... (``prefill_graph_sizes``) up to ``max_prefill_tokens``
  new tokens. The prefill attention kernel runs one program per
  row of a work list of (sequence, query tile) pairs (attention/prefill_tiles.py), captured at
  the most tiles a step of that many tokens can have; each replay writes the step's list, the
  rows past it (sequence -1) return at once, the padding rows (slot -1) write no KV, and their
  attention output is zero (``AttentionMetadata.padded``).

Larger steps run eagerly, as does everything with ``enforce_eager``, unless the model is small
enough for the host to be its bottleneck: with ``--max-prefill-graph-tokens`` unset, start-up times
an eager 2,048-token step's launches against its graph's kernels, and where launching takes
longer than the GPU would need for a whole step's tokens, prefill graphs go on doubling up to
``--max-num-batched-tokens`` (``extends_prefill_graphs``). A decode graph also captures
the step's logits and their argmax (``DecodeTail``) where the model's logits are a plain product
(``plain_logits_weight``: one rank, no soft cap): every row of a decode step samples, so they are
always wanted. An all-greedy batch (argmax only) then takes its tokens straight from the graph; any
other runs the eager sampler on the graph's logits. That is three launches and their Python a
step fewer on the host, which the GPU of a small model would otherwise wait for. Prefill graphs
capture the forward only: the rows that sample change from step to step. So do verify graphs
(every row's logits are wanted there; a tail for them is not built).

A model with several KV layer groups (engine_core/kv_groups.py) has a static slot mapping and
block tables per group, each staged like group 0's; a model with linear-attention layers
(Qwen3-Next) has the state slot of each decode row, padding rows naming a slot no request holds
(its prompt steps, which loop over sequences on the host, run eagerly; docs/design/
kv-layer-groups.md, "CUDA graphs with groups and state slots").

With LoRA every graph runs the LoRA kernels over a static tile table (docs/design/lora.md), and
the decode graphs come twice: a decode step without adapter rows replays the copy captured
without those kernels, so the base model's traffic on a LoRA engine pays nothing for them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine_core.attention.base import (
    SHARED_PREFIX_MIN_ROWS,
    AttentionBackend,
    AttentionMetadata,
)
from engine_core.attention.layer import Attention
from engine_core.attention.prefill_tiles import (
    NO_SEQUENCE,
    capacity,
    device_tiles,
    prefill_block_m,
)
from engine_core.forward_context import StateRows, forward_context
from engine_core.lora.batch import NO_SLOT, TILE_ROWS, LoraBatch, tile_capacity, tiles_of

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_num_seqs``; ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


# Decode steps whose rows share their leading pages replay graphs of their own, which attend
# those pages once (attention/triton_kernels.py, the shared-prefix pass), while the other steps'
# graphs launch no pass at all (idle, it cost 1.5-2.5 us a layer: docs/design/kernels-and-
# limits.md). Their sizes step by half a doubling (8, 12, 16, 24, 32, ...) up to max_num_seqs,
# a step padded to the next: at most a third more rows, whose products read the weights a
# decode step reads anyway (a mixture of experts' padding rows may reach a few more experts),
# and capture adds 2 graphs a doubling (15 at 1,024 rows).


def shared_graph_sizes(max_num_seqs: int) -> list[int]:
    """SHARED_PREFIX_MIN_ROWS times 1, 1.5, 2, 3, 4, 6, ... while below ``max_num_seqs``,
    then ``max_num_seqs``; empty below SHARED_PREFIX_MIN_ROWS."""
    if max_num_seqs < SHARED_PREFIX_MIN_ROWS:
        return []
    sizes, size = [], SHARED_PREFIX_MIN_ROWS
    while size < max_num_seqs:
        sizes.append(size)
        if size * 3 // 2 < max_num_seqs:
            sizes.append(size * 3 // 2)
        size *= 2
    return [*sizes, max_num_seqs]


_MIN_PREFILL_TOKENS = 16
# Prefill graphs always cover steps of up to this many tokens (--max-prefill-graph-tokens unset);
# past it, only where the host is the bottleneck (``extends_prefill_graphs``).
DEFAULT_PREFILL_GRAPH_TOKENS = 2048
# From here to DEFAULT_PREFILL_GRAPH_TOKENS prefill graph sizes step by quarters, not doubling.
_QUARTERS_FROM = 256


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """16, 32, ... 256 doubling, then steps of a quarter of the power of two below (320, 384,
    448, 512, 640, ... 2,048), doubling again past 2,048; then ``max_tokens``; ascending.

    Empty when ``max_tokens`` is 0 (no prefill graphs). A step pads to the next size: below 256
    tokens the padding is cheap (the step is bound by its weights, not its rows), so sizes
    double; from 256 on each padded row costs its share of the GEMMs, so no step pads by more
    than a quarter up to 2,048. Past 2,048 (the extension where the host is the bottleneck)
    sizes double again to keep the captured memory and start-up time small.
    """
    if max_tokens <= 0:
        return []
    sizes = []
    size = _MIN_PREFILL_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size = _next_prefill_size(size)
    sizes.append(max_tokens)
    return sizes


def _next_prefill_size(size: int) -> int:
    """The prefill graph size after ``size`` (see prefill_graph_sizes)."""
    if size < _QUARTERS_FROM or size >= DEFAULT_PREFILL_GRAPH_TOKENS:
        return size * 2
    power_below = 1 << (size.bit_length() - 1)
    return size + power_below // 4


def prefill_graph_bounds(
    asked: int | None, step_budget: int, tensor_parallel_size: int
) -> tuple[int, int]:
    """(the prefill graphs always captured, in tokens; how far they may extend, 0: not) for
    ``--max-prefill-graph-tokens`` ``asked`` (None: unset) and ``--max-num-batched-tokens``.

    Unset, they cover DEFAULT_PREFILL_GRAPH_TOKENS and may extend to the step budget where the
    host is the bottleneck (``extends_prefill_graphs``); set, exactly what was asked. Never past
    the budget, and never extended across tensor-parallel ranks: each would time its own host,
    and they must not disagree on which steps replay a graph."""
    floor = DEFAULT_PREFILL_GRAPH_TOKENS if asked is None else asked
    may_extend = asked is None and tensor_parallel_size == 1
    return min(floor, step_budget), step_budget if may_extend else 0


def extends_prefill_graphs(host_s: float, gpu_s: float, top: int, extend_to: int) -> bool:
    """Whether steps of up to ``extend_to`` tokens should replay graphs too, given an eager
    ``top``-token step's host time (launching its kernels one by one) and its graph's GPU time.

    Past ``top`` a step pads to the next of ``top``x2, x4, ... (or ``extend_to``): up to twice the
    GPU work. That is free only where the GPU has time to spare, so the graphs extend where even
    a whole ``extend_to``-token step's GPU time (scaled from ``top``'s, as the products' work
    is) is shorter than launching the ``top``-token step eagerly, which takes the same host time
    at any token count. For a small model (smollm2-135m: 26.5 ms of eager launches against
    1.76 ms of kernels at 2,048 tokens) they extend; for a larger one (llama-1b: 8-16 ms
    against 5.9 ms, x4 at 8,192) they do not (docs/design/cuda-graphs-and-warm-up.md,
    "Extended prefill graphs for host-bound models"). The host time is measured at start-up, and
    varies between processes: a model near the line may decide either way from one start to
    the next (both are correct; only speed differs).
    """
    return extend_to > top > 0 and host_s > gpu_s * extend_to / top


def prefill_graph_shape(tokens: int, max_seqs: int) -> tuple[int, int]:
    """(sequences, work-list rows) of the prefill graph of ``tokens`` tokens: as many
    sequences as tokens up to ``max_seqs``, and room for every tile such a step can have."""
    seqs = min(tokens, max_seqs)
    return seqs, capacity(tokens, seqs, prefill_block_m(tokens))


def verify_graph_queries(model: nn.Module, backend: AttentionBackend, num_drafts: int) -> int:
    """K + 1 (``num_drafts`` + 1) where verify steps of K drafts can have graphs of their own:
    every attention layer of ``model`` is plain full K/V attention that the backend attends
    through its verify kernel at that many queries (``verifies``), so the graph reads no
    prefill work list; else 0 (verify steps then replay prefill graphs). Windowed layers too
    take the kernel, eagerly, but no verify graph: a verify replay stages group 0's block
    tables and slots only, not a window group's (engine_core/kv_groups.py)."""
    queries = num_drafts + 1
    verifies = getattr(backend, "verifies", None)
    layers = model.attention_layers()
    if verifies is None or not layers:
        return 0
    for layer in layers:
        if type(layer) is not Attention or layer.sliding_window is not None:
            return 0
        plain = layer.sinks is None and layer.attention_chunk is None
        if not verifies(layer.num_heads, layer.num_kv_heads, layer.head_dim, queries, plain):
            return 0
    return queries


@dataclass
class DecodeTail:
    """What a decode graph computes after the forward, into static buffers: the logits of every
    row and their argmax over the vocabulary (the sampler's whole work for an argmax-only row)."""

    weight: torch.Tensor  # [V', hidden]: logits == hidden @ weight.T (V' >= vocab: padding)
    vocab_size: int
    logits: torch.Tensor  # [max_seqs, V'] in the weights' dtype
    argmax: torch.Tensor  # [max_seqs] int64

    @classmethod
    def allocate(cls, weight: torch.Tensor, vocab_size: int, max_seqs: int) -> DecodeTail:
        logits = torch.empty(max_seqs, weight.shape[0], dtype=weight.dtype, device=weight.device)
        argmax = torch.zeros(max_seqs, dtype=torch.int64, device=weight.device)
        return cls(weight, vocab_size, logits, argmax)

    def run(self, hidden: torch.Tensor) -> None:
        """hidden [B, hidden] -> logits[:B] (hidden @ weight.T, within rounding of F.linear's)
        and argmax[:B], for a graph, on our kernels rather than cuBLAS and torch.argmax: the
        product by the skinny GEMM where a plain Linear would take it, with the argmax's first
        step in its epilogue (so the logits are not read again: one launch fewer a step), and
        the argmax's second step in a chain kernel. The graph's logits then differ from an eager
        step's (compute_logits, cuBLAS) by the rounding of another summation order, as its
        layers' products do; the replay of a decode graph took 6-13 us less for smollm2 and
        llama-1b at decode-64, 21-26 us less for llama-8b (docs/design/cuda-graphs-and-warm-up.md,
        "The decode tail")."""
        from engine_core.models import skinny_gemm, triton_ops  # import triton: CUDA only

        rows = hidden.shape[0]
        logits = self.logits[:rows]
        argmax = self.argmax[:rows]
        if skinny_gemm.decode_linear_argmax(hidden, self.weight, self.vocab_size, logits, argmax):
            return
        if skinny_gemm.decode_linear(hidden, self.weight, None, out=logits) is None:
            torch.mm(hidden, self.weight.t(), out=logits)
        triton_ops.row_argmax(logits, self.vocab_size, out=argmax)


@dataclass
class GraphBuffers:
    """The static tensors every graph reads and writes; a replay first copies a step into them.

    Rows are tokens (N: the most any graph runs), sequences are at most ``max_seqs``.
    """

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64, -1 on padding rows
    seq_lens: torch.Tensor  # [max_seqs] int32, 0 on padding sequences
    block_tables: torch.Tensor  # [max_seqs, max_blocks_per_seq] int32
    decode_query_start: torch.Tensor  # [max_seqs + 1] int32: 0, 1, ... (one token a sequence)
    prefill_query_start: torch.Tensor  # [max_seqs + 1] int32, set by each prefill replay
    prefill_tiles: torch.Tensor  # [most tiles, 2] int32: the prefill kernel's work list
    hidden: torch.Tensor  # [N, hidden]: the captured forward's output
    # With LoRA: the LoRA kernels' tile table (lora/batch.py) for N rows, NO_SLOT in every
    # tile's slot where a step has no adapter rows; each replay writes its step's. None: no LoRA.
    lora_table: torch.Tensor | None = None
    # With LoRA: each row's slot [N] int32 (NO_SLOT on padding rows and base rows), which the
    # MoE experts' LoRA kernels read (lora/triton_moe.py); each replay writes its step's.
    lora_token_slots: torch.Tensor | None = None
    # KV layer groups 1.. (engine_core/kv_groups.py; none with one group): each its own slot
    # mapping and block tables, beside group 0's above. [G-1, N] int64 (-1 on padding rows)
    # and [G-1, max_seqs, max_blocks_per_seq] int32.
    group_slot_mapping: torch.Tensor | None = None
    group_block_tables: torch.Tensor | None = None
    # Linear-attention layers (Qwen3-Next): the state slot of each decode row, [max_seqs]
    # int64, and the rows themselves (0, 1, ...: one token a sequence); None: no such layers.
    # Padding rows name ``pad_state_slot``, a slot no request holds: their updates land there.
    state_slots: torch.Tensor | None = None
    state_rows: torch.Tensor | None = None
    pad_state_slot: int = -1
    # [2] int32: the step's shared prefix (AttentionMetadata.shared_prefix), 0 tokens in steps
    # without; ``shared_prefix_staged``: whether the last replay had one.
    shared_prefix: torch.Tensor | None = None
    shared_prefix_staged: bool = False
    # [max_seqs] int32: a decode step's row order (AttentionMetadata.row_order), each padding
    # row its own index, so that a graph's rows are always a permutation; staged with the rows.
    row_order: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tiles: int = 0,
        lora_tiles: int = 0,
        num_groups: int = 1,
        pad_state_slot: int | None = None,
    ) -> GraphBuffers:
        """``num_groups``: the model's KV layer groups; ``pad_state_slot``: the state slot that
        padding rows update (None: the model has no linear-attention layers)."""

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        lora_size = lora_tiles * (1 + TILE_ROWS)
        lora_table = torch.full((lora_size,), NO_SLOT, dtype=torch.int32, device=device)
        token_slots = torch.full((max_tokens,), NO_SLOT, dtype=torch.int32, device=device)
        more = num_groups - 1
        group_slots = group_tables = state_slots = state_rows = None
        if more:
            group_slots = torch.full((more, max_tokens), -1, dtype=torch.int64, device=device)
            group_tables = zeros(more, max_seqs, max_blocks_per_seq, dtype=torch.int32)
        if pad_state_slot is not None:
            state_slots = torch.full((max_seqs,), pad_state_slot, dtype=torch.int64, device=device)
            state_rows = torch.arange(max_seqs, dtype=torch.int64, device=device)
        return cls(
            input_ids=zeros(max_tokens),
            positions=zeros(max_tokens),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            seq_lens=zeros(max_seqs, dtype=torch.int32),
            block_tables=zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32),
            decode_query_start=torch.arange(max_seqs + 1, dtype=torch.int32, device=device),
            prefill_query_start=zeros(max_seqs + 1, dtype=torch.int32),
            prefill_tiles=torch.full((max_tiles, 2), NO_SEQUENCE, dtype=torch.int32, device=device),
            hidden=zeros(max_tokens, hidden_size, dtype=dtype),
            lora_table=lora_table if lora_tiles else None,
            lora_token_slots=token_slots if lora_tiles else None,
            group_slot_mapping=group_slots,
            group_block_tables=group_tables,
            state_slots=state_slots,
            state_rows=state_rows,
            pad_state_slot=-1 if pad_state_slot is None else pad_state_slot,
            shared_prefix=zeros(2, dtype=torch.int32),
            row_order=torch.arange(max_seqs, dtype=torch.int32, device=device),
        )

    @property
    def num_groups(self) -> int:
        tables = self.group_block_tables
        return 1 + (0 if tables is None else tables.shape[0])

    def group_metadata(self, meta: AttentionMetadata) -> tuple[AttentionMetadata, ...]:
        """Every group's metadata of a graph whose group 0 reads ``meta`` (metadata over these
        buffers): ``meta`` first, then groups 1.. over their own slots and tables, as many rows
        and sequences; empty with one group (the forward context's convention)."""
        if self.group_slot_mapping is None or self.group_block_tables is None:
            return ()
        rows, seqs = meta.slot_mapping.shape[0], meta.block_tables.shape[0]
        return (
            meta,
            *(
                dataclasses.replace(meta, slot_mapping=slots[:rows], block_tables=tables[:seqs])
                for slots, tables in zip(
                    self.group_slot_mapping, self.group_block_tables, strict=True
                )
            ),
        )

    def group_buffers(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV group ``group``'s static slot mapping [N] and block tables [max_seqs, width]."""
        if not group:
            return self.slot_mapping, self.block_tables
        assert self.group_slot_mapping is not None and self.group_block_tables is not None
        return self.group_slot_mapping[group - 1], self.group_block_tables[group - 1]

    def decode_state(self, batch: int) -> StateRows | None:
        """What a decode graph of ``batch`` rows captures for linear attention: every row one
        token of its own sequence, reading and writing the slot the buffers name (no chunk, and
        no slot to zero: a replay zeroes a fresh row's slot before it, ``stage_decode``)."""
        if self.state_slots is None or self.state_rows is None:
            return None
        return StateRows(self.state_rows[:batch], self.state_slots[:batch], [], None)

    def stage_decode(
        self,
        step: tuple[torch.Tensor, torch.Tensor],  # the step's input ids and positions [n]
        metas: Sequence[AttentionMetadata],  # every group's (group 0's alone with one group)
        state: StateRows | None,
        batch: int,  # the graph's rows: rows n.. are padding
    ) -> None:
        """A decode step's inputs into the buffers of a ``batch``-row graph, the padding rows
        inert: no KV slot in any group, no context, and the padding state slot."""
        from engine_core.models.triton_ops import stage_decode_inputs  # imports triton

        ids, positions = step
        staged = (self.input_ids, self.positions)
        assert self.row_order is not None
        for g, meta in enumerate(metas):
            # One launch a group: group 0's copies the ids, positions, seq_lens and row order
            # too, and the later ones copy those again (the same values) beside their slots
            # and tables.
            slots, tables = self.group_buffers(g)
            stage_decode_inputs(
                (ids, positions, meta.slot_mapping, meta.seq_lens),
                meta.block_tables,
                (*staged, slots, self.seq_lens),
                tables,
                batch,
                (meta.row_order, self.row_order),
            )
        if state is not None:
            self.stage_state(state, len(metas[0].seq_lens_cpu), batch)
        self.stage_shared_prefix(metas[0].shared_prefix)

    def stage_shared_prefix(self, shared: torch.Tensor | None) -> None:
        """A decode step's shared-prefix tokens into the buffer (zeroed once after a step
        that had them, where this one has none)."""
        assert self.shared_prefix is not None
        if shared is not None:
            self.shared_prefix.copy_(shared, non_blocking=True)
        elif self.shared_prefix_staged:
            self.shared_prefix.zero_()
        self.shared_prefix_staged = shared is not None

    def stage_state(self, state: StateRows, n: int, batch: int) -> None:
        """A decode step's state slots into the buffers (rows n.. the padding slot)."""
        assert self.state_slots is not None and state.decode_slots is not None
        self.state_slots[:n].copy_(state.decode_slots, non_blocking=True)
        if batch > n:
            self.state_slots[n:batch].fill_(self.pad_state_slot)

    def stage_common(
        self,
        step: tuple[torch.Tensor, torch.Tensor],  # the step's input ids and positions [T]
        metas: Sequence[AttentionMetadata],  # every group's (group 0's alone with one group)
        rows: int,  # the graph's rows: rows T.. are padding
    ) -> None:
        """A prefill step's tokens and sequences into the buffers: every group's slots and
        tables, no KV slot on the padding rows."""
        ids, positions = step
        tokens, n = ids.shape[0], len(metas[0].seq_lens_cpu)
        self.input_ids[:tokens].copy_(ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(metas[0].seq_lens, non_blocking=True)
        for g, meta in enumerate(metas):
            slots, tables = self.group_buffers(g)
            slots[:tokens].copy_(meta.slot_mapping, non_blocking=True)
            if rows > tokens:
                slots[tokens:rows].fill_(-1)
            width = meta.block_tables.shape[1]
            tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.stage_shared_prefix(metas[0].shared_prefix)

    def decode_metadata(
        self, batch: int, max_model_len: int, shared: bool = False
    ) -> AttentionMetadata:
        """Decode metadata over the first ``batch`` rows of the buffers; ``shared``: with the
        shared-prefix buffer (the graphs of steps whose rows share pages).

        The host lists are placeholders (a graph cannot read per-step host values); the decode
        path of a graph-safe backend reads only the device tensors and their shapes.
        """
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.decode_query_start[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=max_model_len,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[max_model_len] * batch,
            shared_prefix=self.shared_prefix if shared else None,
            row_order=None if self.row_order is None else self.row_order[:batch],
        )

    def prefill_metadata(self, tokens: int, max_model_len: int) -> AttentionMetadata:
        """Metadata of a prefill graph of ``tokens`` rows (and as many sequences at most).

        ``max_query_len`` is the bucket's size: it sets the kernel's tile height, and the work
        list has room for every tile such a step can have. The host lists are placeholders.
        """
        seqs, rows = prefill_graph_shape(tokens, self.seq_lens.shape[0])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.prefill_query_start[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            max_query_len=tokens,
            max_seq_len=max_model_len,
            query_start_loc_cpu=[0] * (seqs + 1),
            seq_lens_cpu=[max_model_len] * seqs,
            padded=True,
            prefill_tiles=self.prefill_tiles[:rows],
            shared_prefix=self.shared_prefix if self.num_groups == 1 else None,
        )

    def verify_metadata(
        self, batch: int, queries: int, query_start: torch.Tensor, max_model_len: int
    ) -> AttentionMetadata:
        """Metadata of a verify graph: ``batch`` sequences of ``queries`` new tokens each
        (``query_start``: 0, Q, 2Q, ..., static). The host lists are placeholders; no work
        list: every layer attends through the verify kernel (verify_graph_queries)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: batch * queries],
            query_start_loc=query_start,
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=queries,
            max_seq_len=max_model_len,
            query_start_loc_cpu=list(range(0, (batch + 1) * queries, queries)),
            seq_lens_cpu=[max_model_len] * batch,
            uniform_query_len=queries,
        )


class CudaGraphRunner:
    """Captures and replays the model's forward for decode and small prefill steps."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_prefill_tokens: int = 0,
        extend_prefill_to: int = 0,
        vocab_size: int = 0,
        lora_slots: int = 0,
        verify_queries: int = 0,
        num_kv_groups: int = 1,
        state_tensors: Sequence[torch.Tensor] = (),
        pad_state_slot: int | None = None,
        shared_decode_graphs: bool = True,
    ) -> None:
        """``num_kv_groups``: the model's KV layer groups, each its own static slots and
        tables. ``state_tensors``: every linear-attention layer's state tensors [slots, ...]
        (empty: none), the slot ``pad_state_slot`` one no request holds (decode graphs only:
        such a model's prompt steps loop over their chunks on the host).
        ``shared_decode_graphs``: whether steps may name shared pages (a forward whose
        metadata never does, EAGLE-3's head, captures no shared decode graphs).
        ``vocab_size``: the model's vocabulary, for the decode graphs' argmax; with the
        model's ``plain_logits_weight`` they capture the logits (0 or no such weight: not).
        ``lora_slots``: the model's LoRA slots (0: no LoRA); every graph then runs the LoRA
        kernels over the static tile table, which each replay fills with its step's rows, and
        the decode graphs are captured a second time without them (``base_graphs``), for the
        decode steps that have no adapter row.
        ``extend_prefill_to``: after capture, prefill graphs up to this many tokens too, where
        ``extends_prefill_graphs`` says the host is the bottleneck (0: never).
        ``verify_queries``: K + 1 with speculation where ``verify_graph_queries`` allows it:
        verify graphs at every decode batch size (0: none)."""
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.prefill_sizes = prefill_graph_sizes(max_prefill_tokens)
        self.max_prefill_tokens = self.prefill_sizes[-1] if self.prefill_sizes else 0
        # Room in the buffers for the graphs an extension may add (captured graphs bake in the
        # buffers' addresses, so they cannot grow later), kept even where it declines: the rows
        # of the step budget, e.g. 64 MiB of hidden states for llama-8b at 8,192 tokens.
        self.extend_prefill_to = extend_prefill_to if self.max_prefill_tokens else 0
        max_blocks = -(-max_model_len // block_size)
        top = max(self.max_prefill_tokens, self.extend_prefill_to)
        self.verify_queries = verify_queries
        rows = max(self.max_batch * max(verify_queries, 1), top)
        self.lora_slots = lora_slots
        # The tiles of a step of the buffers' rows: the table every step's LoraBatch is laid
        # out for (model_runner), so that a replay copies it whole.
        self.lora_tiles = tile_capacity(rows, lora_slots) if lora_slots else 0
        self._lora_clear = True  # the static table names no slot (no copy needed for none)
        self.buffers = GraphBuffers.allocate(
            rows,
            self.max_batch,
            max_blocks,
            hidden_size,
            dtype,
            device,
            max_tiles=prefill_graph_shape(top, self.max_batch)[1] if top else 0,
            lora_tiles=self.lora_tiles,
            num_groups=num_kv_groups,
            pad_state_slot=pad_state_slot,
        )
        self.state_tensors = tuple(state_tensors)
        weight = model.plain_logits_weight()  # see engine_core/models/__init__.py
        self.tail: DecodeTail | None = None
        if weight is not None and vocab_size > 0:
            self.tail = DecodeTail.allocate(weight, vocab_size, self.max_batch)
        self._tail_rows = 0  # rows of the last replay's tail to hand out (0: none)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode, by batch size
        # Decode graphs with the shared-prefix pass, by batch size (shared_graph_sizes; one
        # KV group only: input_batch.py finds shared pages in group 0's tables alone; not for
        # a forward whose metadata never names shared pages: ``shared_decode_graphs``). With
        # LoRA, whose steps choose between graphs with and without its kernels already, the
        # decode graphs carry the pass themselves (``pass_in_decode_graphs``), idle where a
        # step shares nothing.
        shares = shared_decode_graphs and num_kv_groups == 1
        self.shared_sizes = shared_graph_sizes(max_num_seqs) if shares and not lora_slots else []
        self.pass_in_decode_graphs = shares and bool(lora_slots)
        self.shared_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.shared_replays = 0  # decode steps that replayed one of them (tests, benchmarks)
        # With LoRA: decode graphs captured without the LoRA kernels, for the steps that have
        # no adapter row (the base model's traffic then pays nothing for LoRA), by batch size.
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # prefill, by tokens
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # verify, by batch size
        # Each verify graph's static query starts (0, Q, 2Q, ...), kept alive with it.
        self._verify_starts: dict[int, torch.Tensor] = {}
        self.verify_replays = 0  # verify steps that replayed a graph (tests, benchmarks)
        # The rows of the decode graph the last run replayed, its padding included; 0 where it
        # replayed a prefill or verify graph (the profiler's step shapes, engine_core/profiler.py).
        self.last_decode_rows = 0
        self.pool: tuple[int, int] | None = None
        # _bucket[n]: the smallest captured decode size >= n, for n in 0..max_batch
        self._bucket = [
            next(s for s in self.batch_sizes if s >= n) for n in range(self.max_batch + 1)
        ]
        # _shared_bucket[n]: the smallest shared graph's size >= n, for n up to the largest
        top = self.shared_sizes[-1] + 1 if self.shared_sizes else 0
        self._shared_bucket = [next(s for s in self.shared_sizes if s >= n) for n in range(top)]

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> float:
        """Capture every graph, the one needing the most memory first; returns the seconds."""
        from tqdm import tqdm

        start = time.perf_counter()
        plan = [("decode", n) for n in self.batch_sizes] + [
            ("prefill", t) for t in self.prefill_sizes
        ]
        if self.lora_slots:
            plan += [("decode-base", n) for n in self.batch_sizes]
        self._keep_shared_graphs_if_a_layer_takes_the_pass()
        plan += [("decode-shared", n) for n in self.shared_sizes]
        if self.verify_queries:
            plan += [("verify", n) for n in self.batch_sizes]
        # Activation memory grows with the rows a graph runs: a prefill graph's rows are its
        # tokens, a verify graph's K + 1 a sequence; on ties the prefill graph (more attention
        # work) goes first.
        # (A shared decode graph needs a little more than the plain one of its size: first.)
        plan.sort(
            key=lambda kind_size: (
                self._rows(*kind_size),
                kind_size[0] == "prefill",
                kind_size[0] == "decode-shared",
            ),
            reverse=True,
        )
        for kind, size in tqdm(plan, desc="Capturing CUDA graphs", disable=not progress):
            if kind == "prefill":
                self._capture_prefill(size)
                continue
            if kind == "verify":
                self._capture_verify(size)
                continue
            shared = kind == "decode-shared" or self.pass_in_decode_graphs
            meta, state = self._decode_graph_inputs(size, shared)
            if kind == "decode":
                self.graphs[size] = self._capture_one(size, meta, self.tail, state=state)
            elif kind == "decode-shared":
                self.shared_graphs[size] = self._capture_one(size, meta, self.tail, state=state)
            else:
                self.base_graphs[size] = self._capture_one(
                    size, meta, self.tail, lora=False, state=state
                )
        torch.cuda.synchronize()
        self._extend_prefill_if_host_bound()
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs in %.1f s (decode batches %d..%d, prefill steps of %s "
            "tokens, verify steps of %s tokens a sequence)",
            len(self.graphs) + len(self.base_graphs) + len(self.shared_graphs)
            + len(self.prefill_graphs) + len(self.verify_graphs),
            elapsed,
            self.batch_sizes[0],
            self.max_batch,
            f"{self.prefill_sizes[0]}..{self.max_prefill_tokens}" if self.prefill_sizes else "no",
            self.verify_queries or "no",
        )  # fmt: skip
        return elapsed

    def _keep_shared_graphs_if_a_layer_takes_the_pass(self) -> None:
        """Drop the shared decode graphs where no layer attends shared pages once (FP8
        caches, MLA, windows, heads over 128: the backend declines): one eager forward of the
        smallest one's inputs (padding rows only: it writes nothing), counting the backend's
        passes."""
        if not self.shared_sizes:
            return
        passes = getattr(self.backend, "shared_prefix_passes", None)
        if passes is not None:
            size = self.shared_sizes[0]
            meta, state = self._decode_graph_inputs(size, shared=True)
            self._graph_forward(size, meta, self.tail, state=state)()
            if self.backend.shared_prefix_passes > passes:
                return
        logger.info("no layer attends shared pages once: no shared decode graphs")
        self.shared_sizes, self._shared_bucket = [], []

    def _rows(self, kind: str, size: int) -> int:
        """The token rows of a graph of ``kind`` and ``size`` (its batch; a prefill graph's
        tokens)."""
        return size * self.verify_queries if kind == "verify" else size

    def _extend_prefill_if_host_bound(self) -> None:
        """Capture prefill graphs past ``max_prefill_tokens`` up to ``extend_prefill_to`` where
        the largest captured one shows the host to be the bottleneck (see there)."""
        top, extend_to = self.max_prefill_tokens, self.extend_prefill_to
        if extend_to <= top or not top:
            return
        host_s, gpu_s = self._eager_and_graph_seconds(top)
        if not extends_prefill_graphs(host_s, gpu_s, top, extend_to):
            logger.info(
                "prefill graphs stay at %d tokens: an eager %d-token step took %.1f ms on the "
                "host, its graph %.2f ms on the GPU (x%.1f for %d tokens is longer)",
                top, top, 1e3 * host_s, 1e3 * gpu_s, extend_to / top, extend_to,
            )  # fmt: skip
            return
        extra = [size for size in prefill_graph_sizes(extend_to) if size > top]
        for size in extra:
            self._capture_prefill(size)
        torch.cuda.synchronize()
        self.prefill_sizes += extra
        self.max_prefill_tokens = extra[-1]
        logger.info(
            "prefill graphs extended to %d tokens: an eager %d-token step took %.1f ms on the "
            "host, its graph %.2f ms on the GPU",
            extend_to, top, 1e3 * host_s, 1e3 * gpu_s,
        )  # fmt: skip

    def _eager_and_graph_seconds(self, size: int) -> tuple[float, float]:
        """(host seconds to launch a ``size``-token prefill eagerly, GPU seconds of its graph's
        replay), each the best of three. The eager launch is timed with the GPU idle, so it
        never waits for a full queue: it is the host's own time. The graph's replay has no gaps
        between kernels: it is the GPU's own time."""
        buf = self.buffers
        meta = buf.prefill_metadata(size, self.max_model_len)
        host, gpu = [], []
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            torch.cuda.synchronize()
            groups = buf.group_metadata(meta)
            with forward_context(meta, self.backend, self._static_lora(size), groups):
                started = time.perf_counter()
                self.model(buf.input_ids[:size], buf.positions[:size])
                host.append(time.perf_counter() - started)
            torch.cuda.synchronize()
            begin.record()
            self.prefill_graphs[size].replay()
            end.record()
            end.synchronize()
            gpu.append(begin.elapsed_time(end) / 1e3)
        return min(host), min(gpu)

    def _capture_prefill(self, size: int) -> None:
        meta = self.buffers.prefill_metadata(size, self.max_model_len)
        self.prefill_graphs[size] = self._capture_one(size, meta)

    def _capture_verify(self, batch: int) -> None:
        queries = self.verify_queries
        starts = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32)
        self._verify_starts[batch] = starts.to(self.buffers.seq_lens.device)
        buf = self.buffers
        meta = buf.verify_metadata(batch, queries, self._verify_starts[batch], self.max_model_len)
        self.verify_graphs[batch] = self._capture_one(batch * queries, meta)
        if meta.prefill_tiles is not None:  # the backend worked a list out: a prefill kernel ran
            raise RuntimeError(
                "a layer attended a verify graph through the prefill kernel, whose work list "
                "the graph would keep from its capture (verify_graph_queries must refuse it)"
            )

    def _decode_graph_inputs(
        self, size: int, shared: bool = False
    ) -> tuple[AttentionMetadata, StateRows | None]:
        """What the decode graph of ``size`` rows reads: metadata over the buffers' first
        ``size`` rows (every KV group's static slots and tables; ``shared``: the shared-prefix
        buffer) and the linear-attention rows' static slots."""
        buf = self.buffers
        return buf.decode_metadata(size, self.max_model_len, shared), buf.decode_state(size)

    def decode_forward(
        self, size: int, lora: bool = True, shared: bool = False
    ) -> Callable[[], None]:
        """The forward the decode graph of ``size`` rows captures (``shared``: the shared
        decode graph's), to run without capturing (tests on the CPU)."""
        meta, state = self._decode_graph_inputs(size, shared or self.pass_in_decode_graphs)
        return self._graph_forward(size, meta, self.tail, lora, state)

    def _capture_one(
        self,
        rows: int,
        meta: AttentionMetadata,
        tail: DecodeTail | None = None,
        lora: bool = True,
        state: StateRows | None = None,
    ) -> torch.cuda.CUDAGraph:
        """A graph of ``_graph_forward``'s forward."""
        return self._capture(self._graph_forward(rows, meta, tail, lora, state))

    def _graph_forward(
        self,
        rows: int,
        meta: AttentionMetadata,
        tail: DecodeTail | None = None,
        lora: bool = True,
        state: StateRows | None = None,
    ) -> Callable[[], None]:
        """The forward of ``rows`` rows over the buffers, what a graph captures; with ``lora``
        (and LoRA slots) its LoRA kernels over the static tile table, else the base model's
        alone. Every KV group reads its own static slots and tables; linear-attention layers
        the static ``state`` rows."""
        from engine_core.models import skinny_gemm  # imports triton: CUDA only

        buf = self.buffers
        static_lora = self._static_lora(rows) if lora else None
        groups = buf.group_metadata(meta)

        def forward() -> None:
            context = forward_context(meta, self.backend, static_lora, groups, state)
            with context, skinny_gemm.for_graphs():
                buf.hidden[:rows] = self.model(buf.input_ids[:rows], buf.positions[:rows])
                if tail is not None:
                    tail.run(buf.hidden[:rows])

        return forward

    def _capture(self, forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A graph of ``forward`` (``_graph_forward``), in the runner's memory pool."""
        # One eager run first: compiles the Triton kernels and lets cuBLAS pick its kernels,
        # neither of which may happen during capture. Padding inputs write and read nothing.
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def _static_lora(self, rows: int) -> LoraBatch | None:
        """What a graph of ``rows`` rows captures for LoRA: the kernels over the first tiles of
        the static table (as many as a step of that many rows can need), whatever it holds."""
        table, token_slots = self.buffers.lora_table, self.buffers.lora_token_slots
        if table is None or token_slots is None:
            return None
        tiles = tiles_of(table, tile_capacity(rows, self.lora_slots))
        return LoraBatch(tiles, token_slots[:rows], None)

    def _stage_lora(self, lora: LoraBatch | None, base_graph: bool) -> None:
        """The step's LoRA tile table into the static one (laid out for it: one copy); a step
        without adapter rows clears its slots, once, unless it replays a base-only graph (which
        reads no table)."""
        table = self.buffers.lora_table
        if table is None:
            if lora is not None:
                raise RuntimeError("a LoRA step for CUDA graphs captured without LoRA")
            return
        if lora is None:
            if base_graph:
                return
            if not self._lora_clear:
                table[: self.lora_tiles].fill_(NO_SLOT)
                self._stage_token_slots(None)
                self._lora_clear = True
            return
        if lora.tiles.table.shape != table.shape:
            raise RuntimeError(
                f"a LoRA tile table of {lora.tiles.table.shape[0]} entries for a graph table of "
                f"{table.shape[0]}: the step's was not laid out for the graphs (lora_tiles)"
            )
        table.copy_(lora.tiles.table, non_blocking=True)
        self._stage_token_slots(lora.token_slots)
        self._lora_clear = False

    def _stage_token_slots(self, step: torch.Tensor | None) -> None:
        """Each row's slot into the static buffer, NO_SLOT past the step's rows (padding rows
        must not take a previous step's adapters in the MoE experts' kernels)."""
        token_slots = self.buffers.lora_token_slots
        assert token_slots is not None
        rows = 0 if step is None else step.shape[0]
        if step is not None:
            token_slots[:rows].copy_(step, non_blocking=True)
        token_slots[rows:].fill_(NO_SLOT)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a step that fits a captured graph: decode-only and no larger than the
        largest decode batch, or a prefill step within the prefill graphs' bounds."""
        if meta.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return False
        if self._fits_verify(meta):
            return True
        if meta.is_decode_only:
            return meta.num_seqs <= self.max_batch and bool(self.graphs)
        return (
            meta.num_seqs <= self.max_batch
            and meta.slot_mapping.shape[0] <= self.max_prefill_tokens
            and bool(self.prefill_graphs)
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,  # a step ``can_run`` accepted
        ids_from: torch.Tensor | None = None,  # [T]: the input ids, where input_ids lacks them
        lora: LoraBatch | None = None,  # the step's LoRA rows, laid out for ``lora_tiles``
        group_metadata: Sequence[AttentionMetadata] = (),  # every KV group's; () with one
        state: StateRows | None = None,  # the linear-attention rows; None: no such layers
    ) -> torch.Tensor:  # [T, hidden], a view of the static output (valid until the next run)
        """Copy a step into the static buffers, pad, replay its graph, return the real rows."""
        self._tail_rows = 0
        self.last_decode_rows = 0
        base_graph = lora is None and meta.is_decode_only and bool(self.base_graphs)
        self._stage_lora(lora, base_graph)
        metas = tuple(group_metadata) or (meta,)
        if len(metas) != self.buffers.num_groups:
            raise RuntimeError(
                f"a step of {len(metas)} KV groups for graphs of {self.buffers.num_groups}"
            )
        if meta.is_decode_only:
            graphs, buckets = self.base_graphs if base_graph else self.graphs, self._bucket
            shared = self.shared_graphs and meta.shared_prefix is not None
            if shared and meta.num_seqs < len(self._shared_bucket):
                graphs, buckets = self.shared_graphs, self._shared_bucket
                self.shared_replays += 1
            return self._run_decode(input_ids, positions, metas, ids_from, graphs, buckets, state)
        if ids_from is not None:
            input_ids.copy_(ids_from)
        if self._fits_verify(meta):
            return self._run_verify(input_ids, positions, metas)
        return self._run_prefill(input_ids, positions, metas)

    def _fits_verify(self, meta: AttentionMetadata) -> bool:
        """A verify step of the captured K + 1 tokens a sequence, within the largest batch."""
        return (
            meta.uniform_query_len == self.verify_queries
            and meta.num_seqs <= self.max_batch
            and bool(self.verify_graphs)
        )

    def _run_verify(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        n, queries = metas[0].num_seqs, self.verify_queries
        batch = self._bucket[n]
        self.buffers.stage_common((input_ids, positions), metas, batch * queries)
        # Padding sequences: no context, so the kernel reads nothing of them and writes zeros.
        self.buffers.seq_lens[n:batch].zero_()
        self.verify_graphs[batch].replay()
        self.verify_replays += 1
        return self.buffers.hidden[: n * queries]

    def _run_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: tuple[AttentionMetadata, ...],
        ids_from: torch.Tensor | None,
        graphs: dict[int, torch.cuda.CUDAGraph],
        buckets: list[int],  # the size of ``graphs``' graph for n rows, at index n
        state: StateRows | None,
    ) -> torch.Tensor:
        n = metas[0].num_seqs
        batch = buckets[n]
        self.last_decode_rows = batch
        if (state is None) != (self.buffers.state_slots is None):
            raise RuntimeError("a step's linear-attention rows do not match the graphs' buffers")
        if state is not None:
            # A fresh row (a one-token prompt) starts from a zero state; the graph reads its slot
            # as it is, so it is zeroed here (the eager layer zeroes it at its start).
            state.zero_fresh(*self.state_tensors)
        # One launch per KV group for the copies and the padding's fills, the ids from where
        # they are when input_ids lacks them (the previous step's sampled ids).
        ids = input_ids if ids_from is None else ids_from
        self.buffers.stage_decode((ids, positions), metas, state, batch)
        graphs[batch].replay()
        if self.tail is not None:
            self._tail_rows = n
        return self.buffers.hidden[:n]

    def take_tail(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last replay's logits [n, V'] and argmax [n] (views of static buffers, valid until
        the next replay), if it was a decode graph with a tail; each replay's are handed out
        once. Row i is the step's sequence i: every row of a decode graph's step is its own
        sequence's last token."""
        rows, self._tail_rows = self._tail_rows, 0
        if not rows:
            return None
        assert self.tail is not None
        return self.tail.logits[:rows], self.tail.argmax[:rows]

    def _run_prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: tuple[AttentionMetadata, ...],
    ) -> torch.Tensor:
        meta = metas[0]
        n, tokens = meta.num_seqs, input_ids.shape[0]
        size = next(t for t in self.prefill_sizes if t >= tokens)
        buf = self.buffers
        buf.stage_common((input_ids, positions), metas, size)
        seqs, rows = prefill_graph_shape(size, self.max_batch)  # as the graph was captured
        # Padding sequences: no query rows and no context (no tile names them anyway).
        buf.seq_lens[n:seqs].zero_()
        buf.prefill_query_start[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        buf.prefill_query_start[n + 1 : seqs + 1].fill_(tokens)
        # The step's work list (packed with its inputs, at the same tile height as the graph's:
        # prefill_block_m), then rows that name no sequence up to the captured length. All on
        # the device: nothing here waits for the step still running (overlap).
        tiles = meta.prefill_tiles
        if tiles is None:
            tiles = device_tiles(meta.query_start_loc_cpu, input_ids.device)
        used = tiles.shape[0]
        buf.prefill_tiles[:used].copy_(tiles, non_blocking=True)
        buf.prefill_tiles[used:rows].fill_(NO_SEQUENCE)
        self.prefill_graphs[size].replay()
        return buf.hidden[:tokens]
