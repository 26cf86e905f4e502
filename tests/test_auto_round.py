"""Intel AutoRound checkpoints (``quant_method: "auto-round"``) on the CPU: a tiny random Llama
and a tiny Qwen3-MoE quantized by the test to 4 bits and packed as AutoRound's exporters pack
them (GPTQ's layout storing zero - 1 for ``auto_round:auto_gptq``, the zero itself for its
native ``auto_round``; AWQ's for ``auto_round:auto_awq``; no ``g_idx``), with ``extra_config``
keeping some layers in 16 bits, load and give HF transformers' greedy tokens on the dequantized
weights (the float layers as they were). Then what is refused, by name.

The packers are tests/quant_fixtures.py's GPTQ and AWQ ones (written from AutoGPTQ's and
AutoAWQ's ``pack``); AutoRound's own (auto_round_extension/torch/qlinear_torch_zp.py and
qlinear_torch.py, export_to_awq's WQLinear_GEMM) lay out the same names, shapes and nibble
orders, differing only in the stored zero point, which is what the cases below vary.
"""

# The fixture `plain` arrives as a parameter named like the imported fixture: F811 is expected.
# ruff: noqa: F811
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_core.config import is_ignored
from engine_core.models.quant_config import (
    quant_config_from_hf,
    random_weights_config,
    with_quantization_flag,
)
from engine_core.models.quantize import check_tested_format
from engine_core.presets import PRESETS
from tests.paged_harness import assert_matches, generate_greedy, load_float32
from tests.quant_fixtures import (
    awq_tensors,
    gptq_tensors,
    is_linear_weight,
    reference_run,
)
from tests.test_w4a16 import ATOL, PROMPTS, plain  # noqa: F401 (the float Llama, a fixture)
from tests.test_w4a16_moe import NEW_TOKENS, Pack, qwen3_moe, write_w4a16_moe

# Layers the Llama cases keep in 16 bits: one by its name, three by a pattern, as AutoRound
# writes its extra_config keys (a layer's name, or a regular expression searched for).
KEPT_FLOAT = {
    "model.layers.1.mlp.down_proj": {"bits": 16, "data_type": "float"},
    r".*layers\.0\.self_attn\.[qkv]_proj": {"bits": 16},
}
KEPT_NAMES = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj",
              "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")  # fmt: skip


def auto_round_qc(packing: str, group_size: int, sym: bool, extra: dict | None = None) -> dict:
    """A quantization_config as AutoRound's exporter writes it (calibration fields included)."""
    qc = {"quant_method": "auto-round", "packing_format": packing, "bits": 4,
          "group_size": group_size, "sym": sym, "data_type": "int", "iters": 200,
          "autoround_version": "0.9.0", "block_name_to_quantize": "model.layers"}  # fmt: skip
    return qc | ({"extra_config": extra} if extra else {})


