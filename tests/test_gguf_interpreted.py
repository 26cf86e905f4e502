"""The GGUF CUDA kernels (engine_core/models/gguf_kernels.py) on the CPU, through Triton's
interpreter, against gguf-py's dequantization of the same blocks times the activations: each type
with a kernel, row counts from one to past the GEMV's (the dequantize-and-cuBLAS path), an N
that leaves a partial row tile and a K that leaves a partial step of blocks, and merged layers
whose parts have different types (Q4_K's super-blocks beside 32-value blocks).

Triton's interpreter mishandles bf16, so the activations are float32 here; bf16 is checked on a
GPU (tests/test_gguf_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_gguf_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models import gguf_kernels as kernels  # noqa: E402
from tests.gguf_fixtures import expected_product, gguf_py_weight, random_layer  # noqa: E402

ROWS = (1, 3, kernels.GEMV_ROWS, kernels.GEMV_ROWS + 1, 37)
# name -> (part types, part rows, K): K = 160 is 5 blocks, one step of 4 and a partial one; 768
# is 3 K-quant super-blocks: Q4_K's one step of 2 and a partial one, Q6_K's 6 halves in steps of 2.
LAYERS = {
    "Q8_0": (("Q8_0",), (40,), 160),
    "Q4_0": (("Q4_0",), (40,), 160),
    "Q4_1": (("Q4_1",), (40,), 160),
    "Q4_K": (("Q4_K",), (40,), 768),
    "q, k, v of three types": (("Q4_0", "Q4_1", "Q8_0"), (32, 16, 8), 160),
    "gate, up of one type, then another": (("Q4_1", "Q4_1", "Q8_0"), (24, 24, 16), 160),
    "Q6_K": (("Q6_K",), (40,), 768),
    "q, k of Q4_K, v of Q8_0": (("Q4_K", "Q4_K", "Q8_0"), (32, 16, 16), 256),
    "q, k of Q4_K, v of Q6_K": (("Q4_K", "Q4_K", "Q6_K"), (32, 16, 16), 512),
}


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_product_is_gguf_py_weights_times_the_activations(name: str, rows: int) -> None:
    types, parts, cols = LAYERS[name]
    layout, blocks, raws = random_layer(types, parts, cols, seed=rows)
    a = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    got = kernels.gguf_matmul(a, layout.planes(blocks), sum(parts))
    expected = expected_product(a, gguf_py_weight(types, raws))
    assert got.dtype == torch.float32
    assert_close_to_scale(got, expected)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_the_dequantized_weight_is_gguf_py_s(type_name: str) -> None:
    cols = 512 if type_name.endswith("_K") else 96
    layout, blocks, raws = random_layer((type_name,), (24,), cols)
    ((_, planes),) = layout.planes(blocks)
    got = kernels.dequantize(planes, cols, torch.float32)
    # The kernel may fuse a multiply and an add into one rounding: within one float32 ulp.
    torch.testing.assert_close(got, gguf_py_weight((type_name,), raws), atol=1e-7, rtol=1.2e-7)


def test_a_strided_activation_is_read_by_its_rows() -> None:
    layout, blocks, raws = random_layer(("Q4_1",), (16,), 64)
    a = torch.randn(2, 128)[:, ::2]
    got = kernels.gguf_matmul(a, layout.planes(blocks), 16)
    assert_close_to_scale(got, expected_product(a, gguf_py_weight(("Q4_1",), raws)))


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within float32 sums' rounding, relative to the output's size (Q4_K's mins cancel)."""
    error = (got.double() - expected).abs().max() / expected.abs().max()
    assert float(error) < 1e-6, f"relative error {float(error):.2e}"
