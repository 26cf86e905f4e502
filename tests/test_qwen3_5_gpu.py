"""Qwen3.5 on a GPU: the tiny dense CausalLM and MoE ConditionalGeneration models of
tests/test_models_qwen3_5.py through the engine on CUDA (float32, decode CUDA graphs on, FLA's
prompt kernels where installed, our in-place decode kernel) give HF's greedy tokens, batched and
chunked. The projections' layout is the only difference from Qwen3-Next, whose kernels
tests/test_qwen3_next_gpu.py and tests/test_graph_groups_gpu.py hold to the torch path::

    .venv/bin/python -m pytest tests/test_qwen3_5_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from transformers import (  # noqa: E402
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5TextConfig,
)

from engine_core.llm import LLM  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests.paged_harness import hf_greedy, random_prompts, randomize  # noqa: E402
from tests.test_models_qwen3_5 import VISION, VOCAB, text_fields  # noqa: E402

NEW_TOKENS = 16


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-vl"])
def test_engine_on_cuda_gives_hf_greedy_tokens(tmp_path: Path, moe: bool) -> None:
    """Three prompts under a 40-token budget (the longest in four chunks), decoded together
    from CUDA graphs; heads of 16 dims, as FLA's kernels take."""
    fields = text_fields(moe) | {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    torch.manual_seed(0)
    if moe:
        config = Qwen3_5MoeConfig(text_config=fields, vision_config=VISION)
        hf_model: torch.nn.Module = Qwen3_5MoeForConditionalGeneration(config)
    else:
        hf_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))
    randomize(hf_model.eval(), 0)
    hf_model.save_pretrained(tmp_path)
    hf_model.to("cuda")  # where fla is installed HF may take its kernels: CUDA tensors only
    prompts = random_prompts(VOCAB, (150, 97, 5))
    want = [hf_greedy(hf_model, prompt, NEW_TOKENS).tokens[0] for prompt in prompts]
    llm = LLM(
        str(tmp_path), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
        max_model_len=400, max_num_batched_tokens=40, max_num_seqs=4,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        got = llm.generate(prompts, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [out.token_ids for out in got] == want
