"""Gemma 3 (text) over the paged KV cache: the Llama implementation with Gemma's decoder layer.

Everything else Gemma 3 needs is a ModelConfig flag the Llama model honours (see
``gemma3_config`` in models/__init__.py): sliding-window layers interleaved with global ones
(``layer_types``), each kind with its own rope (``local_rope_theta``), q/k RMSNorm per head,
RMSNorm applied as (1 + w), GeGLU, embeddings scaled by sqrt(hidden), the
``query_pre_attn_scalar`` attention scale, final logit soft-capping and tied embeddings. What
is left is the layer itself: four norms, the attention and MLP outputs each normalized before
they join the residual stream.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.config import ModelConfig
from engine_core.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    first_norm,
    make_mlp,
    make_norm,
)
from engine_core.parallel import SINGLE, TPGroup


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = make_norm(config, hidden)
        self.self_attn = LlamaAttention(config, tp, layer)
        self.post_attention_layernorm = make_norm(config, hidden)
        self.pre_feedforward_layernorm = make_norm(config, hidden)
        self.mlp = make_mlp(config, tp, layer)
        self.post_feedforward_layernorm = make_norm(config, hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as LlamaDecoderLayer: (sublayer output, residual stream before it),
        each [T, hidden]; the residual adds ride in the pre-norms."""
        hidden, residual = first_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; checkpoint names follow HF's Gemma3ForCausalLM."""

    decoder_layer = Gemma3DecoderLayer
