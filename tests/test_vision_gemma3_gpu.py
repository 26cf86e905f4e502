"""Gemma 3 with images on the GPU: the tiny random Gemma 3 (tests/vision_factories.py) through
the engine on CUDA, float32, gives HF transformers' greedy tokens (with HF's bidirectional mask
over each image) for one image, two images, an image amid text in several chunks, and the same
image twice (an encoder-cache hit). Its image steps attend through the Triton prefill kernel
with key ends (counted; the torch reference is never called), in the sliding and the full
layers (docs/design/vision.md, "Gemma 3"); the decodes after them replay graphs. The encoder's
measured peak on CUDA stays under the memory plan's bound; the gemma-3-4b preset's encoder
batches images as it encodes each alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from frontend.vision import VisionProcessor  # noqa: E402
from tests import test_vision_gemma3  # noqa: E402
from tests.test_vision_gemma3 import LONG_TEXT, PARAMS, hf_greedy, prompt  # noqa: E402
from tests.vision_factories import random_image  # noqa: E402

NEW_TOKENS = test_vision_gemma3.NEW_TOKENS
vl_dir = test_vision_gemma3.vl_dir  # the fixtures: the tiny model's folder, HF's on the CPU
hf = test_vision_gemma3.hf
processor = test_vision_gemma3.processor


def test_gemma3_images_on_cuda_match_hf(
    vl_dir: Path,
    processor: VisionProcessor,
    hf: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_core.attention import torch_ref, triton_backend

    calls = {"key ends": 0, "windowed": 0, "reference": 0}
    kernel = triton_backend.paged_prefill_attention
    reference = torch_ref.TorchReferenceBackend.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("key_ends") is not None:
            calls["key ends"] += 1
            calls["windowed"] += kwargs.get("sliding_window") is not None
        return kernel(*args, **kwargs)

    def reference_counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["reference"] += 1
        return reference(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_prefill_attention", counted)
    monkeypatch.setattr(torch_ref.TorchReferenceBackend, "forward", reference_counted)
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = [
        ["What is in", cat, "this picture?"],
        [cat, "and", dog, "differ how?"],
        [LONG_TEXT, dog, LONG_TEXT],
        ["Again:", cat, "what is it?"],
    ]
    built = [prompt(vl_dir, processor, hf, parts) for parts in cases]
    expected = [hf_greedy(hf, ids, pil, NEW_TOKENS) for ids, _, pil in built]
    config: dict[str, Any] = dict(
        device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=512,
        max_num_batched_tokens=32, max_num_seqs=4,
    )  # fmt: skip
    llm = LLM(str(vl_dir), **config)
    try:
        outs = llm.generate(
            [ids for ids, _, _ in built],
            PARAMS,
            detokenize=False,
            images=[images for _, images, _ in built],
        )
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.runner.multimodal.cache.hits > 0  # the cat, encoded once
        # Every image step's layers attended through the kernel, the sliding ones too.
        assert calls["key ends"] > calls["windowed"] > 0
        assert calls["reference"] == 0
    finally:
        llm.engine.shutdown()


def test_the_encoder_peak_on_cuda_is_under_the_plan(vl_dir: Path) -> None:
    import dataclasses

    from engine_core.loader import load_model
    from engine_core.memory_plan import encoder_peak_bytes
    from engine_core.multimodal import MultimodalRunner
    from tests.test_vision_memory import wire_image

    device = torch.device("cuda")
    loaded = load_model(str(vl_dir), "cuda", torch.float32)
    vision = dataclasses.replace(loaded.config.vision, max_image_tokens=16)
    images = [wire_image(i, (1, 3, 56, 56), (1, 8, 8), 2) for i in range(6)]
    tokens = sum(image.length for image in images)
    runner = MultimodalRunner(loaded.module, vision, device, 0, tokens)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runner._encode(images)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    hidden = loaded.config.hidden_size
    assert peak <= encoder_peak_bytes(vision, hidden, tokens, torch.float32)


def test_4b_encoder_batches_images_as_each_alone() -> None:
    """The gemma-3-4b preset's tower and projector (27 blocks of 1,152 over 64x64 patches,
    pooled to 256 tokens of 2,560) as benchmarks/vision.py runs them, two images in one call
    against each alone, in float32 so that only one image seeing the other could part them."""
    from benchmarks.vision import build_vision_tower, encoder_pixels

    tower = build_vision_tower("gemma-3-4b", "cuda", torch.float32)
    grid = (1, 64, 64)
    pixels = encoder_pixels(tower, grid, 2, "cuda")
    with torch.inference_mode():
        both = tower(pixels, [grid, grid])
        alone = torch.cat([tower(pixels[:1], [grid]), tower(pixels[1:], [grid])])
    assert both.shape == (2 * 256, 2560) and both.isfinite().all()
    torch.testing.assert_close(both, alone, rtol=1e-3, atol=1e-4)
