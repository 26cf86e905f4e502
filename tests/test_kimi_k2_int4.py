"""Kimi-K2's INT4 checkpoints on the CPU: a tiny DeepSeek-V3 written in Kimi-K2-Thinking's
published layout (compressed-tensors pack-quantized W4A16, 32-column groups, symmetric, the
routed experts only; its ignore list, the same regexes, leaves the latent attention, the shared
experts and the dense MLP in float) gives the greedy tokens of HF transformers running the
dequantized weights, alone and at TP=2 over gloo. A checkpoint that quantizes more than the
routed experts, or DeepSeek in compressed-tensors FP8, is refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import test_models_deepseek as deepseek
from tests.paged_harness import assert_matches, generate_greedy, load_float32, randomize
from tests.quant_fixtures import reference_run, write_folder
from tests.test_fp8 import compressed_tensors_config
from tests.test_w4a16 import ATOL
from tests.test_w4a16_moe import ct_qc, ct_tensors, write_w4a16_moe
from tests.tp_cases import assert_same_greedy, engine_greedy, hf_reference

NEW_TOKENS = 8
# Kimi-K2-Thinking's quantization_config.ignore, as published.
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]
ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def kimi_qc(ignore: list[str]) -> dict:
    return ct_qc(32) | {"ignore": ignore}


def write_int4(plain: Path, folder: Path, quantized: re.Pattern[str], ignore: list[str]) -> Path:
    """``plain`` with the weights ``quantized`` matches in pack-quantized W4A16 under
    ``ignore`` (``folder/int4``); a plain checkpoint of the weights they stand for beside it
    (returned)."""
    packer = (lambda w, _: ct_tensors(w, 32), kimi_qc(ignore))
    return write_w4a16_moe(plain, folder, "int4", packer, selected=quantized.match)[1]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the INT4 checkpoint, the plain one of its dequantized weights)."""
    folder = tmp_path_factory.mktemp("kimi-k2")
    deepseek.make_hf_model("v3").save_pretrained(folder / "plain")
    reference = write_int4(folder / "plain", folder, ROUTED_EXPERT, KIMI_IGNORE)
    return folder / "int4", reference


def test_routed_experts_run_in_int4_and_give_hfs_tokens(kimi: tuple[Path, Path]) -> None:
    """The experts held packed (eight 4-bit values an int32, a scale per 32 columns), the
    attention and shared experts in float; prompts chunked beside decodes."""
    folder, reference = kimi
    ours = load_float32(folder)
    moe = ours.model.layers[1].mlp
    assert moe.w13 is None and moe.w13_qweight.dtype == torch.int32
    assert moe.w2_scales.shape[1] == 1  # down's 32 input columns: one group
    assert ours.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.float32
    assert moe.shared_experts.gate_up_proj.weight.dtype == torch.float32
    got = generate_greedy(ours, deepseek.PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(reference, deepseek.PROMPTS, NEW_TOKENS), ATOL)


def test_tp2_that_cuts_a_group_is_refused(kimi: tuple[Path, Path]) -> None:
    """Experts of width 32 over 2 ranks would give each half of down's one 32-column group:
    refused naming the width, before any worker starts."""
    folder, _ = kimi
    with pytest.raises(ValueError, match=r"whole groups of 32 .*expert width .* 32 / 2"):
        engine_greedy(folder, deepseek.PROMPTS, NEW_TOKENS, tp=2)


def test_tp2_with_wider_experts_gives_hfs_tokens(tmp_path: Path) -> None:
    """Experts of width 64: each rank one 32-column group of down's input, its half of
    gate/up's rows; HF's tokens on the dequantized weights."""
    torch.manual_seed(0)
    config = deepseek.CONFIGS["v3"]()
    config.moe_intermediate_size = 64
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model, 0)
    model.save_pretrained(tmp_path / "plain")
    reference = write_int4(tmp_path / "plain", tmp_path, ROUTED_EXPERT, KIMI_IGNORE)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    got = engine_greedy(tmp_path / "int4", deepseek.PROMPTS, NEW_TOKENS, tp=2)
    assert_same_greedy(got, hf_reference(hf, deepseek.PROMPTS, NEW_TOKENS))


def test_an_int4_attention_or_shared_expert_is_refused_by_name(tmp_path: Path) -> None:
    """Without the ignore list's self_attn and shared_experts entries those layers would be
    W4A16 too: not tested for DeepSeek, refused naming the first such linear."""
    deepseek.make_hf_model("v3").save_pretrained(tmp_path / "plain")
    write_int4(tmp_path / "plain", tmp_path, ROUTED_EXPERT, ["lm_head"])
    with pytest.raises(ValueError, match=r"W4A16 .* for DeepSeek's model\.layers\.0\.self_attn"):
        load_float32(tmp_path / "int4")


def test_compressed_tensors_fp8_is_refused_for_deepseek(tmp_path: Path) -> None:
    """llm-compressor's FP8_BLOCK preset on a DeepSeek: not V3's own FP8 layout, untested."""
    deepseek.make_hf_model("v3").save_pretrained(tmp_path / "plain")
    write_folder(tmp_path / "fp8", tmp_path / "plain", {}, compressed_tensors_config("FP8_BLOCK"))
    with pytest.raises(ValueError, match=r"compressed-tensors\) is not implemented for DeepSeek"):
        load_float32(tmp_path / "fp8")
