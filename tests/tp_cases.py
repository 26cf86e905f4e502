"""Shared by the tensor-parallel model tests: HF's greedy reference with the chosen tokens'
logprobs, and one engine's greedy run at a tensor-parallel size over gloo on the CPU, with a
16-token step budget so longer prompts are chunked beside other sequences' decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine_core.llm import LLM
from protocol.messages import SamplingParams
from tests.paged_harness import hf_greedy

Greedy = tuple[list[list[int]], torch.Tensor]  # tokens per prompt; their logprobs [P, N]


def hf_reference(model: nn.Module, prompts: list[list[int]], new_tokens: int) -> Greedy:
    """HF generate's greedy tokens for each prompt and the log-softmax of each chosen one."""
    tokens, logprobs = [], []
    for prompt in prompts:
        ref = hf_greedy(model, prompt, new_tokens)
        chosen = torch.tensor(ref.tokens[0])[:, None]
        tokens.append(ref.tokens[0])
        logprobs.append(ref.logits[0].log_softmax(-1).gather(1, chosen)[:, 0])
    return tokens, torch.stack(logprobs)


def engine_greedy(
    folder: Path, prompts: list[list[int]], new_tokens: int, tp: int, **settings: Any
) -> Greedy:
    """The engine's greedy tokens and their logprobs at tensor-parallel size ``tp``;
    ``settings`` override the engine's (a device, a block size)."""
    defaults: dict[str, Any] = {
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_model_len": 64,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
    }
    llm = LLM(str(folder), tensor_parallel_size=tp, **(defaults | settings))
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    logprobs = torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs])
    return [o.token_ids for o in outs], logprobs


def assert_same_greedy(got: Greedy, expected: Greedy) -> None:
    """Equal tokens, and the logprobs behind them within float32 rounding."""
    assert got[0] == expected[0]
    torch.testing.assert_close(got[1], expected[1], atol=1e-4, rtol=0)


def assert_same_greedy_quantized(
    got: Greedy, expected: Greedy, atol: float = 1e-4, bound: float = 0.5
) -> None:
    """For activations quantized at run time (tests/quant_fixtures.py
    ``assert_matches_quantized``): equal tokens, most logprobs within ``atol`` and all within
    ``bound``; a sum in another order now and then puts an activation on the other side of a
    rounding boundary, one quantization step apart, and the KV cache carries it on."""
    assert got[0] == expected[0]
    diffs = (got[1] - expected[1]).abs()
    assert float((diffs <= atol).float().mean()) >= 0.5, f"logprob differences {diffs.tolist()}"
    assert float(diffs.max()) <= bound, f"logprob differences {diffs.tolist()}"
