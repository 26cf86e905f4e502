"""gpt-oss against HF transformers on the same random weights, bf16 experts and MXFP4 ones.

A tiny GptOssForCausalLM shaped like the real one (sliding-window layers of window 8 alternating
with full ones, attention sinks, q/k/v/o biases, YaRN with a short original context so the
scaling reaches the frequencies these prompts use, 4 experts with biases, a SwiGLU limit low
enough that the clamp bites) is saved with ``save_pretrained`` and loaded through our loader.
Greedy generation over the paged KV cache, with prompts longer than the window, must give HF
``generate(do_sample=False)``'s tokens with the logits within atol 1e-4 (float32).

MXFP4: the same model's experts quantized by the reference quantizer (models/mxfp4.py) and
written in the published layout (``*_blocks`` [E, rows, cols / 32, 16], ``*_scales``
[E, rows, cols / 32], gate and up rows interleaved, ``quantization_config`` as openai/gpt-oss
ships it) must load, stay MXFP4 in memory, and match HF running the dequantized weights (which
MXFP4 represents exactly) within the same atol.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from engine_core.loader import load_model_config
from engine_core.models import mxfp4
from engine_core.models.gpt_oss_moe import GptOssMoE
from tests.factories import tiny_hf_sizes
from tests.paged_harness import (
    HFCase,
    assert_matches,
    generate_greedy,
    hf_greedy,
    load_float32,
    random_prompts,
    randomize,
    save_hf_case,
)

ATOL = 1e-4
NEW_TOKENS = 24
VOCAB = 320
WINDOW = 8
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
# Lengths 5, 11 and 23: within, past and far past the window of 8.
PROMPTS = random_prompts(VOCAB, (5, 11, 23))
PUBLISHED_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def gpt_oss_config() -> GptOssConfig:
    sizes = tiny_hf_sizes(VOCAB) | {"num_hidden_layers": 4, "intermediate_size": 64}
    return GptOssConfig(
        **sizes,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        rope_parameters=YARN,
        swiglu_limit=0.5,
        tie_word_embeddings=False,
    )


def make_hf_model(seed: int = 0) -> torch.nn.Module:
    """Random weights; the sinks near 1 in size, so they weigh in every softmax."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gpt_oss_config()).eval()
    randomize(model, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(10)
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> HFCase:
    folder = tmp_path_factory.mktemp("gpt_oss")
    return save_hf_case("gpt_oss", make_hf_model(), PROMPTS, folder, NEW_TOKENS)


def test_config_reads_the_real_shape(case: HFCase) -> None:
    config = load_model_config(case.folder)
    assert config.architecture == "gpt_oss"
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_scaling["attention_factor"] == pytest.approx(0.1 * 1.3862943611 + 1)
    assert config.attention_sinks and config.expert_format == "dense"


def test_greedy_matches_hf(case: HFCase) -> None:
    """All prompts prefilled in one flattened batch, then decoded together."""
    model = load_float32(case.folder)
    assert not model.model.layers[0].mlp.cuda_graph_safe  # bf16 experts: grouped on the host
    got = generate_greedy(model, PROMPTS, NEW_TOKENS, block_size=4)
    assert_matches(got, case.reference, ATOL)


def test_mixed_batches_match_hf(case: HFCase) -> None:
    """Staggered starts and 5-token chunks: prompt chunks beside other sequences' decodes, on
    shuffled blocks."""
    got = generate_greedy(
        load_float32(case.folder),
        PROMPTS,
        NEW_TOKENS,
        prefill_chunk=5,
        stagger=3,
        shuffle_blocks=True,
    )
    assert_matches(got, case.reference, ATOL)


def test_sinks_window_and_clamp_are_exercised(case: HFCase) -> None:
    """Each feature must change the output, or matching HF proves nothing about it."""
    for undo in (drop_sinks, drop_window, drop_clamp):
        model = load_float32(case.folder)
        undo(model)
        got = generate_greedy(model, PROMPTS[-1:], 4)
        assert (got.logits[0] - case.reference[2].logits[0][:4]).abs().max() > 100 * ATOL


def drop_sinks(model: torch.nn.Module) -> None:
    for attn in model.attention_layers():
        attn.sinks = None


def drop_window(model: torch.nn.Module) -> None:
    for attn in model.attention_layers():
        attn.sliding_window = None


def drop_clamp(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.mlp.limit = 1e9


# ---- MXFP4 ------------------------------------------------------------------------------------


def write_mxfp4_checkpoint(hf_model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """Save ``hf_model`` with its experts as published MXFP4 (HF's [E, in, out] weights
    quantized along ``in`` for each output row), and return a copy of it whose experts hold the
    dequantized values: the bf16 reference the MXFP4 model must match."""
    hf_model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2)  # [E, out, in], as published
        blocks, scales = mxfp4.quantize(weight)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = PUBLISHED_QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized_copy(hf_model, tensors)


def dequantized_copy(
    hf_model: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> torch.nn.Module:
    reference = AutoModelForCausalLM.from_config(gpt_oss_config()).eval()
    reference.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                prefix = f"model.layers.{i}.mlp.experts.{proj}"
                blocks = tensors[f"{prefix}_blocks"].flatten(-2)
                weight = mxfp4.dequantize(blocks, tensors[f"{prefix}_scales"], torch.float32)
                getattr(layer.mlp.experts, proj).copy_(weight.transpose(1, 2))
    return reference


def test_mxfp4_checkpoint_matches_dequantized_reference(tmp_path: Path) -> None:
    reference = write_mxfp4_checkpoint(make_hf_model(), tmp_path)
    model = load_float32(tmp_path)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, GptOssMoE) and moe.mxfp4
    assert moe.w13_blocks.dtype == torch.uint8 and not hasattr(moe, "w13")
    assert moe.cuda_graph_safe  # its CUDA kernels read no host values (bf16's grouping does)
    # 4.25 bits a weight: half a byte each, and one scale byte per 32.
    experts, rows, half_cols = moe.w13_blocks.shape
    assert moe.w13_scales.shape == (experts, rows, 2 * half_cols // 32)
    got = generate_greedy(model, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=3)
    assert_matches(got, [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS], ATOL)


def test_mxfp4_quantizer_round_trips() -> None:
    """Dequantize(quantize(w)) is within half an e2m1 step of w (the scale's largest step is
    2 at magnitude 6, so at most scale / 1 off), and the values it gives quantize to themselves."""
    weights = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4.quantize(weights)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    back = mxfp4.dequantize(blocks.flatten(-2), scales, torch.float32)
    step = torch.exp2(scales.float() - mxfp4.SCALE_BIAS).repeat_interleave(32, dim=-1)
    assert bool(((back - weights).abs() <= step).all())
    again = mxfp4.dequantize(
        *(lambda b, s: (b.flatten(-2), s))(*mxfp4.quantize(back)), torch.float32
    )
    assert torch.equal(again, back)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"group_size": 32}, "quantization_config.group_size"),
        ({"modules_to_not_convert": ["model.layers.*.mlp.experts"]}, "modules_to_not_convert"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({"dequantize": True}, "quantization_config.dequantize"),
        ({"quant_method": "awq"}, "quantization_config.quant_method"),
    ],
)
def test_malformed_mxfp4_configs_are_refused_naming_the_field(
    case: HFCase, tmp_path: Path, change: dict, field: str
) -> None:
    config = json.loads((case.folder / "config.json").read_text())
    config["quantization_config"] = PUBLISHED_QUANTIZATION | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_model_config(tmp_path)
