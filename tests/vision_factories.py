"""Tiny random vision-language models written as users hand one over: save_pretrained's weights
and config, the default model's tokenizer with the model's image tokens added and an
image-aware chat template, and the real HF image processor's config (its PIL backend), the last
two written by engine_core/preset_folders.py. Qwen2.5-VL, as the random vision-language presets'
folders are; Gemma 3 (``Gemma3ForConditionalGeneration``); Mistral 3
(``Mistral3ForConditionalGeneration``)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_core.preset_folders import (
    write_gemma3_image_processor,
    write_gemma3_tokenizer,
    write_image_processor,
    write_pixtral_image_processor,
    write_pixtral_tokenizer,
    write_vision_tokenizer,
)

if TYPE_CHECKING:
    from engine_core.llm import LLM
    from protocol.messages import ImageInput, SamplingParams

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


QWEN3_PATCH = 16


def write_qwen3_vl_inputs(path: Path, tokenizer_source: Path) -> dict[str, int]:
    """The vision tokenizer and Qwen3-VL's image processor (16-pixel patches, mean and std 0.5,
    images resized to 2x2 to 8x8 merged tokens) in ``path``; the vision tokens' ids."""
    ids = write_vision_tokenizer(tokenizer_source, path)
    side = QWEN3_PATCH * MERGE
    write_image_processor(
        path, QWEN3_PATCH, MERGE, min_pixels=side * side * 4, max_pixels=side * side * 64,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    return ids


def write_tiny_qwen3_vl(path: Path, tokenizer_source: Path) -> Path:
    """Two language layers (Qwen3's q/k norms; interleaved M-RoPE sections 2/3/3 over head dim
    16), a two-block vision tower whose both blocks feed DeepStack features to the two language
    layers, a 4x4 learned position grid resampled to each image's; Qwen3-VL's image processor
    (16-pixel patches, mean and std 0.5), images resized to 2x2 to 8x8 merged tokens."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = write_qwen3_vl_inputs(path, tokenizer_source)
    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=max(ids.values()) + 1, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024, eos_token_id=2, bos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            patch_size=QWEN3_PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # well-separated greedy choices, as tests/factories.py explains
        model.lm_head.weight.mul_(8.0)
        # Sharp attention, so that positions (M-RoPE's three) change the tokens.
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
        # Strong DeepStack features, so that adding them (at the right rows) changes the tokens.
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.mul_(QWEN3_DEEPSTACK_SCALE)
    model.save_pretrained(path)
    return path


QWEN3_DEEPSTACK_SCALE = 4.0


def write_tiny_qwen3_vl_moe(path: Path, tokenizer_source: Path) -> Path:
    """The tiny Qwen3-VL's tower, tokenizer and processor with a Qwen3-MoE language model: two
    layers of four experts of width 48, two a token (2 x 48 gate/up columns against hidden 64,
    so a transposed expert tensor cannot pass for the right one), the second layer's router
    scaled so that routing decides the tokens."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    write_tiny_qwen3_vl(path, tokenizer_source)  # the tokenizer, processor and dense config
    dense = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in dense["text_config"].items() if k not in ("model_type", "dtype")}
    text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    top = {k: dense[k] for k in dense if k.endswith("token_id")}
    torch.manual_seed(0)
    config = Qwen3VLMoeConfig(
        text_config=text, vision_config=dense["vision_config"], tie_word_embeddings=False, **top
    )
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    with torch.no_grad():  # as write_tiny_qwen3_vl, for the same reasons
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
            layer.mlp.gate.weight.mul_(8.0)
            layer.mlp.experts.down_proj.mul_(4.0)
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.mul_(QWEN3_DEEPSTACK_SCALE)
    for stale in path.glob("*.safetensors"):
        stale.unlink()
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


def hf_generate(model: Any, ids: list[int], max_new_tokens: int, **inputs: Any) -> list[int]:
    """HF transformers' greedy tokens (exactly ``max_new_tokens``) after the prompt ``ids``,
    with the model's image ``inputs`` (pixel values and what goes with them)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            **inputs,
        )
    return out[0, len(ids) :].tolist()


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
    return hf_generate(model, ids, max_new_tokens, **kwargs)


GEMMA3_IMAGE_SIZE = 56  # 8x8 patches of 7 pixels, pooled 2x2 to 16 tokens an image
GEMMA3_TOKENS_PER_IMAGE = 16
GEMMA3_WINDOW = 6  # shorter than an image's run: a sliding layer's window cuts through it


def write_tiny_gemma3_vl(path: Path, tokenizer_source: Path) -> Path:
    """Gemma 3 with images, tiny: four language layers (sliding, full, sliding, full; a
    6-token window), a two-layer SigLIP tower of 8x8 patches pooled to 16 tokens an image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = write_gemma3_tokenizer(tokenizer_source, path)
    write_gemma3_image_processor(path, GEMMA3_IMAGE_SIZE)
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=dict(
            vocab_size=max(ids.values()) + 1, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            max_position_embeddings=1024, eos_token_id=2, bos_token_id=1, pad_token_id=0,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=GEMMA3_IMAGE_SIZE, patch_size=7, vision_use_head=False,
        ),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"], tie_word_embeddings=False,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    sharpen_gemma3(model, GEMMA3_SHARPNESS)
    model.save_pretrained(path)
    return path


