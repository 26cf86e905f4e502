"""The host KV tier on CUDA (--kv-offload-gb): pinned host slots, copies on a side stream
ordered against the step in flight (engine_core/kv_offload_pool.py). The CPU tests
(tests/test_kv_offload_engine.py) check the bookkeeping with synchronous copies; here the same
evictions and restores run through the CUDA path, with the overlapped loop and CUDA graphs on,
against HF transformers' tokens and the engine without a tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_core.llm import LLM
from protocol.messages import SamplingParams
from tests.test_kv_offload_engine import (
    GREEDY,
    HOST_BLOCKS,
    hf_greedy,
    prompts,
    scheduled_tokens,
    tiny_llm,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_an_evicted_prefix_comes_back_from_pinned_host_memory(tiny_llama: Path) -> None:
    shared, *fillers = prompts(4, 20, seed=11)
    expected = hf_greedy(tiny_llama, shared, GREEDY.max_tokens)
    llm = tiny_llm(tiny_llama, 12, HOST_BLOCKS, device="cuda", dtype="float32")
    pool = llm.engine.runner.host_kv
    assert pool is not None and pool.host.is_pinned()
    first = scheduled_tokens(llm, shared)
    for filler in fillers:
        scheduled_tokens(llm, filler)
    again = scheduled_tokens(llm, shared)
    decode_tokens = GREEDY.max_tokens - 1
    assert first == (expected, 20 + decode_tokens, 0, 0)
    assert again == (expected, 4 + decode_tokens, 0, 16)  # 4 blocks restored, not computed


def test_many_requests_through_a_small_pool_give_the_tokens_of_a_large_one(
    tiny_llama: Path,
) -> None:
    """Shared prefixes through 16 device blocks and 6 host slots, preemptions, restores and
    evictions in the same steps, the overlapped loop running ahead: every request's tokens are
    those of an engine that never evicts, and nothing leaks."""
    rng = random.Random(3)
    heads = prompts(4, 12, seed=5)
    batch = [heads[i % 4] + prompts(1, rng.randrange(2, 9), seed=100 + i)[0] for i in range(24)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(tiny_llama), device="cuda", dtype="float32", block_size=4, num_kv_blocks=400)
    expected = [o.token_ids for o in roomy.generate(batch, params, detokenize=False)]
    del roomy
    llm = tiny_llm(tiny_llama, 16, 6, device="cuda", dtype="float32", max_model_len=64)
    for _ in range(2):  # the second round meets prefixes in both tiers
        outs = llm.generate(batch, params, detokenize=False)
        assert [o.token_ids for o in outs] == expected
    core = llm.engine
    bm = core.scheduler.block_manager
    assert bm.host_tier is not None and bm.host_tier.num_restored > 0
    bm.check_integrity()
    assert bm.num_used_blocks == 0
