"""Quantized Qwen3-Next on the CPU against HF transformers: a tiny random ``Qwen3NextForCausalLM``
(the one of tests/test_models_qwen3_next.py) saved with ``save_pretrained``, then written by the
test in the published block-FP8 layout (``quant_method: fp8``, ``weight_block_size``, 16 x 16
here, 128 x 128 there), with what Qwen3-Next-80B-A3B-Instruct-FP8 leaves in bf16 listed in
``modules_to_not_convert``: the linear attention's in_proj_ba, the router and the shared expert's
gate (docs/design/quantization.md, "Hybrid models"). The linear attention's in_proj_qkvz and
out_proj, the full attention's projections, the experts and the shared expert are FP8.

The reference is HF on the dequantized weights (computed by the test, independently of our
code) with the scheme's activation round trip (per token and 16-column group) in front of every
quantized linear and every expert's products (tests/quant_fixtures.py). Our engine (scheduler,
state slots, saved states) gives its greedy tokens for a batch decoding together and for a
prompt resuming at a saved state. A format or layer split not tested is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_core.models import build_model, model_config_from_hf
from engine_core.models.moe import SparseMoE
from tests.paged_harness import load_float32, random_prompts, randomize
from tests.quant_fixtures import (
    LINEARS,
    assert_hf_greedy_up_to_ties,
    e4m3_per_token,
    quantize_expert_inputs,
    quantize_inputs,
)
from tests.test_fp8 import fp8_block_format, write_quantized
from tests.test_models_qwen3_next import NEW_TOKENS, VOCAB, greedy, hf_dict, make_llm, tiny_config

E4M3 = torch.float8_e4m3fn
BLOCK = (16, 16)  # divides every quantized projection of the tiny model (the shared expert's 48)
# The linears the published checkpoint holds in FP8, by leaf name (the shared expert's gate,
# up and down among LINEARS).
FP8_LINEARS = (*LINEARS, "in_proj_qkvz", "out_proj")
LAYERS = tiny_config().num_hidden_layers


def not_converted(layers: int) -> tuple[str, ...]:
    """``modules_to_not_convert`` in the published checkpoint's form: full module names, layer by
    layer, of what stays bf16 (norms and the convolution too, which nothing quantizes anyway)."""
    per_layer = (
        "linear_attn.in_proj_ba", "linear_attn.conv1d", "linear_attn.A_log",
        "linear_attn.dt_bias", "linear_attn.norm", "mlp.gate", "mlp.shared_expert_gate",
        "input_layernorm", "post_attention_layernorm",
    )  # fmt: skip
    names = [f"model.layers.{i}.{part}" for i in range(layers) for part in per_layer]
    return ("lm_head", "model.embed_tokens", *names)


def activations(x: torch.Tensor) -> torch.Tensor:
    return e4m3_per_token(x, BLOCK[1])


@pytest.fixture(scope="module")
def fp8_next(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(the block-FP8 checkpoint, HF on the values it stands for with the activation round
    trip)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    randomize(model, 3)
    root = tmp_path_factory.mktemp("qwen3-next-fp8")
    fmt = fp8_block_format(BLOCK, not_converted(LAYERS))
    write_quantized(model, fmt, root / "fp8", root / "ref", FP8_LINEARS)
    reference = AutoModelForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).eval()
    quantize_inputs(reference, activations, leaves=FP8_LINEARS)
    quantize_expert_inputs(reference, activations)
    return root / "fp8", reference


def test_the_published_layers_are_fp8_and_the_listed_ones_stay_float(
    fp8_next: tuple[Path, torch.nn.Module],
) -> None:
    model = load_float32(fp8_next[0])
    linear, full = model.model.layers[0], model.model.layers[1]
    assert linear.linear_attn.in_proj_qkvz.weight.dtype == E4M3
    assert linear.linear_attn.out_proj.weight.dtype == E4M3
    assert full.self_attn.qkv_proj.weight.dtype == E4M3
    assert linear.linear_attn.in_proj_ba.weight.dtype == torch.float32
    moe = linear.mlp
    assert isinstance(moe, SparseMoE) and moe.w13.dtype == moe.w2.dtype == E4M3
    assert moe.shared_expert.gate_up_proj.weight.dtype == E4M3
    assert moe.shared_expert_gate.weight.dtype == moe.gate.weight.dtype == torch.float32


def test_batched_decode_and_a_prefix_hit_give_hfs_tokens(
    fp8_next: tuple[Path, torch.nn.Module],
) -> None:
    """Three prompts prefilled (one in chunks of 64) and decoded together; then a 150-token
    prompt, and one sharing its first 130 tokens, which resumes at the state saved at 128 and
    computes only what follows. Each continuation is HF's greedy one up to near ties
    (``assert_hf_greedy_up_to_ties`` says why FP8 activations make ties matter)."""
    folder, reference = fp8_next
    llm = make_llm(folder, num_kv_blocks=256, max_num_batched_tokens=64)
    try:
        prompts = random_prompts(VOCAB, (5, 33, 97))
        got = llm.generate(prompts, greedy(), detokenize=False)
        assert [len(out.token_ids) for out in got] == [NEW_TOKENS] * len(prompts)
        for prompt, out in zip(prompts, got, strict=True):
            assert_hf_greedy_up_to_ties(reference, prompt, out.token_ids)
        first = random_prompts(VOCAB, (150,))[0]
        second = first[:130] + random_prompts(VOCAB, (25,))[0]
        alone = llm.generate([first], greedy(), detokenize=False)[0].token_ids
        assert_hf_greedy_up_to_ties(reference, first, alone)
        before = llm.engine.scheduler.counts().prefix_cache_hits
        out = llm.generate([second], greedy(), detokenize=False)[0]
        assert llm.engine.scheduler.counts().prefix_cache_hits - before == 128
        assert_hf_greedy_up_to_ties(reference, second, out.token_ids)
    finally:
        llm.engine.shutdown()


def block_fp8_config(**overrides: object) -> dict[str, object]:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": list(not_converted(LAYERS)),
    } | overrides


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-channel FP8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, "W4A16"),
    ],
    ids=["fp8-per-channel", "awq"],
)
def test_untested_formats_are_refused_by_name(
    quantization_config: dict[str, object], named: str
) -> None:
    hf = hf_dict(quantization_config=quantization_config)
    with torch.device("meta"), pytest.raises(ValueError, match=f"{named}.*not implemented for"):
        build_model(model_config_from_hf(hf))


def test_a_merged_projection_half_in_the_ignore_list_is_refused() -> None:
    """Qwen3.5's in_proj_b and in_proj_a load as one projection: one of them FP8 and the
    other not cannot be run as one."""
    hf = hf_dict(
        architectures=["Qwen3_5MoeForCausalLM"],
        quantization_config=block_fp8_config(
            weight_block_size=[16, 16], modules_to_not_convert=["in_proj_b"]
        ),
    )
    with torch.device("meta"), pytest.raises(ValueError, match="in_proj_b.*in_proj_a"):
        build_model(model_config_from_hf(hf))
