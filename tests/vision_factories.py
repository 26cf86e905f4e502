"""A tiny random Qwen2.5-VL written as users hand one over: save_pretrained's weights and
config, the default model's tokenizer with Qwen's vision tokens added and a Qwen2-VL-style chat
template, and the real HF image processor's config (its PIL backend), the last two written as
the random vision-language presets' folders are (engine_core/preset_folders.py)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_core.preset_folders import write_image_processor, write_vision_tokenizer

PATCH = 14
MERGE = 2


def write_tiny_qwen2_5_vl(path: Path, tokenizer_source: Path) -> Path:
    """Two language layers (M-RoPE sections 2/3/3 over head dim 16), a two-block vision tower
    (one window-attention block, one full), images resized to 2x2 to 8x8 merged tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = write_vision_tokenizer(tokenizer_source, path)
    side = PATCH * MERGE
    write_image_processor(
        path, PATCH, MERGE, min_pixels=side * side * 4, max_pixels=side * side * 64
    )
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=max(ids.values()) + 1, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, eos_token_id=2, bos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # well-separated greedy choices, as tests/factories.py explains
        model.lm_head.weight.mul_(8.0)
        # Sharp attention, so that positions (M-RoPE's three) change the tokens: at random
        # init's scale every query attends nearly evenly and any positions give HF's tokens.
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    model.save_pretrained(path)
    return path


def random_image(seed: int, width: int = 100, height: int = 80) -> Any:
    """A PIL RGB image of random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Any, format: str = "PNG") -> bytes:
    """The image's file bytes, losslessly (WebP too: the server must see HF's pixels)."""
    out = io.BytesIO()
    image.save(out, format=format, **({"lossless": True} if format == "WEBP" else {}))
    return out.getvalue()


def hf_vl_greedy(
    model: Any, processor: Any, ids: list[int], images: list[Any], max_new_tokens: int
) -> list[int]:
    """HF transformers' greedy tokens for the expanded prompt ``ids`` and its PIL ``images``,
    processed by HF's own image ``processor``."""
    kwargs: dict[str, Any] = {}
    if images:
        kwargs = dict(processor(images=images, return_tensors="pt"))
        # What HF's full processor returns beside the ids; generate computes the M-RoPE
        # positions (get_rope_index) only with it, else it rotates by the plain positions.
        image_token = model.config.image_token_id
        kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == image_token).int()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()
