"""W4A16 experts on the CPU: a tiny Qwen3-MoE (and Mixtral) whose every decoder linear and every
expert's gate, up and down the test quantizes to 4 bits and writes in AWQ's, GPTQ's or
compressed-tensors' published layout (tests/quant_fixtures.py's packers, written independently
of engine_core), loads with its experts held packed per expert, and gives the greedy tokens of
HF transformers on the dequantized weights (the same 4-bit values as floats: transformers runs
none of these formats' experts on the CPU). W4A16 leaves activations in their dtype, so the
logits agree to float32 rounding. Then what is refused, by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from engine_core.models import model_config_from_hf
from engine_core.models.moe import SparseMoE
from engine_core.models.quantize import check_act_order_experts
from engine_core.parallel import TPGroup
from tests.factories import tiny_hf_sizes
from tests.paged_harness import assert_matches, generate_greedy, load_float32, randomize
from tests.quant_fixtures import (
    LINEARS,
    SAME_INPUT,
    VOCAB,
    awq_tensors,
    dequantize,
    gptq_tensors,
    group_indices,
    input_seed,
    minmax_quantize,
    pack_along_rows,
    reference_run,
    write_dequantized,
    write_folder,
)
from tests.test_w4a16 import ATOL, PROMPTS, awq_qc, gptq_qc

NEW_TOKENS = 8
MIXTRAL_EXPERTS = ("w1", "w2", "w3")  # Mixtral's gate, down and up
Pack = Callable[[torch.Tensor, int], tuple[dict, torch.Tensor]]


def qwen3_moe(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **tiny_hf_sizes(VOCAB), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, norm_topk_prob=True,
    )  # fmt: skip
    return scaled_head(AutoModelForCausalLM.from_config(config).eval(), seed)


def mixtral(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = MixtralConfig(**tiny_hf_sizes(VOCAB), num_local_experts=4, num_experts_per_tok=2)
    return scaled_head(AutoModelForCausalLM.from_config(config).eval(), seed)


def scaled_head(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights, the LM head scaled so greedy choices are well apart."""
    randomize(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def ct_tensors(weight: torch.Tensor, group_size: int) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' pack-quantized W4A16 (symmetric) tensors for weight [N, K]: the
    signed values -8..7 stored offset by 8, eight to an int32 along K (weight_packed [N, K/8]),
    weight_scale [N, G], weight_shape [2]; and the weight they stand for."""
    rows, cols = weight.shape
    g_idx = group_indices(cols, group_size, False, 0)
    q, scale, zero = minmax_quantize(weight, g_idx, int(g_idx.max()) + 1, symmetric=True)
    tensors = {
        "weight_packed": pack_along_rows(q),
        "weight_scale": scale.float(),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int32),
    }
    return tensors, dequantize(q, scale, zero, g_idx)


def ct_qc(group_size: int) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group_size, "dynamic": False}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }


FORMATS: dict[str, tuple[Pack, dict]] = {
    "awq-g32": (lambda w, _: awq_tensors(w, 32), awq_qc(32)),
    "gptq-g-1-sym": (
        lambda w, seed: gptq_tensors(w, -1, False, True, False, seed),
        gptq_qc(-1, desc_act=False, sym=True, v2=False),
    ),
    "compressed-tensors-g32": (lambda w, _: ct_tensors(w, 32), ct_qc(32)),
}


def is_quantized_linear(name: str) -> bool:
    module, _, param = name.rpartition(".")
    return param == "weight" and module.rpartition(".")[2] in LINEARS + MIXTRAL_EXPERTS


def write_w4a16_moe(
    plain: Path,
    folder: Path,
    fmt: str,
    packer: tuple[Pack, dict] | None = None,
    selected: Callable[[str], bool] = is_quantized_linear,
    seed_of: Callable[[str], int] = lambda name: 0,
) -> tuple[Path, Path]:
    """``plain`` with every attention linear and expert projection (or the weights
    ``selected`` names) in format ``fmt`` (the router and the head stay float; ``packer``: the
    (pack, quantization_config) of a format not in FORMATS, named ``fmt``); returns (that
    checkpoint, a plain one of the dequantized weights it stands for). ``seed_of``: each
    weight's seed, which an act-order packer draws its column order from."""
    pack, qc = packer or FORMATS[fmt]
    tensors, dequantized = {}, {}
    for name, weight in load_file(plain / "model.safetensors").items():
        if not selected(name):
            tensors[name] = weight
            continue
        module = name.rpartition(".")[0]
        packed, dequantized[name] = pack(weight, seed_of(name))
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
    quantized = write_folder(folder / fmt, plain, tensors, qc)
    return quantized, write_dequantized(plain, folder / f"{fmt}-reference", dequantized)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-moe")
    qwen3_moe().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_w4a16_experts_match_hf_on_the_dequantized_weights(
    fmt: str, plain: Path, tmp_path: Path
) -> None:
    folder, reference = write_w4a16_moe(plain, tmp_path, fmt)
    ours = load_float32(folder)
    moe = ours.model.layers[0].mlp
    assert moe.w13 is None and moe.w13_qweight.shape == (4, 128, 64 // 8)  # packed, per expert
    assert moe.w2_qweight.shape == (4, 64, 64 // 8) and moe.w2_scales.dtype == torch.float32
    assert (moe.w13_zeros is None) == fmt.startswith("compressed-tensors")
    # On CUDA the fused kernels read no host value, so the layer stays capturable in graphs.
    assert getattr(moe, "cuda_graph_safe", True)
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


def test_mixtral_w4a16_experts(tmp_path: Path) -> None:
    """Mixtral's experts are w1 (gate), w3 (up) and w2 (down) in its checkpoints."""
    mixtral().save_pretrained(tmp_path / "plain")
    folder, reference = write_w4a16_moe(tmp_path / "plain", tmp_path, "gptq-g-1-sym")
    ours = load_float32(folder)
    assert ours.model.layers[1].mlp.w2_qweight.shape == (4, 64, 128 // 8)
    got = generate_greedy(ours, PROMPTS[:2], NEW_TOKENS)
    assert_matches(got, reference_run(reference, PROMPTS[:2], NEW_TOKENS), ATOL)


def test_the_experts_scales_and_zeros_count(plain: Path, tmp_path: Path) -> None:
    """The comparison above would see a reader that ignored the experts' scales or zero points:
    doubling either changes the logits far beyond its tolerance."""
    folder, _ = write_w4a16_moe(plain, tmp_path, "awq-g32")
    ours = load_float32(folder)
    before = generate_greedy(ours, PROMPTS[:1], 4).logits[0]
    for name in ("w13_scales", "w2_zeros"):
        layer = ours.model.layers[1].mlp
        original = getattr(layer, name).data.clone()
        getattr(layer, name).data.copy_(original * 2)
        after = generate_greedy(ours, PROMPTS[:1], 4).logits[0]
        getattr(layer, name).data.copy_(original)
        assert (before - after).abs().max() > 1000 * ATOL, name


def test_a_missing_or_plain_expert_tensor_is_named(plain: Path, tmp_path: Path) -> None:
    folder, _ = write_w4a16_moe(plain, tmp_path, "awq-g32")
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.mlp.experts.2.up_proj.scales")
    write_folder(folder, plain, tensors, FORMATS["awq-g32"][1])
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 weights.*mlp\.w13_scales\[5\]"):
        load_float32(folder)
    tensors = load_file(plain / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight.* is a plain weight"):
        load_float32(write_folder(tmp_path / "plain-awq", plain, tensors, awq_qc(32)))


MIXTRAL_INPUTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_input_seed(name: str) -> int:
    """A seed per layer, expert and input (``model.layers.<i>.<block>.experts.<e>.<proj>.weight``):
    an act-order quantizer orders an expert's gate and up alike (one input, the tokens routed to
    that expert) and each expert in its own order; attention as tests/quant_fixtures.py's."""
    parts = name.split(".")
    if "experts" not in parts:
        return input_seed(name)
    at = parts.index("experts")
    proj = MIXTRAL_INPUTS.get(parts[at + 2], parts[at + 2])
    return 1000 * int(parts[2]) + 10 * (int(parts[at + 1]) + 1) + SAME_INPUT[proj]


def act_order_packer(sym: bool = True, ordered: Callable[[int], bool] = lambda seed: True) -> tuple:
    """GPTQ with desc_act, groups of 32; ``ordered(seed)``: whether that weight's columns are
    quantized in a drawn order (else in order, its g_idx trivial)."""
    return (
        lambda w, seed: gptq_tensors(w, 32, ordered(seed), sym, False, seed),
        gptq_qc(32, desc_act=True, sym=sym, v2=False),
    )


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zeros"])
def test_act_order_experts_match_hf_on_the_dequantized_weights(
    sym: bool, plain: Path, tmp_path: Path
) -> None:
    """GPTQ with desc_act: every expert's columns in an order of its own (gate and up sharing
    one), sorted by group at load and their inputs gathered in that order."""
    packer = act_order_packer(sym)
    folder, reference = write_w4a16_moe(
        plain, tmp_path, "gptq-act-order", packer, seed_of=expert_input_seed
    )
    ours = load_float32(folder)
    moe = ours.model.layers[0].mlp
    assert moe.w13_perm.shape == (4, 64) and moe.w2_perm.shape == (4, 64)
    assert len({tuple(p.tolist()) for p in moe.w13_perm}) == 4  # an order per expert
    assert moe.w13_g_idx is None  # read, sorted by, and dropped
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


def test_act_order_in_down_only_gives_both_projections_an_order(
    plain: Path, tmp_path: Path
) -> None:
    """Gate and up quantized in order, down not: the kernels take both orders or neither, so
    gate/up's is the identity."""
    packer = act_order_packer(ordered=lambda seed: seed % 10 == SAME_INPUT["down_proj"])
    folder, reference = write_w4a16_moe(
        plain, tmp_path, "down-only", packer, seed_of=expert_input_seed
    )
    ours = load_float32(folder)
    moe = ours.model.layers[0].mlp
    assert torch.equal(moe.w13_perm, torch.arange(64, dtype=torch.int32).expand(4, 64))
    assert not torch.equal(moe.w2_perm, torch.arange(64, dtype=torch.int32).expand(4, 64))
    got = generate_greedy(ours, PROMPTS[:2], NEW_TOKENS)
    assert_matches(got, reference_run(reference, PROMPTS[:2], NEW_TOKENS), ATOL)


def test_mixtral_act_order_experts(tmp_path: Path) -> None:
    mixtral().save_pretrained(tmp_path / "plain")
    folder, reference = write_w4a16_moe(
        tmp_path / "plain", tmp_path, "act-order", act_order_packer(), seed_of=expert_input_seed
    )
    ours = load_float32(folder)
    assert ours.model.layers[1].mlp.w2_perm.shape == (4, 128)
    got = generate_greedy(ours, PROMPTS[:2], NEW_TOKENS)
    assert_matches(got, reference_run(reference, PROMPTS[:2], NEW_TOKENS), ATOL)


def test_act_order_experts_of_an_untested_architecture_are_refused(plain: Path) -> None:
    hf = json.loads((plain / "config.json").read_text())
    hf["quantization_config"] = gptq_qc(32, desc_act=True, sym=True, v2=False)
    config = dataclasses.replace(model_config_from_hf(hf), architecture="deepseek")
    with pytest.raises(ValueError, match=r"desc_act: act-order W4A16 experts are tested for"):
        check_act_order_experts(config, config.quantization)


def test_act_order_experts_whose_gate_and_up_orders_differ_are_refused(
    plain: Path, tmp_path: Path
) -> None:
    write_w4a16_moe(plain, tmp_path, "bad", act_order_packer(), seed_of=lambda name: len(name))
    with pytest.raises(ValueError, match=r"experts\.0\.w13: the merged parts' g_idx differ"):
        load_float32(tmp_path / "bad")


def test_act_order_experts_under_tensor_parallelism_are_refused(plain: Path) -> None:
    """A rank's slice of down's columns would need an order of its own: refused by name."""
    hf = json.loads((plain / "config.json").read_text())
    hf["quantization_config"] = gptq_qc(32, desc_act=True, sym=True, v2=False)
    config = model_config_from_hf(hf)
    layer = SparseMoE(config, TPGroup(rank=0, size=2))
    with pytest.raises(ValueError, match=r"desc_act: act-order W4A16 experts under --tensor-"):
        layer.make_w4a16(config.quantization, "model.layers.0.mlp")


def test_a_group_size_not_dividing_the_expert_width_is_refused(plain: Path, tmp_path: Path) -> None:
    tensors = load_file(plain / "model.safetensors")
    qc = awq_qc(48)
    with pytest.raises(ValueError, match=r"group_size 48 does not divide the input size \(64\)"):
        load_float32(write_folder(tmp_path / "g48", plain, tensors, qc))


def test_random_w4a16_experts_for_the_presets(tmp_path: Path) -> None:
    """`random:qwen3-30b-a3b --quantization gptq` (the GPU benchmarks): random 4-bit experts
    whose values have the presets' spread (0.02), as the dense linears'."""
    import dataclasses
    import json

    from engine_core.config import W4A16Config
    from engine_core.models import build_model, model_config_from_hf
    from engine_core.models.w4a16 import dequantize
    from engine_core.presets import init_random_weights
    from tests.factories import write_tiny_qwen3_moe

    hf = json.loads((write_tiny_qwen3_moe(tmp_path) / "config.json").read_text())
    quant = W4A16Config("gptq", group_size=32, zero_points=True)
    config = dataclasses.replace(model_config_from_hf(hf), quantization=quant)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")
    init_random_weights(model, seed=0)
    moe = model.model.layers[0].mlp
    weight = dequantize(moe.w2_qweight[3], moe.w2_scales[3], moe.w2_zeros[3], 32)
    assert 0.015 < float(weight.std()) < 0.025