def gptq_packed(group_size: int, sym: bool, zero_minus_one: bool) -> Pack:
    """GPTQ's layout without g_idx (AutoRound's GPTQ packers write none)."""

    def pack(weight: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
        tensors, dequantized = gptq_tensors(
            weight, group_size, False, sym, not zero_minus_one, seed
        )
        del tensors["g_idx"]
        return tensors, dequantized

    return pack


CASES: dict[str, tuple[Pack, dict]] = {
    "auto_gptq-g32-sym": (
        gptq_packed(32, sym=True, zero_minus_one=True),
        auto_round_qc("auto_round:auto_gptq", 32, sym=True, extra=KEPT_FLOAT),
    ),
    "native-g64-asym": (
        gptq_packed(64, sym=False, zero_minus_one=False),
        auto_round_qc("auto_round", 64, sym=False),
    ),
    "auto_awq-g64": (
        lambda w, _: awq_tensors(w, 64),
        auto_round_qc("auto_round:auto_awq", 64, True),
    ),
}


def quantized_here(name: str) -> bool:
    """A Llama linear the AutoRound checkpoint holds 4-bit (not one extra_config keeps)."""
    return is_linear_weight(name) and name.removesuffix(".weight") not in KEPT_NAMES


@pytest.mark.parametrize("name", list(CASES))
def test_auto_round_llama_matches_hf_on_the_dequantized_weights(
    name: str, plain: Path, tmp_path: Path
) -> None:
    kept = "extra_config" in CASES[name][1]
    selected = quantized_here if kept else is_linear_weight
    folder, reference = write_w4a16_moe(plain, tmp_path, name, CASES[name], selected)
    ours = load_float32(folder)
    layers = ours.model.layers
    assert layers[0].mlp.down_proj.qweight.dtype == torch.int32  # held packed
    assert (layers[0].self_attn.qkv_proj.weight is not None) == kept  # kept float
    assert (layers[1].mlp.down_proj.weight is not None) == kept
    assert layers[1].self_attn.qkv_proj.weight is None
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


def test_auto_round_moe_experts_match_hf(tmp_path: Path) -> None:
    """Qwen3-MoE as Intel's MoE checkpoints have it: attention and experts 4-bit, the routers
    listed in extra_config at 16 bits."""
    qwen3_moe().save_pretrained(tmp_path / "plain")
    routers = {f"model.layers.{i}.mlp.gate": {"bits": 16, "data_type": "float"} for i in (0, 1)}
    qc = auto_round_qc("auto_round:auto_gptq", 32, sym=True, extra=routers)
    packer = (gptq_packed(32, sym=True, zero_minus_one=True), qc)
    folder, reference = write_w4a16_moe(tmp_path / "plain", tmp_path, "auto-round", packer)
    ours = load_float32(folder)
    moe = ours.model.layers[0].mlp
    assert moe.w13 is None and moe.w13_qweight.shape == (4, 128, 64 // 8)  # packed, per expert
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


# ---- what the config reads ----------------------------------------------------------------------


def read(qc: dict) -> object:
    return quant_config_from_hf({"quantization_config": qc})


def test_packing_formats_read_as_their_layouts() -> None:
    """The stored zero point by packing (AutoRound's reader: auto_gptq "zp+-1"); an absent
    packing_format is auto_round:auto_gptq, as AutoRound's and vLLM's readers default it."""
    got = {
        packing: (config.source, config.zero_offset, config.group_size)
        for packing in (
            "auto_round:auto_gptq",
            "auto_round",
            "auto_round:gptqmodel",
            "auto_round:auto_awq",
        )  # fmt: skip
        for config in [read(auto_round_qc(packing, 128, sym=True))]
    }
    assert got == {
        "auto_round:auto_gptq": ("gptq", 1, 128),
        "auto_round": ("gptq", 0, 128),
        "auto_round:gptqmodel": ("gptq", 0, 128),
        "auto_round:auto_awq": ("awq", 0, 128),
    }
    qc = auto_round_qc("", 128, sym=True)
    del qc["packing_format"]
    assert read(qc).zero_offset == 1


def test_extra_config_keys_match_as_autoround_reads_them() -> None:
    """A layer's name matches that layer only (not gate_proj for mlp.gate); a pattern matches
    wherever it is found in a name."""
    extra = {"model.layers.0.mlp.gate": {"bits": 16}, r".*mlp\.shared_expert_gate": {"bits": 16}}
    config = read(auto_round_qc("auto_round:auto_gptq", 128, sym=True, extra=extra))
    assert is_ignored("model.layers.0.mlp.gate", config)
    assert not is_ignored("model.layers.0.mlp.gate_proj", config)
    assert not is_ignored("model.layers.10.mlp.gate", config)
    assert is_ignored("model.layers.7.mlp.shared_expert_gate", config)
    assert not is_ignored("model.layers.7.mlp.shared_expert.gate_proj", config)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"bits": 8}, r"\(auto-round\)\.bits 8 is not supported"),
        ({"bits": 2}, r"\(auto-round\)\.bits 2 is not supported"),
        ({"act_bits": 8}, r"\.act_bits 8: quantized activations are not supported"),
        ({"data_type": "nv_fp"}, r"\.data_type 'nv_fp' is not supported"),
        (
            {"packing_format": "auto_round:llm_compressor"},
            r"\.packing_format 'auto_round:llm_compressor' is not supported",
        ),  # fmt: skip
        ({"group_size": 0}, r"\.group_size 0 is not -1 or a size"),
        (
            {"extra_config": {"model.layers.0.mlp.down_proj": {"bits": 8}}},
            r"extra_config\['model\.layers\.0\.mlp\.down_proj'\]: bits=8 is not supported",
        ),
        (
            {"extra_config": {"model.layers.1.self_attn.o_proj": {"group_size": 64}}},
            r"extra_config\['model\.layers\.1\.self_attn\.o_proj'\]: group_size=64",
        ),
        (
            {"extra_config": {"lm_head": {"bits": 4, "group_size": 128, "sym": True}}},
            r"extra_config\['lm_head'\]: bits=4, group_size=128, sym=True is not supported",
        ),
        (
            {"block_name_to_quantize": "model.visual.blocks,model.language_model.layers"},
            r"block_name_to_quantize names 'model\.visual\.blocks'",
        ),
        ({"rotation_config": {"hadamard": True}}, r"\.rotation_config is not supported"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(edit: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read(auto_round_qc("auto_round:auto_gptq", 128, sym=True) | edit)


def test_part_of_a_merged_projection_kept_float_is_refused(plain: Path, tmp_path: Path) -> None:
    extra = {"model.layers.0.self_attn.q_proj": {"bits": 16}}
    packer = (gptq_packed(32, True, True), auto_round_qc("auto_round:auto_gptq", 32, True, extra))
    folder, _ = write_w4a16_moe(plain, tmp_path, "partial", packer)
    with pytest.raises(ValueError, match="leaves some of .*q_proj.* unquantized but not all"):
        load_float32(folder)


def test_the_flag_and_the_tested_format_lists_name_auto_round() -> None:
    """``--quantization auto-round`` (vLLM's name) agrees; ``gptq`` does not, though the layout
    is GPTQ's. Qwen3-Next stays limited to its tested formats."""
    from engine_core.config import EngineConfig

    assert EngineConfig(quantization="auto-round").quantization == "auto-round"  # the CLI's too
    config = read(auto_round_qc("auto_round:auto_gptq", 128, sym=True))
    assert with_quantization_flag(config, "auto-round") is config
    with pytest.raises(ValueError, match="which has a auto-round one"):
        with_quantization_flag(config, "gptq")
    with pytest.raises(ValueError, match=r"W4A16 \(auto-round\) \(gptq\) is not implemented for "
                                         "Qwen3-Next"):  # fmt: skip
        check_tested_format(SimpleNamespace(architecture="qwen3_next"), config)


def test_random_weights_under_the_flag_take_autorounds_default_packing() -> None:
    """`random:<preset> --quantization auto-round` (no checkpoint): GPTQ's layout, named
    AutoRound in messages."""
    quant = random_weights_config("auto-round", PRESETS["smollm2-135m"])
    assert (quant.source, quant.origin, quant.group_size) == ("gptq", "auto-round", 64)
