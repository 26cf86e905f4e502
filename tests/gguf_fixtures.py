"""Helpers for the tests of GGUF layers kept in blocks (engine_core/models/gguf.py): a layer of
random blocks of given types, and the reference product from gguf-py's reading of them."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine_core.models.gguf import KERNEL_TYPES, GgufLayout, load_part
from tests.test_gguf_blocks import random_blocks


def random_layer(
    types: tuple[str, ...], rows: tuple[int, ...], cols: int, seed: int = 0
) -> tuple[GgufLayout, torch.Tensor, list[np.ndarray]]:
    """(layout, its loaded uint8 tensor, each part's raw block rows)."""
    layout = GgufLayout(types, rows, cols)
    blocks = torch.zeros(layout.nbytes, dtype=torch.uint8)
    raws = []
    for part, (type_name, n) in enumerate(zip(types, rows, strict=True)):
        per_row = cols // KERNEL_TYPES[type_name].values
        raw = random_blocks(type_name, n * per_row, seed + part).reshape(n, -1)
        load_part(layout, blocks, part, torch.from_numpy(raw), f"part{part}")
        raws.append(raw)
    return layout, blocks, raws


def gguf_py_weight(types: tuple[str, ...], raws: list[np.ndarray]) -> torch.Tensor:
    """The layer's float32 W [N, K], each part as gguf-py dequantizes its blocks."""
    parts = [
        gguf_dequantize(raw, GGMLQuantizationType[t]) for t, raw in zip(types, raws, strict=True)
    ]
    return torch.from_numpy(np.concatenate(parts).astype(np.float32))


def expected_product(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a @ W.T in float64: the exact product that a kernel's float32 sums approach."""
    return F.linear(a.double(), weight.double())
