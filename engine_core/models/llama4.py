"""Llama 4's text model (``Llama4ForCausalLM``, and the language model of
``Llama4ForConditionalGeneration``) over the paged KV cache: the Llama implementation with
Llama 4's differences, each where it belongs.

- **Chunked local attention** on the rotary layers: a query at position p sees only the keys in
  [p // C * C, p] (``attention_chunk_size`` C, 8,192 in the released models). The layers carry
  ``attention_chunk`` (attention/layer.py); their KV group gives back the blocks before the
  chunk (kv_groups.py). HF's ``layer_types`` says which layers are chunked.
- **NoPE layers** (``no_rope_layers``: every fourth layer in the released models) take no
  rotary and attend to the whole context; with ``attn_temperature_tuning`` their queries are
  scaled by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (``Llama4Model``).
- **QK norm** (``use_qk_norm``): q and k of the rotary layers through an L2 norm without a
  weight (x / sqrt(mean(x^2) + eps)), after the rotary, as HF does.
- **Rotary over (even, odd) pairs.** HF rotates each head's dims 2i and 2i + 1 together; our
  rotary (the Triton kernels' too) pairs dim i with i + D/2. The checkpoint's q and k rows are
  permuted within each head as they load (``rotary_halves``), which changes no q.k product, no
  L2 norm and no NoPE layer: one layout, no second rotary.
- **MoE with a shared expert** on ``moe_layers`` (or every ``interleave_moe_layer_step``-th
  layer), dense MLPs of ``intermediate_size_mlp`` elsewhere. The router takes each token's top
  logit, and its sigmoid multiplies the expert's *input* (not its output: the SwiGLU makes the
  two differ); the shared expert (``intermediate_size`` wide, as each routed one) sees the
  token unscaled (``Llama4MoE``). Only top-1 routing is implemented (the released models').

Checkpoint names are HF's: ``feed_forward`` is our ``mlp``, its ``router`` our ``gate``, the
stacked experts' ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` are transposed into
SparseMoE's ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``. Llama4ForConditionalGeneration's
``language_model.`` prefix is dropped; its vision tower's and projector's tensors pass through
under their own names to ``Llama4ForConditionalGeneration`` (models/llama4_mm.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine_core.config import ModelConfig
from engine_core.models.layers import load_mapped_weights, rotate_qk
from engine_core.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    first_norm,
    make_norm,
)
from engine_core.models.moe import Routing, SparseMoE
from engine_core.parallel import SINGLE, PendingSum, TPGroup

LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")

# Fields of a Llama 4 text config that would change the output, with the values implemented.
_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "num_experts_per_tok": (1,),  # sigmoid top-1 routing, as released
}
_LAYER_KINDS = ("chunked_attention", "full_attention")
_EXPERTS = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)$")
# q and k rows (and an FP8 checkpoint's scale for each row) move to our rotary's layout.
_QK = re.compile(r"\.self_attn\.[qk]_proj\.(weight|bias|weight_scale)$")


class Llama4Attention(LlamaAttention):
    """Llama's attention with rotary only on the rope layers, the L2 QK norm there, and the
    temperature of the NoPE layers' queries (``Llama4Model`` computes the scales)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__(config, tp, layer)
        self.uses_rope = layer not in config.nope_layers
        self.l2_norm_eps = config.norm_eps if config.qk_l2_norm and self.uses_rope else None
        self.scales_queries = config.query_temperature is not None and not self.uses_rope

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        query_scales: torch.Tensor | None = None,
    ) -> torch.Tensor | PendingSum:
        """hidden [T, hidden], cos/sin [T, D], query_scales [T, 1, 1] or None -> [T, hidden]."""
        num_tokens, head_dim = hidden.shape[0], self.attn.head_dim
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q = q.view(num_tokens, -1, head_dim)  # [T, H, D]
        k = k.view(num_tokens, -1, head_dim)  # [T, KVH, D]
        if self.uses_rope:
            q, k = rotate_qk(q, k, cos, sin)
        if self.l2_norm_eps is not None:
            q, k = l2_norm(q, self.l2_norm_eps), l2_norm(k, self.l2_norm_eps)
        if self.scales_queries and query_scales is not None:
            q = (q * query_scales).to(q.dtype)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32, back in x's dtype (HF's
    Llama4TextL2Norm: an RMSNorm without a weight)."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4MoE(SparseMoE):
    """Routed experts (SparseMoE's stacked weights and kernels) behind Llama 4's router, and
    the shared expert."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, tp)
        width = config.moe_intermediate_size
        self.shared_expert = LlamaMLP(dataclasses.replace(config, intermediate_size=width), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the chosen expert applied to x scaled by its sigmoid score (on the
        input, as HF), plus the shared expert applied to x, [T, hidden]."""
        return self.routed_output(x, self.sigmoid_top1) + self.shared_expert(x)

    def sigmoid_top1(self, x: torch.Tensor) -> Routing:
        """Each token's best expert, its input scaled by the sigmoid of its logit, weight one."""
        top, ids = self.gate(x).topk(1, dim=-1)  # [T, 1] each
        score = torch.sigmoid(top.float()).to(x.dtype)
        unweighted = torch.ones(score.shape, dtype=torch.float32, device=x.device)
        return x * score, unweighted, ids


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Llama4Attention(config, tp, layer)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        moe = config.is_moe_layer(layer)
        self.mlp = Llama4MoE(config, tp) if moe else LlamaMLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        query_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        """LlamaDecoderLayer's contract (sublayer output, residual stream before it), with the
        NoPE layers' query scales."""
        hidden, residual = first_norm(self.input_layernorm, hidden, residual)
        attn = self.self_attn(hidden, cos, sin, query_scales)
        hidden, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(hidden), residual


