"""MoE models through the engine on a GPU: the fused Triton path (one-launch router and
grouping, the two expert kernels, the combine) inside CUDA graphs gives HF transformers' greedy
tokens for the tiny random Mixtral and Qwen3-MoE of tests/test_models_moe.py, in float32; and
so does the one-token path (one prompt alone: its decode steps route and run one token at a
time), after which every layer's router arrival count is back at zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from engine_core.models.moe import SparseMoE  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests.paged_harness import hf_greedy  # noqa: E402
from tests.test_models_moe import NEW_TOKENS, PROMPTS, make_hf_model  # noqa: E402


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalised"])
def test_moe_engine_on_the_gpu_gives_hf_greedy_tokens(name: str, tmp_path: Path) -> None:
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    want = [hf_greedy(hf_model, prompt, NEW_TOKENS).tokens[0] for prompt in PROMPTS]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=128,
              num_kv_blocks=64)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        got = llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [out.token_ids for out in got] == want


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_engine_decoding_one_sequence_gives_hf_greedy_tokens(name: str, tmp_path: Path) -> None:
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=128,
              num_kv_blocks=64)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        for prompt in PROMPTS[:2]:  # one at a time: batch-1 decode steps (CUDA graphs)
            want = hf_greedy(hf_model, prompt, NEW_TOKENS).tokens[0]
            assert llm.generate([prompt], params, detokenize=False)[0].token_ids == want
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert layers and all(int(m.router_arrived.item()) == 0 for m in layers)
    finally:
        llm.engine.shutdown()
