"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): Gemma 3's language model
(models/gemma3.py) fed the embeddings of a SigLIP vision tower and its projector
(models/siglip.py).

Each image becomes ``mm_tokens_per_image`` embeddings (256 in the released models) that replace
the prompt's run of image soft tokens after the text embeddings are scaled, as HF's model does.
Positions are the plain ones (no M-RoPE). What differs from a text model is the attention mask:
an image's tokens attend to each other in both directions (HF's ``token_type_ids`` mask), the
rest stays causal. The runner hands each such step a per-row key end (``MultimodalStep.key_ends``,
engine_core/multimodal.py) that the attention backends honour; the scheduler keeps each image's
run inside one chunk so the whole image is in the cache when its rows attend
(docs/design/vision.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_core.config import ModelConfig
from engine_core.models.gemma3 import Gemma3ForCausalLM
from engine_core.models.image_text import language_model_name, run_with_image_rows
from engine_core.models.siglip import Gemma3MultiModalProjector, SiglipVisionModel

if TYPE_CHECKING:
    from engine_core.multimodal import MultimodalStep


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        vision = config.vision
        assert vision is not None
        self.vision_tower = SiglipVisionModel(vision.tower)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision.tower, config.hidden_size, vision.tokens_per_image
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        multimodal: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; ``multimodal``: the
        step's image embeddings, where it has any (its attention mask rides in the forward
        context)."""
        return run_with_image_rows(self.model, input_ids, positions, multimodal)

    @torch.inference_mode()
    def encode_images(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixels [N, C, S, S] of N images (every one the tower's size; ``grids`` unused:
        they are all the same) -> their embeddings [N * tokens_per_image, hidden]."""
        projected = self.multi_modal_projector(self.vision_tower(pixels))
        return projected.flatten(0, 1)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """The checkpoint's names in any of the layouts transformers writes: the released
        checkpoints' (``language_model.model.``, ``vision_tower.vision_model.``), transformers
        5's in memory (``model.language_model.``, ``model.vision_tower.``), and 5's save
        (``vision_tower.`` with no ``vision_model.``). A SigLIP pooling head (``head.``), which
        Gemma 3 never reads (nor does HF's model), is not loaded."""
        name = hf_name.removeprefix("model.")
        for tower in ("vision_tower.vision_model.", "vision_tower."):
            if name.startswith(tower):
                inner = name.removeprefix(tower)
                return None if inner.startswith("head.") else ("vision_tower." + inner, None)
        if name.startswith("multi_modal_projector."):
            return name, None
        if name.startswith("language_model."):
            hf_name = language_model_name(name)
        return super().map_name(hf_name)
