"""GGUF's quantized blocks: what each block type means, as a dequantizing CPU reference in torch.

A GGUF weight [N, K] of a block type is N rows of K / block_elements blocks, each a fixed run
of bytes (llama.cpp's ggml-quants; gguf-py's ``quants.py`` reads them the same way, and
transformers dequantizes GGUF files with it). ``dequantize(raw, type)`` turns raw uint8 rows
[N, K / elements * bytes] into float32 [N, K], in float32 throughout as gguf-py does.

- Q8_0 (34 bytes, 32 values): fp16 d, 32 int8 q: d * q.
- Q4_0 (18 bytes, 32 values): fp16 d, 16 bytes of nibbles (values 0-15 low, 16-31 high):
  d * (q - 8).
- Q4_1 (20 bytes, 32 values): fp16 d and m, 16 bytes of nibbles: d * q + m.
- Q4_K (144 bytes, 256 values): fp16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128
  bytes of nibbles (32-byte chunk j: sub-block 2j low, 2j + 1 high):
  d * scale_s * q - dmin * min_s for sub-block s of 32.
- Q6_K (210 bytes, 256 values): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
  scales, fp16 d: d * scale_s * (q - 32) for sub-block s of 16.

These are the reference of the GGUF layers that keep their blocks on CUDA (all five types:
engine_core/models/gguf.py, whose planes go back into blocks to be read here;
docs/design/quantization.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256  # values in a K-quant super-block


def fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> [..., 2, B]: the low nibbles, then the high ones."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return fp16_at(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 2:]).flatten(1).float()  # [n, 32]
    return fp16_at(blocks, 0) * (q - 8)


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 4:]).flatten(1).float()
    return fp16_at(blocks, 0) * q + fp16_at(blocks, 2)


def k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's (and Q5_K's) 12 bytes -> eight 6-bit scales and eight 6-bit mins, [n, 8] each:
    bytes 0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 mins 0-3 (and the top bits
    of mins 4-7), 8-11 the low nibbles of scales 4-7 and mins 4-7."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = k_scales_and_mins(blocks[:, 4:16])
    d = (fp16_at(blocks, 0) * scales)[:, :, None]  # [n, 8, 1]
    dm = (fp16_at(blocks, 2) * mins)[:, :, None]
    q = nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (fp16_at(blocks, 208) * scales)[:, :, None]  # [n, 16, 1]
    low = nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)  # 64-byte half h: 4h..4h+3
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


# GGML type name -> (values a block holds, its bytes, its dequantization).
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (32, 34, q8_0),
    "Q4_0": (32, 18, q4_0),
    "Q4_1": (32, 20, q4_1),
    "Q4_K": (QK_K, 144, q4_k),
    "Q6_K": (QK_K, 210, q6_k),
}


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """uint8 rows [N, K / elements * bytes] of ``type_name`` blocks -> float32 [N, K]."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {type_name} has no reference here; it reads "
                         f"{', '.join(BLOCK_TYPES)}")  # fmt: skip
    elements, size, function = BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    if raw.dtype != torch.uint8 or raw.shape[-1] % size:
        raise ValueError(f"{type_name} rows are uint8 runs of {size}-byte blocks, got "
                         f"{raw.dtype} {tuple(raw.shape)}")  # fmt: skip
    return function(raw.reshape(-1, size)).reshape(rows, -1)
