"""A quantized vision-language checkpoint on the CPU: a tiny Qwen2.5-VL in the layout of Qwen's
published AWQ one (the language model's linears in AWQ, 4-bit with zero points in 32-column
groups; ``modules_to_not_convert: ["visual"]`` keeping the vision tower in float) gives, with
images, the greedy tokens of HF transformers running the dequantized weights. A checkpoint that
quantizes the tower too is refused at load, naming the tensor."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from engine_core.llm import LLM
from frontend.vision import VisionProcessor
from tests.quant_fixtures import awq_tensors, write_dequantized, write_folder
from tests.test_vision_engine import NEW_TOKENS, PARAMS, make_llm, prompt
from tests.test_w4a16 import awq_qc
from tests.vision_factories import hf_vl_greedy, random_image, write_tiny_qwen2_5_vl

# The language model's linears and the tower's (qkv, proj and its MLP), as the checkpoint names
# their leaves; the tower's patch embedding (a convolution) and merger stay float in any case.
TEXT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOWER_LINEARS = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")


def in_tower(name: str) -> bool:
    return name.startswith(("visual.", "model.visual."))


def quantize_folder(
    plain: Path, folder: Path, tower_too: bool, ignore: list[str] | None
) -> tuple[Path, Path]:
    """``plain`` with its language model's linears (and the tower's, ``tower_too``) in AWQ,
    and a plain checkpoint of the weights they stand for; both beside the tokenizer and the
    image processor's files. Returns (the AWQ folder, the reference folder)."""
    tensors, dequantized = {}, {}
    for name, weight in load_file(plain / "model.safetensors").items():
        module, _, param = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        tower = in_tower(name) and "merger" not in name and "patch_embed" not in name
        wanted = (tower and tower_too and leaf in TOWER_LINEARS) or (
            not in_tower(name) and leaf in TEXT_LINEARS
        )
        if param != "weight" or not wanted:
            tensors[name] = weight
            continue
        packed, dequantized[name] = awq_tensors(weight, 32)
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
    quantized = write_folder(folder / "awq", plain, tensors, awq_qc(32) | {
        "modules_to_not_convert": ignore
    })  # fmt: skip
    reference = write_dequantized(plain, folder / "reference", dequantized)
    for extra in plain.iterdir():  # the tokenizer, chat template and image processor
        if extra.name not in ("model.safetensors", "config.json"):
            for target in (quantized, reference):
                shutil.copy(extra, target / extra.name)
    return quantized, reference


@pytest.fixture(scope="module")
def plain(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), default_tokenizer_dir)


def test_an_awq_language_model_beside_a_float_tower_gives_hfs_tokens(
    plain: Path, tmp_path: Path
) -> None:
    """One image, and two in a prompt longer than a prefill chunk."""
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    folder, reference = quantize_folder(plain, tmp_path, tower_too=False, ignore=["visual"])
    hf: Any = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(reference)).eval()
    hf_processor = AutoImageProcessor.from_pretrained(str(reference))
    processor = VisionProcessor.load(folder)
    assert processor is not None
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = [["What is in", cat, "this picture?"], [cat, "and", dog, "differ how?"]]
    built = [prompt(folder, processor, parts) for parts in cases]
    expected = [hf_vl_greedy(hf, hf_processor, ids, pil, NEW_TOKENS) for ids, _, pil in built]
    llm: LLM = make_llm(folder)
    try:
        layer = llm.engine.runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.w4a16 is not None  # held 4-bit, not dequantized
        outs = llm.generate(
            [ids for ids, _, _ in built],
            PARAMS,
            detokenize=False,
            images=[images for _, images, _ in built],
        )
        assert [out.token_ids for out in outs] == expected
    finally:
        llm.engine.shutdown()


def test_a_quantized_tower_is_refused_naming_its_tensor(plain: Path, tmp_path: Path) -> None:
    folder, _ = quantize_folder(plain, tmp_path, tower_too=True, ignore=None)
    with pytest.raises(ValueError, match=r"'visual\.blocks\.0\.\S+' is quantized, but Tandem"):
        make_llm(folder)
