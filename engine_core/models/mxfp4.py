"""MXFP4 (OCP microscaling FP4): gpt-oss's expert weights as published.

Each run of 32 consecutive weights along the input dimension is a block: 32 e2m1 values (4 bits:
sign, two exponent bits, one mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) and one e8m0
scale (a power of two, the byte minus 127). A checkpoint holds each expert projection as two
uint8 tensors (transformers' ``integrations/mxfp4.py``; openai/gpt-oss's safetensors):

- ``<proj>_blocks`` [E, rows, cols / 32, 16]: two values a byte, the low nibble first;
- ``<proj>_scales`` [E, rows, cols / 32]: the block's exponent + 127;

with rows the output features ([E, 2I, H] for gate_up_proj, its gate and up rows interleaved;
[E, H, I] for down_proj). We keep them so in memory (the blocks' last two dims merged,
[E, rows, cols / 2]): 4.25 bits a weight. On the CPU an expert's rows are dequantized when it
runs (``dequantize``); on CUDA models/mxfp4_kernels.py's GEMMs widen them in registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 32  # weights per scale
SCALE_BIAS = 127  # e8m0: the scale is 2 ** (byte - 127)
# e2m1 code (0..15) -> value: the low three bits index the magnitudes, bit 3 is the sign.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
FP4_MAX = 6.0
# Bound on the bytes of CUDA's prefill scratch (experts dequantized a chunk at a time,
# mxfp4_prefill.py): 21 of gpt-oss's experts (49.8 MB each in bf16).
SCRATCH_BYTES = 2**30
# quantization_config keys of transformers' Mxfp4Config that a checkpoint may carry.
_CONFIG_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")


@dataclass(frozen=True)
class Mxfp4Experts:
    """One layer's MXFP4 experts as GptOssMoE holds them, with its activation's constants: what
    the experts' GEMMs read (gpt_oss_moe.experts_reference, mxfp4_kernels.fused_moe_mxfp4)."""

    w13_blocks: torch.Tensor  # [E, 2I, H/2] uint8: gate rows, then up rows
    w13_scales: torch.Tensor  # [E, 2I, H/32] uint8
    b13: torch.Tensor  # [E, 2I]
    w2_blocks: torch.Tensor  # [E, H, I/2] uint8
    w2_scales: torch.Tensor  # [E, H, I/32] uint8
    b2: torch.Tensor  # [E, H]
    limit: float  # the SwiGLU's clamp
    alpha: float  # the sigmoid's slope


def expert_bytes(hidden: int, inter: int, dtype: torch.dtype) -> int:
    """One expert's gate/up and down weights dequantized to ``dtype``."""
    return 3 * hidden * inter * torch.empty((), dtype=dtype).element_size()


def chunk_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """Experts a chunk of CUDA's prefill path (mxfp4_prefill.py) dequantizes at once: as many
    as fit SCRATCH_BYTES, at least one."""
    return max(1, min(num_experts, SCRATCH_BYTES // expert_bytes(hidden, inter, dtype)))


def scratch_bytes(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """The scratch buffer that path needs for a layer of these experts: one chunk's weights."""
    return chunk_experts(num_experts, hidden, inter, dtype) * expert_bytes(hidden, inter, dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., cols / 2] uint8, scales [..., cols / 32] uint8 -> weights [..., cols] in
    ``dtype`` (exact: every e2m1 value times a power of two is a float32, and a bf16 where the
    exponent fits)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., cols]
    values = lut[codes.long()]  # [..., cols] float32
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [..., cols / 32]
    values = values.unflatten(-1, (-1, BLOCK))  # [..., cols / 32, 32]
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2).to(dtype)


def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer: weights [..., cols] -> (blocks [..., cols / 32, 16] uint8, scales
    [..., cols / 32] uint8) in the published layout. Each block's scale is the smallest power of
    two that brings its largest magnitude within e2m1's 6; each value rounds to the nearest
    e2m1 value (ties to the lower magnitude)."""
    if weights.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs rows of whole {BLOCK}-value blocks, got {weights.shape[-1]}")
    w = weights.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = w.abs().amax(dim=-1)  # [..., G]
    exponents = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / FP4_MAX))
    exponents = exponents.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = w / torch.exp2(exponents)[..., None]  # [..., G, 32] within [-6, 6]
    magnitudes = torch.tensor(FP4_VALUES[:8], device=w.device)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., G, 32] 0..7
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)


def check_mxfp4_config(qc: dict[str, Any]) -> None:
    """Refuse a ``quant_method: mxfp4`` quantization_config that we would read wrongly, naming
    the field: the format quantizes the experts and nothing else."""
    where = "quantization_config"
    unknown = sorted(set(qc) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a field of the mxfp4 format Tandem reads")
    if qc.get("dequantize"):
        raise ValueError(f"{where}.dequantize true: the checkpoint is bf16; drop the field")
    skipped = qc.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(m, str) for m in skipped):
        raise ValueError(f"{where}.modules_to_not_convert must be a list of module names")
    for pattern in skipped:
        if "experts" in pattern or pattern.rstrip(".*").endswith(".mlp"):
            raise ValueError(
                f"{where}.modules_to_not_convert lists {pattern!r}: mxfp4 checkpoints Tandem "
                "reads hold every expert in MXFP4"
            )
