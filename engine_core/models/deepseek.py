"""The DeepSeek-V2/V3 architecture (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``; also
DeepSeek-R1 and V3.1, and Kimi-K2, which publish V3's) over a paged latent cache.

What it adds to the Llama implementation, as HF transformers computes it:

- multi-head latent attention (``MlaAttention``; the cache and the two ways to attend are in
  engine_core/attention/mla.py): q from one projection or a low-rank pair with a norm between
  (``q_lora_rank``), the KV latent and the shared rotary key from ``kv_a_proj_with_mqa``;
  rotary over (even, odd) pairs (``rope_interleave``; V2 always), YaRN with DeepSeek's mscale
  (cos/sin times the ratio of the mscale terms, the softmax scale times the square of the
  ``mscale_all_dim`` one);
- DeepSeekMoE (``DeepseekMoE``): routed experts stacked as models/moe.py keeps them, a router
  of sigmoid scores plus ``e_score_correction_bias`` choosing among the top ``topk_group`` of
  ``n_group`` expert groups (V3), or softmax scores, greedy or group-limited (V2); the chosen
  scores (renormalised where ``norm_topk_prob``) times ``routed_scaling_factor``; and shared
  experts (a dense MLP of ``n_shared_experts`` x ``moe_intermediate_size``) added to them;
- the first ``first_k_dense_replace`` layers have a dense MLP of ``intermediate_size``.

FP8 checkpoints (V3's published block-FP8) keep every linear and every expert in e4m3 (as
models/quantize.py does for any model) except ``kv_b_proj``, which the absorbed decode reads as
a matrix: it is dequantized into the model's dtype once loaded (``LatentUpProjection``), and the
latent it multiplies is not quantized, as vLLM computes it too.

Tensor parallelism splits the heads (q_b, kv_b and o; the latent is every rank's), the shared
experts and every routed expert along its width; the dense layers' MLP as Llama's.

Kimi-K2's INT4 checkpoints (compressed-tensors W4A16, 32-column groups, symmetric) quantize the
routed experts only, the rest listed as ignored: those experts take SparseMoE's W4A16 path;
a W4A16 attention, shared-expert or dense linear is refused (models/quantize.py).

Refused by name (models/__init__.py ``deepseek_fields``, models/quantize.py): quantization
formats other than V3's FP8 and Kimi-K2's INT4 experts. ``--kv-cache-dtype fp8`` keeps the
latent cache in e4m3 (attention/mla.py).
The multi-token-prediction layer some checkpoints carry (``model.layers.<num_layers>``) is
skipped here; speculative decoding loads it on its own (engine_core/mtp.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine_core.attention.mla import LatentAttention
from engine_core.config import Fp8Config, MlaConfig, ModelConfig
from engine_core.models.fp8 import dequantize
from engine_core.models.layers import (
    Linear,
    RMSNorm,
    TPSharded,
    apply_rotary,
    check_divisible,
    column_parallel_linear,
    load_mapped_weights,
    rank_rows,
    row_parallel_linear,
)
from engine_core.models.llama import LlamaForCausalLM, LlamaMLP, first_norm, make_norm
from engine_core.models.moe import Routing, SparseMoE
from engine_core.parallel import SINGLE, TPGroup

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MlaAttention(nn.Module):
    """DeepSeek's attention projections around a LatentAttention; HF's parameter names."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        hidden, heads = config.hidden_size, config.num_heads
        # Under tensor parallelism each rank keeps its heads' rows of q_b and kv_b and their
        # columns of o; the latent and rotary key (kv_a) are every head's, so kv_a, q_a and their
        # norms are replicated and each rank caches the whole latent for its own heads' use.
        self.heads, self.mla = check_divisible("number of attention heads", heads, tp), mla
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = column_parallel_linear(hidden, [heads * qk_dim], False, tp)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = column_parallel_linear(mla.q_lora_rank, [heads * qk_dim], False, tp)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.cache_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = LatentUpProjection(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), tp
        )
        self.o_proj = row_parallel_linear(heads * mla.v_head_dim, hidden, bias, tp)
        scale = qk_dim**-0.5 * softmax_mscale(config.rope_scaling) ** 2
        self.attn = LatentAttention(
            self.heads,
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
            scale,
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden], cos/sin [T, P] -> [T, hidden]."""
        mla, num_tokens = self.mla, hidden.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.heads, -1)  # [T, H, N + P]
        q_nope, q_pe = q.split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            (mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1
        )
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe = self.rotate(q_pe, cos, sin)  # [T, H, P]
        k_pe = self.rotate(k_pe[:, None], cos, sin)[:, 0]  # [T, P]
        out = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight)  # [T, H, V]
        return self.o_proj(out.flatten(1))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, P] rotated; with interleaved pairs, evens then odds first (HF's
        apply_rotary_pos_emb_interleave: the layout it leaves q and k in; only q . k is read)."""
        if self.mla.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, cos, sin)


