"""On the GPU: the overlapped loop (device-resident sampled ids, pinned ring buffers, CUDA
graphs) gives exactly the tokens of the simple loop."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.llm import LLM
from protocol.messages import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_overlap_matches_simple_loop_on_gpu() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 90))] for _ in range(24)]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    ]
    per_prompt = [params[i % 2] for i in range(len(prompts))]
    results = {}
    for overlap in (True, False):
        llm = LLM(
            "random:smollm2-135m", async_scheduling=overlap, max_model_len=512, dtype="float32"
        )
        outs = llm.generate(prompts, per_prompt, detokenize=False)
        results[overlap] = [o.token_ids for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert results[True] == results[False]
