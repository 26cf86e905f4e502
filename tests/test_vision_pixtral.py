"""Pixtral's vision encoder and Mistral 3's projector (engine_core/models/pixtral.py) against
HF transformers' Mistral3Model.get_image_features on the same tiny random weights: images of
different sizes in one padded batch (block-diagonal attention, per-image 2D RoPE, the 2 x 2
patch merger)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine_core.models.pixtral import (  # noqa: E402
    Mistral3MultiModalProjector,
    PixtralVisionModel,
)

PATCH, MERGE = 4, 2


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    config = transformers.Mistral3Config(
        text_config={
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 128,
            "rms_norm_eps": 1e-5,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": PATCH,
            "hidden_act": "silu",  # the released checkpoints' (the config's default is gelu)
            "image_size": 32,
        },
        spatial_merge_size=MERGE,
        image_token_index=10,
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    # HF's init (std 0.02, norms at one) leaves attention near uniform, where a wrong RoPE
    # would still pass: weights of unit gain make every piece matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif param.dim() >= 2:
                param.normal_(0.0, 1.5 / param[0].numel() ** 0.5)
    return model


def test_encoder_matches_hf_on_images_of_different_sizes(hf_model: torch.nn.Module) -> None:
    config = hf_model.config
    tower = config.vision_config.to_dict()
    ours_tower = PixtralVisionModel(tower)
    projector = Mistral3MultiModalProjector(
        tower, config.text_config.hidden_size, MERGE, config.text_config.rms_norm_eps, False
    )
    state = hf_model.model.state_dict()
    ours_tower.load_state_dict(
        {k.removeprefix("vision_tower."): v for k, v in state.items() if "vision_tower." in k}
    )
    projector.load_state_dict(
        {
            k.removeprefix("multi_modal_projector."): v
            for k, v in state.items()
            if "multi_modal_projector." in k
        }
    )
    sizes = [(16, 24), (32, 8)]  # pixels: grids of 4 x 6 and 8 x 2 patches
    pixels = torch.zeros(2, 3, 32, 24)
    generator = torch.Generator().manual_seed(1)
    for i, (h, w) in enumerate(sizes):
        pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=generator)
    with torch.no_grad():
        expected = hf_model.model.get_image_features(
            pixel_values=pixels, image_sizes=torch.tensor(sizes)
        ).pooler_output
        got = [
            projector(patches, h // PATCH, w // PATCH)
            for patches, (h, w) in zip(ours_tower(pixels, sizes), sizes, strict=True)
        ]
    assert [e.shape[0] for e in expected] == [6, 4]  # (rows / 2) * (cols / 2) cells
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
