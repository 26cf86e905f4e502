"""gpt-oss and DeepSeek-V3 through the real engine on the CPU (``engine_core.llm.LLM``): the
scheduler's batches, chunked prefills, the block manager's prefix cache and the runner's caches
(MLA's latent rows, allocated per layer), against HF transformers' greedy tokens.

The first call runs three prompts together (the longest past gpt-oss's window of 8) with a
small token budget, so prompts are chunked and prefill beside other requests' decodes; the
second sends a prompt sharing its first 20 tokens with one of them, whose blocks the prefix
cache must hand over (counted) without changing the tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.llm import LLM
from protocol.messages import SamplingParams
from tests import test_models_deepseek, test_models_gpt_oss
from tests.paged_harness import hf_greedy

NEW_TOKENS = 16
MAKERS = {
    "gpt_oss": test_models_gpt_oss.make_hf_model,
    "deepseek_v3": lambda: test_models_deepseek.make_hf_model("v3"),
}
PROMPTS = test_models_gpt_oss.PROMPTS  # lengths 5, 11 and 23


@pytest.mark.parametrize("name", list(MAKERS))
def test_engine_batches_and_prefix_cache_match_hf(name: str, tmp_path: Path) -> None:
    hf_model = MAKERS[name]()
    hf_model.save_pretrained(tmp_path)
    shared = PROMPTS[2][:20] + [7, 8, 9]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in [*PROMPTS, shared]]
    llm = LLM(
        str(tmp_path),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        first = llm.generate(PROMPTS, params, detokenize=False)
        assert [o.token_ids for o in first] == expected[:3]
        hits_before = llm.engine.scheduler.counts().prefix_cache_hits
        second = llm.generate([shared], params, detokenize=False)
        assert second[0].token_ids == expected[3]
        assert llm.engine.scheduler.counts().prefix_cache_hits - hits_before >= 20
    finally:
        llm.engine.shutdown()


def test_mla_engine_allocates_latent_caches(tmp_path: Path) -> None:
    """The runner gives each MLA layer one [blocks, block_size, R + P] cache, nothing per
    head."""
    test_models_deepseek.make_hf_model("v3").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), block_size=4, num_kv_blocks=8, max_model_len=32)
    try:
        caches = llm.engine.runner.kv_cache
        assert isinstance(caches, list) and len(caches) == 3
        assert all(c.shape == (8, 4, 32 + 8) and c.dtype == torch.float32 for c in caches)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", list(MAKERS))
def test_speculation_keeps_hf_greedy_tokens(name: str, tmp_path: Path) -> None:
    """n-gram drafts on a window-and-sinks model and on the latent cache: the rejected drafts'
    rows (K/V or latent) are written over by the next step, so the tokens stay HF's."""
    hf_model = MAKERS[name]()
    hf_model.save_pretrained(tmp_path)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], PROMPTS[2]]
    expected = [hf_greedy(hf_model, p, 24).tokens[0] for p in prompts]
    draft = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    llm = LLM(
        str(tmp_path), block_size=4, num_kv_blocks=80, max_model_len=128, speculative_config=draft
    )
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        got = llm.generate(prompts, params, detokenize=False)
        assert [o.token_ids for o in got] == expected
        assert llm.engine.scheduler.counts().spec_draft_tokens > 0
    finally:
        llm.engine.shutdown()
