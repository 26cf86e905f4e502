"""Qwen3-VL-MoE on the GPU: the tiny random Qwen3-VL-MoE (tests/vision_factories.py) through the
engine on CUDA, its experts through the fused MoE kernels (models/fused_moe.py), gives HF
transformers' greedy tokens for text only, one image and two images, in float32 as the other
engine-on-CUDA tests run; steps with image rows run eagerly, the decodes after them replay CUDA
graphs (docs/design/vision.md, "Qwen3-VL")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests import test_vision_qwen3vl_moe  # noqa: E402
from tests.test_vision_gpu import cuda_llm, record_steps  # noqa: E402
from tests.vision_factories import engine_tokens  # noqa: E402

NEW_TOKENS = test_vision_qwen3vl_moe.NEW_TOKENS
moe_dir = test_vision_qwen3vl_moe.moe_dir  # the fixtures: the tiny model's folder, HF's (CPU)
hf = test_vision_qwen3vl_moe.hf


def test_moe_images_on_cuda_give_hf_tokens_and_decodes_replay_graphs(
    moe_dir: Path, hf: tuple[Any, Any]
) -> None:
    built, expected = test_vision_qwen3vl_moe.three_prompts_and_hf_tokens(moe_dir, hf)
    llm = cuda_llm(moe_dir)
    try:
        steps = record_steps(llm)
        assert engine_tokens(llm, built, test_vision_qwen3vl_moe.PARAMS) == expected
    finally:
        llm.engine.shutdown()
    image_steps = [replayed for has_images, replayed in steps if has_images]
    text_steps = [replayed for has_images, replayed in steps if not has_images]
    assert image_steps and not any(image_steps), "a step with image rows replayed a graph"
    assert len(text_steps) >= NEW_TOKENS - 1 and all(text_steps)
