"""gpt-oss under tensor parallelism over gloo on the CPU: TP=2 gives HF transformers' greedy
tokens and logprobs with MXFP4 experts (against HF on the dequantized weights, which
tests/test_models_gpt_oss.py shows TP=1 matches); bf16 experts' shares sum to the whole layer
(the GPU file runs bf16 through the engine at TP=2).

The single-rank tests' tiny model (sliding layers of window 8 beside full ones, sinks near 1,
q/k/v/o biases, 4 experts with biases, a clamp that bites): 4 heads and 2 KV heads, so each rank
keeps 2 heads with their sinks; expert width 64, so each rank keeps 32 columns of down, one
whole MXFP4 block. Every bias is random, so a bias added on both ranks would show.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_core.loader import load_model_config
from engine_core.models.gpt_oss_moe import GptOssMoE
from engine_core.parallel import TPGroup
from tests.paged_harness import random_prompts
from tests.test_models_gpt_oss import VOCAB, make_hf_model, write_mxfp4_checkpoint
from tests.tp_cases import assert_same_greedy, engine_greedy, hf_reference

NEW_TOKENS = 8
# Past the window of 8; the 23-token one in two chunks beside the other's decodes.
PROMPTS = random_prompts(VOCAB, (11, 23))


def test_bf16_expert_shares_sum_to_the_whole_layer(tmp_path: Path) -> None:
    """bf16 experts (the engine test below runs MXFP4 ones): the two ranks' shares, cut from
    the layer's tensors as the loader cuts a checkpoint's, sum to the single-rank layer's
    output, b2 counted once. No engine: the sum is the all-reduce's."""
    make_hf_model().save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    torch.manual_seed(0)
    whole = GptOssMoE(config)
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    shares = [GptOssMoE(config, TPGroup(rank=rank, size=2)) for rank in (0, 1)]
    for share in shares:
        with torch.no_grad():
            for name, param in share.named_parameters():
                full = whole.get_parameter(name)
                param.copy_(
                    full
                    if name.startswith("router.")
                    else share.narrow_checkpoint(name, full, None)
                )
    x = torch.randn(9, config.hidden_size)
    summed = sum(share.local_experts(x) for share in shares)
    torch.testing.assert_close(summed, whole(x), atol=1e-5, rtol=0)


def test_tp2_mxfp4_matches_dequantized_hf(tmp_path: Path) -> None:
    reference = write_mxfp4_checkpoint(make_hf_model(), tmp_path)
    got = engine_greedy(tmp_path, PROMPTS, NEW_TOKENS, tp=2)
    assert_same_greedy(got, hf_reference(reference, PROMPTS, NEW_TOKENS))


def test_mxfp4_split_inside_a_block_is_refused(tmp_path: Path) -> None:
    """Width 64 over 4 ranks is 16 columns each: half a 32-value block, refused by name."""
    make_hf_model().save_pretrained(tmp_path)
    config = dataclasses.replace(load_model_config(tmp_path), expert_format="mxfp4")
    with pytest.raises(ValueError, match=r"size 4 does not split intermediate_size 64 on block"):
        GptOssMoE(config, TPGroup(rank=0, size=4))


def test_expert_parallelism_is_refused(tmp_path: Path) -> None:
    make_hf_model().save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    with pytest.raises(ValueError, match="--enable-expert-parallel: gpt-oss"):
        GptOssMoE(config, TPGroup(rank=0, size=2, expert_parallel=True))
