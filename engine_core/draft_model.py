"""A draft model for speculative decoding (``"method": "draft_model"``): a smaller model of the
target's vocabulary proposes each speculating request's next K tokens, one batched forward per
token, and the target checks them in its next step (engine_core/speculative.py).

Its KV cache shares the target's block ids: per layer, a K and a V tensor of the draft's own
shape with as many blocks as the target's pool, so the block manager's tables, allocation,
prefix cache, preemption and rollback serve both caches without a second manager. Both caches
are written on the same slots by the same steps: the draft runs every forward the target runs,
on the same inputs (``run_alongside``: prefills, prompt chunks, decodes, verify chunks), so its
KV is right wherever the target's is. A rejected draft's slot is written over by the next step
in both caches, as the scheduler moves the request's computed tokens back; a prefix-cache hit
finds both caches filled, since a block is registered only after the step that computed it.

Proposing for a request whose last known token t sits at position p (the KV of the tokens
before it in both caches): draft 1 is the draft's argmax after t (a forward of t at p), draft
j + 1 its argmax after draft j (a forward of draft j at p + j), K forwards in all, batched
across the step's speculating requests. They write the draft's KV at p .. p + K - 1, in the
slots the scheduler reserved for the verify chunk (t and the K drafts); the verify step's own
forward of the draft writes the same tokens there again and adds the last draft's.

Drafts are the draft's argmax, whatever the request's temperature: a proposal q that is one
token is what makes "keep the draft exactly when the target draws it" the rejection-sampling
rule (accept with probability p(d), else draw from p without d), as for prompt lookup. So the
output is the target's own, token for token for greedy and seeded requests, in distribution
for the others; the draft decides only how many tokens a step yields.

The draft runs in the model's dtype (its cache too, whatever ``--kv-cache-dtype``), on one GPU.
Where the target replays CUDA graphs, so does the draft (``capture_graphs``): its forward beside
the target's replays a decode or prefill graph of its own (engine_core/cuda_graph.py, as the
target's steps do), and a proposal replays one graph of its K chained forwards
(engine_core/draft_graphs.py). Without graphs (the CPU, ``--enforce-eager``) the same chain runs
eagerly; either way a proposal sends its rows to the device once, builds each forward's
attention metadata there and copies the drafts back once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine_core.attention.base import AttentionMetadata
from engine_core.attention.layer import Attention
from engine_core.config import ModelConfig
from engine_core.draft_graphs import ProposalGraphs, drafts_of, eager_rows, propose_chain
from engine_core.forward_context import forward_context
from engine_core.kv_groups import model_kv_layout
from engine_core.loader import LoadedModel
from engine_core.speculative import DraftRow

if TYPE_CHECKING:
    from engine_core.attention.base import AttentionBackend
    from engine_core.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class DraftForwards:
    """How the draft's work ran, counted for tests and benchmarks: proposals and forwards
    beside the target's, each as a graph replay or eagerly."""

    proposal_replays: int = 0
    proposal_eager: int = 0
    alongside_replays: int = 0
    alongside_eager: int = 0


