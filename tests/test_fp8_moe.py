"""FP8 experts on the CPU: a tiny Qwen3-MoE written in FP8 (every decoder linear and every
expert's gate, up and down in e4m3, with a scale per block or per output row, the router in
float32) loads with its experts held in e4m3 and gives the greedy tokens of the model it stands
for. The reference is HF transformers on the dequantized weights (computed by the test itself,
independently of our code) with the scheme's activation round trip added in front of every
linear and every expert's products (tests/quant_fixtures.py): transformers runs no FP8 experts
on the CPU. Then ``--quantization fp8`` quantizing a plain checkpoint's experts as they load
(Qwen3-MoE and Mixtral), DeepSeek-V3's published FP8 form, and what is refused, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from engine_core.loader import load_model
from tests.factories import tiny_hf_sizes
from tests.paged_harness import (
    GreedyResult,
    generate_greedy,
    hf_greedy,
    load_float32,
    randomize,
)
from tests.quant_fixtures import (
    LINEARS,
    assert_expert_scales_and_activations_count,
    assert_matches_quantized,
    e4m3_per_token,
    quantize_expert_inputs,
    quantize_inputs,
)
from tests.test_fp8 import (
    BLOCK,
    FORMATS,
    NEW_TOKENS,
    PROMPTS,
    VOCAB,
    edit_config,
    edit_tensors,
    write_quantized,
)

E4M3 = torch.float8_e4m3fn
# The activations' round trip each format's scheme makes (test_fp8.FORMATS).
ACTIVATIONS = {
    "fp8-block": lambda x: e4m3_per_token(x, BLOCK[1]),
    "ct-channel-dynamic": e4m3_per_token,
}


def make_hf_model(expert_width: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **tiny_hf_sizes(VOCAB),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=expert_width,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed)
    return model


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model()


def reference(
    folder: Path,
    activations: Callable[[torch.Tensor], torch.Tensor],
    leaves: tuple[str, ...] = LINEARS,
    prompts: list[list[int]] = PROMPTS,
) -> list[GreedyResult]:
    """HF's greedy run of ``folder`` with ``activations`` in front of the linears named
    ``leaves`` and of every expert's products."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantize_inputs(hf, activations, leaves=leaves)
    quantize_expert_inputs(hf, activations)
    return [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_fp8_experts_match_hf_on_what_the_checkpoint_means(
    name: str, hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    write_quantized(hf_model, FORMATS[name], tmp_path / "fp8", tmp_path / "ref")
    ours = load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32).module
    moe = ours.model.layers[0].mlp
    assert moe.w13.dtype == E4M3 and moe.w2.dtype == E4M3  # held in FP8, not widened
    assert moe.w13_scale.shape[0] == moe.w2_scale.shape[0] == 4
    # On CUDA the fused kernels read no host value, so the layer stays capturable in graphs.
    assert getattr(moe, "cuda_graph_safe", True)
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches_quantized(got, reference(tmp_path / "ref", ACTIVATIONS[name]))


def test_the_experts_scales_and_activations_count(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    """The comparison above would see a reader that ignored either: HF on the dequantized
    weights without the activations' round trip gives other logits, and so does the same model
    with its experts' scales doubled."""
    write_quantized(hf_model, FORMATS["fp8-block"], tmp_path / "fp8", tmp_path / "ref")
    ours = load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32).module
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    assert_expert_scales_and_activations_count(ours, plain, PROMPTS[0])


def test_a_missing_or_plain_expert_tensor_is_named(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    folder = tmp_path / "fp8"
    write_quantized(hf_model, FORMATS["fp8-block"], folder, tmp_path / "ref")
    scale = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    edit_tensors(folder, lambda t: t.pop(scale))
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 weights.*mlp\.w13_scale\[5\]"):
        load_model(str(folder), torch.device("cpu"), torch.float32)
    write_quantized(hf_model, FORMATS["fp8-block"], folder, tmp_path / "ref")
    weight = "model.layers.1.mlp.experts.2.up_proj.weight"
    edit_tensors(folder, lambda t: t.update({weight: t[weight].float()}))
    with pytest.raises(ValueError, match=f"{weight}.* is torch.float32"):
        load_model(str(folder), torch.device("cpu"), torch.float32)


def mixtral_model() -> torch.nn.Module:
    torch.manual_seed(1)
    config = MixtralConfig(**tiny_hf_sizes(VOCAB), num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model, 1)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_quantization_flag_quantizes_experts_per_row_as_they_load(
    family: str, hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    """--quantization fp8 on a plain MoE checkpoint: every expert's rows in e4m3 with one absmax
    scale each, the values of the test's own per-row quantization (Mixtral's experts are w1, w3
    and w2 in its checkpoints)."""
    model = hf_model if family == "qwen3_moe" else mixtral_model()
    model.save_pretrained(tmp_path / "plain")
    linears = LINEARS + (("w1", "w2", "w3") if family == "mixtral" else ())
    fmt = FORMATS["ct-channel-dynamic"]
    write_quantized(model, fmt, tmp_path / "unused", tmp_path / "ref", linears)
    ours = load_float32(tmp_path / "plain", quantization="fp8")
    moe = ours.model.layers[1].mlp
    assert moe.w13.dtype == moe.w2.dtype == E4M3 and moe.w13_scale.shape == moe.w13.shape[:2]
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS)
    assert_matches_quantized(got, reference(tmp_path / "ref", e4m3_per_token))


def test_static_activation_scales_for_experts_are_refused(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    write_quantized(hf_model, FORMATS["fp8-tensor-static"], tmp_path / "fp8", tmp_path / "ref")
    with pytest.raises(ValueError, match="FP8 experts with static activation scales"):
        load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32)


def test_experts_width_not_a_whole_number_of_blocks_is_refused(tmp_path: Path) -> None:
    """Gate and up are stacked into one tensor of scales: each half must be whole blocks."""
    model = make_hf_model(expert_width=48)
    write_quantized(model, FORMATS["ct-channel-dynamic"], tmp_path / "fp8", tmp_path / "ref")
    edit_config(
        tmp_path / "fp8",
        lambda c: c.update(
            quantization_config={
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [32, 16],
            }
        ),
    )
    with pytest.raises(ValueError, match=r"experts' width \(48\) is not a whole number of 32-row"):
        load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32)


# DeepSeek-V3's published FP8: its latent attention's projections too, in 32 x 32 blocks here
# (128 x 128 there), the partial blocks of q_b_proj's 48 columns and kv_a_proj's 40 rows (576 in
# 128-row blocks there) with their own scales.
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def e4m3_groups(x: torch.Tensor) -> torch.Tensor:
    """Per token and 32-column group, a last narrower group its own (K of 48)."""
    return torch.cat([e4m3_per_token(part) for part in x.split(BLOCK[1], dim=-1)], dim=-1)


def test_deepseek_v3_fp8_checkpoint_matches_hf(tmp_path: Path) -> None:
    """Every linear and expert in e4m3 but kv_b_proj, which the absorbed decode reads as a
    matrix: dequantized at load, and the latent it multiplies not quantized (as vLLM computes
    it), so the reference hooks every other linear."""
    from tests import test_models_deepseek as deepseek

    hf_model = deepseek.make_hf_model("v3")
    write_quantized(
        hf_model, FORMATS["fp8-block"], tmp_path / "fp8", tmp_path / "ref", LINEARS + MLA_LINEARS
    )
    ours = load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32).module
    attn = ours.model.layers[0].self_attn
    assert attn.q_a_proj.weight.dtype == attn.kv_a_proj_with_mqa.weight.dtype == E4M3
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.fp8 is None
    assert ours.model.layers[1].mlp.w13.dtype == E4M3
    want = reference(tmp_path / "ref", e4m3_groups, LINEARS + MLA_LINEARS[:3], deepseek.PROMPTS)
    got = generate_greedy(ours, deepseek.PROMPTS, NEW_TOKENS, block_size=4)
    assert_matches_quantized(got, want)


def test_quantizing_a_plain_deepseek_checkpoint_is_refused(tmp_path: Path) -> None:
    from tests import test_models_deepseek as deepseek

    deepseek.make_hf_model("v3").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantizing a plain DeepSeek checkpoint"):
        load_float32(tmp_path, quantization="fp8")
