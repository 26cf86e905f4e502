"""The ``qwen2.5-vl-7b``, ``qwen3-vl-8b`` (and ``qwen3-vl-30b-a3b``) random presets and the
folders their API processes read: each preset's config.json builds, in HF transformers' own
classes, a model with exactly our parameters and shapes (on the meta device: nothing is
allocated); the folder written for it holds the default tokenizer with the vision tokens at the
ids the preset's config names, a chat template that writes them, and Qwen2-VL's image
processor, which makes a 1,024x1,024 image 74x74 patches of 14 pixels (Qwen2.5-VL) or 64x64 of
16 (Qwen3-VL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.presets import PRESETS, hf_config

PRESET = "qwen2.5-vl-7b"
# preset: (HF's class names, the vision tower's depth, width and output width)
HF_CLASSES = {
    "qwen2.5-vl-7b": (("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"), (32, 1280, 3584)),
    "qwen3-vl-8b": (("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"), (27, 1152, 4096)),
    "qwen3-vl-30b-a3b": (
        ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
        (27, 1152, 2048),
    ),
}


@pytest.mark.parametrize("preset", list(HF_CLASSES))
def test_the_preset_is_hf_s_model_parameter_for_parameter(preset: str) -> None:
    (config_class, model_class), tower = HF_CLASSES[preset]
    theirs = hf_model_with_our_parameters(preset, config_class, model_class)
    vision = theirs.config.vision_config
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == tower


def hf_model_with_our_parameters(preset: str, config_class: str, model_class: str) -> Any:
    """HF's model of the preset's config (transformers' ``config_class``, ``model_class``), on
    the meta device, checked to hold exactly our parameters: every one of HF's maps to one of
    ours, shape for shape (fused ones as the sum of their shards), and the counts agree."""
    import transformers

    from engine_core.models import build_model

    hf_config_class = getattr(transformers, config_class)
    with torch.device("meta"):
        ours = build_model(PRESETS[preset], None)
        theirs = getattr(transformers, model_class)(hf_config_class(**hf_config(preset)))
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
    return theirs


@pytest.fixture
def preset_cache(default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory for the preset folders, the default tokenizer read as it is."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_TOKENIZER_DIR", str(default_model_dir))
    return tmp_path


def preset_folder_ids(preset: str) -> tuple[Path, dict[str, Any], list[int]]:
    """The folder serving ``preset`` writes (with ``preset_cache`` set), checked to hold the
    preset's config.json and a tokenizer of its vocabulary: (folder, the config, the ids its
    chat template gives a user turn of an image and "hi")."""
    import json

    from transformers import AutoTokenizer

    from engine_core.model_dir import resolve_for_serving

    _, folder = resolve_for_serving(f"random:{preset}")
    hf = hf_config(preset)
    assert json.loads((folder / "config.json").read_text()) == hf
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert len(tokenizer) == hf["text_config"]["vocab_size"]
    message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
    text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    return folder, hf, tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("preset", "side", "patch"), [(PRESET, 74, 14), ("qwen3-vl-8b", 64, 16)])
def test_serving_the_preset_writes_its_vision_folder_once(
    preset_cache: Path, preset: str, side: int, patch: int
) -> None:
    from transformers import AutoTokenizer

    from engine_core.model_dir import resolve_for_serving
    from frontend.vision import VisionProcessor
    from tests.vision_factories import random_image

    model, folder = resolve_for_serving(f"random:{preset}")
    assert model == f"random:{preset}" and folder == preset_cache / "presets" / preset
    written = (folder / "config.json").stat().st_mtime_ns
    assert resolve_for_serving(f"random:{preset}")[1] == folder
    assert (folder / "config.json").stat().st_mtime_ns == written  # not written again
    hf = hf_config(preset)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert len(tokenizer) == (hf.get("text_config") or hf)["vocab_size"]
    message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
    text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = ids.index(hf["vision_start_token_id"])
    assert ids[start + 1 : start + 3] == [hf["image_token_id"], hf["vision_end_token_id"]]
    processor = VisionProcessor.load(folder)
    assert processor is not None and processor.marker.placeholder_id == hf["image_token_id"]
    # 1,024 pixels a side round to 37 merge blocks of 28 pixels (74 x 74 patches, 37 x 37
    # tokens), or to 32 of 32 pixels for Qwen3-VL's 16-pixel patches (Qwen2-VL's smart_resize).
    (image,) = processor.process([random_image(0, 1024, 1024)], ["image"])
    assert image.grid_thw == (1, side, side) and processor.num_tokens(image) == side * side // 4
    assert image.pixels.shape == (side * side, 3 * 2 * patch * patch)


def test_a_text_preset_still_borrows_the_default_tokenizer(
    preset_cache: Path, default_model_dir: Path
) -> None:
    from engine_core.model_dir import resolve_for_serving

    assert resolve_for_serving("random:llama-1b") == ("random:llama-1b", default_model_dir)
    assert not (preset_cache / "presets").exists()