class Llama4Model(LlamaModel):
    """LlamaModel whose forward also computes the NoPE layers' query scales, once for all."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup = SINGLE,
        layer_class: type[nn.Module] = Llama4DecoderLayer,
    ) -> None:
        super().__init__(config, tp, layer_class)
        self.query_temperature = config.query_temperature

    def query_scales(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[T, 1, 1] float32: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (HF's
        attention temperature tuning); None without it."""
        if self.query_temperature is None:
            return None
        floor_scale, attn_scale = self.query_temperature
        steps = torch.floor((positions.float() + 1.0) / floor_scale)
        return (torch.log1p(steps) * attn_scale + 1.0)[:, None, None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.run_from(self.embed(input_ids), positions)

    def run_from(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] (the token embeddings, an image's rows replaced) -> final
        hidden states [T, hidden]."""
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        scales = self.query_scales(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, scales)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4's text model; checkpoint names follow HF's Llama4ForCausalLM (or, prefixed
    ``language_model.``, its Llama4ForConditionalGeneration)."""

    decoder_layer = Llama4DecoderLayer
    model_class = Llama4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = llama4_tensors(weights, self.config.head_dim)
        load_mapped_weights(self, tensors, self.map_name)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.startswith(VISION_PREFIXES):
            return None  # the text model of a vision checkpoint
        return super().map_name(hf_name)


def llama4_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's tensors under the Llama family's names and in our layouts (see the module's
    docstring); the vision tower's and the projector's unchanged."""
    for name, tensor in weights:
        if (bare := name.removeprefix("model.")).startswith(VISION_PREFIXES):
            yield bare, tensor  # HF's layouts as they are (models/llama4_mm.py)
            continue
        name = name.removeprefix("language_model.")
        name = name.replace(".feed_forward.router.", ".feed_forward.gate.")
        name = name.replace(".feed_forward.", ".mlp.")
        if _EXPERTS.match(name):
            tensor = tensor.transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in]
        elif _QK.search(name):
            tensor = rotary_halves(tensor, head_dim)
        yield name, tensor


def rotary_halves(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q or k projection rows [heads * D, ...] with each head's (even, odd) dim pairs moved to
    (i, i + D/2): HF's interleaved rotary becomes our rotate-half one."""
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    heads = tensor.shape[0] // head_dim
    shaped = tensor.reshape(heads, head_dim, *tensor.shape[1:])
    return shaped[:, order].reshape(tensor.shape).contiguous()


def llama4_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json fields: ``text_config`` (with the top level's token ids
    where it lacks them) for Llama4ForConditionalGeneration, the top level otherwise."""
    if "text_config" not in hf:
        return hf
    text = dict(hf["text_config"])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in hf and key not in text:
            text[key] = hf[key]
    return text


def llama4_fields(text: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ModelConfig fields of a Llama 4 text config beyond the Llama family's (whose
    ``intermediate_size`` is the dense MLPs' width here); refuses, by name, what is not
    implemented."""
    check_llama4_supported(text, architecture)
    num_layers = text["num_hidden_layers"]
    chunk = text.get("attention_chunk_size", 8192)
    rope_layers = text.get("no_rope_layers") or [
        int((i + 1) % text.get("no_rope_layer_interval", 4) != 0) for i in range(num_layers)
    ]
    kinds = text.get("layer_types") or [
        "chunked_attention" if uses_rope and chunk is not None else "full_attention"
        for uses_rope in rope_layers
    ]
    if len(kinds) != num_layers or set(kinds) - set(_LAYER_KINDS) or len(rope_layers) < num_layers:
        raise ValueError(
            f"{architecture}: layer_types {kinds!r} / no_rope_layers {rope_layers!r} do not "
            f"describe {num_layers} layers of {_LAYER_KINDS}"
        )
    if "chunked_attention" in kinds and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{architecture}: attention_chunk_size {chunk!r} must be a positive int")
    moe_layers = text.get("moe_layers")
    if moe_layers is None:
        step = text.get("interleave_moe_layer_step", 1)
        moe_layers = list(range(step - 1, num_layers, step))
    temperature = None
    if text.get("attn_temperature_tuning", True):
        temperature = (float(text.get("floor_scale", 8192)), float(text.get("attn_scale", 0.1)))
    return {
        "architecture": "llama4",
        "intermediate_size": text.get("intermediate_size_mlp", 16384),
        "layer_types": tuple(kinds),
        "attention_chunk_size": chunk if "chunked_attention" in kinds else None,
        "nope_layers": tuple(i for i in range(num_layers) if not rope_layers[i]),
        "query_temperature": temperature,
        "qk_l2_norm": bool(text.get("use_qk_norm", True)),
        "num_experts": text.get("num_local_experts", 16),
        "num_experts_per_tok": 1,
        "moe_intermediate_size": text.get("intermediate_size", 8192),
        "n_shared_experts": 1,
        "moe_router": "llama4",
        "dense_layers": tuple(i for i in range(num_layers) if i not in set(moe_layers)),
    }


def check_llama4_supported(text: dict[str, Any], architecture: str) -> None:
    """ValueError naming a field of ``text`` (a text config, with the top level's quantization)
    that would change the output and is not implemented."""
    for name, allowed in _IMPLEMENTED.items():
        if name in text and text[name] not in allowed:
            raise ValueError(
                f"{architecture}: config field {name}={text[name]!r} is not supported "
                f"(implemented: {list(allowed)})"
            )
    method = (text.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "compressed-tensors"):
        raise ValueError(
            f"{architecture}: quantization_config quant_method {method!r} is not supported for "
            "Llama 4; its compressed-tensors FP8 checkpoints (per-channel weights, dynamic "
            "activations) are"
        )
