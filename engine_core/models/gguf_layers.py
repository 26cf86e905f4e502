"""The token embedding held as GGUF blocks (engine_core/models/gguf.py): a lookup gathers its
rows' blocks and dequantizes them, as gguf-py reads them; a tied LM head multiplies by the same
blocks (the GEMV for decode rows, as a GGUF ``Linear`` does)."""

from __future__ import annotations

import torch
from torch import nn

from engine_core.models.gguf import (
    GgufLayout,
    HoldsGgufBlocks,
    dequantize,
    gather_rows,
    gguf_linear,
)
from engine_core.models.layers import LoadsQuantized, ShardIndex, empty_param


class GgufEmbedding(nn.Module, LoadsQuantized, HoldsGgufBlocks):
    """The embedding matrix [vocab, hidden] as ``type_name`` blocks, in the model's dtype out."""

    def __init__(self, vocab_size: int, hidden_size: int, type_name: str) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.dtype = torch.get_default_dtype()  # the activations'
        self.gguf = GgufLayout((type_name,), (vocab_size,), hidden_size)
        self.gguf_blocks = empty_param((self.gguf.nbytes,), torch.uint8, torch.empty(0).device)

    @property
    def quantized(self) -> bool:
        return True

    def quantized_form(
        self, param_name: str, tensor: torch.Tensor, hf_name: str
    ) -> list[tuple[str, torch.Tensor]]:
        return [("gguf_blocks" if param_name == "weight" else param_name, tensor)]

    def load_quantized(
        self, param_name: str, tensor: torch.Tensor, index: ShardIndex | None, hf_name: str
    ) -> None:
        self.load_gguf_part(tensor, None, hf_name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        ((_, planes),) = self.gguf_planes()
        return dequantize(gather_rows(planes, input_ids)).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> [N, vocab] in hidden's dtype: the tied LM head."""
        return gguf_linear(hidden, self.gguf_planes(), self.vocab_size)
