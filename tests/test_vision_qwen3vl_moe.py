"""A tiny random Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL's tower and
DeepStack, Qwen3-MoE's experts stored fused) through one real engine on the CPU, its prompts
placed by the API process's code with the real HF image processor, against HF transformers'
greedy tokens: text only, one image, two images. Our tower against HF's; the released
checkpoints' expert layout ([E, in, out], transformers 5 writes [E, out, in]) loads to the same
weights; a ``norm_topk_prob`` HF would not honour is refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.llm import LLM
from engine_core.loader import load_model
from engine_core.models import model_config_from_hf
from frontend.vision import VisionProcessor
from protocol.messages import SamplingParams
from tests.test_vision_engine import prompt
from tests.vision_factories import (
    QWEN3_PATCH,
    engine_tokens,
    hf_vl_greedy,
    random_image,
    write_tiny_qwen3_vl_moe,
)

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3-vl-moe")
    return write_tiny_qwen3_vl_moe(path, default_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(moe_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoImageProcessor, Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(moe_dir)).eval()
    return model, AutoImageProcessor.from_pretrained(str(moe_dir))


@pytest.fixture(scope="module")
def llm(moe_dir: Path) -> Iterator[LLM]:
    engine = LLM(
        str(moe_dir), block_size=4, num_kv_blocks=128, max_model_len=512,
        max_num_batched_tokens=64, max_num_seqs=4,
    )  # fmt: skip
    try:
        yield engine
    finally:
        engine.engine.shutdown()


def test_engine_matches_hf_text_one_image_two_images(
    llm: LLM, moe_dir: Path, hf: tuple[Any, Any]
) -> None:
    """One batch of three prompts, each against HF's greedy tokens. The routing matters: HF
    with its experts' gate/up halves swapped (what a gate/up mix-up would load) differs."""
    built, expected = three_prompts_and_hf_tokens(moe_dir, hf)
    swapped = with_gate_and_up_swapped(hf[0])
    ids, _, pil = built["one image"]
    assert hf_vl_greedy(swapped, hf[1], ids, pil, NEW_TOKENS) != expected["one image"]
    assert engine_tokens(llm, built, PARAMS) == expected


def three_prompts_and_hf_tokens(
    moe_dir: Path, hf: tuple[Any, Any]
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Text only, one image, two images: each prompt built by the real processor, and HF's
    greedy tokens for it (the CPU and the GPU tests' batch)."""
    processor = VisionProcessor.load(moe_dir)
    assert processor is not None
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = {
        "text only": ["Tell me about the weather on the coast today."],
        "one image": ["What is in", cat, "this picture?"],
        "two images": [cat, "and", dog, "differ how?"],
    }
    built = {name: prompt(moe_dir, processor, parts) for name, parts in cases.items()}
    expected = {name: hf_vl_greedy(*hf, i, pil, NEW_TOKENS) for name, (i, _, pil) in built.items()}
    return built, expected


def with_gate_and_up_swapped(model: Any) -> Any:
    """A copy of HF's model whose every expert has its gate and up rows exchanged."""
    import copy

    swapped = copy.deepcopy(model)
    with torch.no_grad():
        for layer in swapped.model.language_model.layers:
            gate_up = layer.mlp.experts.gate_up_proj  # [E, 2I, H]
            gate_up.copy_(torch.cat(gate_up.chunk(2, dim=1)[::-1], dim=1))
    return swapped


def test_our_vision_tower_is_hf_s(llm: LLM, hf: tuple[Any, Any]) -> None:
    """The engine's tower with its DeepStack features against HF's on random pixels of two
    images at once."""
    grids = [(1, 2, 4), (1, 10, 14)]
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(
        patches, 3 * 2 * QWEN3_PATCH**2, generator=torch.Generator().manual_seed(0)
    )
    ours = llm.engine.runner.model.encode_images(pixels, grids)
    with torch.no_grad():
        out = hf[0].model.visual(pixels, grid_thw=torch.tensor(grids))
    theirs = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_released_expert_layout_loads_the_same_weights(
    moe_dir: Path, tmp_path: Path, hf: tuple[Any, Any]
) -> None:
    """The folder rewritten with the experts as the released checkpoints store them
    ([E, H, 2I] and [E, I, H]): HF's model and ours load the same numbers from it as from
    transformers 5's layout (with which the engine gives HF's tokens, above)."""
    released = tmp_path / "released"
    shutil.copytree(moe_dir, released)
    tensors = load_file(released / "model.safetensors")
    for name in [n for n in tensors if ".mlp.experts." in n]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, released / "model.safetensors", metadata={"format": "pt"})
    from transformers import Qwen3VLMoeForConditionalGeneration

    theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(released)).state_dict()
    for name, value in hf[0].state_dict().items():
        torch.testing.assert_close(theirs[name], value, rtol=0, atol=0)
    ours = load_model(str(released), "cpu", torch.float32).module.state_dict()
    served = load_model(str(moe_dir), "cpu", torch.float32).module.state_dict()  # HF's tokens
    assert any(name.endswith("mlp.w13") for name in served)
    for name, value in served.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0)


def test_norm_topk_prob_false_is_refused_by_name(moe_dir: Path) -> None:
    """HF's Qwen3-VL-MoE router always renormalises; a config that says otherwise is refused."""
    hf = json.loads((moe_dir / "config.json").read_text())
    assert model_config_from_hf(hf).norm_topk_prob
    hf["text_config"]["norm_topk_prob"] = False
    with pytest.raises(ValueError, match="norm_topk_prob"):
        model_config_from_hf(hf)
