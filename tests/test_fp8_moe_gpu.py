"""FP8 experts on a GPU: the fused FP8 MoE kernels (engine_core/models/fp8_moe_kernels.py) at
Qwen3-30B-A3B's layer shape (hidden 2048, width 768, 128 experts, top 8; 128 x 128 blocks as
its FP8 release, and row scales) against the CPU reference for 1, 64 and 2,048 tokens, with
the Triton activation quantizers the interpreted tests replace; and a tiny Qwen3-MoE in
transformers' block-FP8 format (tests/test_fp8_moe.py) with 64 x 64 blocks on its experts (the
smallest the GPU's block GEMM takes; the attention, whose 32-row k/v parts are not whole such
blocks, stays in bf16) loaded on CUDA: its MoE layers' outputs equal the CPU reference's on the
same checkpoint, and the engine decodes through CUDA graphs the tokens it decodes eagerly.

    .venv/bin/python -m pytest -q tests/test_fp8_moe_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.loader import load_model  # noqa: E402
from engine_core.models.fp8 import Fp8Experts  # noqa: E402
from engine_core.models.fp8_moe_kernels import fused_moe_fp8  # noqa: E402
from tests.fp8_moe_cases import random_experts, reference, relative_error, routing  # noqa: E402
from tests.moe_graph_cases import assert_graphs_decode_as_eagerly  # noqa: E402
from tests.test_fp8 import PROMPTS, fp8_block_format, write_quantized  # noqa: E402
from tests.test_fp8_moe import make_hf_model  # noqa: E402

QWEN3_30B_A3B = (2048, 768, 128, 8)  # hidden, width, experts, top k


def on_cuda(experts: Fp8Experts) -> Fp8Experts:
    e = experts
    moved = (t.cuda() for t in (e.w13, e.w13_scale, e.w2, e.w2_scale))
    return Fp8Experts(*moved, e.block)


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "row"])
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_kernels_at_qwen3_30b_a3b_shapes_match_the_reference(
    tokens: int, block: tuple[int, int] | None
) -> None:
    """bf16 activations against the float32 reference of the same (bf16-valued) tokens: the
    kernels round each product to bf16 and re-quantize the activation from bf16, so about one
    activation in 16 lands on a neighbouring e4m3 value (tests/test_fp8_moe_interpreted.py's
    bf16 test measures the same on the CPU: up to 3.7%); a wrong scale is 100%."""
    hidden, inter, num_experts, top_k = QWEN3_30B_A3B
    experts = random_experts(num_experts, hidden, inter, block, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    x = x.bfloat16().float()
    weights, ids = routing(tokens, num_experts, top_k, seed=tokens)
    want = reference(x, experts, weights, ids)
    got = fused_moe_fp8(x.cuda().bfloat16(), on_cuda(experts), weights.cuda(), ids.cuda())
    assert got.dtype == torch.bfloat16
    assert relative_error(got.cpu(), want) < 8e-2


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "row"])
def test_float32_activations_give_the_reference_to_float32_rounding(
    block: tuple[int, int] | None,
) -> None:
    """In float32 the differences are the sums' order and the tensor cores' accumulation (e4m3
    products are exact), and the GPU quantizer's division, whose last bit may differ from
    torch's and so move an activation to the neighbouring e4m3 value now and then: 1/16 of one
    term of a 256-term sum, far below 1% of the output; a wrong scale is 100%."""
    experts = random_experts(8, 512, 256, block, seed=3)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(40, 8, 2, seed=3)
    want = reference(x, experts, weights, ids)
    got = fused_moe_fp8(x.cuda(), on_cuda(experts), weights.cuda(), ids.cuda())
    assert relative_error(got.cpu(), want) < 1e-2


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


def test_the_engine_decodes_through_cuda_graphs_as_eagerly(folder: Path) -> None:
    """The fused kernels read nothing on the host, so the FP8 MoE layers are captured: the
    graphs' greedy tokens are the eager engine's."""
    assert_graphs_decode_as_eagerly(folder, PROMPTS, lambda m: m.fp8 is not None)


def test_blocks_the_gpu_gemm_cannot_take_are_refused_at_load(tmp_path: Path) -> None:
    write_quantized(make_hf_model(), fp8_block_format((32, 32)), tmp_path / "q", tmp_path / "r")
    with pytest.raises(ValueError, match="32 x 32 blocks"):
        load_model(str(tmp_path / "q"), torch.device("cuda"), torch.bfloat16)
