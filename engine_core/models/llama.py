"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

One implementation, switched by ModelConfig flags: ``attention_bias`` (Qwen2's q/k/v bias),
``qk_norm`` (Qwen3's per-head RMSNorm on q and k, before rotary), ``sliding_window`` (Mistral).
q/k/v and gate/up are each one merged linear; ``load_weights`` maps HF's separate tensors into
their rows. Parameter names otherwise follow HF, so the mapping stays a few renames.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.attention.layer import Attention
from engine_core.config import ModelConfig
from engine_core.models.layers import (
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    load_mapped_weights,
    silu_and_mul,
)

# HF projection name -> (our merged projection, shard index).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.qkv_proj = MergedLinear(config.hidden_size, self.sizes, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=has_o_bias(config))
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
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q.flatten(1), k.flatten(1), v)  # [T, H*D]
        return self.o_proj(out)


def has_o_bias(config: ModelConfig) -> bool:
    """HF Llama and Qwen3 put ``attention_bias`` on o_proj too; Qwen2 has q/k/v bias only."""
    return config.attention_bias and config.hf_config.get("model_type") != "qwen2"


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # [T, D] each
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder; see the module docstring for the variants it covers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models read the embedding matrix directly rather than holding a second alias.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

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
