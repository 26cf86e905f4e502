"""The ``gemma-3-4b`` random preset: its config.json builds, in HF transformers' own classes
(on the meta device), a model with exactly our parameters and shapes; the folder written for it
holds the default tokenizer with Gemma 3's image tokens at the ids the config names and
Gemma 3's image processor, which makes any image 896x896 pixels, 64x64 patches pooled to 256
tokens; and the vision benchmark's encoder table runs Gemma 3's tower and projector (the tiny
model's, on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_core.presets import PRESETS, hf_config
from tests import test_vision_gemma3

PRESET = "gemma-3-4b"
vl_dir = test_vision_gemma3.vl_dir  # the fixture: the tiny Gemma 3's folder


def test_the_preset_is_hf_s_gemma3_parameter_for_parameter() -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from engine_core.models import build_model

    with torch.device("meta"):
        ours = build_model(PRESETS[PRESET], None)
        theirs = Gemma3ForConditionalGeneration(Gemma3Config(**hf_config(PRESET)))
    our_shapes = {name: tuple(p.shape) for name, p in ours.named_parameters()}
    # HF's q/k/v (and gate/up) are shards of one of our fused parameters: their rows add up.
    their_shards: dict[str, list[tuple[int, ...]]] = {}
    for name, param in theirs.named_parameters():
        mapped = ours.map_name(name)
        assert mapped is not None, name
        their_shards.setdefault(mapped[0], []).append(tuple(param.shape))
    assert set(their_shards) == set(our_shapes)
    for name, shards in their_shards.items():
        assert our_shapes[name] == (sum(s[0] for s in shards), *shards[0][1:]), name
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    text = theirs.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (2560, 34, 256)
    assert text.layer_types.count("full_attention") == 5  # one in six: layers 5, 11, ... 29
    assert PRESETS[PRESET].layer_types == tuple(text.layer_types)


def test_serving_the_preset_writes_gemma3_s_folder(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from engine_core.model_dir import resolve_for_serving
    from frontend.vision import VisionProcessor
    from tests.vision_factories import random_image

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_TOKENIZER_DIR", str(default_model_dir))
    _, folder = resolve_for_serving(f"random:{PRESET}")
    hf = hf_config(PRESET)
    assert json.loads((folder / "config.json").read_text()) == hf
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert len(tokenizer) == hf["text_config"]["vocab_size"]
    message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
    text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    assert hf["boi_token_index"] in tokenizer.encode(text, add_special_tokens=False)
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
