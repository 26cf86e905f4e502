"""Multi-token prediction (``"method": "mtp"``, also spelled ``"deepseek_mtp"``): the MTP
layer a DeepSeek-V3 checkpoint ships beside its decoder layers, used as the speculative
proposer.

The published layout (DeepSeek-V3, R1, V3.1: ``num_nextn_predict_layers`` 1 in config.json):
the layer is stored as decoder layer ``num_hidden_layers`` of the target's own checkpoint,
``model.layers.<L>.*``: ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj`` [H, 2H] (plain, also in
the FP8 checkpoints), one full decoder layer (MLA attention, DeepSeekMoE; the target's names
and formats), ``shared_head.norm`` and ``shared_head.head`` [V, H], and ``embed_tokens`` (a copy
of the target's embedding, shared here when it is equal). HF transformers drops the layer when
it loads the model; vLLM (deepseek_mtp.py) and SGLang (deepseek_nextn.py) read it as here.

What it computes: its entry at position p reads the embedding of the token at p + 1 and the
target's final hidden state at p (after the target's final norm): x = eh_proj([enorm(e) |
hnorm(h)]), then the decoder layer (attention over the MTP layer's own latent cache of the
entries before p), then shared_head.norm; shared_head.head of that gives the draft after p + 1.
Drafting on, an entry takes the previous draft's embedding and the layer's own normed output in
place of the target's hidden state, post-norm like the target's (as SGLang's deepseek_nextn
recycles it; vLLM's deepseek_mtp.py hands on the stream before the norm); the one layer is run
K times for K drafts, as the peers do when K exceeds the layers shipped.

Its cache and its entries follow EAGLE-3's scheme (engine_core/eagle3.py, whose module comment
walks it): one latent cache with as many blocks as the target's pool, indexed by the target's
block ids; the entries lag the target's positions by one, rewritten after each step with the
tokens then known; a proposal rewrites the entry before the row's last token and writes one
per draft. Unlike EAGLE-3 it needs no hooks: the target's final hidden states are the
forward's output, which a CUDA-graph replay returns too. Where the target replays graphs, a
proposal replays one graph of the layer's K chained one-token forwards per batch bucket (EAGLE-3's
chain and graphs, engine_core/draft_graphs.py, over ``MtpChain``), its latent attention's decode
kernel and its MoE inside; its forward beside the target's runs eagerly (prompt-shaped rows,
which the latent attention plans on the host). Drafts are the layer's argmax, so exactness is
the verify step's (engine_core/speculative.py); the layer decides only how many tokens a step
yields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
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
from engine_core.loader import normalize_fp8_names, read_json
from engine_core.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from engine_core.models.layers import Linear, NameMap, load_mapped_weights, reset_buffers
from engine_core.models.llama import choose_layer_forms, make_norm
from engine_core.models.meta_build import materialize, meta_build
from engine_core.models.quantize import make_quantized_linears
from engine_core.models.target import BuildTarget
from engine_core.request import SchedulerOutput
from engine_core.speculative import DraftRow

if TYPE_CHECKING:
    from engine_core.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

WHERE = "--speculative-config method 'mtp'"
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

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [N, H] -> the head's argmax [N] int64."""
        return self.shared_head.head(normed).argmax(dim=-1)

    def attention(self) -> LatentAttention:
        return self.block.self_attn.attn


# ---- loading ---------------------------------------------------------------------------------


def check_target(target: nn.Module, hf: dict[str, Any]) -> None:
    """Refuse a target whose checkpoint has no MTP layer or one this proposer cannot run."""
    architectures = hf.get("architectures") or []
    if "Qwen3NextForCausalLM" in architectures:
        raise ValueError(
            f"{WHERE}: Qwen3-Next's MTP layer (its 'mtp.*' tensors) is not read yet; "
            "'ngram' and 'draft_model' speculate on it"
        )
    if not isinstance(target, DeepseekForCausalLM) or "DeepseekV3ForCausalLM" not in architectures:
        raise ValueError(
            f"{WHERE}: the target must be a DeepSeek-V3-architecture model (DeepSeek-V3/R1/V3.1, "
            f"Kimi-K2) that ships an MTP layer; {architectures} has none that Tandem reads"
        )
    layers = hf.get("num_nextn_predict_layers")
    if layers != 1:
        raise ValueError(
            f"{WHERE}: config.json num_nextn_predict_layers is {layers!r}; Tandem reads a "
            "checkpoint with exactly one MTP layer (as DeepSeek-V3 publishes)"
        )
    if target.model.stage.size > 1:
        raise ValueError(f"{WHERE}: not supported with --pipeline-parallel-size > 1")


