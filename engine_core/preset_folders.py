"""The folder a vision-language preset's API process reads (``random:qwen2.5-vl-7b``,
``random:gemma-3-4b``, ``random:mistral-small-3.1-24b``).

A text preset borrows the default model's tokenizer as it is. A vision-language one needs more
from its folder: the model's image tokens (Qwen's or Gemma 3's) in the tokenizer (the chat
template writes them, the engine embeds them), a chat template that renders image parts, the
model's HF image processor config, and the preset's config.json (frontend/vision.py reads the
architecture, the placeholder id and the merge size there). This module writes that folder
once, from the default tokenizer, under the cache directory; the tests' tiny Qwen2.5-VL
folders are written by the same ``write_vision_tokenizer`` and ``write_image_processor``
(tests/vision_factories.py), a Gemma 3 preset's (as the tiny Gemma 3's) by
``write_gemma3_tokenizer`` and ``write_gemma3_image_processor``.

    folder = vision_preset_dir("qwen2.5-vl-7b", default_tokenizer_dir)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common import env
from engine_core.presets import VISION_TOKENS, hf_config

# Qwen2-VL's chat template, shortened: an image part becomes the vision markers around one
# <|image_pad|>, which the API process then repeats for the image's embeddings.
VL_CHAT_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}
{%- else %}{% for part in message['content'] %}
{%- if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json: 4 to 16,384 merged tokens an image.
QWEN2_5_VL_PIXELS = {"min_pixels": 3136, "max_pixels": 12845056}
# Qwen3-VL-8B-Instruct's preprocessor_config.json: size {"shortest_edge": 65536,
# "longest_edge": 16777216} (64 to 16,384 merged tokens of 32 x 32 pixels) and mean and std
# 0.5 for every channel (not CLIP's, which Qwen2.5-VL keeps).
QWEN3_VL_PROCESSOR = {
    "min_pixels": 65536,
    "max_pixels": 16777216,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def write_vision_tokenizer(tokenizer_source: Path, out: Path) -> dict[str, int]:
    """The tokenizer of ``tokenizer_source`` with Qwen's vision tokens added after its
    vocabulary and the image-aware chat template, saved in ``out``; the tokens' ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}


def write_image_processor(out: Path, patch: int, merge: int, **options: Any) -> None:
    """Qwen2-VL's HF image processor config (Qwen2.5-VL and Qwen3-VL use it too) in ``out``,
    its PIL backend so no torchvision is needed; ``options``: min_pixels and max_pixels, and
    Qwen3-VL's image_mean and image_std."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, **options).save_pretrained(out)


# Gemma 3's image tokens, as its tokenizer names them: the chat template writes the first once
# per image, the API process puts the soft tokens and the end marker after it (frontend/vision.py).
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
# Gemma 3's chat template, shortened, on ChatML turns (the default tokenizer's): an image part
# becomes <start_of_image>, which the API process expands as Gemma3Processor does.
GEMMA3_CHAT_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}
{%- else %}{% for part in message['content'] %}
{%- if part['type'] == 'image' %}<start_of_image>
{%- elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_gemma3_tokenizer(tokenizer_source: Path, out: Path) -> dict[str, int]:
    """The tokenizer of ``tokenizer_source`` with Gemma 3's image tokens added (named as
    Gemma's tokenizer names them, so HF's Gemma3Processor reads them) and an image-aware chat
    template, saved in ``out``; the tokens' ids by name (boi_token, image_token, eoi_token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(tokenizer_source), extra_special_tokens=GEMMA3_IMAGE_TOKENS
    )
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return {name: tokenizer.convert_tokens_to_ids(t) for name, t in GEMMA3_IMAGE_TOKENS.items()}


