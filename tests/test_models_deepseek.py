"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeekMoE) against HF transformers.

Tiny random models shaped like the real ones (a low-rank q or a single q projection, a small KV
latent and rotary key, YaRN with DeepSeek's mscale, grouped sigmoid routing with a correction
bias or softmax routing, shared experts, a first dense layer) are saved with ``save_pretrained``
and loaded through our loader. Greedy generation over the paged latent cache must give HF
``generate(do_sample=False)``'s tokens with the logits within atol 1e-4 (float32), batched,
chunked and from another sequence's cached blocks; the absorbed decode path must equal the
expanded one it replaces.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, PretrainedConfig

from engine_core.attention.mla import LatentAttention
from engine_core.loader import load_model_config
from engine_core.memory_plan import kv_block_bytes
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
from tests.test_models_moe import generate_after_cached_prefix

ATOL = 1e-4
NEW_TOKENS = 24
VOCAB = 320
MLA = {
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
SIZES = tiny_hf_sizes(VOCAB) | {"num_hidden_layers": 3, "intermediate_size": 96, **MLA}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 16,
}
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "v3": lambda: DeepseekV3Config(
        **SIZES, **MOE, q_lora_rank=48, n_group=4, topk_group=2, rope_parameters=YARN,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    "v3_plain_rope": lambda: DeepseekV3Config(
        **SIZES, **MOE, q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
        routed_scaling_factor=1.5, norm_topk_prob=False,
    ),
    "v2_lite": lambda: DeepseekV2Config(**SIZES, **MOE, q_lora_rank=None),
    "v2_grouped": lambda: DeepseekV2Config(
        **SIZES, **MOE, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=2.0, rope_parameters=YARN,
    ),
}  # fmt: skip
# Lengths 5, 11 and 23: partial, multiple and many blocks of 4.
PROMPTS = random_prompts(VOCAB, (5, 11, 23))


def make_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Random weights; V3's router correction bias random too (HF zeroes it), so it moves the
    choice of experts."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFCase:
    folder = tmp_path_factory.mktemp(request.param)
    return save_hf_case(request.param, make_hf_model(request.param), PROMPTS, folder, NEW_TOKENS)


def test_greedy_matches_hf(case: HFCase) -> None:
    got = generate_greedy(load_float32(case.folder), PROMPTS, NEW_TOKENS, block_size=4)
    assert_matches(got, case.reference, ATOL)


def test_mixed_batches_match_hf(case: HFCase) -> None:
    """Prompt chunks beside other sequences' decodes (absorbed), on shuffled blocks."""
    got = generate_greedy(
        load_float32(case.folder),
        PROMPTS,
        NEW_TOKENS,
        prefill_chunk=5,
        stagger=3,
        shuffle_blocks=True,
    )
    assert_matches(got, case.reference, ATOL)


def test_prefix_cached_prefill_matches_hf(case: HFCase) -> None:
    """A prompt that starts from another sequence's cached latent blocks."""
    prompt = PROMPTS[2][:20] + [7, 8, 9]
    got = generate_after_cached_prefix(load_float32(case.folder), PROMPTS[2], prompt, NEW_TOKENS)
    ref = hf_greedy(case.hf_model, prompt, NEW_TOKENS)
    assert got.tokens[0] == ref.tokens[0]
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=ATOL, rtol=0)


def test_absorbed_decode_equals_expanded(case: HFCase) -> None:
    """The same decodes through the expanded path (every layer's absorb_decode off) give the
    same logits within float32 rounding."""
    absorbed = generate_greedy(load_float32(case.folder), PROMPTS, 8)
    model = load_float32(case.folder)
    for layer in model.attention_layers():
        assert isinstance(layer, LatentAttention)
        layer.absorb_decode = False
    expanded = generate_greedy(model, PROMPTS, 8)
    assert absorbed.tokens == expanded.tokens
    for a, b in zip(absorbed.logits, expanded.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_latent_cache_is_per_token_not_per_head(case: HFCase) -> None:
    """The cache holds kv_lora_rank + qk_rope_head_dim values per token and layer, and the
    memory plan counts exactly that."""
    config = load_model_config(case.folder)
    model = load_float32(case.folder)
    layer = model.attention_layers()[0]
    assert layer.cache_shapes(10, 4) == [(10, 4, 32 + 8)]
    per_block = kv_block_bytes(config, config.num_kv_heads, 4, torch.bfloat16)
    assert per_block == 4 * 3 * (32 + 8) * 2


def test_router_bias_groups_and_mscale_are_exercised(tmp_path: Path) -> None:
    """V3's correction bias, its group limit, YaRN's softmax mscale and the shared experts each
    change the output, or matching HF proves nothing about them."""
    hf_model = make_hf_model("v3")
    hf_model.save_pretrained(tmp_path)
    ref = hf_greedy(hf_model, PROMPTS[-1], 4)
    for undo in (zero_router_bias, drop_group_limit, drop_mscale, drop_shared_experts):
        model = load_float32(tmp_path)
        undo(model)
        got = generate_greedy(model, PROMPTS[-1:], 4)
        assert (got.logits[0] - ref.logits[0]).abs().max() > 100 * ATOL, undo.__name__


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "router_kind")]


def zero_router_bias(model: torch.nn.Module) -> None:
    for moe in moe_layers(model):
        moe.e_score_correction_bias.data.zero_()


def drop_group_limit(model: torch.nn.Module) -> None:
    for moe in moe_layers(model):
        moe.topk_group = moe.n_group


def drop_mscale(model: torch.nn.Module) -> None:
    for layer in model.attention_layers():
        layer.scale = (16 + 8) ** -0.5


def drop_shared_experts(model: torch.nn.Module) -> None:
    for moe in moe_layers(model):
        moe.shared_experts = None


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("v3", {"quantization_config": AWQ}, "quant_method 'awq'"),
        ("v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("v3", {"n_group": 3}, "n_group"),
        ("v2_lite", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("v2_lite", {"topk_method": "noaux_tc"}, "topk_method"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    name: str, change: dict, field: str, tmp_path: Path
) -> None:
    """Quantization formats other than FP8 (tests/test_fp8_moe.py loads V3's) and routing we
    do not implement are refused at start-up, naming the field."""
    make_hf_model(name).config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_model_config(tmp_path)