class DraftModel:
    """The draft's weights and KV cache (owned here, as the model runner owns the target's),
    and the proposer the scheduler asks for drafts (a speculative.BatchProposer)."""

    def __init__(
        self, loaded: LoadedModel, max_drafts: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.model = loaded.module
        self.max_drafts = max_drafts
        self.device = device
        self.dtype = dtype  # its cache's: the model's dtype (the draft's KV is never FP8)
        self.hidden_size = loaded.config.hidden_size
        self.vocab_size = loaded.config.vocab_size
        self.block_size = 0
        self.cache: list[torch.Tensor] = []
        self.backend: AttentionBackend | None = None
        self.step_graphs: CudaGraphRunner | None = None  # its forwards beside the target's
        self.proposal_graphs: ProposalGraphs | None = None
        self.forwards = DraftForwards()

    # ---- set-up -------------------------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        """Bytes the draft's cache adds to one block id of the pool: K and V of every layer."""
        layers = self.model.attention_layers()
        elements = sum(math.prod(s) for layer in layers for s in layer.cache_shapes(1, block_size))
        return elements * self.dtype.itemsize

    def allocate_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend) -> None:
        """Its K and V tensors, ``num_blocks`` blocks like the target's pool (the same ids)."""
        for layer in self.model.attention_layers():
            shapes = layer.cache_shapes(num_blocks, block_size)
            own = [torch.zeros(s, dtype=self.dtype, device=self.device) for s in shapes]
            layer.bind_cache(own)
            self.cache += own
        self.block_size, self.backend = block_size, backend
        logger.info(
            "draft model: %d layers, its KV cache %.2f GiB beside the target's",
            len(self.cache) // 2,
            sum(t.numel() * t.element_size() for t in self.cache) / 2**30,
        )

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, prefill_tokens: int) -> None:
        """CUDA graphs for the draft, where the target has them (after ``allocate_cache``: they
        bake in its cache's addresses): decode graphs, verify graphs and prefill graphs of up to
        ``prefill_tokens`` tokens (the target's) for its forward beside the target's, and the
        proposal's chain per batch bucket."""
        from engine_core.cuda_graph import CudaGraphRunner, verify_graph_queries

        assert self.backend is not None
        if not all(getattr(module, "cuda_graph_safe", True) for module in self.model.modules()):
            # As for a target (model_runner._capture_graphs): layers that read host values.
            logger.warning("draft model: %s runs without CUDA graphs", type(self.model).__name__)
            return
        common = {"max_model_len": max_model_len, "device": self.device}
        # Verify steps (K + 1 tokens a row) too, where its layers take the verify kernel.
        verify = verify_graph_queries(self.model, self.backend, self.max_drafts)
        self.step_graphs = CudaGraphRunner(
            self.model, self.backend, max_num_seqs=max_num_seqs, block_size=self.block_size,
            hidden_size=self.hidden_size, dtype=self.dtype, max_prefill_tokens=prefill_tokens,
            verify_queries=verify, **common,
        )  # fmt: skip
        self.step_graphs.capture(progress=False)
        self.proposal_graphs = ProposalGraphs(
            self.model, self.backend, max_rows=max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // self.block_size), num_drafts=self.max_drafts,
            block_size=self.block_size, vocab_size=self.vocab_size, **common,
        )  # fmt: skip
        self.proposal_graphs.capture()

    # ---- every step: the target's inputs ------------------------------------------------------

    @torch.inference_mode()
    def run_alongside(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        ids_from: torch.Tensor | None = None,
    ) -> None:
        """Write the draft's KV for the tokens the target's forward computed this step: the
        same ids [T] (or, where the target's decode graph left them there, ``ids_from``),
        positions [T] and slots (its logits are not needed). A graph replay where the step
        fits one of the draft's graphs."""
        assert self.backend is not None
        graphs = self.step_graphs
        if graphs is not None and graphs.can_run(meta):
            graphs.run(input_ids, positions, meta, ids_from)
            self.forwards.alongside_replays += 1
            return
        if ids_from is not None:
            input_ids.copy_(ids_from)
        with forward_context(meta, self.backend):
            self.model(input_ids, positions)
        self.forwards.alongside_eager += 1

    # ---- proposing ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        """``row.count`` greedy drafts for each row: K chained one-token forwards over the rows
        (engine_core/draft_graphs.py), a graph replay where one fits. The rows go to the device
        once and the drafts come back once."""
        assert self.backend is not None
        graphs = self.proposal_graphs
        if graphs is not None and graphs.can_run(rows):
            self.forwards.proposal_replays += 1
            return graphs.propose(rows)
        chain = eager_rows(rows, self.device)
        drafts = torch.zeros((len(rows), max(r.count for r in rows)), dtype=torch.int64)
        drafts = drafts.to(self.device)
        host_rows = [(r.position, r.count) for r in rows]
        propose_chain(
            self.model, self.backend, chain, drafts, self.block_size, 0, host_rows=host_rows
        )
        self.forwards.proposal_eager += 1
        return drafts_of(drafts.tolist(), rows)


def check_draft(draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    """Refuse a draft model the engine cannot pair with the target, naming why."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"--speculative-config draft model: vocab_size {draft.vocab_size} differs from the "
            f"target's {target.vocab_size}; a draft model needs the target's tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"--speculative-config draft model: it reaches {draft.max_position_embeddings} "
            f"positions, fewer than --max-model-len {max_model_len}; lower --max-model-len"
        )
    if not attends_fully(draft) or draft.vision is not None:
        raise ValueError(
            "--speculative-config draft model: only a text model whose layers all attend to "
            "the full context can draft (no sliding-window, linear-attention or vision layers)"
        )
    if draft.embedding is not None:
        raise ValueError("--speculative-config draft model: an embedding model cannot draft")
    if not attends_fully(target, linear_layers=True):
        # The draft reads the context through the target's first layer group's tables, whose
        # blocks a window group gives back once they leave the window. Linear-attention layers
        # hold no blocks: a verify step keeps their state per position (qwen3-next.md).
        raise ValueError(
            "--speculative-config draft model: the target has sliding-window or chunked "
            "attention layers, whose block tables a draft model cannot share yet"
        )


def attends_fully(config: ModelConfig, linear_layers: bool = False) -> bool:
    """One KV layer group, of full attention (no window or attention chunk; no linear layers
    unless ``linear_layers``)."""
    layout = model_kv_layout(config)
    windows = (*layout.windows, *layout.attention_chunks)
    one_full_group = len(layout.groups) == 1 and all(w is None for w in windows)
    return one_full_group and (linear_layers or not layout.state_layers)


def check_draft_layers(model: torch.nn.Module) -> None:
    if any(type(layer) is not Attention for layer in model.attention_layers()):
        raise ValueError(
            "--speculative-config draft model: its attention is not plain K/V attention "
            "(MLA and other cache layouts cannot draft yet)"
        )


def check_same_tokenizer(target_dir: Path | None, draft_dir: Path | None) -> None:
    """Refuse a draft whose tokenizer.json maps tokens to other ids than the target's (where
    both folders have one; a random preset has none and shares the default model's)."""
    if target_dir is None or draft_dir is None:
        return
    files = (target_dir / "tokenizer.json", draft_dir / "tokenizer.json")
    if not all(f.is_file() for f in files):
        return
    from tokenizers import Tokenizer

    vocabs = [Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files]
    if vocabs[0] != vocabs[1]:
        raise ValueError(
            f"--speculative-config draft model: its tokenizer ({files[1]}) maps tokens to "
            f"other ids than the target's ({files[0]}); a draft model needs the same tokenizer"
        )
