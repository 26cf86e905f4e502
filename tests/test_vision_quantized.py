"""Quantized vision-language checkpoints on the CPU: a tiny Qwen2.5-VL in the layout of Qwen's
published AWQ one (the language model's linears in AWQ, 4-bit with zero points in 32-column
groups; ``modules_to_not_convert: ["visual"]`` keeping the vision tower in float), and a tiny
Qwen3.5-MoE, Qwen3-VL and Qwen3-VL-MoE in block FP8 (their towers float), give, with images,
the greedy tokens of HF transformers running the dequantized weights. A checkpoint that
quantizes the tower too is refused at load, naming the tensor."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.llm import LLM
from frontend.vision import VisionProcessor
from tests.quant_fixtures import awq_tensors
from tests.test_vision_engine import NEW_TOKENS, PARAMS, make_llm, prompt
from tests.test_w4a16 import awq_qc
from tests.test_w4a16_moe import write_w4a16_moe
from tests.vision_factories import (
    hf_vl_greedy,
    random_image,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_vl,
    write_tiny_qwen3_vl_moe,
)

# The language model's linears and the tower's (qkv, proj and its MLP), as the checkpoint names
# their leaves; the tower's patch embedding (a convolution) and merger stay float in any case.
TEXT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOWER_LINEARS = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")


def in_tower(name: str) -> bool:
    return name.startswith(("visual.", "model.visual."))


def copy_extras(plain: Path, *folders: Path) -> None:
    """The tokenizer, chat template and image processor's files into each folder."""
    for extra in plain.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            for folder in folders:
                shutil.copy(extra, folder / extra.name)


def greedy_with_images(
    llm: LLM, built: list[tuple[list[int], tuple[Any, ...], list[Any]]]
) -> list[list[int]]:
    """The engine's greedy tokens for each (ids, wire images, PIL images) prompt, batched."""
    outs = llm.generate(
        [ids for ids, _, _ in built],
        PARAMS,
        detokenize=False,
        images=[images for _, images, _ in built],
    )
    return [out.token_ids for out in outs]


def quantize_folder(
    plain: Path, folder: Path, tower_too: bool, ignore: list[str] | None
) -> tuple[Path, Path]:
    """``plain`` with its language model's linears (and the tower's, ``tower_too``) in AWQ,
    and a plain checkpoint of the weights they stand for; both beside the tokenizer and the
    image processor's files. Returns (the AWQ folder, the reference folder)."""

    def wanted(name: str) -> bool:
        module, _, param = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if not in_tower(name):
            return param == "weight" and leaf in TEXT_LINEARS
        tower = tower_too and "merger" not in name and "patch_embed" not in name
        return tower and param == "weight" and leaf in TOWER_LINEARS

    packer = (lambda w, _: awq_tensors(w, 32), awq_qc(32) | {"modules_to_not_convert": ignore})
    quantized, reference = write_w4a16_moe(plain, folder, "awq", packer, selected=wanted)
    copy_extras(plain, quantized, reference)
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
        assert greedy_with_images(llm, built) == expected
    finally:
        llm.engine.shutdown()


def test_a_quantized_tower_is_refused_naming_its_tensor(plain: Path, tmp_path: Path) -> None:
    folder, _ = quantize_folder(plain, tmp_path, tower_too=True, ignore=None)
    with pytest.raises(ValueError, match=r"'visual\.blocks\.0\.\S+' is quantized, but Tandem"):
        make_llm(folder)


# ---- Qwen3.5 with images in block FP8 ----------------------------------------------------------

FP8_BLOCK = (16, 16)
# The linears the published Qwen3.5 FP8 checkpoints hold in e4m3, by leaf name: attention, the
# linear attention's q/k/v and z projections and its output, the experts and the shared expert;
# in_proj_b/a, the routers and the vision tower stay float (``modules_to_not_convert``).
QWEN3_5_FP8_LINEARS = (*TEXT_LINEARS, "in_proj_qkv", "in_proj_z", "out_proj")


