"""DeepSeek under tensor parallelism over gloo on the CPU: TP=2 gives HF transformers' greedy
tokens and logprobs (TP=1's equal HF's in tests/test_models_deepseek.py).

A tiny V3 (low-rank q, YaRN with DeepSeek's mscale, grouped sigmoid routing with a random
correction bias, a shared expert, a first dense layer) with 4 heads: each rank keeps 2 heads'
q_b/kv_b rows and o columns, the whole latent, half of every expert's width. One TP=2 engine
runs the batch, with a 16-token step budget, so the 23-token prompt is chunked beside decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DeepseekV3Config

from engine_core.loader import load_model_config
from engine_core.models.deepseek import MlaAttention
from engine_core.parallel import TPGroup
from tests.factories import tiny_hf_sizes
from tests.paged_harness import random_prompts, randomize
from tests.tp_cases import Greedy, assert_same_greedy, engine_greedy, hf_reference

VOCAB = 320
NEW_TOKENS = 8
PROMPTS = random_prompts(VOCAB, (5, 11, 23))
MLA = {
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
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


def v3_config() -> DeepseekV3Config:
    return DeepseekV3Config(
        **(tiny_hf_sizes(VOCAB) | {"num_hidden_layers": 2, "intermediate_size": 96} | MLA),
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=48,
        n_group=4,
        topk_group=2,
        rope_parameters=YARN,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def hf_model() -> nn.Module:
    """Random weights; the router's correction bias random too (HF zeroes it), so it moves the
    choice of experts."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(v3_config()).eval()
    randomize(model, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Greedy]:
    """The model saved once, and HF's greedy tokens and logprobs for PROMPTS."""
    model = hf_model()
    folder = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(folder)
    return folder, hf_reference(model, PROMPTS, NEW_TOKENS)


def test_tp2_matches_hf(saved: tuple[Path, Greedy]) -> None:
    folder, reference = saved
    assert_same_greedy(engine_greedy(folder, PROMPTS, NEW_TOKENS, tp=2), reference)


def test_heads_that_do_not_split_are_refused(
    saved: tuple[Path, Greedy],
) -> None:
    """4 heads over 3 ranks: refused by name, with both sizes, as the layer is built."""
    config = load_model_config(saved[0])
    with pytest.raises(ValueError, match=r"size 3 does not divide .*attention heads \(4\)"):
        MlaAttention(config, TPGroup(rank=0, size=3))
