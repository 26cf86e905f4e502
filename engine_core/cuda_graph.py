"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed with padded inputs.

A decode step of a small model is hundreds of short kernels; launching them one by one from
Python costs more than running them. At start-up we capture the model's forward for decode
batches of sizes 1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs`` (largest first, all into one
memory pool, so the smaller graphs reuse the largest one's memory). A step with n sequences copies
its inputs into static buffers, pads them to the next captured size (slot -1: no KV write; seq_len
0: no attention), replays that graph and returns the first n rows of the static output. Batches
larger than the largest size, and any batch with a prefill, run eagerly.

Only the model's forward is captured: the logits of the rows that sample and the sampler run
eagerly after it (their shapes and per-request choices change from step to step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine_core.attention.base import AttentionBackend, AttentionMetadata
from engine_core.forward_context import forward_context

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_num_seqs``; ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class GraphBuffers:
    """The static tensors every graph reads and writes; a replay first copies a step into them."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64, -1 on padding rows
    seq_lens: torch.Tensor  # [N] int32, 0 on padding rows
    block_tables: torch.Tensor  # [N, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [N + 1] int32: 0, 1, ..., N (one token per sequence)
    hidden: torch.Tensor  # [N, hidden]: the captured forward's output

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> GraphBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch),
            positions=zeros(max_batch),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
            seq_lens=zeros(max_batch, dtype=torch.int32),
            block_tables=zeros(max_batch, max_blocks_per_seq, dtype=torch.int32),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            hidden=zeros(max_batch, hidden_size, dtype=dtype),
        )

    def metadata(self, batch: int, max_model_len: int) -> AttentionMetadata:
        """Decode metadata over the first ``batch`` rows of the buffers.

        The host lists are placeholders (a graph cannot read per-step host values); the decode
        path of a graph-safe backend reads only the device tensors and their shapes.
        """
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=max_model_len,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[max_model_len] * batch,
        )


class CudaGraphRunner:
    """Captures and replays the model's forward for decode batches at bucketed sizes."""

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
    ) -> None:
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.buffers = GraphBuffers.allocate(self.max_batch, max_blocks, hidden_size, dtype, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: tuple[int, int] | None = None
        # _bucket[n]: the smallest captured size >= n, for n in 0..max_batch
        self._bucket = [
            next(s for s in self.batch_sizes if s >= n) for n in range(self.max_batch + 1)
        ]

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> float:
        """Capture one graph per batch size, largest first; returns the seconds it took."""
        from tqdm import tqdm

        start = time.perf_counter()
        sizes = sorted(self.batch_sizes, reverse=True)
        for batch in tqdm(sizes, desc="Capturing CUDA graphs", disable=not progress):
            self.graphs[batch] = self._capture_one(batch)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s",
            len(sizes),
            sizes[-1],
            sizes[0],
            elapsed,
        )
        return elapsed

    def _capture_one(self, batch: int) -> torch.cuda.CUDAGraph:
        buf = self.buffers
        meta = buf.metadata(batch, self.max_model_len)
        with forward_context(meta, self.backend):
            # One eager run first: compiles the Triton kernels and lets cuBLAS pick its kernels,
            # neither of which may happen during capture. Padding inputs write and read nothing.
            buf.hidden[:batch] = self.model(buf.input_ids[:batch], buf.positions[:batch])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                buf.hidden[:batch] = self.model(buf.input_ids[:batch], buf.positions[:batch])
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a decode-only batch no larger than the largest captured size."""
        return (
            meta.is_decode_only
            and meta.num_seqs <= self.max_batch
            and meta.block_tables.shape[1] <= self.buffers.block_tables.shape[1]
            and bool(self.graphs)
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,  # decode-only, n sequences
    ) -> torch.Tensor:  # [n, hidden], a view of the static output (valid until the next run)
        """Copy a decode step into the static buffers, pad, replay, return the real rows."""
        n = meta.num_seqs
        batch = self._bucket[n]
        buf = self.buffers
        buf.input_ids[:n].copy_(input_ids, non_blocking=True)
        buf.positions[:n].copy_(positions, non_blocking=True)
        buf.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        buf.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        buf.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if batch > n:
            buf.slot_mapping[n:batch].fill_(-1)
            buf.seq_lens[n:batch].zero_()
        self.graphs[batch].replay()
        return buf.hidden[:n]
