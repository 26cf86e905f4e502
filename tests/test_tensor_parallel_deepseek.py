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
from transformers import AutoModelForCausalLM, DeepseekV3Config

from engine_core.llm import LLM
from engine_core.loader import load_model_config
from engine_core.models.deepseek import MlaAttention
from engine_core.parallel import TPGroup
from protocol.messages import SamplingParams
from tests.factories import tiny_hf_sizes
from tests.paged_harness import hf_greedy, random_prompts, randomize

VOCAB = 320
NEW_TOKENS = 12
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


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[list[int]], list[list[float]]]:
    """The model saved once; HF's greedy tokens and their logprobs for PROMPTS."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(v3_config()).eval()
    randomize(model, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF zeroes the router's correction bias; random, it moves choices
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    folder = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(folder)
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ref = hf_greedy(model, prompt, NEW_TOKENS)
        tokens.append(ref.tokens[0])
        chosen = torch.tensor(ref.tokens[0])[:, None]
        logprobs.append(ref.logits[0].log_softmax(-1).gather(1, chosen)[:, 0].tolist())
    return folder, tokens, logprobs


def test_tp2_matches_hf(saved: tuple[Path, list[list[int]], list[list[float]]]) -> None:
    folder, tokens, logprobs = saved
    llm = LLM(
        str(folder),
        tensor_parallel_size=2,
        block_size=4,
        num_kv_blocks=64,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
        outs = llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outs] == tokens
    got = torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs])
    torch.testing.assert_close(got, torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_heads_that_do_not_split_are_refused(
    saved: tuple[Path, list[list[int]], list[list[float]]],
) -> None:
    """4 heads over 3 ranks: refused by name, with both sizes, as the layer is built."""
    config = load_model_config(saved[0])
    with pytest.raises(ValueError, match=r"size 3 does not divide .*attention heads \(4\)"):
        MlaAttention(config, TPGroup(rank=0, size=3))
