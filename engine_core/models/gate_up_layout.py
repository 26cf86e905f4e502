"""The interleaved row layout of a SiLU-gated MLP's gate/up weight (no Triton needed to make it).

The rows are interleaved in tiles of ``GLU_HALF`` gate rows, then their ``GLU_HALF`` up rows, so
that one 2 * GLU_HALF-row tile of the skinny GEMM (models/skinny_gemm.py) holds both halves of
GLU_HALF activations and its epilogue writes silu(gate) * up: no SiLU-and-mul launch, no gate/up
product written and read back. What it saved: docs/design/kernels-and-limits.md, "SiLU-and-mul".
"""

from __future__ import annotations

import torch

GLU_HALF = 32


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up weight [gate; up] ([2I, K], I a multiple of GLU_HALF) with its rows in tiles of
    GLU_HALF gate rows followed by the same GLU_HALF up rows (a copy)."""
    rows, k = weight.shape
    if rows % (2 * GLU_HALF):
        raise ValueError(f"a gate/up weight of {rows} rows is not whole {2 * GLU_HALF}-row tiles")
    tiles = rows // 2 // GLU_HALF
    return weight.reshape(2, tiles, GLU_HALF, k).transpose(0, 1).reshape(rows, k)
