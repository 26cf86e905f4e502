"""The draft model's proposal as a chain of K one-token forwards that never leaves the device,
and its CUDA graphs (engine_core/draft_model.py proposes through them).

A proposal for B rows is K decode-shaped forwards of the draft: forward j feeds each row the
token forward j - 1 chose (the row's last known token for j = 0) at its position + j, takes the
argmax, and writes it as the row's draft j. Every forward runs over all B rows: a row that wants
fewer drafts than K (near its length limit) is *dead* from its count on, and a dead row writes no
KV (slot -1), attends to one cached position (length 1: its table's first slot, always a real
block) and reads position 0, so nothing it computes reaches memory another row reads and nothing
it indexes is out of range. Its argmax past its count is never read. The positions, slots and
lengths of each forward are computed on the device from the rows' first positions, counts and
tables (``chain_step_inputs``), so the chain needs no host value between its forwards: the rows
go in once, the drafts come out once.

That makes the whole chain capturable: ``ProposalGraphs`` captures it once per batch bucket (the
target's decode sizes: 1, 2, 4, 8, then multiples of 8) over static buffers: the rows' tokens,
positions and counts, their tables (staged as wide as the widest row's, not as ``--max-model-len``
allows: at 128k tokens and 256 rows a full-width copy would move 8 MiB), the padding rows dead
(count 0), and the argmax in the graph (the target's DecodeTail: logits and argmax on the skinny
GEMM where the draft's logits are a plain product). One replay then replaces K eager forwards, each
of which launched the draft's few hundred kernels from Python (docs/design/speculative-decoding.md
has the measurements). The same chain runs eagerly on the CPU, and on the GPU for a proposal no
graph fits, with exact host lists for the backends that read them.

A one-layer proposer that drafts from a feature (an EAGLE-3 head, eagle3.py; an MTP layer,
mtp.py) runs the same chain with a feature carried from forward to forward
(``propose_feature_chain``: the target's feature at the row's last known position, then the
layer's own output), and its graphs (``FeatureProposalGraphs``) stage each row's first feature
beside the row; the layer is reached through a ``FeatureDrafter``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from engine_core.attention.base import AttentionBackend, AttentionMetadata
from engine_core.cuda_graph import DecodeTail, graph_batch_sizes
from engine_core.forward_context import forward_context
from engine_core.speculative import DraftRow

logger = logging.getLogger(__name__)

ID32 = torch.int32
ID64 = torch.int64
# The staged row's columns: its last known token, that token's position, its draft count.
TOKEN, POSITION, COUNT = 0, 1, 2


@dataclass
class ChainRows:
    """A proposal's rows on the device: [b] int64 each, tables [b, W] int32 (covering every
    row's verify chunk; padded with any block id)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor  # 0 on padding rows: dead from the first forward
    tables: torch.Tensor
    query_start: torch.Tensor  # [b + 1] int32: 0, 1, ..., b (one token a row)


