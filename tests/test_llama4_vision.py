"""Llama 4's vision tower and projector (engine_core/models/llama4_vision.py) against HF
transformers' ``Llama4VisionModel`` and ``Llama4MultiModalProjector`` on the same random
weights: several tiles at once, every row of every tile."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Llama4Config
from transformers.models.llama4.modeling_llama4 import (
    Llama4MultiModalProjector,
    Llama4VisionModel,
)

from engine_core.models.llama4_vision import Llama4VisionTower, tokens_per_tile

TEXT_HIDDEN = 40


def vision_config() -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "vision_output_dim": 24,
        "image_size": 16,
        "patch_size": 4,
        "pixel_shuffle_ratio": 0.5,
        "projector_input_dim": 24,
        "projector_output_dim": 24,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


@pytest.fixture(scope="module")
def hf_modules() -> tuple[Llama4VisionModel, Llama4MultiModalProjector]:
    config = Llama4Config(vision_config=vision_config(), text_config={"hidden_size": TEXT_HIDDEN})
    torch.manual_seed(0)
    tower = Llama4VisionModel(config.vision_config).eval()
    projector = Llama4MultiModalProjector(config).eval()
    with torch.no_grad():
        for param in [*tower.parameters(), *projector.parameters()]:
            param.normal_(0.0, 0.3)
        # Sharper attention, so that a patch's position (the 2D rotary) changes the output.
        for layer in tower.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    return tower, projector


def ours_from(hf: tuple[Llama4VisionModel, Llama4MultiModalProjector]) -> Llama4VisionTower:
    tower, projector = hf
    ours = Llama4VisionTower(vision_config(), TEXT_HIDDEN)
    state = {f"vision_model.{k}": v for k, v in tower.state_dict().items()}
    state |= {f"multi_modal_projector.{k}": v for k, v in projector.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    return ours.eval()


def hf_rows(hf: tuple[Llama4VisionModel, Llama4MultiModalProjector], pixels: torch.Tensor):
    tower, projector = hf
    with torch.no_grad():
        features = tower(pixels).last_hidden_state
        return projector(features.flatten(0, 1))


def test_tiles_match_hf(hf_modules: tuple[Llama4VisionModel, Llama4MultiModalProjector]) -> None:
    torch.manual_seed(1)
    pixels = torch.randn(3, 3, 16, 16)
    ours = ours_from(hf_modules).encode_tiles(pixels)
    assert tokens_per_tile(vision_config()) == 4
    assert ours.shape == (3 * 4, TEXT_HIDDEN)
    torch.testing.assert_close(ours, hf_rows(hf_modules, pixels), rtol=1e-4, atol=1e-4)


def test_positions_matter(hf_modules: tuple[Llama4VisionModel, Llama4MultiModalProjector]) -> None:
    """Without the rotary the rows differ from HF's: the comparison above sees positions."""
    torch.manual_seed(2)
    pixels = torch.randn(1, 3, 16, 16)
    ours = ours_from(hf_modules)
    ours.vision_model.rope_cos.fill_(1.0)
    ours.vision_model.rope_sin.zero_()
    diff = (ours.encode_tiles(pixels) - hf_rows(hf_modules, pixels)).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_act", "silu"),
        ("norm_eps", 1e-6),
        ("multi_modal_projector_bias", True),
        ("projector_output_dim", 48),
        ("pixel_shuffle_ratio", 0.25),
    ],
)
def test_refuses_what_hf_would_ignore(field: str, value: object) -> None:
    config = vision_config() | {field: value}
    with pytest.raises(ValueError, match=field):
        Llama4VisionTower(config, TEXT_HIDDEN)
