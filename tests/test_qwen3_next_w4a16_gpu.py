"""Qwen3-Next in W4A16 on a GPU: the tiny model of tests/test_qwen3_next_w4a16.py, written in
llm-compressor's published layout (every linear 4-bit but the router and shared-expert gate),
loaded on CUDA in float32: the W4A16 Triton kernels under the linear attention's projections,
the full attention, the shared expert, and the fused W4A16 MoE kernels under the routed
experts, decode steps replaying CUDA graphs; HF transformers' greedy tokens on the dequantized
weights (on CUDA too), batched, the longest prompt in chunks of 64.

    .venv/bin/python -m pytest -q tests/test_qwen3_next_w4a16_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

from tests.paged_harness import hf_greedy, random_prompts  # noqa: E402
from tests.test_models_qwen3_next import VOCAB  # noqa: E402
from tests.test_qwen3_next_w4a16 import save_tiny, write_ct  # noqa: E402
from tests.tp_cases import engine_greedy  # noqa: E402


def test_engine_on_cuda_gives_hfs_tokens(tmp_path: Path) -> None:
    # Heads of 16 dims, as tests/test_qwen3_next_gpu.py gives flash-linear-attention's kernels.
    plain = save_tiny(tmp_path, linear_key_head_dim=16, linear_value_head_dim=16)
    folder, reference = write_ct(plain, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval().cuda()
    prompts = random_prompts(VOCAB, (5, 33, 150))
    want = [hf_greedy(hf, prompt, 16).tokens[0] for prompt in prompts]
    settings = {"device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64,
                "max_model_len": 400, "max_num_batched_tokens": 64, "max_num_seqs": 4}  # fmt: skip
    assert engine_greedy(folder, prompts, 16, tp=1, **settings)[0] == want