# (LM head scale, q/k scale, projector std): chosen so that the greedy tokens vary and a causal
# mask over the images gives other tokens than HF's bidirectional one.
GEMMA3_SHARPNESS = (8.0, 3.0, 0.05)


def sharpen_gemma3(model: Any, sharpness: tuple[float, float, float]) -> None:
    head, qk, projector_std = sharpness
    with torch.no_grad():  # well-separated greedy choices, as tests/factories.py explains
        model.lm_head.weight.mul_(head)
        # The projector starts at zero (HF's init): random, so images change the tokens.
        projector = model.model.multi_modal_projector
        projector.mm_input_projection_weight.normal_(std=projector_std)
        # Sharp attention, so that the mask (an image's tokens seeing each other) changes the
        # tokens: at random init's scale every query attends nearly evenly.
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(qk)
            layer.self_attn.k_proj.weight.mul_(qk)


def hf_gemma3_greedy(
    model: Any,
    processor: Any,
    ids: list[int],
    images: list[Any],
    max_new_tokens: int,
    bidirectional: bool = True,
) -> list[int]:
    """HF transformers' greedy tokens for Gemma 3's expanded prompt ``ids`` and its PIL
    ``images``, processed by HF's own image ``processor``. ``token_type_ids`` (what HF's
    Gemma3Processor returns beside the ids) give the image tokens their bidirectional mask;
    ``bidirectional=False`` leaves them out, HF's causal-only mask."""
    kwargs: dict[str, Any] = {}
    if images:
        kwargs = dict(processor(images=images, return_tensors="pt"))
        kwargs.pop("num_crops", None)
        if bidirectional:
            image_token = model.config.image_token_id
            kwargs["token_type_ids"] = (torch.tensor([ids]) == image_token).long()
    return hf_generate(model, ids, max_new_tokens, **kwargs)


def engine_tokens(
    llm: LLM,
    built: dict[str, tuple[list[int], tuple[ImageInput, ...], list[Any]]],
    params: SamplingParams,
) -> dict[str, list[int]]:
    """The engine's tokens for each named prompt (``test_vision_engine.prompt``'s triples),
    all in one batch."""
    outs = llm.generate(
        [ids for ids, _, _ in built.values()],
        params,
        detokenize=False,
        images=[images for _, images, _ in built.values()],
    )
    return {name: out.token_ids for name, out in zip(built, outs, strict=True)}


def warm_up_with_its_image(runner: Any) -> ImageInput:
    """Run ``runner``'s start-up warm-up, having checked that its one image step's blank image
    passes the checks a client's image must; afterwards no encoder-cache entry or count is left.
    Returns the blank image."""
    (blank,) = [s for plan in runner.warm_up_plans() for s in plan.scheduled if s.request.images]
    runner.multimodal.check(blank.request)
    runner.warm_up()
    assert runner.multimodal.encoded_images == len(runner.multimodal.cache) == 0
    return blank.request.images[0]


PIXTRAL_PATCH = 4
PIXTRAL_EDGE = 48  # images fit 48 x 48 pixels: at most 6 x 6 merged cells, 42 tokens an image


def write_tiny_mistral3(path: Path, tokenizer_source: Path) -> Path:
    """Mistral 3, tiny: two Mistral layers, a two-block Pixtral tower of 4-pixel patches
    (SiLU gate, as the released checkpoints), the 2 x 2 patch merger; images scaled to fit
    48 pixels."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = write_pixtral_tokenizer(tokenizer_source, path)
    write_pixtral_image_processor(path, PIXTRAL_PATCH, PIXTRAL_EDGE)
    torch.manual_seed(0)
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=max(ids.values()) + 1, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            sliding_window=None, eos_token_id=2, bos_token_id=1, rms_norm_eps=1e-5,
        ),
        vision_config=dict(
            model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, patch_size=PIXTRAL_PATCH, hidden_act="silu",
            image_size=PIXTRAL_EDGE,
        ),
        spatial_merge_size=MERGE, image_token_index=ids["[IMG]"], tie_word_embeddings=False,
    )  # fmt: skip
    model = Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # well-separated greedy choices, as tests/factories.py explains
        model.lm_head.weight.mul_(8.0)
        # Sharp attention, so that which rows hold the image (and the row breaks' own
        # embeddings) change the tokens: at random init's scale every query attends evenly.
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
        projector = model.model.multi_modal_projector
        projector.linear_2.weight.mul_(8.0)  # image rows as large as the text embeddings
    model.save_pretrained(path)
    return path
