"""INT8 experts on a GPU: the fused kernels with int8 tiles (fp8_moe_kernels.fused_moe_int8) at
Qwen3-30B-A3B's layer shape (hidden 2048, width 768, 128 experts, top 8) against the CPU
reference for 1, 64 and 2,048 tokens, with the Triton activation quantizer; and the tiny W8A8
Qwen3-MoE of tests/test_int8_moe.py loaded on CUDA: its MoE layers equal the CPU reference on
the same checkpoint, and the engine decodes through CUDA graphs the tokens it decodes eagerly.

    .venv/bin/python -m pytest -q tests/test_int8_moe_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.loader import load_model  # noqa: E402
from engine_core.models.fp8_moe_kernels import fused_moe_int8  # noqa: E402
from engine_core.models.int8 import Int8Experts  # noqa: E402
from tests.fp8_moe_cases import relative_error, routing  # noqa: E402
from tests.int8_moe_cases import int8_reference, random_int8_experts  # noqa: E402
from tests.moe_graph_cases import assert_graphs_decode_as_eagerly  # noqa: E402
from tests.test_fp8 import PROMPTS  # noqa: E402
from tests.test_fp8_moe import make_hf_model  # noqa: E402
from tests.test_int8_moe import write_w8a8_moe  # noqa: E402

QWEN3_30B_A3B = (2048, 768, 128, 8)  # hidden, width, experts, top k


def on_cuda(experts: Int8Experts) -> Int8Experts:
    e = experts
    return Int8Experts(*(t.cuda() for t in (e.w13, e.w13_scale, e.w2, e.w2_scale)))


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_kernels_at_qwen3_30b_a3b_shapes_match_the_reference(tokens: int) -> None:
    """bf16 activations against the float32 reference of the same (bf16-valued) tokens: the
    kernels round each product to bf16 and re-quantize the activation from bf16, a level apart
    now and then (a 255th of a token's range); a wrong scale is 100%."""
    hidden, inter, num_experts, top_k = QWEN3_30B_A3B
    experts = random_int8_experts(num_experts, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    x = x.bfloat16().float()
    weights, ids = routing(tokens, num_experts, top_k, seed=tokens)
    want = int8_reference(x, experts, weights, ids)
    got = fused_moe_int8(x.cuda().bfloat16(), on_cuda(experts), weights.cuda(), ids.cuda())
    assert got.dtype == torch.bfloat16
    assert relative_error(got.cpu(), want) < 5e-2


def test_float32_activations_give_the_reference_to_a_level() -> None:
    """In float32 the int32 sums are exact; the GPU quantizer's division may differ from
    torch's in the last bit, which moves an activation one level now and then: far below 1% of
    the output; a wrong scale is 100%."""
    experts = random_int8_experts(8, 512, 256, seed=3)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(40, 8, 2, seed=3)
    want = int8_reference(x, experts, weights, ids)
    got = fused_moe_int8(x.cuda(), on_cuda(experts), weights.cuda(), ids.cuda())
    assert relative_error(got.cpu(), want) < 1e-2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w8a8, _ = write_w8a8_moe(make_hf_model(), tmp_path_factory.mktemp("int8_moe"))
    return w8a8


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_layer_on_cuda_matches_the_cpu_reference(folder: Path, tokens: int) -> None:
    gpu = load_model(str(folder), torch.device("cuda"), torch.float32).module
    cpu = load_model(str(folder), torch.device("cpu"), torch.float32).module
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    for layer in range(len(cpu.model.layers)):
        want = cpu.model.layers[layer].mlp(x)
        got = gpu.model.layers[layer].mlp(x.cuda()).cpu()
        torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_the_engine_decodes_through_cuda_graphs_as_eagerly(folder: Path) -> None:
    """The fused kernels read nothing on the host, so the INT8 MoE layers are captured: the
    graphs' greedy tokens are the eager engine's."""
    assert_graphs_decode_as_eagerly(folder, PROMPTS, lambda m: m.int8 is not None)
