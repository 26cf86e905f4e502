"""Mistral 3 with images (``Mistral3ForConditionalGeneration``: Mistral-Small-3.1/3.2): the
Mistral language model (our Llama-family one: plain positions, causal attention) fed the
embeddings of Pixtral's vision tower and Mistral 3's projector (models/pixtral.py).

The prompt holds an image as rows of ``[IMG]`` tokens, each row closed by ``[IMG_BREAK]`` and
the last by ``[IMG_END]``; the image's run on the wire spans all of them, and the runner writes
the image's embeddings at its ``[IMG]`` rows only (``VisionConfig.row_breaks``,
engine_core/multimodal.py), so the break and end tokens keep their text embeddings, as in HF's
model, which scatters the features at the ``[IMG]`` tokens (docs/design/vision.md, "Mistral 3").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_core.config import ModelConfig
from engine_core.models.image_text import language_model_name, run_with_image_rows
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.pixtral import (
    Mistral3MultiModalProjector,
    PixtralVisionModel,
    pixtral_embeddings,
)

if TYPE_CHECKING:
    from engine_core.multimodal import MultimodalStep


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        vision = config.vision
        assert vision is not None
        self.vision_tower = PixtralVisionModel(vision.tower)
        self.multi_modal_projector = Mistral3MultiModalProjector(
            vision.tower,
            config.hidden_size,
            vision.spatial_merge_size,
            config.norm_eps,  # HF's projector norm takes the text model's eps
            bool(config.hf_config.get("multimodal_projector_bias", False)),  # the top level's
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        multimodal: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; ``multimodal``: the
        step's image embeddings, where it has any."""
        return run_with_image_rows(self.model, input_ids, positions, multimodal)

    @torch.inference_mode()
    def encode_images(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixels [patches, C * P * P] of one or more images, their patch grids -> their
        embeddings [sum of cells, hidden] (models/pixtral.py ``pixtral_embeddings``)."""
        return pixtral_embeddings(self.vision_tower, self.multi_modal_projector, pixels, grids)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """The checkpoint's names in either layout: the released checkpoints' (transformers
        4: ``language_model.model.``, ``vision_tower.``) or transformers 5's
        (``model.language_model.``, ``model.vision_tower.``)."""
        name = hf_name.removeprefix("model.")
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None
        if name.startswith("language_model."):
            hf_name = language_model_name(name)
        return super().map_name(hf_name)
