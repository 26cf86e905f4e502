"""An EAGLE-3 head as the speculative proposer (``"method": "eagle3"``): one decoder layer
trained beside a target model, which drafts from the target's own hidden states.

The published layout (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; read as vLLM's
llama_eagle3.py and SGLang's read it): config.json with architectures
["LlamaForCausalLMEagle3"], the head's own Llama shape (hidden_size, heads, intermediate_size,
one layer), ``draft_vocab_size`` and, where it differs from hidden_size, ``target_hidden_size``;
tensors ``fc.weight`` [H, 3 * H_target], ``midlayer.*`` (a Llama layer whose q/k/v take 2 * H
inputs, plus ``hidden_norm``), ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t``
[draft_vocab] (a draft id's offset to its target id) and ``t2d`` (its inverse, unused here);
``embed_tokens.weight`` only where the head does not share the target's embedding.

What it computes: the target's residual stream entering three of its layers (2, L // 2 and
L - 3 of L, or the config's ``eagle_config.eagle_aux_hidden_state_layer_ids``), concatenated
and projected by ``fc``, is the feature f(p) of position p. The head's entry at position p
reads the embedding of the token at p + 1 and f(p): its layer normalises both, concatenates
them into attention (over its own KV of the entries before p), then an MLP; its final norm and
LM head give the draft after p + 1. Drafting on from there, an entry takes the previous
draft's embedding and the head's own residual stream (before the final norm) in place of f.

Its KV cache shares the target's block ids, as the draft model's does (draft_model.py): one
K/V tensor pair with as many blocks as the target's pool. Its entry at p needs the token at
p + 1, which the target's step that computes p may not know yet (the step samples it), so the
head's KV lags the target's by one position. After each target step the head runs over the
step's positions with the tokens after them (``run_alongside``), a stand-in where that token
is still to be sampled (each sampling row's last position), and over the position before each
row's first again, with its token now known and the feature kept from the step that computed
it: so after a step every entry before a request's last computed position is right. A
proposal for a request whose last known token t sits at position p writes the entry at p - 1
(t with f(p - 1)), which gives draft 1; forward j + 1 writes the entry at p - 1 + j (draft j
with the head's stream) and gives draft j + 1. The verify step's run writes the drafts'
entries again with the target's features; a rejected draft's is written over by the next.

Drafts are the head's argmax, so keeping a draft exactly when the target draws it is exact
(engine_core/speculative.py); the head decides only how many tokens a step yields. Its KV
can be stale in one place: after a prefix-cache hit, the last entry of a cached block holds
what the request that computed it wrote there (the token after the block in that request, or
a stand-in where it ended), which may cost a draft, never the output.

The target's three hidden states are written by its own forward into a static buffer
(models/aux_hidden.py), so a CUDA-graph replay of the target fills it as an eager forward does.
Where the target replays graphs the head does too (``capture_graphs``): its forward beside the
target's replays a decode or prefill graph of its own (engine_core/cuda_graph.py over
``HeadEntries``), and a proposal replays one graph of its K chained forwards per batch bucket
(draft_graphs.FeatureProposalGraphs over ``HeadChain``: the draft model's graphs with the
feature carried from forward to forward). The same chain runs eagerly on the CPU and for what
no graph fits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from engine_core.attention.base import AttentionMetadata
from engine_core.attention.layer import Attention
from engine_core.attention.prefill_tiles import prefill_block_m, query_lens, tile_list
from engine_core.config import ModelConfig
from engine_core.draft_graphs import FeatureProposalGraphs, eager_feature_proposal
from engine_core.draft_model import DraftForwards, attends_fully
from engine_core.forward_context import forward_context
from engine_core.loader import iter_checkpoint, read_json
from engine_core.model_dir import resolve_model_dir
from engine_core.models import llama_config
from engine_core.models.aux_hidden import AuxHiddenStates
from engine_core.models.layers import (
    MergedLinear,
    RotaryEmbedding,
    load_mapped_weights,
    reset_buffers,
)
from engine_core.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    make_norm,
)
from engine_core.models.meta_build import materialize, meta_build
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from engine_core.scheduler import PLACEHOLDER
from engine_core.speculative import DraftRow

if TYPE_CHECKING:
    from engine_core.attention.base import AttentionBackend
    from engine_core.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
ID32 = torch.int32
WHERE = "--speculative-config eagle3 head"


# ---- the head --------------------------------------------------------------------------------


class Eagle3Layer(nn.Module):
    """The head's decoder layer (``midlayer``): attention over [embedding, feature]."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = make_norm(config, hidden)
        self.hidden_norm = make_norm(config, hidden)
        self.self_attn = LlamaAttention(config)
        sizes = self.self_attn.qkv_proj.output_sizes
        self.self_attn.qkv_proj = MergedLinear(2 * hidden, sizes, config.attention_bias)
        self.post_attention_layernorm = make_norm(config, hidden)
        self.mlp = LlamaMLP(config)

    def forward(
        self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, feature [T, H] -> (the MLP's output, the residual stream before it)."""
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            feature = self.hidden_norm(feature)
            residual = feature
        else:
            residual, feature = feature, self.hidden_norm(feature)
        attn = self.self_attn
        heads = attn.attend(attn.qkv_proj(torch.cat([embeds, feature], dim=-1)), cos, sin)
        out, residual = self.post_attention_layernorm(attn.o_proj(heads), residual)
        return self.mlp(out), residual


class Eagle3Head(nn.Module):
    """The head's weights, under the checkpoint's names, and its forward."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        config, hidden = shape.config, shape.config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if shape.own_embedding else None
        self.fc = nn.Linear(3 * shape.target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config, shape.norm_before_residual)
        self.norm = make_norm(config, hidden)
        self.lm_head = nn.Linear(hidden, shape.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab, dtype=torch.int64))
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, feature [T, H], positions [T] -> (the residual stream fed to the next
        draft, the normed hidden state the LM head reads), [T, H] each."""
        cos, sin = self.rotary_emb(positions, feature.dtype)
        out, residual = self.midlayer(embeds, feature, cos, sin)
        normed, stream = self.norm(out, residual)
        return stream, normed

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [N, H] -> the argmax of the draft vocabulary, as target ids [N] int64."""
        return self.target_ids(self.lm_head(normed).argmax(dim=-1))

    def target_ids(self, draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids [N] -> target ids [N] int64 (``d2t``: the offsets)."""
        return draft + self.d2t[draft]

    def plain_logits_weight(self) -> torch.Tensor:
        """[draft_vocab, H]: draft logits == normed @ W.T (the proposal graphs' argmax tail)."""
        return self.lm_head.weight

    def attention(self) -> Attention:
        return self.midlayer.self_attn.attn


# ---- the target's three hidden states --------------------------------------------------------


def aux_layer_ids(head_hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The three target layers whose input the head reads: the checkpoint's choice where its
    config names one, else vLLM's default (2, L // 2, L - 3)."""
    eagle = head_hf.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    where = "eagle_config.eagle_aux_hidden_state_layer_ids" if "eagle_config" in head_hf else None
    if len(ids) != 3 or not all(type(i) is int and 0 <= i < num_layers for i in ids):
        source = f"its {where} {ids}" if where else f"layers {ids}"
        raise ValueError(
            f"{WHERE}: it reads the target's hidden states entering three of its layers, "
            f"{source}, but the target has {num_layers} layers (EAGLE-3 needs at least 3)"
        )
    return tuple(ids)


# ---- loading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadShape:
    """What config.json says the head is, checked against the target."""

    config: ModelConfig  # the head's own Llama shape
    target_hidden: int
    draft_vocab: int
    own_embedding: bool
    norm_before_residual: bool
    layer_ids: tuple[int, ...]


REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def read_head_shape(model_dir: Path, target: ModelConfig, own_embedding: bool) -> HeadShape:
    """The head's shape from its config.json; ValueError naming the field that does not fit."""
    hf = read_json(model_dir / "config.json")
    architectures = hf.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ValueError(
            f"{WHERE}: config.json architectures {architectures} is not [{ARCHITECTURE!r}]"
        )
    missing = [name for name in REQUIRED if name not in hf]
    if missing:
        raise ValueError(f"{WHERE}: config.json has no {missing[0]!r}")
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{WHERE}: config.json num_hidden_layers is {hf['num_hidden_layers']}; an EAGLE-3 "
            "head has one layer"
        )
    if hf["vocab_size"] != target.vocab_size:
        raise ValueError(
            f"{WHERE}: config.json vocab_size {hf['vocab_size']} differs from the target's "
            f"{target.vocab_size}"
        )
    draft_vocab = hf.get("draft_vocab_size")
    if draft_vocab is None:  # a head over the whole vocabulary
        draft_vocab = hf["vocab_size"]
    if type(draft_vocab) is not int or not 0 < draft_vocab <= target.vocab_size:
        raise ValueError(
            f"{WHERE}: config.json draft_vocab_size {draft_vocab!r} is not in "
            f"[1, {target.vocab_size}]"
        )
    target_hidden = hf.get("target_hidden_size")
    if target_hidden is None:  # the target's hidden size is the head's
        target_hidden = hf["hidden_size"]
    if target_hidden != target.hidden_size:
        field = "target_hidden_size" if "target_hidden_size" in hf else "hidden_size"
        raise ValueError(
            f"{WHERE}: config.json {field} {target_hidden} differs from the target's hidden "
            f"size {target.hidden_size}"
        )
    if not own_embedding and hf["hidden_size"] != target.hidden_size:
        raise ValueError(
            f"{WHERE}: it has no embed_tokens.weight and its hidden_size {hf['hidden_size']} "
            f"differs from the target's {target.hidden_size}, so it cannot share the target's"
        )
    config = llama_config({**hf, "num_hidden_layers": 1}, ARCHITECTURE)
    return HeadShape(
        config=config,
        target_hidden=target_hidden,
        draft_vocab=draft_vocab,
        own_embedding=own_embedding,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
        layer_ids=aux_layer_ids(hf, target.num_layers),
    )


def map_head_name(name: str) -> tuple[str, int | None] | None:
    """A checkpoint name -> (our parameter, shard of a merged projection); None: not a weight
    (``d2t`` and ``t2d`` are read apart)."""
    if name in ("d2t", "t2d") or name.endswith("rotary_emb.inv_freq"):
        return None
    name = name.removeprefix("model.")
    module, _, param = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    merged = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
    if proj in merged:
        return f"{parent}.qkv_proj.{param}", merged[proj]
    if proj in ("gate_proj", "up_proj"):
        return f"{parent}.gate_up_proj.{param}", int(proj == "up_proj")
    return name, None


def load_head(
    model: str, target: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[Eagle3Head, HeadShape]:
    """The head of folder or hub id ``model``, its weights in ``dtype`` on ``device``."""
    model_dir = resolve_model_dir(model)
    weights = dict(iter_checkpoint(model_dir))
    names = {n.removeprefix("model.") for n in weights}
    shape = read_head_shape(model_dir, target, own_embedding="embed_tokens.weight" in names)
    with meta_build(dtype):
        head = Eagle3Head(shape)
    materialize(head, device)
    reset_buffers(head)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    load_mapped_weights(head, weights.items(), map_head_name)
    head.d2t.copy_(checked_d2t(d2t, shape.draft_vocab, target.vocab_size))
    head.eval().requires_grad_(False)
    return head, shape


def checked_d2t(d2t: torch.Tensor | None, draft_vocab: int, vocab: int) -> torch.Tensor:
    """``d2t`` (draft id -> target id minus the draft id), checked: every draft id must land
    on a target id. A head over the whole vocabulary may leave it out (offsets of 0)."""
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(
                f"{WHERE}: the checkpoint has no 'd2t' tensor, which a draft vocabulary of "
                f"{draft_vocab} (not the target's {vocab}) needs"
            )
        return torch.zeros(draft_vocab, dtype=torch.int64)
    if d2t.shape != (draft_vocab,) or d2t.is_floating_point():
        raise ValueError(
            f"{WHERE}: tensor 'd2t' is {d2t.dtype} {list(d2t.shape)}, not integers "
            f"[{draft_vocab}] (draft_vocab_size)"
        )
    targets = torch.arange(draft_vocab) + d2t.long()
    if targets.min() < 0 or targets.max() >= vocab:
        raise ValueError(f"{WHERE}: tensor 'd2t' maps draft ids outside the target's {vocab} ids")
    return d2t.long()


def check_target(target: nn.Module, config: ModelConfig) -> LlamaModel:
    """The target's decoder body, refusing a target the head cannot read hidden states from:
    LlamaModel's decoder loop writes them (models/aux_hidden.py), over Llama-layout layers,
    whose inputs are the hidden and the residual."""
    body = getattr(target, "model", None)
    if type(body) is not LlamaModel or any(
        type(layer) is not LlamaDecoderLayer for layer in body.layers
    ):
        raise ValueError(
            f"{WHERE}: the target must be a Llama-family model (Llama, Mistral, Qwen2/3, their "
            f"MoE variants); {config.architecture!r} layers are not read yet"
        )
    if config.vision is not None or config.embedding is not None:
        raise ValueError(f"{WHERE}: the target must be a text model that generates")
    if not attends_fully(config):
        raise ValueError(
            f"{WHERE}: the target has sliding-window or chunked attention layers, whose block "
            "tables the head's cache cannot share yet"
        )
    return body


# ---- the proposal's chain and its graphs ------------------------------------------------------


@dataclass
class HeadChain:
    """The head as the proposal's chain runs it (draft_graphs.FeatureDrafter): the feature
    carried on is its residual stream, the drafts are over the draft vocabulary, then d2t."""

    head: Eagle3Head
    embed: nn.Module  # the head's own embedding, or the target's

    @property
    def feature_size(self) -> int:
        return self.head.fc.out_features

    def chain_forward(
        self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.embed(tokens), feature, positions)

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head.draft_ids(normed)

    def target_ids(self, argmax: torch.Tensor) -> torch.Tensor:
        return self.head.target_ids(argmax)

    def plain_logits_weight(self) -> torch.Tensor:
        return self.head.plain_logits_weight()


class HeadEntries(nn.Module):
    """The head's forward over a step's entries as a CudaGraphRunner runs a model, (ids,
    positions) -> [T, H]: the entries' features are staged first into ``feature``, which the
    captured graphs read."""

    def __init__(self, head: Eagle3Head, embed: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.head, self.embed = head, embed
        weight = head.fc.weight  # [H, 3 * H_target]
        self.feature = weight.new_zeros((max_rows, weight.shape[0]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        stream, _ = self.head(self.embed(input_ids), self.feature[: input_ids.shape[0]], positions)
        return stream

    def plain_logits_weight(self) -> None:
        """No logits: the entries only write the head's KV."""
        return None


# ---- the proposer ----------------------------------------------------------------------------


@dataclass
class Features:
    """The target's features f of a request's latest computed positions: the ones a proposal
    may start from (the last one; every position of a verify chunk)."""

    request: Request
    first: int  # the position of row 0
    rows: torch.Tensor  # [n, H]


class Eagle3Proposer:
    """The head, its KV cache (owned here, as the model runner owns the target's), the buffer
    the target's forward writes its hidden states into, and the features it keeps between a
    step and the next proposal; a speculative.BatchProposer."""

    def __init__(
        self,
        head: Eagle3Head,
        aux: AuxHiddenStates,
        embed: nn.Module,
        max_drafts: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.head = head
        self.aux = aux
        self.embed = embed  # the head's own embedding, or the target's
        self.max_drafts = max_drafts
        self.device = device
        self.dtype = dtype
        self.features: dict[str, Features] = {}
        self.block_size = 0
        self.cache: list[torch.Tensor] = []
        self.backend: AttentionBackend | None = None
        self.step_graphs: CudaGraphRunner | None = None  # its forwards beside the target's
        self.entries_model: HeadEntries | None = None  # what those graphs captured
        self.chain = HeadChain(head, embed)
        self.proposal_graphs: FeatureProposalGraphs | None = None
        self.staging = EntryStaging(device)
        self.forwards = DraftForwards()

    # ---- set-up -------------------------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        """Bytes the head's cache adds to one block id of the pool: its layer's K and V."""
        return cache_block_bytes(self.head.attention(), block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend) -> None:
        self.cache = bind_own_cache(
            self.head.attention(), num_blocks, block_size, self.dtype, self.device
        )
        self.block_size, self.backend = block_size, backend
        logger.info("eagle3 head: its KV cache %.3f GiB beside the target's", gib(self.cache))

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, prefill_tokens: int) -> None:
        """CUDA graphs for the head, where the target has them (after ``allocate_cache``: they
        bake in its cache's addresses): for its forward beside the target's, decode graphs and
        prefill graphs of up to the target's ``prefill_tokens`` plus one entry a row (the
        entry before each row's first position); the proposal's chain per batch bucket."""
        from engine_core.cuda_graph import CudaGraphRunner

        assert self.backend is not None
        common = {"max_model_len": max_model_len, "device": self.device}
        entry_tokens = prefill_tokens + max_num_seqs if prefill_tokens else 0
        self.entries_model = HeadEntries(self.head, self.embed, max(max_num_seqs, entry_tokens))
        self.step_graphs = CudaGraphRunner(
            self.entries_model, self.backend, max_num_seqs=max_num_seqs,
            block_size=self.block_size, hidden_size=self.head.fc.out_features, dtype=self.dtype,
            max_prefill_tokens=entry_tokens, shared_decode_graphs=False, **common,
        )  # fmt: skip
        self.step_graphs.capture(progress=False)
        self.proposal_graphs = FeatureProposalGraphs(
            self.chain, self.backend, "eagle3 head", max_rows=max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // self.block_size), num_drafts=self.max_drafts,
            block_size=self.block_size, vocab_size=self.head.lm_head.out_features, **common,
        )  # fmt: skip
        self.proposal_graphs.capture()

    # ---- every step: the head's entries for the target's positions ----------------------------

    @torch.inference_mode()
    def run_alongside(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Write the head's entries for the step (``meta``: the target's forward's): each
        row's positions with the tokens after them, and the entry before its first position
        again, now that its token is known (the last step's stand-in); keep the features a
        proposal may start from. A graph replay where the entries fit one of the head's."""
        assert self.backend is not None
        query_start = meta.query_start_loc_cpu
        aux = self.aux.take(query_start[-1])  # the target's forward wrote it, graph or not
        feature = self.head.fc(aux.to(self.dtype))  # [T, H]
        plan = plan_entries(out, query_start, self._kept_feature, self.block_size)
        kept_rows = self.staging.stage(plan, self.backend_tiles)
        entries_meta = entries_metadata(plan, meta)
        parts = plan.features_of(feature, query_start)  # [n_i, H] each, in entry order
        graphs = self.step_graphs
        if graphs is not None and graphs.can_run(entries_meta):
            assert self.entries_model is not None
            torch.cat(parts, out=self.entries_model.feature[: len(plan.tokens)])
            graphs.run(plan.tokens_on_device, plan.positions_on_device, entries_meta)
            self.forwards.alongside_replays += 1
        else:
            features = torch.cat(parts)
            with forward_context(entries_meta, self.backend):
                self.head(self.embed(plan.tokens_on_device), features, plan.positions_on_device)
            self.forwards.alongside_eager += 1
        self.features = keep_features(self.features, out, plan, feature.index_select(0, kept_rows))

    @property
    def backend_tiles(self) -> bool:
        """Whether the backend reads a prefill work list (Triton): staged with the entries."""
        return self.device.type == "cuda"

    # ---- proposing ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        """``row.count`` greedy drafts for each row: forward 1 rewrites the entry at the row's
        position - 1 (its last token, the target's feature there), forward j + 1 writes the
        entry of draft j (the head's stream); K chained forwards over all the rows
        (draft_graphs.propose_feature_chain), a graph replay where one fits. The rows go to the
        device once and the drafts come back once."""
        assert self.backend is not None
        features = [feature_before(self.features, r, "eagle3: no target feature") for r in rows]
        chain_rows = [replace(r, position=r.position - 1) for r in rows]
        graphs = self.proposal_graphs
        if graphs is not None and graphs.can_run(chain_rows):
            self.forwards.proposal_replays += 1
            return graphs.propose_from(chain_rows, features)
        self.forwards.proposal_eager += 1
        return eager_feature_proposal(
            self.chain, self.backend, chain_rows, features, self.block_size, self.device
        )

    def _kept_feature(self, request_id: str, position: int) -> torch.Tensor | None:
        return feature_at(self.features, request_id, position)


@dataclass
class EntryPlan:
    """A step's entries for the head, planned on the host: tokens, positions and slots [N],
    the rows' entry starts [B + 1], and per row whether it starts with the entry before its
    first position (its feature kept from an earlier step); the rows of the step's features
    each row keeps, (first position, count) per row and their indices [R] into the step's
    rows. Their device copies are set by ``EntryStaging.stage``."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    starts: list[int]
    before: list[torch.Tensor | None]  # [H] per row, or None
    kept: list[tuple[int, int]]
    kept_rows: list[int]
    tokens_on_device: torch.Tensor = field(init=False)
    positions_on_device: torch.Tensor = field(init=False)
    slots_on_device: torch.Tensor = field(init=False)
    starts_on_device: torch.Tensor = field(init=False)
    tiles_on_device: torch.Tensor | None = field(init=False, default=None)

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]

    def features_of(self, feature: torch.Tensor, query_start: list[int]) -> list[torch.Tensor]:
        """The entries' features in order: per row, the kept one before it (if any), then the
        step's rows of its positions (``feature`` [T, H])."""
        parts: list[torch.Tensor] = []
        for i, before in enumerate(self.before):
            if before is not None:
                parts.append(before[None])
            parts.append(feature[query_start[i] : query_start[i + 1]])
        return parts


def plan_entries(
    out: SchedulerOutput,
    query_start: list[int],
    kept_feature: Callable[[str, int], torch.Tensor | None],
    block_size: int,
) -> EntryPlan:
    """The step's entries, row by row: the one before the row's first position where the
    request's feature there was kept (any row but a request's first), then one a position,
    each with the token after it. Each row's context still ends at the target's (the same
    seq_lens). And the features each row keeps: its last position's and, for a verify chunk,
    every drafted position's."""
    plan = EntryPlan([], [], [], [0], [], [], [])
    for i, s in enumerate(out.scheduled):
        begin, end = query_start[i], query_start[i + 1]
        row_positions = list(range(s.start, s.start + end - begin))
        before = kept_feature(s.request.request_id, s.start - 1)
        plan.before.append(before)
        if before is not None:
            row_positions.insert(0, s.start - 1)
            plan.tokens.append(s.request.token_ids[s.start])
        plan.tokens += tokens_after(s, end - begin)
        plan.positions += row_positions
        plan.slots += [s.block_ids[p // block_size] * block_size + p % block_size
                       for p in row_positions]  # fmt: skip
        plan.starts.append(plan.starts[-1] + len(row_positions))
        first_kept = max(begin, end - 1 - len(s.drafts))
        plan.kept.append((s.start + first_kept - begin, end - first_kept))
        plan.kept_rows += range(first_kept, end)
    return plan


def entries_metadata(plan: EntryPlan, meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata of a forward over ``plan``'s entries (staged) beside the target's forward
    of ``meta``: each row's context ends where the target's does."""
    return AttentionMetadata(
        slot_mapping=plan.slots_on_device,
        query_start_loc=plan.starts_on_device,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        max_query_len=max(plan.lengths),
        max_seq_len=meta.max_seq_len,
        query_start_loc_cpu=plan.starts,
        seq_lens_cpu=meta.seq_lens_cpu,
        prefill_tiles=plan.tiles_on_device,
    )


def keep_features(
    features: dict[str, Features], out: SchedulerOutput, plan: EntryPlan, rows: torch.Tensor
) -> dict[str, Features]:
    """The features to keep after a step: for each row of the step, f of its last position
    and, for a verify chunk, of every position (the next proposal starts after its last kept
    draft): ``rows``, the step's kept rows in order. Requests the step did not run keep
    theirs (``features``), copied into the same tensor, so one step's tensor holds every kept
    feature (none outlives its step's successor); finished requests' go."""
    scheduled = {s.request.request_id for s in out.scheduled}
    carried = [f for k, f in features.items() if k not in scheduled and not f.request.is_finished]
    if carried:
        rows = torch.cat([rows, *(f.rows for f in carried)])
    kept: dict[str, Features] = {}
    at = 0
    spans = [(s.request, first, n) for s, (first, n) in zip(out.scheduled, plan.kept, strict=True)]
    spans += [(f.request, f.first, f.rows.shape[0]) for f in carried]
    for request, first, n in spans:
        kept[request.request_id] = Features(request, first, rows[at : at + n])
        at += n
    return kept


class EntryStaging:
    """The host-to-device copy of a step's entry plan: one copy of all its integers, from
    pinned memory on CUDA, so the host never waits there for the target's forward (a copy
    from pageable memory would), with the prefill work list where the backend reads one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.zeros(0, dtype=torch.int64)
        self.copied = torch.cuda.Event() if self.pinned else None

    def stage(self, plan: EntryPlan, tiles: bool) -> torch.Tensor:
        """Set the plan's device tensors; returns its kept rows' indices [R] on the device."""
        columns = [plan.tokens, plan.positions, plan.slots, plan.starts, plan.kept_rows]
        work = None
        if tiles and max(plan.lengths) > 1:  # a prefill-shaped forward: its work list
            work = tile_list(query_lens(plan.starts), prefill_block_m(plan.starts[-1]))
        sizes = [len(c) for c in columns] + ([work.size] if work is not None else [])
        host = self._host(sum(sizes))
        at = 0
        for values in columns:
            host[at : at + len(values)] = values
            at += len(values)
        if work is not None:
            host[at : at + work.size] = work.reshape(-1)
        staged = self.host[: sum(sizes)]
        if self.pinned:
            staged = staged.to(self.device, non_blocking=True)
            self.copied.record()
        else:
            staged = staged.clone()
        parts = staged.split(sizes)
        plan.tokens_on_device, plan.positions_on_device, plan.slots_on_device = parts[:3]
        plan.starts_on_device = parts[3].to(ID32)
        if work is not None:
            plan.tiles_on_device = parts[5].view(-1, 2).to(ID32)
        return parts[4]

    def _host(self, size: int) -> np.ndarray:
        """The host buffer, once the last copy from it is done, with room for ``size``."""
        if self.copied is not None:
            self.copied.synchronize()  # long done: the step that made it has been collected
        if self.host.numel() < size:
            self.host = torch.zeros(2 * size, dtype=torch.int64, pin_memory=self.pinned)
        return self.host.numpy()


def feature_at(
    features: dict[str, Features], request_id: str, position: int
) -> torch.Tensor | None:
    """The target's feature at ``position`` of a request, where the step that computed it kept
    it (None: not kept)."""
    kept = features.get(request_id)
    if kept is None or not 0 <= position - kept.first < kept.rows.shape[0]:
        return None
    return kept.rows[position - kept.first]


def feature_before(features: dict[str, Features], row: DraftRow, missing: str) -> torch.Tensor:
    """The feature at the row's position - 1, which a proposal starts from; ``missing`` opens
    the error if no step kept it."""
    feature = feature_at(features, row.request_id, row.position - 1)
    if feature is None:
        raise RuntimeError(
            f"{missing} kept for request {row.request_id!r} at position {row.position - 1}"
        )
    return feature


def cache_block_bytes(attention: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one layer's own cache (a proposer's, beside the target's) adds to a block id."""
    return sum(math.prod(s) for s in attention.cache_shapes(1, block_size)) * dtype.itemsize


def bind_own_cache(
    attention: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """A proposer layer's cache of ``num_blocks`` blocks (indexed by the target's block ids),
    zeroed and bound to its attention."""
    own = [torch.zeros(s, dtype=dtype, device=device) for s in
           attention.cache_shapes(num_blocks, block_size)]  # fmt: skip
    attention.bind_cache(own)
    return own


def gib(tensors: Sequence[torch.Tensor]) -> float:
    """The GiB the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def tokens_after(row: ScheduledRequest, count: int) -> list[int]:
    """For each of the ``count`` positions a row computes, the token after it: known inside a
    prompt and a verify chunk; a stand-in (0) where it is still to be sampled, an entry the
    next step writes again."""
    after = row.request.token_ids[row.start + 1 : row.start + 1 + count]
    return [0 if token == PLACEHOLDER else token for token in after] + [0] * (count - len(after))


def load_eagle3(
    model: str,
    target: nn.Module,
    target_config: ModelConfig,
    max_drafts: int,
    max_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Eagle3Proposer:
    """The proposer of ``"method": "eagle3"``: the head loaded and checked against the
    target, and the buffer the target's forward writes its hidden states into (rows for a
    step of ``max_tokens`` tokens, the most any forward of the target runs), tapped into
    its decoder loop."""
    body = check_target(target, target_config)
    head, shape = load_head(model, target_config, device, dtype)
    logger.info(
        "eagle3 head: hidden %d, draft vocabulary %d, reading target layers %s",
        shape.config.hidden_size,
        shape.draft_vocab,
        list(shape.layer_ids),
    )
    aux = AuxHiddenStates.allocate(
        shape.layer_ids, max_tokens, target_config.hidden_size, dtype, device
    )
    body.aux_hidden_states = aux
    embed = head.embed_tokens if head.embed_tokens is not None else body.embed_tokens
    return Eagle3Proposer(head, aux, embed, max_drafts, device, dtype)
