"""Mistral 3 with images on the GPU: the tiny random model of tests/test_vision_mistral3.py
through the engine on CUDA, float32 as the other engine-on-CUDA tests run, gives HF
transformers' greedy tokens for one image, two images of different sizes (runs crossing
16-token chunks, so a chunk takes a slice of an image's rows and row breaks) and the same image
again (an encoder-cache hit); the steps whose chunks hold image rows run eagerly and the decodes
replay CUDA graphs. The mistral-small-3.1-24b preset's encoder (random weights, float32) gives
two images of different sizes in one batch what it gives each alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.test_vision_gpu import record_steps  # noqa: E402
from tests.test_vision_mistral3 import NEW_TOKENS, Case  # noqa: E402
from tests.vision_factories import random_image, write_tiny_mistral3  # noqa: E402


@pytest.fixture(scope="module")
def cuda_case(
    default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Case]:
    folder = write_tiny_mistral3(tmp_path_factory.mktemp("mistral3-cuda"), default_tokenizer_dir)
    case = Case(folder, device="cuda", dtype="float32")
    try:
        yield case
    finally:
        case.llm.engine.shutdown()


def test_images_on_cuda_give_hf_tokens_and_decodes_replay_graphs(cuda_case: Case) -> None:
    wide, tall = random_image(1, width=100, height=80), random_image(2, width=60, height=150)
    built = [
        cuda_case.prompt(["What is in", wide, "this picture?"]),
        cuda_case.prompt([wide, "and", tall, "differ how?"]),
    ]
    expected = [cuda_case.hf_greedy(ids, pil) for ids, _, pil in built]
    steps = record_steps(cuda_case.llm)
    assert cuda_case.generate(built) == expected
    image_steps = [replayed for has_images, replayed in steps if has_images]
    text_steps = [replayed for has_images, replayed in steps if not has_images]
    assert image_steps and not any(image_steps), "a step with image rows replayed a graph"
    assert len(text_steps) >= NEW_TOKENS - 1 and all(text_steps[-(NEW_TOKENS - 1) :])
    runner = cuda_case.llm.engine.runner.multimodal
    encoded = runner.encoded_images
    again = cuda_case.prompt(["Once more:", tall, "what now?"])
    assert cuda_case.generate([again]) == [cuda_case.hf_greedy(again[0], again[2])]
    assert runner.encoded_images == encoded  # the tall image's rows from the encoder cache


def test_the_preset_s_encoder_batches_images_as_it_encodes_each_alone() -> None:
    """24 blocks of 1,024 at the preset's size, in float32 so that only one image seeing the
    other (or its rows misplaced) could part them."""
    from benchmarks.vision import build_vision_tower

    tower = build_vision_tower("mistral-small-3.1-24b", "cuda", torch.float32)
    grids = [(1, 74, 50), (1, 40, 110)]  # 1,036 x 700 and 560 x 1,540 pixels
    gen = torch.Generator().manual_seed(0)
    patches = [torch.randn(t * h * w, 3 * 14 * 14, generator=gen) for t, h, w in grids]
    pixels = [p.to("cuda") for p in patches]
    with torch.inference_mode():
        batched = tower(torch.cat(pixels), grids)
        alone = torch.cat([tower(p, [g]) for p, g in zip(pixels, grids, strict=True)])
    assert batched.shape == (37 * 25 + 20 * 55, 5120)
    torch.testing.assert_close(batched, alone, rtol=1e-3, atol=1e-4)
