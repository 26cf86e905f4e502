"""W4A16 experts on a GPU: the fused W4A16 MoE kernels (engine_core/models/w4a16_moe_kernels.py)
at Qwen3-30B-A3B's layer shape (hidden 2048, width 768, 128 experts, top 8; groups of 128 as its
AWQ and GPTQ-Int4 releases, with zero points and without) against the CPU reference for 1, 64
and 2,048 tokens in bf16, and in float32; and a tiny AWQ Qwen3-MoE (tests/test_w4a16_moe.py)
loaded on CUDA: its MoE layers' outputs equal the CPU reference's on the same checkpoint, and the
engine decodes through CUDA graphs the tokens it decodes eagerly.

    .venv/bin/python -m pytest -q tests/test_w4a16_moe_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.loader import load_model  # noqa: E402
from engine_core.models.w4a16_moe_kernels import fused_moe_w4a16  # noqa: E402
from tests.moe_graph_cases import assert_graphs_decode_as_eagerly  # noqa: E402
from tests.test_w4a16 import PROMPTS  # noqa: E402
from tests.test_w4a16_moe import qwen3_moe, write_w4a16_moe  # noqa: E402
from tests.w4a16_moe_cases import (  # noqa: E402
    random_experts,
    reference,
    relative_error,
    routing,
    to_device,
)

QWEN3_30B_A3B = (2048, 768, 128, 8)  # hidden, width, experts, top k


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_kernels_at_qwen3_30b_a3b_shapes_match_the_reference(
    tokens: int, zeros: bool, act_order: bool
) -> None:
    """bf16 activations against the float32 reference of the same (bf16-valued) tokens: the
    kernels round each dequantized weight, each linear's output and the activation between
    them to bf16 (2**-9 relative each), over sums of 768 to 2,048 terms; a wrong group's scale
    or zero point is wrong by the output's size. Act-order: each expert's inputs gathered in its
    own order."""
    hidden, inter, num_experts, top_k = QWEN3_30B_A3B
    experts = random_experts(num_experts, hidden, inter, 128, zeros, tokens, act_order=act_order)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    x = x.bfloat16().float()
    weights, ids = routing(tokens, num_experts, top_k, seed=tokens)
    want = reference(x, experts, weights, ids)
    got = fused_moe_w4a16(
        x.cuda().bfloat16(), to_device(experts, "cuda"), weights.cuda(), ids.cuda()
    )
    assert got.dtype == torch.bfloat16
    assert relative_error(got.cpu(), want) < 3e-2


@pytest.mark.parametrize("group", [32, -1])
def test_float32_activations_give_the_reference_to_float32_rounding(group: int) -> None:
    """In float32 the products are IEEE float32 (no TF32), the dequantized weights exact: only
    the sums' order differs."""
    experts = random_experts(8, 512, 256, group, True, seed=3)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(40, 8, 2, seed=3)
    want = reference(x, experts, weights, ids)
    got = fused_moe_w4a16(x.cuda(), to_device(experts, "cuda"), weights.cuda(), ids.cuda())
    assert relative_error(got.cpu(), want) < 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("w4a16_moe")
    qwen3_moe().save_pretrained(root / "plain")
    quantized, _ = write_w4a16_moe(root / "plain", root, "awq-g32")
    return quantized


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_layer_on_cuda_matches_the_cpu_reference(folder: Path, tokens: int) -> None:
    gpu = load_model(str(folder), torch.device("cuda"), torch.bfloat16).module
    cpu = load_model(str(folder), torch.device("cpu"), torch.float32).module
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    for layer in range(len(cpu.model.layers)):
        want = cpu.model.layers[layer].mlp(x)
        got = gpu.model.layers[layer].mlp(x.to("cuda", torch.bfloat16)).float().cpu()
        torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)


def test_the_engine_decodes_through_cuda_graphs_as_eagerly(folder: Path) -> None:
    """The fused kernels read nothing on the host, so the W4A16 MoE layers are captured: the
    graphs' greedy tokens are the eager engine's."""
    assert_graphs_decode_as_eagerly(folder, PROMPTS, lambda m: m.w4a16 is not None)
