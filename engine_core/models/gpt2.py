"""GPT-2 over the paged KV cache: learned positions, pre-LayerNorm blocks, gelu_new MLP.

HF stores GPT-2's projections as Conv1D ([in, out]); we use nn.Linear ([out, in]) and transpose
those weights once at load. c_attn already holds q, k and v stacked, so no merging is needed.

Under tensor parallelism each rank holds 1/N of the heads (c_attn column-parallel, each of its q,
k and v blocks split; attn.c_proj row-parallel), 1/N of the MLP and 1/N of the vocabulary; the
position embedding and the LayerNorms are replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.attention.layer import Attention
from engine_core.config import ModelConfig
from engine_core.models.layers import (
    LayerNorm,
    check_divisible,
    column_parallel_linear,
    gelu_new,
    lm_head,
    load_mapped_weights,
    project_logits,
    row_parallel_linear,
    vocab_embedding,
)
from engine_core.parallel import SINGLE, TPGroup, get_tp_group

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_new,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
_CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
# Causal-mask buffers that old checkpoints saved next to the weights.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = check_divisible("number of attention heads", config.num_heads, tp)
        self.c_attn = column_parallel_linear(hidden, [hidden] * 3, True, tp)
        self.c_proj = row_parallel_linear(hidden, hidden, True, tp)
        head_dim = config.head_dim
        self.attn = Attention(heads, heads, head_dim, head_dim**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)  # [T, hidden / tp] each
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        size = config.intermediate_size
        self.c_fc = column_parallel_linear(config.hidden_size, [size], True, tp)
        self.c_proj = row_parallel_linear(size, config.hidden_size, True, tp)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config, tp)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config, tp)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous sublayer's output, residual stream before it) -> (this block's MLP output,
        residual stream before it), each [T, hidden]: every residual add happens inside the
        next LayerNorm."""
        hidden, residual = self.ln_1(hidden, residual)
        hidden, residual = self.ln_2(self.attn(hidden), residual)
        return self.mlp(hidden), residual


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.wte = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, tp) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The embedding sum wte + wpe is the first residual add, done inside the first norm.
        hidden, residual = self.wte(input_ids), self.wpe(positions)  # [T, hidden] each
        for block in self.h:
            hidden, residual = block(hidden, residual)
        return self.ln_f(hidden, residual)[0]


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with the output projection tied to the token embedding (as all GPT-2 checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported GPT-2 activation {config.hidden_act!r}")
        self.config = config
        self.tp = get_tp_group()  # the tensor-parallel group this process builds for, read once
        self.transformer = GPT2Model(config, self.tp)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else lm_head(config.vocab_size, config.hidden_size, self.tp)
        )
        self.packed_logits_weight: torch.Tensor | None = None  # CPU: pack_cpu_weights sets it

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] float32 (None on tensor-parallel workers);
        ``widen=False``: in the weights' dtype where nothing else needs float32."""
        return project_logits(
            hidden,
            self.logits_weight(),
            self.tp,
            self.config.vocab_size,
            self.packed_logits_weight,
            widen=widen,
        )

    def logits_weight(self) -> torch.Tensor:
        """The LM head's matrix [vocab (this rank's), hidden]: the embedding's when tied."""
        return self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight

    def plain_logits_weight(self) -> torch.Tensor | None:
        """The matrix W with logits == hidden @ W.T exactly (the decode graphs project them
        themselves), or None under tensor parallelism (a gather)."""
        return None if self.tp.size > 1 else self.logits_weight()

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named GPT-2 tensors, transposing the Conv1D weights."""
        load_mapped_weights(self, transpose_conv1d(weights), self.map_name)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.endswith(_MASK_BUFFERS):
            return None
        if hf_name.startswith("lm_head."):
            return None if self.lm_head is None else (hf_name, None)
        # The original hub checkpoint names its tensors without the "transformer." prefix.
        if not hf_name.startswith("transformer."):
            hf_name = "transformer." + hf_name
        return hf_name, None


def transpose_conv1d(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, tensor.t() if name.endswith(_CONV1D_WEIGHTS) else tensor
