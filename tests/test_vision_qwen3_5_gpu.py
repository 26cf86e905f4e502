"""Qwen3.5 with images on the GPU: the tiny random dense and MoE models of
tests/test_vision_qwen3_5.py through the engine on CUDA give HF transformers' greedy tokens for
one image and two images, in float32 as the other engine-on-CUDA tests run; the steps whose
chunks hold image rows run eagerly and the decode steps after them replay CUDA graphs (the
linear-attention layers' decode kernel included)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.test_vision_gpu import record_steps  # noqa: E402
from tests.test_vision_qwen3_5 import NEW_TOKENS, Case, write_tiny_qwen3_5_vl  # noqa: E402
from tests.vision_factories import random_image  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def cuda_case(
    request: pytest.FixtureRequest,
    default_tokenizer_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Case]:
    folder = tmp_path_factory.mktemp("qwen3.5-vl-cuda")
    write_tiny_qwen3_5_vl(folder, default_tokenizer_dir, moe=request.param)
    case = Case(folder, device="cuda", dtype="float32", max_num_batched_tokens=256)
    try:
        yield case
    finally:
        case.llm.engine.shutdown()


def test_images_on_cuda_give_hf_tokens_and_decodes_replay_graphs(cuda_case: Case) -> None:
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    built = [
        cuda_case.prompt(["What is in", cat, "this picture?"]),
        cuda_case.prompt([cat, "and", dog, "differ how?"]),
    ]
    expected = [cuda_case.hf_greedy(ids, pil) for ids, _, pil in built]
    steps = record_steps(cuda_case.llm)
    assert cuda_case.generate(built) == expected
    image_steps = [replayed for has_images, replayed in steps if has_images]
    text_steps = [replayed for has_images, replayed in steps if not has_images]
    assert image_steps and not any(image_steps), "a step with image rows replayed a graph"
    # The decodes replay graphs; a prompt's text after its last image runs eagerly first
    # (Qwen3.5, as Qwen3-Next, has no prompt graphs).
    assert len(text_steps) >= NEW_TOKENS - 1 and all(text_steps[-(NEW_TOKENS - 1) :])
