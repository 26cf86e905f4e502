"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's language model (q/k norms, no
biases) with interleaved M-RoPE, fed image embeddings and DeepStack features from its own vision
tower (models/qwen3_vl_vision.py).

What it shares with Qwen2.5-VL (models/qwen2_5_vl.py): the placeholder rows take the image's
embeddings, every token's three positions (HF's get_rope_index: an image's cells after its
start, text one past the image's largest) come from ``MultimodalStep.positions``, and a step
without image rows runs the plain rotary. What differs:

- **Interleaved M-RoPE** (``mrope_interleaved``): frequency j turns with the height position
  where j % 3 == 1, the width one where j % 3 == 2 (within their sections' counts), else the
  temporal one (``section_of_each_frequency``), not three consecutive chunks.
- **DeepStack**: the tower's embedding of an image token carries, after its own ``hidden``
  columns, one feature of width ``hidden`` per DeepStack layer; after language layer i (for i
  below their count) the i-th feature is added to the hidden state at the token's row, as HF's
  ``_deepstack_process``. The features ride in the step's ``MultimodalStep.embeds`` with the
  rows they belong to, so a chunk that holds part of an image adds exactly its rows' features,
  and a prefix-cache hit past an image needs none (those rows' KV already has them).

Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) is this model with Qwen3-MoE's MLPs
(models/moe.py; the config says which layers). The released checkpoints store each layer's
experts fused and input-major: ``experts.gate_up_proj [E, H, 2I]`` (gate columns, then up: HF's
forward chunks x @ W in two) and ``experts.down_proj [E, I, H]``; transposed as they load
(``output_major_experts``), they are SparseMoE's ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from engine_core.config import ModelConfig
from engine_core.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine_core.models.qwen3_vl_vision import Qwen3VisionTransformer

if TYPE_CHECKING:
    from engine_core.multimodal import MultimodalStep

_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    vision_tower = Qwen3VisionTransformer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        vision = config.vision
        assert vision is not None
        self.deepstack_layers = vision.deepstack_layers
        if self.deepstack_layers > config.num_layers:
            raise ValueError(
                f"Qwen3-VL: {self.deepstack_layers} DeepStack layers, more than the language "
                f"model's {config.num_layers}"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        multimodal: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; ``multimodal``: the
        step's image embeddings (with their DeepStack features) and M-RoPE positions."""
        hidden, cos, sin = self.step_inputs(input_ids, positions, multimodal)
        deepstack = self.deepstack_features(multimodal, hidden.shape[1])
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, cos, sin)
            if deepstack is not None and i < deepstack.shape[0]:
                # The layer's output is the MLP's sum before the residual add (which the next
                # norm does): adding the feature to it adds it to the hidden state.
                hidden = hidden.index_add(0, multimodal.rows, deepstack[i].to(hidden.dtype))
        return self.model.norm(hidden, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors, Qwen3-VL-MoE's fused experts turned output-major on the way."""
        config = self.config
        shapes = {
            "gate_up_proj": (2 * config.moe_intermediate_size, config.hidden_size),
            "down_proj": (config.hidden_size, config.moe_intermediate_size),
        }
        super().load_weights(output_major_experts(weights, shapes))

    def deepstack_features(
        self, multimodal: MultimodalStep | None, width: int
    ) -> torch.Tensor | None:
        """[DeepStack layers, image rows, hidden]: the step's image rows' features, layer by
        layer; None where the step has no image rows."""
        if multimodal is None or not multimodal.rows.numel() or not self.deepstack_layers:
            return None
        features = multimodal.embeds[:, width:]  # [rows, layers * hidden]
        return features.view(-1, self.deepstack_layers, width).transpose(0, 1)


def output_major_experts(
    weights: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-VL-MoE's fused experts as SparseMoE holds them, ``[E, out, in]`` (``shapes``: each
    projection's (out, in)). The released checkpoints store ``[E, in, out]``; transformers 5's
    ``save_pretrained`` writes its in-memory ``[E, out, in]``. Like transformers' loader
    (``Transpose(check_dims=True)``), a tensor already of the held shape loads as it is and any
    other is transposed, so both load, and a square one (out == in) is read as HF reads it."""
    for name, tensor in weights:
        if (match := _FUSED_EXPERTS.search(name)) and tuple(tensor.shape[1:]) != shapes[match[1]]:
            tensor = tensor.transpose(1, 2).contiguous()
        yield name, tensor