class LatentUpProjection(Linear, TPSharded):
    """``kv_b_proj``: the absorbed decode reads its weight as W_UK and W_UV, so the weight stays a
    plain matrix in the model's dtype: never packed for oneDNN, and an FP8 checkpoint's e4m3
    weight dequantized once it is in (the memory plan counted it in e4m3: the difference is one
    byte per element of this projection, about 1 GiB over DeepSeek-V3's 61 layers).

    Its rows are head-major, so under tensor parallelism a rank keeps the contiguous rows (and
    block scales) of its own heads."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE) -> None:
        local = check_divisible("latent up-projection width (kv_b_proj)", out_features, tp)
        super().__init__(in_features, local, bias=False)
        self.tp = tp
        self.plain_dtype = self.weight.dtype  # the model's, as it is built

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        return rank_rows(tensor, self.tp)

    def pack_for_cpu(self) -> None:
        return

    def finish_loading(self, name: str) -> None:
        super().finish_loading(name)
        if not isinstance(self.fp8, Fp8Config):
            return
        plain = dequantize(self.weight.data, self.weight_scale.data, self.fp8)
        self.weight = nn.Parameter(plain.to(self.plain_dtype), requires_grad=False)
        del self.weight_scale
        self.fp8 = None


def softmax_mscale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's YaRN factor on the softmax scale (squared by the caller): 0.1 * mscale_all_dim
    * ln(factor) + 1, or 1 without YaRN or mscale_all_dim (HF's yarn_apply_mscale)."""
    if not scaling or scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = scaling["factor"]
    return 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0


class DeepseekMoE(SparseMoE):
    """Routed experts (SparseMoE's stacked weights and kernels) with DeepSeek's router, plus the
    shared experts."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, tp)
        self.router_kind = config.moe_router
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        # V3's router bias (chooses experts, weighs nothing); V2 has none.
        self.e_score_correction_bias = None
        if self.router_kind == "sigmoid_grouped":
            bias = torch.zeros(config.num_experts)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = (
            LlamaMLP(dataclasses.replace(config, intermediate_size=shared), tp) if shared else None
        )

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        if param_name == "e_score_correction_bias":  # the router's: every rank routes alike
            return tensor
        return super().narrow_checkpoint(param_name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> routed experts' sum + shared experts', [T, hidden]."""
        out = self.routed_output(x, self.grouped_route)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def grouped_route(self, x: torch.Tensor) -> Routing:
        """DeepSeek's router over x [T, hidden]; the routed scaling factor in the weights."""
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E]
        if self.router_kind == "sigmoid_grouped":
            weights, ids = route_sigmoid_grouped(
                logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group
            )
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights, ids = route_softmax_grouped(logits, self.top_k, self.n_group, self.topk_group)
        return x, weights * self.scaling, ids


