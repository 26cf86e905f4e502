"""The vision path on the GPU: the tiny random Qwen2.5-VL (tests/vision_factories.py) through the
engine on CUDA gives HF transformers' greedy tokens for one image, two images and the same image
twice (an encoder-cache hit), in float32 as the other engine-on-CUDA tests run; the steps whose
chunks hold image rows run eagerly and the decode steps after them still replay CUDA graphs
(docs/design/vision.md says why). At Qwen2.5-VL-7B's shapes (the ``qwen2.5-vl-7b`` preset),
a batch of two 1,024x1,024 images encodes as each image alone does: the encoder batches
images across requests, and no image may see another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from engine_core.model_runner import ModelInputs  # noqa: E402
from frontend.vision import VisionProcessor  # noqa: E402
from tests import test_vision_engine  # noqa: E402
from tests.test_vision_engine import PARAMS, prompt  # noqa: E402
from tests.vision_factories import hf_vl_greedy, random_image  # noqa: E402

NEW_TOKENS = test_vision_engine.NEW_TOKENS
vl_dir = test_vision_engine.vl_dir  # the fixtures: the tiny model's folder, HF's model on the CPU
hf = test_vision_engine.hf
processor = test_vision_engine.processor


def cuda_llm(vl_dir: Path, **overrides: Any) -> LLM:
    config: dict[str, Any] = dict(
        device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=512,
        max_num_batched_tokens=256, max_num_seqs=4,
    )  # fmt: skip
    return LLM(str(vl_dir), **(config | overrides))


def record_steps(llm: LLM) -> list[tuple[bool, bool]]:
    """A list each forward of ``llm``'s runner appends to: (the step has image rows, it
    replayed a CUDA graph)."""
    runner = llm.engine.runner
    assert runner.graph_runner is not None, "the engine captured no CUDA graphs"
    steps: list[tuple[bool, bool]] = []
    replays: list[int] = []
    graph_run, forward = runner.graph_runner.run, runner._forward

    def counting_run(*args: Any, **kwargs: Any) -> torch.Tensor:
        replays.append(1)
        return graph_run(*args, **kwargs)

    def recording_forward(inputs: ModelInputs) -> torch.Tensor:
        before = len(replays)
        out = forward(inputs)
        steps.append((inputs.multimodal is not None, len(replays) > before))
        return out

    runner.graph_runner.run = counting_run  # type: ignore[method-assign]
    runner._forward = recording_forward  # type: ignore[method-assign]
    return steps


def test_one_and_two_images_on_cuda_give_hf_tokens_and_decodes_replay_graphs(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = {
        "one image": ["What is in", cat, "this picture?"],
        "two images": [cat, "and", dog, "differ how?"],
    }
    built = {name: prompt(vl_dir, processor, parts) for name, parts in cases.items()}
    expected = {
        name: hf_vl_greedy(*hf, ids, pil, NEW_TOKENS) for name, (ids, _, pil) in built.items()
    }
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
        # The cat is in both prompts: encoded once (in one step's batch, or then cached).
        assert llm.engine.runner.multimodal.encoded_images == 2
    finally:
        llm.engine.shutdown()
    image_steps = [replayed for has_images, replayed in steps if has_images]
    text_steps = [replayed for has_images, replayed in steps if not has_images]
    assert image_steps and not any(image_steps), "a step with image rows replayed a graph"
    # Every decode step of the two image requests (text tokens, plain positions) replays.
    assert len(text_steps) >= NEW_TOKENS - 1 and all(text_steps)


def test_the_same_image_twice_on_cuda_hits_the_encoder_cache(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    image = random_image(3)
    ids, images, pil = prompt(vl_dir, processor, ["Look:", image, "what now?"])
    other_ids, other_images, other_pil = prompt(vl_dir, processor, ["Again", image, "and now?"])
    llm = cuda_llm(vl_dir)
    try:
        first = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        second = llm.generate([other_ids], PARAMS, detokenize=False, images=[other_images])
        multimodal = llm.engine.runner.multimodal
        assert (multimodal.encoded_images, multimodal.cache.hits) == (1, 1)
        assert first[0].token_ids == hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
        assert second[0].token_ids == hf_vl_greedy(*hf, other_ids, other_pil, NEW_TOKENS)
    finally:
        llm.engine.shutdown()


def test_7b_encoder_batches_two_large_images_as_each_alone() -> None:
    """The preset's vision tower (32 blocks of 1,280, windows of 112 pixels) on two
    1,024x1,024 images (74x74 patches, 1,369 tokens each, as tests/test_vision_preset.py shows
    the preset's processor makes them; benchmarks/vision.py's size), in float32 so that only
    one image seeing the other could part the batch's embeddings from each image's own."""
    from benchmarks.vision import build_vision_tower, image_patches

    tower = build_vision_tower("qwen2.5-vl-7b", "cuda", torch.float32)
    grid = (1, 74, 74)
    pixels = image_patches(grid, count=2, device="cuda")
    with torch.inference_mode():
        both = tower(pixels, [grid, grid])
        half = pixels.shape[0] // 2
        alone = torch.cat([tower(pixels[:half], [grid]), tower(pixels[half:], [grid])])
    assert both.shape == (2 * 1369, 3584) and both.isfinite().all()
    torch.testing.assert_close(both, alone, rtol=1e-3, atol=1e-4)
