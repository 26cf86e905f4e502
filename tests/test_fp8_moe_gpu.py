"""FP8 experts on a GPU: a tiny Qwen3-MoE in transformers' block-FP8 format (tests/test_fp8_moe.py)
with 64 x 64 blocks on its experts (the smallest the GPU's block GEMM takes; the attention,
whose 32-row k/v parts are not whole such blocks, stays in bf16) loaded on CUDA runs each
expert on the FP8 tensor cores; its MoE layers' outputs equal the CPU
reference's on the same checkpoint, for token counts of a decode step and of a prompt, and the
engine serves it on CUDA (eagerly: grouping tokens by expert reads their counts on the host).

    .venv/bin/python -m pytest -q tests/test_fp8_moe_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from engine_core.loader import load_model  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests.test_fp8 import PROMPTS, fp8_block_format, write_quantized  # noqa: E402
from tests.test_fp8_moe import make_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8_moe")
    experts = ("gate_proj", "up_proj", "down_proj")
    fmt = fp8_block_format((64, 64), not_converted=("self_attn",))
    write_quantized(make_hf_model(), fmt, root / "fp8", root / "ref", experts)
    return root / "fp8"


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_layer_on_cuda_matches_the_cpu_reference(folder: Path, tokens: int) -> None:
    gpu = load_model(str(folder), torch.device("cuda"), torch.bfloat16).module
    cpu = load_model(str(folder), torch.device("cpu"), torch.float32).module
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    for layer in range(len(cpu.model.layers)):
        want = cpu.model.layers[layer].mlp(x)
        got = gpu.model.layers[layer].mlp(x.to("cuda", torch.bfloat16)).float().cpu()
        torch.testing.assert_close(got, want, atol=5e-2 * want.abs().max().item(), rtol=5e-2)


def test_the_engine_serves_fp8_experts_on_cuda(folder: Path) -> None:
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [len(out.token_ids) for out in outs] == [8] * len(PROMPTS)


def test_blocks_the_gpu_gemm_cannot_take_are_refused_at_load(tmp_path: Path) -> None:
    write_quantized(make_hf_model(), fp8_block_format((32, 32)), tmp_path / "q", tmp_path / "r")
    with pytest.raises(ValueError, match="32 x 32 blocks"):
        load_model(str(tmp_path / "q"), torch.device("cuda"), torch.bfloat16)
