"""Qwen2.5-VL: Qwen2's language model with M-RoPE, fed image embeddings from a vision tower.

The language model is our Llama-family one (models/llama.py, Qwen2's q/k/v bias); what differs
is the input and the rotary. At a step that holds image placeholders the runner hands the forward
a ``MultimodalStep`` (engine_core/multimodal.py): the encoder's embeddings replace the
placeholder rows of the token embeddings, and every token's three M-RoPE positions (temporal,
height, width) give its rotary angles, each frequency taking the position its section of
``mrope_section`` names. A text token's three positions are equal, where M-RoPE is plain RoPE,
so a step without one runs the plain rotary on its one position per token.

The vision tower (models/qwen2_5_vl_vision.py: patch embedding, window and full attention blocks
with 2D rotary, the patch merger) runs eagerly on the engine core's device
(docs/design/vision.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine_core.config import ModelConfig
from engine_core.models.layers import RotaryEmbedding
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.meta_build import computed_buffer
from engine_core.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer

if TYPE_CHECKING:
    from engine_core.multimodal import MultimodalStep


class MRopeSections(nn.Module):
    """M-RoPE's split of the rotary frequencies among the three positions, as a buffer."""

    def __init__(self, mrope_section: tuple[int, ...], interleaved: bool = False) -> None:
        super().__init__()
        self.mrope_section = mrope_section
        self.interleaved = interleaved
        section = computed_buffer(lambda: section_of_each_frequency(mrope_section, interleaved))
        self.register_buffer("section", section, persistent=False)

    def reset_buffers(self) -> None:
        section = section_of_each_frequency(self.mrope_section, self.interleaved)
        self.section = section.to(self.section.device)


def mrope_cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, section: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] (temporal, height, width) -> (cos, sin) [T, D]: frequency j turns with
    the position ``section[j]`` names (0, 1 or 2), as HF's apply_multimodal_rotary_pos_emb."""
    freqs = positions.float()[:, :, None] * rotary.inv_freq.float()[None, None, :]  # [3, T, D/2]
    index = section.view(1, 1, -1).expand(1, positions.shape[1], -1)
    chosen = freqs.gather(0, index).squeeze(0)  # [T, D/2]
    emb = torch.cat((chosen, chosen), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def section_of_each_frequency(
    mrope_section: tuple[int, ...], interleaved: bool = False
) -> torch.Tensor:
    """[D/2] int64: for each rotary frequency, which of the three positions turns it. Chunked
    (Qwen2.5-VL): the first ``mrope_section[0]`` frequencies temporal, the next height, the
    rest width. Interleaved (Qwen3-VL, HF's recomposition_frequencies): frequency j is height
    where j % 3 == 1 and j < 3 * sections[1], width where j % 3 == 2 and j < 3 * sections[2],
    else temporal, so every position turns low and high frequencies alike."""
    if not interleaved:
        parts = [torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)]
        return torch.cat(parts)
    j = torch.arange(sum(mrope_section))
    out = torch.zeros_like(j)
    for axis in (1, 2):
        out[(j % 3 == axis) & (j < 3 * mrope_section[axis])] = axis
    return out


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    vision_tower: type[nn.Module] = Qwen2_5_VisionTransformer  # Qwen3-VL's is its own

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        vision = config.vision
        assert vision is not None
        if sum(vision.mrope_section) * 2 != config.rotary_dim:
            raise ValueError(
                f"mrope_section {list(vision.mrope_section)} does not split the rotary's "
                f"{config.rotary_dim // 2} frequencies"
            )
        self.visual = self.vision_tower(vision.tower)
        self.mrope = MRopeSections(vision.mrope_section, vision.mrope_interleaved)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        multimodal: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; ``multimodal``: the
        step's image embeddings and M-RoPE positions, where it has any."""
        hidden, cos, sin = self.step_inputs(input_ids, positions, multimodal)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        return self.model.norm(hidden, residual)[0]

    def step_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, multimodal: MultimodalStep | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input [T, hidden] (the image rows' embeddings in place of their
        placeholders': an embedding's first ``hidden`` columns) and the rotary (cos, sin)."""
        body = self.model
        hidden = body.embed(input_ids)  # [T, hidden]
        if multimodal is None:
            return hidden, *body.rotary_emb(positions, hidden.dtype)
        if multimodal.rows.numel():
            width = hidden.shape[1]
            hidden[multimodal.rows] = multimodal.embeds[:, :width].to(hidden.dtype)
        cos, sin = mrope_cos_sin(
            body.rotary_emb, multimodal.positions, self.mrope.section, hidden.dtype
        )
        return hidden, cos, sin

    @torch.inference_mode()
    def encode_images(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixels [patches, C * T * P * P] of one or more images, their patch grids -> their
        embeddings [tokens, hidden], the images' tokens one after another."""
        return self.visual(pixels, grids)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """The checkpoint's names in either layout: transformers 4's (``model.layers``,
        ``visual.``) or 5's (``model.language_model.``, ``model.visual.``)."""
        if hf_name.startswith("model.visual."):
            return hf_name.removeprefix("model."), None
        if hf_name.startswith("visual."):
            return hf_name, None
        if hf_name.startswith("model.language_model."):
            hf_name = "model." + hf_name.removeprefix("model.language_model.")
        return super().map_name(hf_name)