def read_layer_tensors(model_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of decoder layer ``layer``, by their names less its prefix,
    from the files the index names for them (a V3 checkpoint's other layers stay on disk)."""
    prefix = f"model.layers.{layer}."
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = read_json(index)["weight_map"]
        names = {file for name, file in weight_map.items() if name.startswith(prefix)}
        files = [model_dir / name for name in sorted(names)]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith(prefix):
                    tensors[name.removeprefix(prefix)] = f.get_tensor(name)
    return tensors


def mtp_name_map(target: DeepseekForCausalLM) -> NameMap:
    """A checkpoint name (less the layer prefix) -> (our parameter, shard): the layer's own
    tensors as they are, the decoder layer's as the target maps its layer 0's (merged
    projections, stacked experts), under ``block.``."""

    def map_name(name: str) -> tuple[str, int | None] | None:
        if name.startswith(OWN):
            return name, None
        mapped = target.map_name(f"model.layers.0.{name}")
        if mapped is None:
            return None
        return "block." + mapped[0].removeprefix("model.layers.0."), mapped[1]

    return map_name


def load_mtp_layer(
    target: DeepseekForCausalLM,
    config: ModelConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[MtpLayer, nn.Module]:
    """The MTP layer of the target's checkpoint, in the target's weight format, and the
    embedding it reads (the target's, unless the checkpoint's copy differs from it)."""
    layer = config.num_layers  # stored as the decoder layer after the target's last
    tensors = read_layer_tensors(model_dir, layer)
    if not any(name.startswith(OWN) for name in tensors):
        raise ValueError(
            f"{WHERE}: {model_dir} has no MTP weights (no 'model.layers.{layer}.eh_proj.weight' "
            "and the rest of the layer); a checkpoint saved by HF transformers drops them"
        )
    # The plain forms (no gate/up interleaving): its proposal graphs capture them as they are.
    build = BuildTarget(device, dtype)
    with meta_build(dtype):
        mtp = MtpLayer(config)
        make_quantized_linears(mtp, config)
        choose_layer_forms(mtp, build)
    materialize(mtp, device)
    reset_buffers(mtp)
    own_embedding = tensors.pop("embed_tokens.weight", None)
    try:
        load_mapped_weights(mtp, normalize_fp8_names(iter(tensors.items())), mtp_name_map(target))
    except ValueError as exc:  # names the tensor; say whose
        raise ValueError(f"{WHERE}: the MTP layer (model.layers.{layer}): {exc}") from None
    mtp.eval().requires_grad_(False)
    if device.type == "cpu":  # oneDNN's layout, as the target's linears take (cpu_gemm.py)
        for module in mtp.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
    return mtp, layer_embedding(target, own_embedding, device, dtype)


def layer_embedding(
    target: DeepseekForCausalLM,
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

    layer: MtpLayer
    embed: nn.Module
    rotary: nn.Module  # the target's (the layer is one of its decoder layers)
    dtype: torch.dtype

    @property
    def feature_size(self) -> int:
        return self.layer.eh_proj.out_features

    def chain_forward(
        self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(positions, self.dtype)
        normed = self.layer(self.embed(tokens), feature, cos, sin)
        return normed, normed

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        return self.layer.draft_ids(normed)

    def target_ids(self, argmax: torch.Tensor) -> torch.Tensor:
        return argmax  # the layer's head is over the target's vocabulary

    def plain_logits_weight(self) -> torch.Tensor:
        return self.layer.shared_head.head.weight


class MtpProposer:
    """The MTP layer, its latent cache (owned here, as the model runner owns the target's) and
    the target's hidden states it keeps between a step and the next proposal; a
    speculative.BatchProposer."""

    def __init__(
        self,
        layer: MtpLayer,
        embed: nn.Module,
        rotary: nn.Module,
        max_drafts: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.layer = layer
        self.embed = embed
        self.chain = MtpChain(layer, embed, rotary, dtype)
        self.max_drafts = max_drafts
        self.device = device
        self.dtype = dtype
        self.features: dict[str, Features] = {}
        self.block_size = 0
        self.cache: list[torch.Tensor] = []
        self.backend: AttentionBackend | None = None
        self.proposal_graphs: FeatureProposalGraphs | None = None
        self.staging = EntryStaging(device)
        self.forwards = DraftForwards()

    # ---- set-up -------------------------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        """Bytes the layer's cache adds to one block id of the pool: one latent row a token."""
        return cache_block_bytes(self.layer.attention(), block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend) -> None:
        self.cache = bind_own_cache(
            self.layer.attention(), num_blocks, block_size, self.dtype, self.device
        )
        self.block_size, self.backend = block_size, backend
        logger.info("mtp layer: its latent cache %.3f GiB beside the target's", gib(self.cache))

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, prefill_tokens: int) -> None:
        """Where the target replays graphs (after ``allocate_cache``: they bake in its cache's
        address): the proposal's K chained one-token forwards per batch bucket, the latent
        attention's decode kernel and the MoE's fused experts inside. The layer's forward beside
        the target's stays eager: its rows are prompt-shaped (the entry before a row's first
        position and the row's own), and the latent attention's expanded path plans them from
        host lengths, as the target's prompt steps do (models/deepseek.py)."""
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
            vocab_size=self.layer.shared_head.head.out_features, device=self.device,
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
        # No prefill work list: the latent attention plans its expanded path itself.
        kept_rows = self.staging.stage(plan, tiles=False)
        features = torch.cat(plan.features_of(hidden, query_start)).to(self.dtype)
        cos, sin = self.chain.rotary(plan.positions_on_device, self.dtype)
        with forward_context(entries_metadata(plan, meta), self.backend):
            self.layer(self.embed(plan.tokens_on_device), features, cos, sin)
        self.forwards.alongside_eager += 1
        # A copy: ``hidden`` may be a graph's static output, written again next step.
        rows = hidden.index_select(0, kept_rows).to(self.dtype)
        self.features = keep_features(self.features, out, plan, rows)

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
    hf = read_json(model_dir / "config.json")
    check_target(target, hf)
    assert isinstance(target, DeepseekForCausalLM)  # check_target
    layer, embed = load_mtp_layer(target, config, model_dir, device, dtype)
    logger.info(
        "mtp layer: model.layers.%d of the target's checkpoint%s",
        config.num_layers,
        "" if embed is target.model.embed_tokens else ", with its own embedding",
    )
    return MtpProposer(layer, embed, target.model.rotary_emb, max_drafts, device, dtype)
