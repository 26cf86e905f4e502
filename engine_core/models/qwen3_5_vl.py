"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``, the MoE one likewise): Qwen3.5's
language model (Qwen3-Next's layers, models/qwen3_next.py) fed image embeddings from
Qwen3-VL's vision tower (models/qwen3_vl_vision.py) through Qwen2.5-VL's image path
(models/qwen2_5_vl.py: placeholder rows replaced, M-RoPE from ``MultimodalStep.positions``).

What differs from Qwen3-VL, per HF's modeling_qwen3_5.py: no DeepStack (the tower has no
DeepStack mergers, so its output is the final merger's alone), and the M-RoPE covers only the
rotary part of each full-attention head (``partial_rotary_factor``; the sections split its
frequencies, interleaved as Qwen3-VL's). The linear-attention layers take no positions, so
images change their input rows only.
"""

from __future__ import annotations

from typing import Any

from engine_core.config import VisionConfig
from engine_core.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine_core.models.qwen3_next import Qwen3NextForCausalLM
from engine_core.models.qwen3_vl_vision import Qwen3VisionTransformer

# HF's Qwen3_5TextRotaryEmbedding's sections where the config names none.
DEFAULT_MROPE_SECTION = (11, 11, 10)
DEFAULT_IMAGE_TOKEN_ID = 248_056  # HF's Qwen3_5Config default


class Qwen3_5VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration, Qwen3NextForCausalLM):
    """Qwen2.5-VL's image inputs and forward over Qwen3-Next's layers: the method order puts
    the image path (``forward``, ``step_inputs``, ``encode_images``, the ``visual.`` names)
    first and Qwen3-Next's layers, state and weight names after it."""

    vision_tower = Qwen3VisionTransformer


def qwen3_5_vision_config(hf: dict[str, Any], text: dict[str, Any], arch: str) -> VisionConfig:
    """The image side of a Qwen3.5 ConditionalGeneration config.json: its tower, image token
    and the text rotary's M-RoPE sections. HF interleaves the sections whatever
    ``mrope_interleaved`` says (Qwen3_5TextRotaryEmbedding), so we do too."""
    tower = hf["vision_config"]
    if tower.get("deepstack_visual_indexes"):
        raise ValueError(
            f"{arch}: vision_config.deepstack_visual_indexes is not supported (Qwen3.5's "
            "tower has no DeepStack)"
        )
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    return VisionConfig(
        tower=tower,
        image_token_id=hf.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID),
        spatial_merge_size=tower.get("spatial_merge_size", 2),
        mrope_section=tuple(rope.get("mrope_section") or DEFAULT_MROPE_SECTION),
        mrope_interleaved=True,
    )
