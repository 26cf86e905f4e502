"""Qwen3-VL on the GPU: the tiny random Qwen3-VL (tests/vision_factories.py) through the engine
on CUDA gives HF transformers' greedy tokens for one image and two images (their DeepStack
features added at the image rows), in float32 as the other engine-on-CUDA tests run; the steps
whose chunks hold image rows run eagerly and the decode steps after them replay CUDA graphs
(docs/design/vision.md, "Qwen3-VL"). At Qwen3-VL-8B's shapes (the ``qwen3-vl-8b`` preset), a
batch of two 1,024x1,024 images encodes as each image alone does, DeepStack features included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from frontend.vision import VisionProcessor  # noqa: E402
from tests import test_vision_qwen3vl  # noqa: E402
from tests.test_vision_engine import prompt  # noqa: E402
from tests.test_vision_gpu import cuda_llm, record_steps  # noqa: E402
from tests.vision_factories import hf_vl_greedy, random_image  # noqa: E402

NEW_TOKENS = test_vision_qwen3vl.NEW_TOKENS
PARAMS = test_vision_qwen3vl.PARAMS
vl_dir = test_vision_qwen3vl.vl_dir  # the fixtures: the tiny model's folder, HF's model (CPU)
hf = test_vision_qwen3vl.hf
processor = test_vision_qwen3vl.processor


def test_images_on_cuda_give_hf_tokens_and_decodes_replay_graphs(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = {
        "one image": ["What is in", cat, "this picture?"],
        "two images": [cat, "and", dog, "differ how?"],
    }
    built = {name: prompt(vl_dir, processor, parts) for name, parts in cases.items()}
    expected = {name: hf_vl_greedy(*hf, i, pil, NEW_TOKENS) for name, (i, _, pil) in built.items()}
    llm = cuda_llm(vl_dir)
    try:
        steps = record_steps(llm)
        outs = llm.generate(
            [ids for ids, _, _ in built.values()],
            PARAMS,
            detokenize=False,
            images=[images for _, images, _ in built.values()],
        )
        assert {name: o.token_ids for name, o in zip(built, outs, strict=True)} == expected
    finally:
        llm.engine.shutdown()
    image_steps = [replayed for has_images, replayed in steps if has_images]
    text_steps = [replayed for has_images, replayed in steps if not has_images]
    assert image_steps and not any(image_steps), "a step with image rows replayed a graph"
    assert len(text_steps) >= NEW_TOKENS - 1 and all(text_steps)


def test_8b_encoder_batches_two_large_images_as_each_alone() -> None:
    """The preset's tower (27 blocks of 1,152, DeepStack mergers after blocks 8, 16 and 24) on
    two 1,024x1,024 images (64x64 patches of 16 pixels, 1,024 tokens each, as
    tests/test_vision_preset.py shows the preset's processor makes them), in float32: each
    token's embedding and its three DeepStack features, 4 x 4,096 wide."""
    from benchmarks.vision import build_vision_tower, image_patches, patch_width

    tower = build_vision_tower("qwen3-vl-8b", "cuda", torch.float32)
    grid = (1, 64, 64)
    pixels = image_patches(grid, count=2, device="cuda", width=patch_width(tower))
    with torch.inference_mode():
        both = tower(pixels, [grid, grid])
        half = pixels.shape[0] // 2
        alone = torch.cat([tower(pixels[:half], [grid]), tower(pixels[half:], [grid])])
    assert both.shape == (2 * 1024, 4 * 4096) and both.isfinite().all()
    torch.testing.assert_close(both, alone, rtol=1e-3, atol=1e-4)
