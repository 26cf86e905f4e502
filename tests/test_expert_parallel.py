"""Expert parallelism over gloo on the CPU: ``--enable-expert-parallel`` with TP=2 holds half of
the experts, whole, on each rank, exchanges tokens with all-to-alls (models/expert_dispatch.py),
and gives TP=1's (and HF's) greedy tokens and logprobs; with TP=4, a quarter of them each.

The models are tests/test_tensor_parallel.py's tiny random Mixtral (6 experts, top 2) and
Qwen3-MoE (8 experts, top 2, a dense layer between two sparse ones, whose MLP stays split by
width), with the same prompts: mixed prefills, chunks, a prefix hit and decodes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig

from engine_core.config import EngineConfig
from engine_core.llm import LLM
from engine_core.models.moe import SparseMoE
from protocol.messages import SamplingParams
from tests.paged_harness import hf_greedy
from tests.test_tensor_parallel import (
    ENGINE_ARGS,
    NEW_TOKENS,
    PROMPTS,
    SIZES,
    children_running_spawn,
    write_model,
)

MOE_MODELS = ["mixtral", "qwen3_moe"]


def generate(
    folder: Path, tp: int, expert_parallel: bool
) -> tuple[list[list[int]], list[list[float]], LLM]:
    llm = LLM(
        str(folder),
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        **ENGINE_ARGS,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, detokenize=False)
    tokens = [o.token_ids for o in outs]
    return tokens, [[lp.logprob for lp in o.logprobs] for o in outs], llm


@pytest.mark.parametrize("name", MOE_MODELS)
def test_ep2_matches_tp1_and_hf_and_holds_half_the_experts(name: str, tmp_path: Path) -> None:
    hf_model = write_model(name, tmp_path)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    tokens1, logprobs1, llm1 = generate(tmp_path, tp=1, expert_parallel=False)
    llm1.engine.shutdown()
    tokens2, logprobs2, llm2 = generate(tmp_path, tp=2, expert_parallel=True)
    try:
        moes = [m for m in llm2.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        hf_experts = hf_layer_experts(hf_model)
        assert moes and len(moes) == len(hf_experts)
        for moe, (gate, up, down) in zip(moes, hf_experts, strict=True):
            half = gate.shape[0] // 2  # rank 0: experts [0, E/2), at their full width
            assert moe.w13.shape[0] == half and moe.w13.shape[1] == 2 * gate.shape[1]
            torch.testing.assert_close(moe.w13.data, torch.cat([gate, up], dim=1)[:half])
            torch.testing.assert_close(moe.w2.data, down[:half])
    finally:
        llm2.engine.shutdown()
    assert tokens1 == reference
    assert tokens2 == tokens1
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-4, rtol=0)


def test_ep2_serves_llama4_like_tp1(tmp_path: Path) -> None:
    """Llama 4's MoE (top-1, the score on the expert's input, a shared expert that stays split
    by width) with half of the experts on each rank: TP=1's and HF's tokens."""
    hf_model = write_model("llama4", tmp_path)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    tokens1, logprobs1, llm1 = generate(tmp_path, tp=1, expert_parallel=False)
    llm1.engine.shutdown()
    tokens2, logprobs2, llm2 = generate(tmp_path, tp=2, expert_parallel=True)
    try:
        moes = [m for m in llm2.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert moes and all(moe.w13.shape[0] == 2 for moe in moes)  # 2 of the 4 experts
    finally:
        llm2.engine.shutdown()
    assert tokens1 == reference
    assert tokens2 == tokens1
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-4, rtol=0)


def test_ep4_with_uneven_token_slices_gives_hf_tokens(tmp_path: Path) -> None:
    """Four ranks, two of the Qwen3-MoE's eight experts each. The steps hold chunks of up to 16
    tokens beside decodes of one to four rows, so the ranks' token slices are uneven and in the
    small steps, and a request alone, the last ranks route no token (they still serve their
    experts)."""
    sizes = SIZES | {"num_hidden_layers": 3, "num_key_value_heads": 4}
    config = Qwen3MoeConfig(
        **sizes,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    hf_model = write_model("", tmp_path, config)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    _, logprobs1, llm1 = generate(tmp_path, tp=1, expert_parallel=False)
    llm1.engine.shutdown()
    tokens, logprobs, llm = generate(tmp_path, tp=4, expert_parallel=True)
    try:
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert len(moes) == 2 and all(moe.w13.shape[0] == 2 for moe in moes)
        # Alone (its prompt cached but the last token): steps of one token, on rank 0's slice.
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        alone = llm.generate(PROMPTS[:1], params, detokenize=False)[0].token_ids
    finally:
        llm.engine.shutdown()
    assert tokens == reference
    assert alone == reference[0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(logprobs1), atol=1e-4, rtol=0)


def hf_layer_experts(hf_model: torch.nn.Module) -> list[tuple[torch.Tensor, ...]]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) of each sparse layer of the HF model."""
    out = []
    for layer in hf_model.model.layers:
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        experts = getattr(block, "experts", None)
        if experts is None:
            continue  # a dense layer
        if hasattr(experts, "gate_up_proj"):  # transformers 5: stacked [E, 2I, H], [E, H, I]
            gate, up = experts.gate_up_proj.data.chunk(2, dim=1)
            out.append((gate, up, experts.down_proj.data))
            continue
        names = ("w1", "w3", "w2") if hasattr(experts[0], "w1") else ("gate_proj", "up_proj")
        parts = [torch.stack([getattr(e, n).weight.data for e in experts]) for n in names[:2]]
        down = "w2" if names[0] == "w1" else "down_proj"
        out.append((*parts, torch.stack([getattr(e, down).weight.data for e in experts])))
    return out


def test_experts_that_do_not_split_over_the_ranks_are_refused(tmp_path: Path) -> None:
    config = MixtralConfig(**SIZES, num_local_experts=5, num_experts_per_tok=2)
    write_model("", tmp_path, config)
    with pytest.raises(ValueError, match=r"does not divide: number of experts \(num_experts\) \(5"):
        LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE_ARGS)
    assert children_running_spawn(os.getpid()) == []


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    write_model("llama", tmp_path)
    with pytest.raises(ValueError, match="--enable-expert-parallel is for mixture-of-experts"):
        LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE_ARGS)


def test_expert_parallel_needs_several_ranks() -> None:
    with pytest.raises(ValueError, match="needs --tensor-parallel-size > 1"):
        EngineConfig(enable_expert_parallel=True)