def write_gemma3_image_processor(out: Path, image_size: int) -> None:
    """Gemma 3's HF image processor config (its PIL backend: no torchvision) in ``out``, every
    image resized to ``image_size`` pixels square, pan-and-scan off (Gemma 3's default)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    size = {"height": image_size, "width": image_size}
    Gemma3ImageProcessorPil(size=size, do_pan_and_scan=False).save_pretrained(out)


# Mistral 3's image tokens, named as its tokenizer names them (HF's PixtralProcessor's
# defaults), and its chat template, shortened, on ChatML turns: an image part becomes one
# [IMG], which the API process replaces by the image's rows (frontend/vision.py).
PIXTRAL_IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
PIXTRAL_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("<start_of_image>", "[IMG]")


def write_pixtral_tokenizer(tokenizer_source: Path, out: Path) -> dict[str, int]:
    """The tokenizer of ``tokenizer_source`` with Mistral 3's image tokens added and an
    image-aware chat template, saved in ``out``; the tokens' ids by name."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_special_tokens({"additional_special_tokens": list(PIXTRAL_IMAGE_TOKENS)})
    tokenizer.chat_template = PIXTRAL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return {token: tokenizer.convert_tokens_to_ids(token) for token in PIXTRAL_IMAGE_TOKENS}


def write_pixtral_image_processor(out: Path, patch: int, longest_edge: int) -> None:
    """Pixtral's HF image processor config (its PIL backend: no torchvision) in ``out``:
    images scaled to fit ``longest_edge`` pixels, CLIP's mean and std (its defaults)."""
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    size = {"longest_edge": longest_edge}
    PixtralImageProcessorPil(
        size=size, patch_size={"height": patch, "width": patch}
    ).save_pretrained(out)


def vision_preset_dir(preset: str, tokenizer_source: Path) -> Path:
    """The folder of vision-language preset ``preset``, written on first use from the text
    tokenizer in ``tokenizer_source`` (atomically, so two processes starting at once never
    read half of one)."""
    folder = env.cache_dir() / "presets" / preset
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=folder.parent))
    try:
        write_vision_preset(preset, tokenizer_source, staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not another process's finished folder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def write_vision_preset(preset: str, tokenizer_source: Path, out: Path) -> None:
    """The preset's tokenizer (``tokenizer_source``'s and the vision tokens), image processor
    and config.json in ``out``; ValueError where the tokenizer gives the tokens other ids than
    the preset's config (a tokenizer of another vocabulary than the default's)."""
    hf = hf_config(preset)
    if hf["model_type"] == "mistral3":
        write_pixtral_preset(hf, tokenizer_source, out)
        return
    gemma3 = hf["model_type"] == "gemma3"
    if gemma3:
        written = write_gemma3_tokenizer(tokenizer_source, out)
        ids = {f"{name}_index": i for name, i in written.items()}
        expected = {name: hf[name] for name in ids}
    else:
        ids, expected = write_vision_tokenizer(tokenizer_source, out), preset_vision_ids(hf)
    if ids != expected:
        raise ValueError(
            f"random:{preset}: the tokenizer's vision tokens are {ids}, not {expected}"
        )
    tower = hf["vision_config"]
    if gemma3:
        write_gemma3_image_processor(out, tower["image_size"])
    else:
        patch, merge = tower["patch_size"], tower["spatial_merge_size"]
        qwen3 = hf["model_type"] in ("qwen3_vl", "qwen3_vl_moe")
        pixels = QWEN3_VL_PROCESSOR if qwen3 else QWEN2_5_VL_PIXELS
        write_image_processor(out, patch, merge, **pixels)
    (out / "config.json").write_text(json.dumps(hf, indent=2))


def write_pixtral_preset(hf: dict[str, Any], tokenizer_source: Path, out: Path) -> None:
    """A Mistral 3 preset's folder: the tokenizer with [IMG] at the config's
    image_token_index, Pixtral's image processor at the tower's largest image."""
    ids = write_pixtral_tokenizer(tokenizer_source, out)
    if ids["[IMG]"] != hf["image_token_index"]:
        raise ValueError(f"the tokenizer's [IMG] is {ids['[IMG]']}, not {hf['image_token_index']}")
    tower = hf["vision_config"]
    write_pixtral_image_processor(out, tower["patch_size"], tower["image_size"])
    (out / "config.json").write_text(json.dumps(hf, indent=2))


def preset_vision_ids(hf: dict[str, Any]) -> dict[str, int]:
    """The vision tokens' ids a Qwen2.5-VL or Qwen3-VL config.json names."""
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return {token: hf[name] for token, name in zip(VISION_TOKENS, names, strict=True)}