def chain_step_inputs(
    rows: ChainRows,
    j: int,
    block_size: int,
    max_seq_len: int,
    host_rows: Sequence[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Forward j's positions [b] and decode metadata: for a live row (count > j) its position +
    j, the slot there and the length up to it; for a dead row position 0, no slot (-1) and one
    position of context. ``host_rows``: each row's (position, count) on the host, for the exact
    host lists of backends that read them; None in a graph (placeholders: the graph-safe
    decode path reads only the device tensors)."""
    live = rows.counts > j  # [b]
    wanted = rows.positions + j  # [b]
    # A dead row's column may pass its table (or every table): clamped, its slot masked anyway.
    column = (wanted // block_size).clamp(max=rows.tables.shape[1] - 1)
    blocks = rows.tables.gather(1, column[:, None]).squeeze(1).to(ID64)  # [b]
    slots = torch.where(live, blocks * block_size + wanted % block_size, -1)
    seq_lens = torch.where(live, wanted + 1, 1).to(ID32)
    b = rows.tokens.shape[0]
    if host_rows is None:
        lengths = [max_seq_len] * b
    else:
        lengths = [p + j + 1 if count > j else 1 for p, count in host_rows]
        max_seq_len = max(lengths)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=rows.query_start,
        seq_lens=seq_lens,
        block_tables=rows.tables,
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=list(range(b + 1)),
        seq_lens_cpu=lengths,
    )
    return torch.where(live, wanted, 0), meta


def propose_chain(
    model: nn.Module,
    backend: AttentionBackend,
    rows: ChainRows,
    drafts: torch.Tensor,  # [b, K] int64: draft j of each row into column j
    block_size: int,
    max_seq_len: int,
    tail: DecodeTail | None = None,
    host_rows: Sequence[tuple[int, int]] | None = None,
) -> None:
    """The K forwards of a proposal (see the module's docstring), all on the device. ``tail``:
    the logits and argmax on the graphs' kernels (CUDA), else the model's own."""
    tokens = rows.tokens
    for j in range(drafts.shape[1]):
        positions, meta = chain_step_inputs(rows, j, block_size, max_seq_len, host_rows)
        with forward_context(meta, backend):
            hidden = model(tokens, positions)  # [b, H]
        if tail is not None:
            tail.run(hidden)
            tokens = tail.argmax[: hidden.shape[0]]
        else:
            tokens = model.compute_logits(hidden, widen=False).argmax(dim=-1)  # [b]
        drafts[:, j].copy_(tokens)


def eager_rows(rows: list[DraftRow], device: torch.device) -> ChainRows:
    """A proposal's rows as the chain reads them, made for one eager run."""
    width = max(len(r.block_ids) for r in rows)
    host = torch.zeros((len(rows), width), dtype=ID32)
    for i, r in enumerate(rows):
        host[i, : len(r.block_ids)] = torch.as_tensor(r.block_ids, dtype=ID32)

    def on(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=ID64).to(device)

    return ChainRows(
        tokens=on([r.token for r in rows]),
        positions=on([r.position for r in rows]),
        counts=on([r.count for r in rows]),
        tables=host.to(device),
        query_start=torch.arange(len(rows) + 1, dtype=ID32, device=device),
    )


def drafts_of(values: list[list[int]], rows: list[DraftRow]) -> list[list[int]]:
    """Each row's first ``count`` drafts of the chain's K (the rest are a dead row's)."""
    return [v[: r.count] for v, r in zip(values, rows, strict=True)]


class ProposalGraphs:
    """The chain captured per batch bucket, over static buffers (see the module's docstring)."""

    name = "draft model"  # what the log calls the proposer

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        *,
        max_rows: int,
        max_blocks_per_seq: int,
        num_drafts: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.block_size, self.max_model_len = block_size, max_model_len
        self.batch_sizes = graph_batch_sizes(max_rows)
        self.max_batch = self.batch_sizes[-1]
        self.width = max_blocks_per_seq
        # The rows (token, position, count) and their tables are packed on the host (pinned),
        # each table as wide as the proposal's widest, copied over as they are, then the tables
        # spread into the graph's [rows, max blocks] one on the device. Columns past a row's
        # table keep what they held (block ids all): no live row reads past its own table, and
        # a dead row's slot is masked whatever block it names.
        # Pinned on CUDA; the CPU tests stage and run the captured chain without a GPU.
        pinned = device.type == "cuda"
        self.host = torch.zeros((self.max_batch, 3), dtype=ID64, pin_memory=pinned)
        self.host_tables = torch.zeros(self.max_batch * self.width, dtype=ID32, pin_memory=pinned)
        self.staged = torch.zeros((self.max_batch, 3), dtype=ID64, device=device)
        self.staged_tables = torch.zeros(self.max_batch * self.width, dtype=ID32, device=device)
        self.tables = torch.zeros((self.max_batch, self.width), dtype=ID32, device=device)
        self.query_start = torch.arange(self.max_batch + 1, dtype=ID32, device=device)
        self.drafts = torch.zeros((self.max_batch, num_drafts), dtype=ID64, device=device)
        self.host_drafts = torch.zeros((self.max_batch, num_drafts), dtype=ID64, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None
        weight = model.plain_logits_weight()
        self.tail = None
        if weight is not None:
            self.tail = DecodeTail.allocate(weight, vocab_size, self.max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: tuple[int, int] | None = None
        self._bucket = [
            next(s for s in self.batch_sizes if s >= n) for n in range(self.max_batch + 1)
        ]

    def staged_rows(self, b: int) -> ChainRows:
        """The first ``b`` staged rows, as the captured chain reads them."""
        staged = self.staged[:b]
        return ChainRows(
            tokens=staged[:, TOKEN].contiguous(),
            positions=staged[:, POSITION].contiguous(),
            counts=staged[:, COUNT].contiguous(),
            tables=self.tables[:b],
            query_start=self.query_start[: b + 1],
        )

    def _chain(self, b: int) -> None:
        """The captured work for ``b`` rows: the chain over the staged rows."""
        propose_chain(
            self.model,
            self.backend,
            self.staged_rows(b),
            self.drafts[:b],
            self.block_size,
            self.max_model_len,
            self.tail,
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's chain, the largest first (its memory serves the smaller ones);
        returns the seconds. The staged rows are all dead (zeros), so the eager run before each
        capture, which compiles the kernels, writes nothing."""
        from engine_core.models import skinny_gemm  # imports triton: CUDA only

        start = time.perf_counter()
        with skinny_gemm.for_graphs():
            for b in reversed(self.batch_sizes):
                self._chain(b)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._chain(b)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info(
            "%s: captured %d proposal graphs (%d forwards each) in %.1f s",
            self.name, len(self.graphs), self.drafts.shape[1], elapsed,
        )  # fmt: skip
        return elapsed

    def can_run(self, rows: list[DraftRow]) -> bool:
        return len(rows) <= self.max_batch and all(len(r.block_ids) <= self.width for r in rows)

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """Stage the rows, replay their bucket's chain, copy the drafts back (one sync)."""
        n = len(rows)
        b = self.stage(rows)
        self.graphs[b].replay()
        self.host_drafts[:n].copy_(self.drafts[:n], non_blocking=True)
        assert self.copied is not None  # captured graphs: CUDA
        self.copied.record()
        self.copied.synchronize()  # the host buffer is written again only after this
        return drafts_of(self.host_drafts[:n].tolist(), rows)

    def stage(self, rows: list[DraftRow]) -> int:
        """The rows into the static buffers the captured chain reads, the padding rows of
        their bucket dead; returns the bucket."""
        n = len(rows)
        b = self._bucket[n]
        width = max(len(r.block_ids) for r in rows)
        host, tables = self.host.numpy(), self.host_tables.numpy()
        for i, r in enumerate(rows):
            host[i, TOKEN], host[i, POSITION], host[i, COUNT] = r.token, r.position, r.count
            tables[i * width : i * width + len(r.block_ids)] = r.block_ids
        host[n:b, COUNT] = 0  # padding rows: dead
        self.staged[:b].copy_(self.host[:b], non_blocking=True)
        packed = self.staged_tables[: n * width]
        packed.copy_(self.host_tables[: n * width], non_blocking=True)
        self.tables[:n, :width].copy_(packed.view(n, width))
        return b


# ---- a one-layer proposer that drafts from a feature (EAGLE-3's head, an MTP layer) -----------


class FeatureDrafter(Protocol):
    """What the feature chain runs: the layer's forward over one token a row, its draft ids
    and the plain weight of its draft logits (the graphs' argmax tail)."""

    feature_size: int

    def chain_forward(
        self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [b], feature [b, F] -> (the next forward's feature [b, F], the
        normed hidden state the draft logits read [b, H])."""
        ...

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [b, H] -> the drafts [b] int64, as target ids (the eager tail)."""
        ...

    def target_ids(self, argmax: torch.Tensor) -> torch.Tensor:
        """The argmax of ``plain_logits_weight``'s logits [b] -> target ids [b] int64."""
        ...

    def plain_logits_weight(self) -> torch.Tensor: ...


def propose_feature_chain(
    drafter: FeatureDrafter,
    backend: AttentionBackend,
    rows: ChainRows,  # positions: each row's entry before its last known token (p - 1)
    feature: torch.Tensor,  # [b, F]: the target's feature at each row's p - 1
    drafts: torch.Tensor,  # [b, K] int64: draft j of each row into column j
    block_size: int,
    max_seq_len: int,
    tail: DecodeTail | None = None,
    host_rows: Sequence[tuple[int, int]] | None = None,
) -> None:
    """The K forwards of a feature proposal, all on the device: forward j writes each live
    row's entry at p - 1 + j (its last known token, then draft j - 1) and gives draft j; the
    feature of forward j + 1 is forward j's. Rows past their count are dead, as in
    ``propose_chain``. ``tail``: the logits and argmax on the graphs' kernels (CUDA), else
    the drafter's own."""
    tokens = rows.tokens
    for j in range(drafts.shape[1]):
        positions, meta = chain_step_inputs(rows, j, block_size, max_seq_len, host_rows)
        with forward_context(meta, backend):
            feature, normed = drafter.chain_forward(tokens, feature, positions)
        if tail is not None:
            tail.run(normed)
            tokens = drafter.target_ids(tail.argmax[: normed.shape[0]])
        else:
            tokens = drafter.draft_ids(normed)
        drafts[:, j].copy_(tokens)


def eager_feature_proposal(
    drafter: FeatureDrafter,
    backend: AttentionBackend,
    rows: list[DraftRow],  # as the chain reads them: at p - 1
    features: list[torch.Tensor],  # [F] each: the target's at each row's p - 1
    block_size: int,
    device: torch.device,
) -> list[list[int]]:
    """The feature chain run once eagerly, with exact host lists: the rows go to the device
    once and the drafts come back once."""
    chain = eager_rows(rows, device)
    drafts = torch.zeros((len(rows), max(r.count for r in rows)), dtype=ID64).to(device)
    host_rows = [(r.position, r.count) for r in rows]
    propose_feature_chain(
        drafter, backend, chain, torch.stack(features), drafts, block_size, 0,
        host_rows=host_rows,
    )  # fmt: skip
    return drafts_of(drafts.tolist(), rows)


class FeatureProposalGraphs(ProposalGraphs):
    """The feature chain captured per batch bucket: ``ProposalGraphs`` with each row's first
    feature staged beside its row."""

    def __init__(
        self, drafter: FeatureDrafter, backend: AttentionBackend, name: str, **kwargs: Any
    ) -> None:
        self.name = name
        super().__init__(drafter, backend, **kwargs)
        weight = drafter.plain_logits_weight()
        self.feature = weight.new_zeros((self.max_batch, drafter.feature_size))

    def _chain(self, b: int) -> None:
        propose_feature_chain(
            self.model,
            self.backend,
            self.staged_rows(b),
            self.feature[:b],
            self.drafts[:b],
            self.block_size,
            self.max_model_len,
            self.tail,
        )

    def propose_from(self, rows: list[DraftRow], features: list[torch.Tensor]) -> list[list[int]]:
        """``rows`` as the chain reads them (at p - 1) and their features [F] each."""
        torch.stack(features, out=self.feature[: len(rows)])
        return self.propose(rows)
