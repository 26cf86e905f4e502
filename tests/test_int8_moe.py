"""INT8 experts on the CPU: a tiny Qwen3-MoE in compressed-tensors' W8A8 (every attention linear
and every expert's gate, up and down in int8 with one scale per output row, the router in
float32, as published W8A8 MoE checkpoints hold them) loads with its experts held in int8 and
gives the greedy tokens of the model it stands for; so does ``--quantization w8a8`` quantizing a
plain checkpoint's experts (Qwen3-MoE and Mixtral) as they load.

The reference is HF transformers on the dequantized weights (compressed-tensors' own quantizer
computes them, independently of our code) with the scheme's int8 activation round trip in front
of every linear and every expert's two products (tests/quant_fixtures.py): transformers runs no
int8 experts. The comparison would see a reader that skipped the activations' round trip or
read a scale from the wrong row (``test_the_experts_scales_and_activations_count``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_core.loader import load_model
from tests.paged_harness import GreedyResult, generate_greedy, hf_greedy, load_float32
from tests.quant_fixtures import (
    LINEARS,
    assert_expert_scales_and_activations_count,
    assert_matches_quantized,
    ct_dequantized,
    ct_observed,
    is_linear_weight,
    quantize_expert_inputs,
    quantize_inputs,
    write_compressed_tensors,
    write_dequantized,
)
from tests.test_fp8 import NEW_TOKENS, PROMPTS
from tests.test_fp8_moe import make_hf_model, mixtral_model
from tests.test_int8 import int8_per_token, int8_rows


def reference(folder: Path, prompts: list[list[int]] = PROMPTS) -> list[GreedyResult]:
    """HF's greedy run of ``folder`` with the int8 round trip in front of every decoder linear
    and every expert's products."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantize_inputs(hf, int8_per_token)
    quantize_expert_inputs(hf, int8_per_token)
    return [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in prompts]


def ct_int8_experts(plain: Path) -> dict[str, torch.Tensor]:
    """Every expert's gate, up and down of ``plain`` as compressed-tensors' W8A8 quantizes them:
    int8 ``weight`` and float32 ``weight_scale`` [rows, 1] under the per-expert names."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("W8A8", ["Linear"]).weights
    out = {}
    for name, weight in load_file(plain / "model.safetensors").items():
        if ".experts." in name and is_linear_weight(name):
            scale, zero = calculate_qparams(*ct_observed(weight, args), args)
            out[name] = quantize(weight, scale, zero, args).to(torch.int8)
            out[f"{name}_scale"] = scale.reshape(-1, 1).float()
    return out


def write_w8a8_moe(model: torch.nn.Module, folder: Path) -> tuple[Path, Path]:
    """(the W8A8 checkpoint of ``model``, a float folder of what it stands for). compressed-
    tensors' writer quantizes the attention linears and keeps transformers' stacked float
    experts; those are replaced by each expert's int8 tensors, as the published checkpoints
    (quantized from the Hub's per-expert layout) hold them."""
    plain = folder / "plain"
    model.save_pretrained(plain)
    w8a8 = write_compressed_tensors(plain, folder / "w8a8", "W8A8")
    state = load_file(w8a8 / "model.safetensors")
    stacked = [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    for name in stacked:
        del state[name]
    state.update(ct_int8_experts(plain))
    save_file(state, str(w8a8 / "model.safetensors"))
    ref = write_dequantized(plain, folder / "ref", ct_dequantized(plain, "W8A8"))
    return w8a8, ref


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_w8a8_moe(make_hf_model(), tmp_path_factory.mktemp("int8-moe"))


def test_int8_experts_match_hf_on_what_the_checkpoint_means(
    checkpoint: tuple[Path, Path],
) -> None:
    w8a8, ref = checkpoint
    config = json.loads((w8a8 / "config.json").read_text())["quantization_config"]
    assert any(name.endswith("mlp.gate") for name in config["ignore"])  # the router stays float
    ours = load_float32(w8a8)
    moe = ours.model.layers[0].mlp
    assert moe.w13.dtype == moe.w2.dtype == torch.int8  # held in int8, not widened
    assert moe.w13_scale.shape == moe.w13.shape[:2] and moe.w2_scale.shape == moe.w2.shape[:2]
    # On CUDA the fused kernels read no host value, so the layer stays capturable in graphs.
    assert getattr(moe, "cuda_graph_safe", True)
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches_quantized(got, reference(ref))


def test_the_experts_scales_and_activations_count(checkpoint: tuple[Path, Path]) -> None:
    """The comparison above would see a reader that ignored either: HF on the dequantized
    weights without the activations' round trip gives other logits, and so does our model with
    its experts' scales doubled."""
    w8a8, ref = checkpoint
    plain = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    quantize_inputs(plain, int8_per_token)  # the dense linears' round trip, not the experts'
    assert_expert_scales_and_activations_count(load_float32(w8a8), plain, PROMPTS[0])


def test_a_plain_expert_weight_is_named(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    w8a8, _ = checkpoint
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "config.json").write_text((w8a8 / "config.json").read_text())
    state = load_file(w8a8 / "model.safetensors")
    weight = "model.layers.1.mlp.experts.2.up_proj.weight"
    state[weight] = state[weight].float()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{weight}.* is torch.float32"):
        load_model(str(folder), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_quantization_flag_quantizes_experts_per_row_as_they_load(
    family: str, tmp_path: Path
) -> None:
    """``--quantization w8a8`` on a plain MoE checkpoint: every expert's rows in int8 with one
    absmax / 127 scale each (the test's own ``int8_rows``; Mixtral's experts are w1, w3 and w2
    in its checkpoints), the router float."""
    model = make_hf_model() if family == "qwen3_moe" else mixtral_model()
    model.save_pretrained(tmp_path / "plain")
    linears = LINEARS + (("w1", "w2", "w3") if family == "mixtral" else ())
    state = load_file(tmp_path / "plain" / "model.safetensors")
    quantized = {
        name: int8_rows(weight)
        for name, weight in state.items()
        if name.rpartition(".")[0].rpartition(".")[2] in linears and name.endswith(".weight")
    }
    ref = write_dequantized(tmp_path / "plain", tmp_path / "ref", quantized)
    ours = load_float32(tmp_path / "plain", quantization="w8a8")
    moe = ours.model.layers[1].mlp
    assert moe.w13.dtype == moe.w2.dtype == torch.int8 and moe.gate.weight.dtype == torch.float32
    # One prompt at a time, as HF runs them: a batch's float32 sums differ from one prompt's in
    # the last bits, which int8's fine levels (a 255th of a token's range) turn into a level
    # apart now and then, enough to flip one of these near-tied tokens; the checkpoint test
    # above runs the batched, chunked path.
    for prompt, want in zip(PROMPTS, reference(ref), strict=True):
        assert_matches_quantized(generate_greedy(ours, [prompt], NEW_TOKENS), [want])
