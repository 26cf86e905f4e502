"""The ``mistral-small-3.1-24b`` random preset: its config.json builds, in HF transformers' own
classes (on the meta device), a model with exactly our parameters and shapes; the folder
written for it holds the default tokenizer with Mistral 3's image tokens at the ids the config
names and Pixtral's image processor (images fit 1,540 pixels, 28-pixel merge blocks). The
vision benchmark's encoder table on Mistral 3 is tested on the tiny model
(tests/test_vision_mistral3.py)."""

from __future__ import annotations

from pathlib import Path

from tests import test_vision_preset
from tests.test_vision_preset import hf_model_with_our_parameters, preset_folder_ids

PRESET = "mistral-small-3.1-24b"
preset_cache = test_vision_preset.preset_cache  # the fixture: a fresh cache directory


def test_the_preset_is_hf_s_mistral3_parameter_for_parameter() -> None:
    theirs = hf_model_with_our_parameters(
        PRESET, "Mistral3Config", "Mistral3ForConditionalGeneration"
    )
    text = theirs.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (5120, 40, 128)
    assert theirs.lm_head.weight is not theirs.model.language_model.embed_tokens.weight


def test_serving_the_preset_writes_mistral3_s_folder(preset_cache: Path) -> None:
    """A 1,024 x 700 (height x width) image fits 1,540 pixels as it is, each side rounded up
    to 28-pixel blocks: 1,036 x 700 pixels, 74 x 50 patches, 37 rows of 25 [IMG] and a
    break."""
    from frontend.vision import VisionProcessor
    from tests.vision_factories import random_image

    folder, hf, ids = preset_folder_ids(PRESET)
    assert hf["image_token_index"] in ids
    processor = VisionProcessor.load(folder)
    assert processor is not None and processor.marker.placeholder_id == hf["image_token_index"]
    (image,) = processor.process([random_image(0, 700, 1024)], ["image"])
    assert image.grid_thw == (1, 74, 50) and image.pixels.shape == (74 * 50, 3 * 14 * 14)
    run = processor.run_ids(image)
    assert len(run) == 37 * 26 and run.count(hf["image_token_index"]) == 37 * 25
