"""What the vision-language models whose language model is our Llama-family body share
(models/gemma3_mm.py, models/mistral3.py): the forward with a step's image rows written into
the token embeddings, and the checkpoint names of the language model inside the
ConditionalGeneration wrapper."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine_core.models.llama import LlamaModel
    from engine_core.multimodal import MultimodalStep


def run_with_image_rows(
    body: LlamaModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    multimodal: MultimodalStep | None,
) -> torch.Tensor:
    """input_ids, positions [T] -> final hidden states [T, hidden]; ``multimodal``: the step's
    image embeddings, written over the token embeddings' rows they fill (after the body's own
    scaling of them, as HF's models do)."""
    if multimodal is None:
        return body(input_ids, positions)
    hidden = body.embed(input_ids)  # [T, hidden]
    return body.run_layers(multimodal.place(hidden), None, positions)


def language_model_name(name: str) -> str:
    """A language-model tensor's name as the text model's own checkpoint has it, from the
    released checkpoints' ``language_model.model.`` / ``language_model.lm_head.`` (transformers
    4) or transformers 5's ``language_model.`` (under ``model.``, already taken off)."""
    if name.startswith("language_model.model."):
        return "model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model."):
        return "model." + name.removeprefix("language_model.")
    return name