def route_sigmoid_grouped(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: logits [T, E] float32 -> (weights [T, K], ids [T, K]). Experts are
    chosen by sigmoid score + correction bias, among the topk_group groups whose two best
    biased scores sum highest; weighted by their unbiased sigmoid scores."""
    scores = logits.sigmoid()
    choice = scores + bias.float()
    num_tokens, experts = choice.shape
    grouped = choice.view(num_tokens, n_group, experts // n_group)
    group_scores = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(dim=-1)
    choice = keep_top_groups(choice, group_scores, topk_group, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    return scores.gather(1, ids), ids


def route_softmax_grouped(
    logits: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router: softmax scores, the top k among the topk_group groups with the
    best single score (all experts when there is one group: the greedy method)."""
    scores = logits.softmax(dim=-1)
    if n_group > 1:
        num_tokens, experts = scores.shape
        group_scores = scores.view(num_tokens, n_group, experts // n_group).amax(dim=-1)
        scores = keep_top_groups(scores, group_scores, topk_group, 0.0)
    return scores.topk(top_k, dim=-1)


def keep_top_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """scores [T, E] with the experts outside each token's topk_group best groups set to
    ``fill``; group_scores [T, G]."""
    num_groups = group_scores.shape[1]
    chosen = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    mask = mask.repeat_interleave(scores.shape[1] // num_groups, dim=1)  # [T, E]
    return scores.masked_fill(~mask, fill)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = MlaAttention(config, tp)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        moe = config.is_moe_layer(layer)
        self.mlp = DeepseekMoE(config, tp) if moe else LlamaMLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaDecoderLayer's contract: (sublayer output, residual stream before it)."""
        hidden, residual = first_norm(self.input_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(hidden, cos, sin), residual)
        return self.mlp(hidden), residual


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2/V3; checkpoint names follow HF's DeepseekV3ForCausalLM."""

    # On CUDA a decode step reads no host value (the fused experts; the latent attention's
    # Triton decode, attention/triton_mla.py), a prompt step does (the expanded prefill
    # gathers each context by host lengths): the runner captures decode graphs only
    # (model_runner.py _capture_graphs), with FP8 experts too (models/fp8_moe_kernels.py).
    cuda_graph_safe = True
    prompt_graphs_safe = False

    decoder_layer = DeepseekDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, weights, self.map_name)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        layer = _LAYER.match(hf_name)
        if layer is not None and int(layer[1]) >= self.config.num_layers:
            return None  # the multi-token-prediction layer
        if ".self_attn." in hf_name:  # our names are HF's (no merged q/k/v here)
            return hf_name, None
        if hf_name.endswith(".mlp.gate.e_score_correction_bias"):
            return hf_name.replace(".gate.", "."), None
        return super().map_name(hf_name)


def deepseek_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek config.json beyond the Llama family's; refuses what
    we do not implement, by name."""
    v3 = architecture == "DeepseekV3ForCausalLM"
    check_deepseek_supported(hf, architecture, v3)
    experts, top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if experts % n_group or not 0 < topk_group <= n_group or not 0 < top_k <= experts:
        raise ValueError(
            f"{architecture}: n_routed_experts {experts}, n_group {n_group}, topk_group "
            f"{topk_group} and num_experts_per_tok {top_k} do not make a routing"
        )
    if not v3 and hf.get("topk_method", "greedy") == "greedy":
        n_group = topk_group = 1
    return {
        "architecture": "deepseek",
        "head_dim": hf["qk_rope_head_dim"],  # what rotary rotates (RotaryEmbedding's width)
        "num_kv_heads": hf["num_attention_heads"],
        "mla": MlaConfig(
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            q_lora_rank=hf.get("q_lora_rank"),
            rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        ),
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", v3)),
        "dense_layers": tuple(range(hf.get("first_k_dense_replace") or 0)),
        "moe_router": "sigmoid_grouped" if v3 else "softmax_grouped",
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "n_shared_experts": hf.get("n_shared_experts") or 0,
    }


# Fields that would change the output, with the values we implement (absent is fine too).
_V3_FIELDS = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,)}
_V2_FIELDS = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy", "group_limited_greedy"),
    "moe_layer_freq": (1,),
    "norm_topk_prob": (False,),  # HF's V2 never renormalises; DeepSeek's own code would
}


def check_deepseek_supported(hf: dict[str, Any], architecture: str, v3: bool) -> None:
    for name, allowed in (_V3_FIELDS if v3 else _V2_FIELDS).items():
        if name in hf and hf[name] is not None and hf[name] not in allowed:
            raise ValueError(f"{architecture}: config field {name}={hf[name]!r} is not supported")
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "fp8", "compressed-tensors"):
        raise ValueError(
            f"{architecture}: quantization_config quant_method {method!r} is not supported for "
            "DeepSeek models; their FP8 checkpoints (quant_method 'fp8') and Kimi-K2's INT4 "
            "experts (compressed-tensors W4A16) are"
        )
    if hf.get("mlp_bias"):
        raise ValueError(f"{architecture}: mlp_bias is not supported")
