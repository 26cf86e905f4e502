"""GPU tests of the W8A8 INT8 product (engine_core/models/int8.py ``int8_linear_cuda``: per-token
int8 activations, cuBLASLt's ``torch._int_mm`` or the Triton GEMM as ``choose_tiles`` says, both
scales) against the CPU reference's numbers, over the presets' projection shapes and rows from 1
(padded past _int_mm's 16-row floor) to 300.

Written without a GPU at hand: the lead runs these on the GPU machine.

    .venv/bin/python -m pytest -q tests/test_int8_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.models.int8 import (  # noqa: E402
    dequantize,
    int8_linear,
    quantize_dequantize,
    quantize_rows,
)

SHAPES = ((960, 576), (576, 1536), (3072, 2048), (2048, 8192), (6144, 4096), (4096, 14336))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_int8_product_matches_the_reference(n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight, scale = quantize_rows(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
    for m in (1, 16, 17, 64, 300):
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        got = int8_linear(x, weight, scale)
        # The reference's numbers: the same per-token int8 values (computed in x's dtype),
        # multiplied in float32 with the dequantized weight.
        expected = F.linear(quantize_dequantize(x).float(), dequantize(weight, scale))
        assert got.dtype == dtype and got.shape == (m, n)
        error = (got.float() - expected).abs().max() / expected.abs().max()
        assert float(error) < 1e-2, f"{m} rows: relative error {float(error):.2e}"
