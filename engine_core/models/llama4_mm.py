"""Llama 4 with images (``Llama4ForConditionalGeneration``): Llama 4's language model
(models/llama4.py) fed the rows of its vision tower and projector (models/llama4_vision.py).

An image reaches the engine as one tile of the tower's size (``image_size`` square): its
``tokens_per_tile`` rows replace the prompt's run of ``<|patch|>`` tokens, as HF's model does;
positions stay plain and the mask causal (HF's Llama 4 gives image tokens no bidirectional
mask). HF's processor splits a large image into tiles plus a global view, each its own run of
``<|patch|>`` between separator tokens; each such run is one ``ImageInput`` here, so a tile is
encoded, cached and prefix-keyed on its own (docs/design/llama4.md, "Vision").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_core.config import ModelConfig
from engine_core.models.llama4 import VISION_PREFIXES, Llama4ForCausalLM
from engine_core.models.llama4_vision import Llama4VisionTower

if TYPE_CHECKING:
    from engine_core.multimodal import MultimodalStep


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        vision = config.vision
        assert vision is not None
        self.vision_tower = Llama4VisionTower(vision.tower, config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        multimodal: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; ``multimodal``: the
        step's image rows, where it has any."""
        if multimodal is None:
            return self.model(input_ids, positions)
        hidden = self.model.embed(input_ids)  # [T, hidden]
        return self.model.run_from(multimodal.place(hidden), positions)

    @torch.inference_mode()
    def encode_images(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixels [N, C, S, S] of N tiles (every one the tower's size; ``grids`` unused: they
        are all the same) -> their rows [N * tokens_per_tile, hidden]."""
        return self.vision_tower.encode_tiles(pixels)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.startswith(VISION_PREFIXES):
            return "vision_tower." + hf_name, None
        return super().map_name(hf_name)
