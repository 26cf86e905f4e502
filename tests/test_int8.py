"""W8A8 INT8 on the CPU: compressed-tensors' W8A8 (int8 weights per channel, int8 activations
per token at run time) and ``--quantization w8a8`` load into int8 linears
(engine_core/models/int8.py) and give HF transformers' greedy tokens.

The references: HF running the compressed-tensors checkpoint itself (it quantizes the
activations as compressed-tensors says); HF on the dequantized weights with the activations'
int8 round trip in forward pre-hooks for the others (tests/quant_fixtures.py). Tokens must be
equal; quantized activations turn the two implementations' float32 rounding differences into
an occasional step of one level, so the logits are compared as ``assert_matches_quantized``
says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine_core.config import Int8Config
from engine_core.memory_plan import module_bytes
from engine_core.models.int8 import quantize_rows
from engine_core.models.layers import Linear
from tests.paged_harness import generate_greedy, hf_greedy, load_float32, random_prompts
from tests.quant_fixtures import (
    VOCAB,
    assert_matches_quantized,
    ct_dequantized,
    is_linear_weight,
    make_hf_model,
    quantize_inputs,
    reference_run,
    sliced,
    write_compressed_tensors,
    write_dequantized,
)

NEW_TOKENS = 12
PROMPTS = random_prompts(VOCAB, (5, 11, 23))


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic symmetric int8: scale = absmax / 127.5, x / scale clamped to
    -128..127 and rounded half to even, times the scale."""
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    return torch.round(torch.clamp(x / scale, -128, 127)) * scale


def int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """``--quantization w8a8``'s weights: one scale per row, absmax / 127, rounded; dequantized."""
    scale = weight.abs().amax(1, keepdim=True) / 127
    return torch.round(weight / scale).clamp(-128, 127) * scale


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plain")
    make_hf_model(seed=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def w8a8(plain: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_compressed_tensors(plain, tmp_path_factory.mktemp("w8a8"), "W8A8")


def test_compressed_tensors_w8a8_matches_hf_running_it(w8a8: Path) -> None:
    ours = load_float32(w8a8)
    down = ours.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.int8 and down.weight_scale.shape == (128,)
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches_quantized(got, reference_run(w8a8, PROMPTS, NEW_TOKENS))


def test_the_activations_are_quantized(plain: Path, w8a8: Path, tmp_path: Path) -> None:
    """HF on the dequantized weights without the activations' round trip is another model."""
    reference = write_dequantized(plain, tmp_path / "ref", ct_dequantized(plain, "W8A8"))
    got = generate_greedy(load_float32(w8a8), PROMPTS[:1], 4).logits[0]
    weights_only = reference_run(reference, PROMPTS[:1], 4)[0].logits[0]
    assert (got - weights_only).abs().max() > 1e-2


def test_quantization_flag_w8a8_quantizes_rows_as_it_loads(plain: Path, tmp_path: Path) -> None:
    state = load_file(plain / "model.safetensors")
    dequantized = {name: int8_rows(w) for name, w in state.items() if is_linear_weight(name)}
    reference = write_dequantized(plain, tmp_path / "ref", dequantized)
    ours = load_float32(plain, quantization="w8a8")
    assert ours.model.layers[1].self_attn.o_proj.weight.dtype == torch.int8
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    quantize_inputs(hf, int8_per_token)
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS)
    assert_matches_quantized(got, [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS])


def test_int8_weights_take_one_byte(plain: Path, w8a8: Path) -> None:
    """Every decoder linear holds one byte a weight and a float32 scale a row."""
    rows = 2 * (256 + 128 + 512 + 128)  # qkv, o, gate/up, down; two layers
    weights = 2 * (256 * 128 + 128 * 128 + 512 * 128 + 128 * 256)
    assert (
        module_bytes(load_float32(plain)) - module_bytes(load_float32(w8a8))
        == 3 * weights - 4 * rows
    )


def test_tp2_quantizes_each_ranks_share_per_token(plain: Path, w8a8: Path, tmp_path: Path) -> None:
    """Per-row scales split with the rows; a row-parallel layer's rank quantizes its half of a
    token's input with that half's own scale, as the reference's hooks do."""
    from engine_core.llm import LLM
    from protocol.messages import SamplingParams

    llm = LLM(str(w8a8), block_size=4, num_kv_blocks=64, max_model_len=128,
              tensor_parallel_size=2)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        tp2 = [o.token_ids for o in llm.generate(PROMPTS, params, detokenize=False)]
    finally:
        llm.engine.shutdown()
    reference = write_dequantized(plain, tmp_path / "ref", ct_dequantized(plain, "W8A8"))
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    quantize_inputs(hf, int8_per_token, sliced(int8_per_token, 2))
    assert tp2 == [hf_greedy(hf, prompt, NEW_TOKENS).tokens[0] for prompt in PROMPTS]


# ---- refusals -----------------------------------------------------------------------------------


def edit_scheme(folder: Path, edit: dict, weights: dict | None = None) -> None:
    config = json.loads((folder / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    if edit.get("input_activations", True) is None:
        group["input_activations"] = None
    else:
        group["input_activations"].update(edit)
    group["weights"].update(weights or {})
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("edit", "weights", "message"),
    [
        ({"symmetric": False}, None, "asymmetric int8 activations are not supported"),
        ({"dynamic": False, "strategy": "tensor"}, None, "read as dynamic per token"),
        ({"input_activations": None}, None, r"weight-only int8 \(W8A16\) is not supported"),
        ({}, {"symmetric": False}, "asymmetric int8 weights are not supported"),
        ({}, {"num_bits": 4}, "4-bit weights with quantized activations are not supported"),
    ],
)
def test_unsupported_int8_schemes_are_refused(
    w8a8: Path, tmp_path: Path, edit: dict, weights: dict | None, message: str
) -> None:
    import shutil

    folder = Path(shutil.copytree(w8a8, tmp_path / "edited"))
    edit_scheme(folder, edit, weights)
    if weights and weights.get("num_bits") == 4:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["format"] = "pack-quantized"
        config["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_float32(folder)


def test_a_biased_int8_linear_adds_its_bias_once_inside_the_product() -> None:
    """As HF runs a compressed-tensors linear: one F.linear of the int8 round-tripped input and
    the dequantized weight, with the bias (rounded once, in bf16)."""
    gen = torch.Generator().manual_seed(0)
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    layer.make_int8(Int8Config())
    weight, scale = quantize_rows(torch.randn(48, 64, generator=gen))
    layer.weight.data.copy_(weight)
    layer.weight_scale.data.copy_(scale)
    layer.bias.data.copy_(torch.randn(48, generator=gen) * 4)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    expected = torch.nn.functional.linear(
        int8_per_token(x), (weight.float() * scale[:, None]).bfloat16(), layer.bias
    )
    assert torch.equal(layer(x), expected)