def write_qwen3_5_moe(folder: Path, tokenizer: Path) -> Path:
    from tests.test_vision_qwen3_5 import write_tiny_qwen3_5_vl

    return write_tiny_qwen3_5_vl(folder, tokenizer, moe=True)


# Each model: (its writer, the linears its published FP8 layout quantizes by leaf name, what
# its modules_to_not_convert keeps float, parameters of ours that must hold e4m3).
FP8_VL_CASES: dict[str, tuple[Any, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "qwen3.5-moe": (
        write_qwen3_5_moe,
        QWEN3_5_FP8_LINEARS,
        ("visual", "in_proj_b", "in_proj_a", "mlp.gate", "shared_expert_gate", "lm_head"),
        ("linear_attn.in_proj_qkvz.weight",),
    ),
    "qwen3-vl": (
        write_tiny_qwen3_vl,
        TEXT_LINEARS,
        ("visual", "lm_head"),
        ("self_attn.qkv_proj.weight",),
    ),
    # Qwen3-VL-30B-A3B-Instruct-FP8's layout: attention and every expert in e4m3, the tower,
    # the routers (``mlp.gate``) and the LM head float.
    "qwen3-vl-moe": (
        write_tiny_qwen3_vl_moe,
        TEXT_LINEARS,
        ("visual", "mlp.gate", "lm_head"),
        ("self_attn.qkv_proj.weight", "mlp.w13", "mlp.w2"),
    ),
}
# A stacked experts tensor as transformers 5 saves Qwen3-VL-MoE's: [E, 2I, H] / [E, H, I].
STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def unstack_experts(fmt: Any, quantized: Path, reference: Path) -> None:
    """Qwen's FP8 releases store each expert's gate, up and down as its own e4m3 linear with
    block scales (``experts.{e}.gate_proj.weight`` and ``.weight_scale_inv``: the per-expert
    names vLLM's Qwen3-VL-MoE loader takes for FP8, its stacked path having no scales), where
    the bf16 Qwen3-VL-MoE stacks them. Each stacked tensor of ``quantized`` is split and
    quantized so; ``reference``'s takes the values they stand for, still stacked as HF loads
    them."""
    from safetensors.torch import load_file, save_file

    q_state = load_file(quantized / "model.safetensors")
    ref_state = load_file(reference / "model.safetensors")
    for name in [n for n in q_state if STACKED_EXPERTS.match(n)]:
        prefix, kind = STACKED_EXPERTS.match(name).groups()
        leaves = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        held = [
            quantize_expert(fmt, expert, f"{prefix}.{e}", leaves, q_state)
            for e, expert in enumerate(q_state.pop(name))  # [E, out, in]
        ]
        ref_state[name] = torch.stack(held)
    save_file(q_state, str(quantized / "model.safetensors"))
    save_file(ref_state, str(reference / "model.safetensors"))


def quantize_expert(
    fmt: Any, expert: torch.Tensor, prefix: str, leaves: tuple[str, ...], out: dict
) -> torch.Tensor:
    """One expert's [out, in] rows (gate then up, or down) into ``out`` as e4m3 linears named
    ``prefix.<leaf>``; returns the values they stand for, rows as given."""
    from tests.test_fp8 import dequantize

    rows = []
    for leaf, part in zip(leaves, expert.chunk(len(leaves)), strict=True):
        weight, scale = fmt.quantize(part)
        out[f"{prefix}.{leaf}.weight"], out[f"{prefix}.{leaf}.{fmt.scale_name}"] = weight, scale
        rows.append(dequantize(weight, scale, fmt.block))
    return torch.cat(rows)


def write_fp8_vl(
    name: str, tokenizer: Path, tmp_path: Path, linears: tuple[str, ...], keep: tuple[str, ...]
) -> Any:
    """FP8_VL_CASES' model ``name`` in block FP8 (the leaves ``linears`` and the experts in
    e4m3, ``keep`` as modules_to_not_convert) at tmp_path/fp8, and the dequantized reference
    at tmp_path/ref; returns the format."""
    from transformers import AutoModelForImageTextToText

    from tests.test_fp8 import fp8_block_format, write_quantized

    plain = FP8_VL_CASES[name][0](tmp_path / "plain", tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(str(plain)).eval()
    fmt = fp8_block_format(FP8_BLOCK, keep)
    write_quantized(model, fmt, tmp_path / "fp8", tmp_path / "ref", linears)
    unstack_experts(fmt, tmp_path / "fp8", tmp_path / "ref")
    copy_extras(plain, tmp_path / "fp8", tmp_path / "ref")
    return fmt


@pytest.mark.parametrize("name", list(FP8_VL_CASES))
def test_block_fp8_language_models_beside_float_towers_give_hfs_tokens(
    name: str, default_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A tiny Qwen3.5-MoE (linear attention, experts), Qwen3-VL (DeepStack) and Qwen3-VL-MoE
    (DeepStack, experts per expert in the checkpoint) with their towers: the language model's
    published FP8 layers in 16 x 16 blocks, the tower in float; HF on the dequantized weights
    with the activations' e4m3 round trip (per token and 16-column group), one image and
    two."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from tests.quant_fixtures import (
        assert_hf_greedy_up_to_ties,
        e4m3_per_token,
        quantize_expert_inputs,
        quantize_inputs,
    )
    from tests.test_vision_qwen3_5 import ENGINE_OPTIONS

    _, linears, keep, held_e4m3 = FP8_VL_CASES[name]
    write_fp8_vl(name, default_tokenizer_dir, tmp_path, linears, keep)
    hf: Any = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "ref")).eval()

    def round_trip(x: Any) -> Any:
        return e4m3_per_token(x, FP8_BLOCK[1])

    quantize_inputs(hf.model.language_model, round_trip, leaves=linears)
    quantize_expert_inputs(hf.model.language_model, round_trip)
    hf_processor = AutoImageProcessor.from_pretrained(str(tmp_path / "ref"))
    processor = VisionProcessor.load(tmp_path / "fp8")
    assert processor is not None
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = [["What is in", cat, "this picture?"], [cat, "and", dog, "differ how?"]]
    built = [prompt(tmp_path / "fp8", processor, parts) for parts in cases]
    llm = LLM(str(tmp_path / "fp8"), **ENGINE_OPTIONS)
    try:
        layer = llm.engine.runner.model.model.layers[0]
        for param in held_e4m3:
            assert layer.get_parameter(param).dtype == torch.float8_e4m3fn, param
        got = greedy_with_images(llm, built)
    finally:
        llm.engine.shutdown()
    # HF's greedy continuation up to near ties (quant_fixtures.assert_hf_greedy_up_to_ties).
    for (ids, _, pil), tokens in zip(built, got, strict=True):
        assert len(tokens) == NEW_TOKENS
        inputs = dict(hf_processor(images=pil, return_tensors="pt"))
        inputs["mm_token_type_ids"] = (torch.tensor([ids]) == hf.config.image_token_id).int()
        assert_hf_greedy_up_to_ties(hf, ids, tokens, **inputs)


def test_qwen3_vl_moe_with_a_block_fp8_tower_is_refused_naming_its_tensor(
    default_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The tower's attention qkv in e4m3 too, ``visual`` not in modules_to_not_convert: the
    tower's linears hold no FP8, so its first quantized tensor is refused, named."""
    write_fp8_vl("qwen3-vl-moe", default_tokenizer_dir, tmp_path, (*TEXT_LINEARS, "qkv"), ())
    tensor = r"'model\.visual\.blocks\.0\.attn\.qkv\.weight' is torch\.float8_e4m3fn"
    with pytest.raises(ValueError, match=tensor):
        make_llm(tmp_path / "fp8")


def test_qwen3_vl_moe_in_an_untested_format_is_refused(
    default_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Quantizing as it loads (tested for neither its experts nor its layout) is refused by
    name; so would be any format but block FP8 (TESTED_FORMATS)."""
    from tests.paged_harness import load_float32

    plain = write_tiny_qwen3_vl_moe(tmp_path, default_tokenizer_dir)
    with pytest.raises(ValueError, match=r"as it loads .* is not implemented for Qwen3-VL-MoE"):
        load_float32(plain, quantization="fp8")
