"""The ``gemma-3-4b`` random preset: its config.json builds, in HF transformers' own classes
(on the meta device), a model with exactly our parameters and shapes; the folder written for it
holds the default tokenizer with Gemma 3's image tokens at the ids the config names and
Gemma 3's image processor, which makes any image 896x896 pixels, 64x64 patches pooled to 256
tokens; and the vision benchmark's encoder table runs Gemma 3's tower and projector (the tiny
model's, on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path

from engine_core.presets import PRESETS
from tests import test_vision_gemma3, test_vision_preset
from tests.test_vision_preset import hf_model_with_our_parameters, preset_folder_ids

PRESET = "gemma-3-4b"
preset_cache = test_vision_preset.preset_cache  # the fixture: a fresh cache directory
vl_dir = test_vision_gemma3.vl_dir  # the fixture: the tiny Gemma 3's folder


def test_the_preset_is_hf_s_gemma3_parameter_for_parameter() -> None:
    theirs = hf_model_with_our_parameters(PRESET, "Gemma3Config", "Gemma3ForConditionalGeneration")
    text = theirs.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (2560, 34, 256)
    assert text.layer_types.count("full_attention") == 5  # one in six: layers 5, 11, ... 29
    assert PRESETS[PRESET].layer_types == tuple(text.layer_types)


def test_serving_the_preset_writes_gemma3_s_folder(preset_cache: Path) -> None:
    from frontend.vision import VisionProcessor
    from tests.vision_factories import random_image

    folder, hf, ids = preset_folder_ids(PRESET)
    assert hf["boi_token_index"] in ids
    processor = VisionProcessor.load(folder)
    assert processor is not None and processor.marker.placeholder_id == hf["image_token_index"]
    (image,) = processor.process([random_image(0, 1024, 700)], ["image"])
    assert image.grid_thw == (1, 64, 64) and processor.num_tokens(image) == 256
    assert image.pixels.shape == (1, 3, 896, 896)


def test_the_benchmark_s_encoder_table_for_gemma3(vl_dir: Path, tmp_path: Path) -> None:
    from benchmarks.__main__ import parse
    from benchmarks.vision import run

    out = tmp_path / "vision.json"
    argv = [
        "vision", "--model", str(vl_dir), "--device", "cpu", "--batches", "1,3",
        "--encoder-trials", "1", "--skip-http", "--json", str(out),
    ]  # fmt: skip
    assert run(parse(argv)) == 0
    rows = json.loads(out.read_text())["results"]["encoder"]
    # The tiny tower's 8x8 patches of a 56-pixel image, pooled to 16 tokens an image.
    assert [(r["batch"], r["patches_per_image"], r["tokens_per_image"]) for r in rows] == [
        (1, 64, 16),
        (3, 64, 16),
    ]
