"""Multi-token prediction (``"method": "mtp"``, also spelled ``"deepseek_mtp"`` and
``"qwen3_next_mtp"``): the MTP layer a DeepSeek-V3, Qwen3-Next or Qwen3.5 checkpoint ships
beside its decoder layers, used as the speculative proposer.

The published layouts (``MtpLayout``; one layer, which config.json's
``num_nextn_predict_layers`` says):

- DeepSeek-V3 (R1, V3.1): the layer is stored as decoder layer ``num_hidden_layers`` of the
  target's own checkpoint, ``model.layers.<L>.*``: ``enorm`` and ``hnorm`` (RMSNorms),
  ``eh_proj`` [H, 2H] (plain, also in the FP8 checkpoints), one full decoder layer (MLA
  attention, DeepSeekMoE; the target's names and formats), ``shared_head.norm`` and
  ``shared_head.head`` [V, H], and ``embed_tokens`` (a copy of the target's embedding, shared
  here when it is equal). vLLM (deepseek_mtp.py) and SGLang (deepseek_nextn.py) read it so.
- Qwen3-Next: ``mtp.*`` beside the target's tensors: ``fc`` [H, 2H] (no bias),
  ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``norm`` (its (1 + w) RMSNorms), and
  ``layers.0.*``, one gated full-attention decoder layer with the target's sparse MoE and
  shared expert (the target's names); the embedding and LM head are the target's
  (models/qwen3_next.py ``Qwen3NextMtpLayer``, as vLLM's qwen3_next_mtp.py reads it; a
  config.json without the field is read as one layer, as vLLM does). Qwen3.5's text models
  (dense or MoE) ship the same tensors, counted by ``mtp_num_hidden_layers`` (vLLM's
  qwen3_5_mtp.py); beside a Qwen3.5 vision-language target the layer is refused, its image
  rows' M-RoPE positions not being its entries' yet.

HF transformers drops the layer when it loads or saves either model.

What it computes: its entry at position p reads the embedding of the token at p + 1 and the
target's final hidden state at p (after the target's final norm, as both peers feed it): x =
eh_proj([enorm(e) | hnorm(h)]) (Qwen3-Next: fc over the pre-fc norms, embedding first, as
vLLM concatenates), then the decoder layer (attention over the MTP layer's own cache of the
entries before p), then its final norm; the LM head of that gives the draft after p + 1.
Drafting on, an entry takes the previous draft's embedding and the layer's own normed output
in place of the target's hidden state, post-norm like the target's (as SGLang's deepseek_nextn
and vLLM's qwen3_next_mtp recycle it; vLLM's deepseek_mtp.py hands on the stream before the
norm); the one layer is run K times for K drafts, as the peers do when K exceeds the layers
shipped.

Its cache and its entries follow EAGLE-3's scheme (engine_core/eagle3.py, whose module comment
walks it): one cache with as many blocks as the target's pool, indexed by the target's block
ids (DeepSeek's a latent row a token, Qwen3-Next's plain K and V, bound as eagle3.py binds its
head's); the entries lag the target's positions by one, rewritten after each step with the
tokens then known; a proposal rewrites the entry before the row's last token and writes one
per draft. Unlike EAGLE-3 it needs no hooks: the target's final hidden states are the
forward's output, which a CUDA-graph replay returns too. On a linear-attention target
(Qwen3-Next) the layer attends fully and holds no state: the target's verify step keeps its
DeltaNet states per verify position (docs/design/qwen3-next.md, "Speculation"), the layer's
entries need nothing of that. Where the target replays graphs, a proposal replays one graph of
the layer's K chained one-token forwards per batch bucket (EAGLE-3's chain and graphs,
engine_core/draft_graphs.py, over ``MtpChain``), its attention's decode kernel and its MoE
inside (for Qwen3-Next's layer not yet run on a GPU); its forward beside the target's runs
eagerly (prompt-shaped rows). Drafts are the layer's argmax, so exactness is the verify step's
(engine_core/speculative.py); the layer decides only how many tokens a step yields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.attention.base import AttentionMetadata
from engine_core.attention.mla import LatentAttention
from engine_core.config import ModelConfig
from engine_core.draft_graphs import FeatureProposalGraphs, eager_feature_proposal
from engine_core.draft_model import DraftForwards
from engine_core.eagle3 import (
    EntryStaging,
    Features,
    bind_own_cache,
    cache_block_bytes,
    entries_metadata,
    feature_at,
    feature_before,
    gib,
    keep_features,
    plan_entries,
)
from engine_core.forward_context import forward_context
from engine_core.loader import normalize_fp8_names, open_safetensors, read_json
from engine_core.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from engine_core.models.layers import Linear, NameMap, load_mapped_weights, reset_buffers
from engine_core.models.llama import choose_layer_forms, make_norm
from engine_core.models.meta_build import materialize, meta_build
from engine_core.models.quantize import make_quantized_linears
from engine_core.models.qwen3_next import (
    QWEN3_5_ARCHITECTURES,
    Qwen3NextForCausalLM,
    Qwen3NextMtpLayer,
    qwen3_5_text_config,
)
from engine_core.models.target import BuildTarget
from engine_core.request import SchedulerOutput
from engine_core.speculative import DraftRow

if TYPE_CHECKING:
    from engine_core.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

WHERE = "--speculative-config method 'mtp'"
QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5 = frozenset(QWEN3_5_ARCHITECTURES)
# The layer's own tensors (the rest are its decoder layer's, under the target's names).
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


# ---- the layer -------------------------------------------------------------------------------


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = make_norm(config, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MtpLayer(nn.Module):
    """The MTP layer's weights (its checkpoint names less ``model.layers.<L>.``, the decoder
    layer's under ``block.``) and its forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = make_norm(config, hidden)
        self.hnorm = make_norm(config, hidden)
        # A torch Linear, not ours: kept in the model's dtype in FP8 checkpoints too.
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # Layer index num_layers: an MoE layer (DeepSeek's dense layers are the first ones).
        self.block = DeepseekDecoderLayer(config, layer=config.num_layers)
        self.shared_head = SharedHead(config)

    def forward(
        self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """embeds (of the tokens after the positions), feature (the target's final hidden
        states there, or this layer's previous output) [T, H] -> the normed output [T, H]:
        the next draft's feature and what the head reads."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
        out, residual = self.block(x, None, cos, sin)
        return self.shared_head.norm(out, residual)[0]

    @property
    def feature_size(self) -> int:
        return self.eh_proj.out_features

    def attention(self) -> LatentAttention:
        return self.block.self_attn.attn


# ---- loading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MtpLayout:
    """Where a target's checkpoint keeps its MTP layer and what the layer is: the names'
    prefix, the layer's own tensors (the rest are its decoder layer's, named as the target's
    layers' after ``block``), the config field giving the layer count (``default_depth`` where
    the field is absent), whether the layer has its own LM head, and its module."""

    prefix: str
    own: tuple[str, ...]
    block: str
    probe: str  # the tensor every checkpoint with the layer holds
    depth_field: str
    default_depth: int | None
    own_head: bool
    build: Callable[[ModelConfig], nn.Module]

    @property
    def name(self) -> str:
        return self.prefix.removesuffix(".")


def deepseek_layout(config: ModelConfig) -> MtpLayout:
    """DeepSeek-V3's: decoder layer ``num_hidden_layers`` of the checkpoint; its config says
    the count (DeepseekV3Config writes it)."""
    return MtpLayout(
        prefix=f"model.layers.{config.num_layers}.", own=OWN, block="", probe="eh_proj.weight",
        depth_field="num_nextn_predict_layers", default_depth=None, own_head=True, build=MtpLayer,
    )  # fmt: skip


# Qwen3-Next's: ``mtp.*`` beside the target's tensors, its head the target's. The count defaults
# to one where config.json has no field (vLLM's reading: HF's Qwen3NextConfig has none).
QWEN3_NEXT_LAYOUT = MtpLayout(
    prefix="mtp.", own=("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm."),
    block="layers.0.", probe="fc.weight", depth_field="num_nextn_predict_layers",
    default_depth=1, own_head=False, build=Qwen3NextMtpLayer,
)  # fmt: skip


# Qwen3.5's text models (the CausalLMs, or a ConditionalGeneration checkpoint without its vision
# tower): the same tensors; the count is its text config's ``mtp_num_hidden_layers``.
QWEN3_5_LAYOUT = replace(QWEN3_NEXT_LAYOUT, depth_field="mtp_num_hidden_layers")


def mtp_layout(target: nn.Module, config: ModelConfig, hf: dict[str, Any]) -> MtpLayout:
    """The target's MTP layout; ValueError for a target whose checkpoint has no MTP layer, one
    this proposer cannot run, or a config that says other than one layer."""
    layout = layout_of(target, config, hf.get("architectures") or [])
    text = qwen3_5_text_config(hf) if layout is QWEN3_5_LAYOUT else hf
    layers = text.get(layout.depth_field, layout.default_depth)
    if layers != 1:
        raise ValueError(
            f"{WHERE}: config.json {layout.depth_field} is {layers!r}; Tandem reads a "
            "checkpoint with exactly one MTP layer (as DeepSeek-V3, Qwen3-Next and Qwen3.5 "
            "publish)"
        )
    if target.model.stage.size > 1:
        raise ValueError(f"{WHERE}: not supported with --pipeline-parallel-size > 1")
    return layout


def layout_of(target: nn.Module, config: ModelConfig, architectures: list[str]) -> MtpLayout:
    if isinstance(target, DeepseekForCausalLM) and "DeepseekV3ForCausalLM" in architectures:
        return deepseek_layout(config)
    if isinstance(target, Qwen3NextForCausalLM) and QWEN3_NEXT in architectures:
        return QWEN3_NEXT_LAYOUT
    if isinstance(target, Qwen3NextForCausalLM) and set(architectures) & QWEN3_5:
        if config.vision is not None:
            # Image rows take M-RoPE positions, which the layer's entries do not carry yet.
            raise ValueError(
                f"{WHERE}: a Qwen3.5 vision-language target's MTP layer is not read yet; its "
                "text model (a config without vision_config) or 'ngram' speculates"
            )
        return QWEN3_5_LAYOUT
    raise ValueError(
        f"{WHERE}: the target must be a DeepSeek-V3-architecture model (DeepSeek-V3/R1/V3.1, "
        f"Kimi-K2), Qwen3-Next or a Qwen3.5 text model that ships an MTP layer; "
        f"{architectures} has none that Tandem reads"
    )


def read_prefixed_tensors(model_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names start with ``prefix``, by their names less it,
    from the files the index names for them (a large checkpoint's other layers stay on disk)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = read_json(index)["weight_map"]
        names = {file for name, file in weight_map.items() if name.startswith(prefix)}
        files = [model_dir / name for name in sorted(names)]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith(prefix):
                    tensors[name.removeprefix(prefix)] = f.get_tensor(name)
    return tensors


def mtp_name_map(target: DeepseekForCausalLM | Qwen3NextForCausalLM, layout: MtpLayout) -> NameMap:
    """A checkpoint name (less the layout's prefix) -> (our parameter, shard): the layer's own
    tensors as they are, the decoder layer's as the target maps its layer 0's (merged
    projections, stacked experts), under ``block.``; any other name as it is, which the
    loader refuses as unknown."""

    def map_name(name: str) -> tuple[str, int | None] | None:
        if name.startswith(layout.own) or not name.startswith(layout.block):
            return name, None
        mapped = target.map_name(f"model.layers.0.{name.removeprefix(layout.block)}")
        if mapped is None:
            return None
        return "block." + mapped[0].removeprefix("model.layers.0."), mapped[1]

    return map_name


def load_mtp_layer(
    target: DeepseekForCausalLM | Qwen3NextForCausalLM,
    layout: MtpLayout,
    config: ModelConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[nn.Module, torch.Tensor | None]:
    """The MTP layer of the target's checkpoint, in the target's weight format, and the
    checkpoint's copy of the embedding for it, if any."""
    tensors = read_prefixed_tensors(model_dir, layout.prefix)
    if layout.probe not in tensors:
        raise ValueError(
            f"{WHERE}: {model_dir} has no MTP weights (no '{layout.prefix}{layout.probe}' "
            "and the rest of the layer); a checkpoint saved by HF transformers drops them"
        )
    # The plain forms (no gate/up interleaving): its proposal graphs capture them as they are.
    build = BuildTarget(device, dtype)
    with meta_build(dtype):
        mtp = layout.build(config)
        make_quantized_linears(mtp, config)
        choose_layer_forms(mtp, build)
    materialize(mtp, device)
    reset_buffers(mtp)
    own_embedding = tensors.pop("embed_tokens.weight", None)
    try:
        load_mapped_weights(
            mtp, normalize_fp8_names(iter(tensors.items())), mtp_name_map(target, layout)
        )
    except ValueError as exc:  # names the tensor; say whose
        raise ValueError(f"{WHERE}: the MTP layer ({layout.name}): {exc}") from None
    mtp.eval().requires_grad_(False)
    if device.type == "cpu":  # oneDNN's layout, as the target's linears take (cpu_gemm.py)
        for module in mtp.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
    return mtp, own_embedding


def layer_embedding(
    target: DeepseekForCausalLM | Qwen3NextForCausalLM,
    tensor: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """The target's embedding where the checkpoint's copy for the layer is absent or equal to
    it (DeepSeek-V3's is); else the copy, as the layer was trained with it."""
    shared = target.model.embed_tokens
    if tensor is None:
        return shared
    if tensor.shape != shared.weight.shape:
        raise ValueError(
            f"{WHERE}: the MTP layer's embed_tokens.weight is {list(tensor.shape)}, the "
            f"target's {list(shared.weight.shape)}"
        )
    # Compared on the host: a second copy on the GPU would stay in the allocator's cache and
    # shrink the KV cache sized after it.
    if torch.equal(tensor.to(dtype), shared.weight.detach().cpu()):
        return shared
    return nn.Embedding.from_pretrained(tensor.to(device, dtype), freeze=True)


# ---- the proposer ----------------------------------------------------------------------------


@dataclass
class MtpChain:
    """The layer as the proposal's chain runs it (draft_graphs.FeatureDrafter): the feature
    carried on is its own normed output, which its head reads too."""

    layer: MtpLayer | Qwen3NextMtpLayer
    embed: nn.Module
    head: torch.Tensor  # [V, H]: the layer's own LM head (DeepSeek) or the target's (Qwen3-Next)
    rotary: nn.Module  # the target's (the layer is one of its decoder layers)
    dtype: torch.dtype

    @property
    def feature_size(self) -> int:
        return self.layer.feature_size

    def chain_forward(
        self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(positions, self.dtype)
        normed = self.layer(self.embed(tokens), feature, cos, sin)
        return normed, normed

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [N, H] -> the head's argmax [N] int64."""
        return F.linear(normed, self.head).argmax(dim=-1)

    def target_ids(self, argmax: torch.Tensor) -> torch.Tensor:
        return argmax  # the layer's head is over the target's vocabulary

    def plain_logits_weight(self) -> torch.Tensor:
        return self.head


class MtpProposer:
    """The MTP layer, its cache (owned here, as the model runner owns the target's) and
    the target's hidden states it keeps between a step and the next proposal; a
    speculative.BatchProposer."""

    def __init__(self, chain: MtpChain, max_drafts: int, device: torch.device) -> None:
        self.layer = chain.layer
        self.embed = chain.embed
        self.chain = chain
        self.max_drafts = max_drafts
        self.device = device
        self.dtype = chain.dtype
        self.features: dict[str, Features] = {}
        self.block_size = 0
        self.cache: list[torch.Tensor] = []
        self.backend: AttentionBackend | None = None
        self.proposal_graphs: FeatureProposalGraphs | None = None
        self.staging = EntryStaging(device)
        self.forwards = DraftForwards()

    # ---- set-up -------------------------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        """Bytes the layer's cache adds to one block id of the pool (DeepSeek's: one latent row
        a token; Qwen3-Next's: its K and V)."""
        return cache_block_bytes(self.layer.attention(), block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend) -> None:
        self.cache = bind_own_cache(
            self.layer.attention(), num_blocks, block_size, self.dtype, self.device
        )
        self.block_size, self.backend = block_size, backend
        logger.info("mtp layer: its cache %.3f GiB beside the target's", gib(self.cache))

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, prefill_tokens: int) -> None:
        """Where the target replays graphs (after ``allocate_cache``: they bake in its cache's
        address): the proposal's K chained one-token forwards per batch bucket, the attention's
        decode kernel (latent or plain) and the MoE's fused experts inside. The layer's forward
        beside the target's stays eager: its rows are prompt-shaped (the entry before a row's
        first position and the row's own), which DeepSeek's latent attention plans from host
        lengths, as the target's prompt steps do (models/deepseek.py), and Qwen3-Next's target
        runs its own prompt and verify steps eagerly."""
        assert self.backend is not None
        logger.info("mtp layer: its forward beside the target's runs eagerly (prompt-shaped)")
        for module in self.layer.modules():
            if not getattr(module, "cuda_graph_safe", True):
                logger.warning(
                    "mtp layer: proposals run eagerly (%s reads host values)",
                    type(module).__name__,
                )
                return
        self.proposal_graphs = FeatureProposalGraphs(
            self.chain, self.backend, "mtp layer", max_rows=max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // self.block_size), num_drafts=self.max_drafts,
            block_size=self.block_size, max_model_len=max_model_len,
            vocab_size=self.chain.head.shape[0], device=self.device,
        )  # fmt: skip
        self.proposal_graphs.capture()

    # ---- every step: the layer's entries for the target's positions ---------------------------

    @torch.inference_mode()
    def run_alongside(
        self, out: SchedulerOutput, meta: AttentionMetadata, hidden: torch.Tensor
    ) -> None:
        """Write the layer's entries for the step (``meta``, ``hidden`` [T, H]: the target's
        forward's metadata and final hidden states): each row's positions with the tokens
        after them, and the entry before its first position again, now that its token is known
        (eagle3.plan_entries); keep the hidden states a proposal may start from."""
        assert self.backend is not None
        query_start = meta.query_start_loc_cpu
        plan = plan_entries(out, query_start, self._kept_feature, self.block_size)
        kept_rows = self.staging.stage(plan, self.backend_tiles)
        features = torch.cat(plan.features_of(hidden, query_start)).to(self.dtype)
        cos, sin = self.chain.rotary(plan.positions_on_device, self.dtype)
        with forward_context(entries_metadata(plan, meta), self.backend):
            self.layer(self.embed(plan.tokens_on_device), features, cos, sin)
        self.forwards.alongside_eager += 1
        # A copy: ``hidden`` may be a graph's static output, written again next step.
        rows = hidden.index_select(0, kept_rows).to(self.dtype)
        self.features = keep_features(self.features, out, plan, rows)

    @property
    def backend_tiles(self) -> bool:
        """Whether the entries are staged with the Triton prefill kernel's work list: on CUDA
        for a plain K/V layer (Qwen3-Next's); DeepSeek's latent attention plans its expanded
        path itself."""
        return self.device.type == "cuda" and not isinstance(
            self.layer.attention(), LatentAttention
        )

    def _kept_feature(self, request_id: str, position: int) -> torch.Tensor | None:
        return feature_at(self.features, request_id, position)

    # ---- proposing ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        """``row.count`` greedy drafts for each row: forward 1 rewrites the entry at the row's
        position - 1 (its last token, the target's hidden state there), forward j + 1 writes
        the entry of draft j (the layer's own output); K chained forwards of the one layer
        over all the rows (draft_graphs.propose_feature_chain), a graph replay where one fits."""
        assert self.backend is not None
        missing = "mtp: no target hidden state"
        features = [feature_before(self.features, r, missing) for r in rows]
        chain_rows = [replace(r, position=r.position - 1) for r in rows]
        graphs = self.proposal_graphs
        if graphs is not None and graphs.can_run(chain_rows):
            self.forwards.proposal_replays += 1
            return graphs.propose_from(chain_rows, features)
        self.forwards.proposal_eager += 1
        return eager_feature_proposal(
            self.chain, self.backend, chain_rows, features, self.block_size, self.device
        )


def load_mtp(
    target: nn.Module,
    config: ModelConfig,
    model_dir: Path,
    max_drafts: int,
    device: torch.device,
    dtype: torch.dtype,
) -> MtpProposer:
    """The proposer of ``"method": "mtp"``: the MTP layer of the target's checkpoint
    (``model_dir``), checked against the target."""
    layout = mtp_layout(target, config, read_json(model_dir / "config.json"))
    assert isinstance(target, DeepseekForCausalLM | Qwen3NextForCausalLM)  # mtp_layout
    layer, own_embedding = load_mtp_layer(target, layout, config, model_dir, device, dtype)
    embed = layer_embedding(target, own_embedding, device, dtype)
    head = layer.shared_head.head.weight if layout.own_head else target.logits_weight()
    logger.info(
        "mtp layer: %s* of the target's checkpoint%s, %s LM head",
        layout.prefix,
        "" if embed is target.model.embed_tokens else ", with its own embedding",
        "its own" if layout.own_head else "the target's",
    )
    chain = MtpChain(layer, embed, head, target.model.rotary_emb, dtype)
    return MtpProposer(chain, max_drafts, device)
