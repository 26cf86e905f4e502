"""Llama 4 with images on the GPU: the tiny random Llama4ForConditionalGeneration of
tests/test_llama4_vision.py through the engine on CUDA, float32, gives HF's greedy tokens
(HF on the CPU) for one image, two images and the same tile twice (encoded once), and for the
API process's tiles of a 2x2 image (tests/test_llama4_images.py on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from tests import test_llama4_vision  # noqa: E402
from tests.paged_harness import random_prompts  # noqa: E402
from tests.test_llama4_vision import (  # noqa: E402
    PARAMS,
    VOCAB,
    hf_tokens,
    tile,
    tiled,
    with_images,
)
from tests.vision_factories import random_image  # noqa: E402

hf_and_dir = test_llama4_vision.hf_and_dir  # the fixture: HF's model on the CPU, its folder


def test_llama4_images_on_cuda_match_hf(hf_and_dir: tuple[Any, Path]) -> None:
    model, folder = hf_and_dir
    a, b, c = random_prompts(VOCAB - 4, (5, 7, 9))
    cases = [([a, b], [tile(1)]), ([a, b, c], [tile(1), tile(2)]), ([a, b, c], [tile(7), tile(7)])]
    built = [with_images(texts, tiles) for texts, tiles in cases]
    expected = [
        hf_tokens(model, ids, tiles) for (ids, _), (_, tiles) in zip(built, cases, strict=True)
    ]
    llm = LLM(str(folder), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
              max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    try:
        outs = llm.generate([ids for ids, _ in built], PARAMS, detokenize=False,
                            images=[images for _, images in built])  # fmt: skip
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.runner.multimodal.encoded_images == 3  # tiles 1, 2 and 7
    finally:
        llm.engine.shutdown()


def test_a_multi_tile_image_on_cuda_matches_hf(hf_and_dir: tuple[Any, Path]) -> None:
    """The port's five tiles of a 2x2 image, in two prompts of one batch: HF's tokens, each
    tile encoded once."""
    model, folder = hf_and_dir
    image = random_image(2, 70, 40)
    built = [tiled(image, *texts) for texts in (random_prompts(VOCAB - 4, (6, 9)),
                                                random_prompts(VOCAB - 4, (10, 11)))]  # fmt: skip
    expected = [hf_tokens(model, ids, tiles) for ids, _, tiles in built]
    llm = LLM(str(folder), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
              max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    try:
        outs = llm.generate([ids for ids, _, _ in built], PARAMS, detokenize=False,
                            images=[images for _, images, _ in built])  # fmt: skip
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.runner.multimodal.encoded_images == 5
    finally:
        llm.engine.shutdown()
