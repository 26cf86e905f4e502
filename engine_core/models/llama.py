"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

One implementation, switched by ModelConfig flags: ``attention_bias`` (Qwen2's q/k/v bias),
``qk_norm`` (Qwen3's per-head RMSNorm on q and k, before rotary), ``sliding_window`` (Mistral).
q/k/v and gate/up are each one merged linear; ``load_weights`` maps HF's separate tensors into
their rows. Parameter names otherwise follow HF, so the mapping stays a few renames.

Under tensor parallelism (engine_core/parallel.py) each rank holds 1/N of the attention heads and
KV heads (column-parallel qkv_proj, row-parallel o_proj), 1/N of the MLP (column-parallel
gate_up_proj, row-parallel down_proj) and 1/N of the vocabulary (embedding and LM head); norms and
rotary are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine_core.attention.layer import Attention
from engine_core.config import ModelConfig
from engine_core.models.layers import (
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    check_divisible,
    lm_head,
    load_mapped_weights,
    project_logits,
    rotate_qk,
    row_parallel_linear,
    silu_and_mul,
    vocab_embedding,
)
from engine_core.parallel import SINGLE, TPGroup, get_tp_group

# HF projection name -> (our merged projection, shard index).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        # This rank's heads and KV heads (all of them at TP=1).
        heads = check_divisible("number of attention heads", heads, tp)
        kv_heads = check_divisible("number of KV heads", kv_heads, tp)
        self.qkv_proj = MergedLinear(config.hidden_size, sizes, config.attention_bias, tp)
        self.sizes = self.qkv_proj.output_sizes  # this rank's q, k, v widths
        self.o_proj = row_parallel_linear(
            config.num_heads * head_dim, config.hidden_size, has_o_bias(config), tp
        )
        self.q_norm = RMSNorm(head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.norm_eps) if config.qk_norm else None
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, config.sliding_window)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden], cos/sin [T, D] -> [T, hidden]."""
        num_tokens, head_dim = hidden.shape[0], self.attn.head_dim
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q = q.view(num_tokens, -1, head_dim)  # [T, H, D]
        k = k.view(num_tokens, -1, head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_qk(q, k, cos, sin)  # in place on CUDA
        out = self.attn(q.flatten(1), k.flatten(1), v)  # [T, H*D]
        return self.o_proj(out)


def has_o_bias(config: ModelConfig) -> bool:
    """HF Llama and Qwen3 put ``attention_bias`` on o_proj too; Qwen2 has q/k/v bias only."""
    return config.attention_bias and config.hf_config.get("model_type") != "qwen2"


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], False, tp)
        self.down_proj = row_parallel_linear(size, config.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous sublayer's output, residual stream before it; None for the first layer)
        -> (this layer's MLP output, residual stream before it), each [T, hidden]: every
        residual add happens inside the next norm."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # [T, D] each
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder; see the module docstring for the variants it covers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()  # the tensor-parallel group this process builds for, read once
        self.model = LlamaModel(config, self.tp)
        # Tied models read the embedding matrix directly rather than holding a second alias.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else lm_head(config.vocab_size, config.hidden_size, self.tp)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] float32 (None on tensor-parallel workers)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return project_logits(hidden, weight, self.tp, self.config.vocab_size)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (q/k/v and gate/up separate) into the merged layout."""
        load_mapped_weights(self, weights, self.map_name)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name.startswith("lm_head.") and self.lm_head is None:
            return None  # some tied checkpoints still store the alias
        module, _, param = hf_name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in _MERGED:
            merged, shard = _MERGED[proj]
            return f"{parent}.{merged}.{param}", shard
        return hf_name, None
