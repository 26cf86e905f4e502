"""W4A16 experts' prefill path (engine_core/models/w4a16_prefill.py) on a GPU, in bf16 (which
Triton's interpreter cannot check): the dequantizing kernel bit for bit against the CPU
reference's dequantization rounded to bf16, and the layer at qwen3-30b-a3b's shape (two chunks of
experts under the 1 GiB scratch) against the reference the CPU serves with."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.models.w4a16 import dequantize  # noqa: E402
from engine_core.models.w4a16_moe import Dequantize, w4a16_moe  # noqa: E402
from engine_core.models.w4a16_prefill import dequantize_experts  # noqa: E402
from tests.w4a16_moe_cases import (  # noqa: E402
    random_experts,
    reference,
    relative_error,
    routing,
    to_device,
)


@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
def test_dequantize_matches_the_reference_bit_for_bit_in_bf16(zeros: bool) -> None:
    e = random_experts(4, 2048, 768, 128, zeros, seed=5)
    want = torch.stack([
        dequantize(e.w13_qweight[i], e.w13_scales[i], None if e.w13_zeros is None else
                   e.w13_zeros[i], 128).to(torch.bfloat16)
        for i in range(4)
    ])  # fmt: skip
    g = to_device(e, "cuda")
    out = torch.empty(want.shape, dtype=torch.bfloat16, device="cuda")
    dequantize_experts(g.w13_qweight, g.w13_scales, g.w13_zeros, 128, out)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize(
    ("zeros", "act_order"), [(True, False), (False, False), (True, True)],
    ids=["zeros", "symmetric", "act-order"],
)  # fmt: skip
def test_the_prefill_path_matches_the_reference_at_qwen3_30b_a3b(
    zeros: bool, act_order: bool
) -> None:
    tokens, num_experts, top_k = 512, 128, 8
    experts = random_experts(num_experts, 2048, 768, 128, zeros, seed=6, act_order=act_order)
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(6))
    weights, ids = routing(tokens, num_experts, top_k, seed=6)
    want = reference(x.bfloat16(), experts, weights, ids)
    g = to_device(experts, "cuda")
    got = w4a16_moe(x.bfloat16().cuda(), g, weights.cuda(), ids.cuda(), Dequantize())
    assert relative_error(got.float().cpu(), want.float()) < 2e-2
