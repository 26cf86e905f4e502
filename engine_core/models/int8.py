"""W8A8 INT8: int8 weights with one scale per output row, activations quantized to int8 per token
at run time; the dequantizing reference and the CUDA path.

A linear layer in INT8 (``Linear`` in layers.py, with ``int8`` set) holds ``weight`` [N, K] int8
and ``weight_scale`` [N] float32: the real weight is ``weight * scale`` of its row.

Activations are quantized the way compressed-tensors does it (its ``calculate_qparams`` and
``_quantize_dequantize``, which HF transformers applies when it runs such a checkpoint): each
token's scale is absmax / 127.5 (the int8 range's width over two, in the activations' dtype;
a zero scale becomes the dtype's eps), values are clamped to -128..127 and rounded half to even.

- CUDA: the activations quantized so by one Triton launch, then int8 x int8 -> int32 on the
  tensor cores, scaled by both scales (and the bias added) in float32, rounded once: by the
  Triton GEMM of engine_core/models/w8a8_kernels.py, or by cuBLASLt (``torch._int_mm``) and
  the scaling after it where that GEMM's table says cuBLASLt wins (``choose_tiles``);
  tests/test_int8_gpu.py and tests/test_w8a8_gpu.py check them against the reference.
- anywhere else: the reference, which CI runs: weights dequantized (float32, then the
  activations' dtype), activations quantized and dequantized per token, one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT8_MIN, INT8_MAX = -128, 127
HALF_RANGE = (INT8_MAX - INT8_MIN) / 2  # 127.5: compressed-tensors' symmetric scale divisor
# _int_mm (cuBLASLt int8) takes more than 16 rows: smaller products are padded to this many.
INT_MM_MIN_ROWS = 32


# An activation that the kernel which wrote it also quantized to int8 per token (an RMSNorm or a
# SiLU-and-mul in front of INT8 linears, models/llama.py fuse_quantizers) carries that form under
# this attribute, (int8 [T, K], scale [T, 1]); the linear then skips its own quantizer launch.
INT8_ROWS_ATTR = "_tandem_int8_rows"


def attach_int8_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mark x [T, K] with its per-token int8 form (rows); returns x."""
    setattr(x, INT8_ROWS_ATTR, rows)
    return x


def takes_int8_rows(linear: torch.nn.Module) -> bool:
    """Whether a linear is INT8 (its activations are always quantized per token at run time):
    then an input that arrives already quantized (INT8_ROWS_ATTR) can be used as is."""
    return getattr(linear, "int8", None) is not None


@dataclass(frozen=True)
class Int8Experts:
    """One MoE layer's INT8 experts as SparseMoE (moe.py) holds them, for the fused kernels
    (fp8_moe_kernels.fused_moe_int8): one scale per output row."""

    w13: torch.Tensor  # [E, 2I, H] int8
    w13_scale: torch.Tensor  # [E, 2I] float32
    w2: torch.Tensor  # [E, H, I] int8
    w2_scale: torch.Tensor  # [E, H] float32
    block: None = None  # as Fp8Experts': row scales only


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (int8 [N, K], scale [N] float32), one symmetric scale
    per row (absmax / 127), for ``--quantization w8a8``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)  # [N]
    quantized = torch.round(w / scale[:, None]).clamp(INT8_MIN, INT8_MAX).to(torch.int8)
    return quantized, scale


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> each token's scale [T, 1] in x's dtype, as compressed-tensors computes it."""
    scale = x.abs().amax(dim=-1, keepdim=True) / HALF_RANGE
    eps = torch.finfo(scale.dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (the int8 values as x's dtype [T, K], scales [T, 1])."""
    scale = token_scales(x)
    return torch.round(torch.clamp(x / scale, INT8_MIN, INT8_MAX)), scale


def quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as its per-token int8 form stands for it, in x's dtype."""
    q, scale = quantize_per_token(x)
    return q * scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] and its row scales [N] -> float32 [N, K]."""
    return weight.float() * scale[:, None]


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ the int8 weight [N, K] transposed (+ bias) -> [..., N] in x's dtype; on
    CUDA from x's attached int8 rows (INT8_ROWS_ATTR) where the kernel before wrote them."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        quantized = getattr(x, INT8_ROWS_ATTR, None)
        out = int8_linear_cuda(rows, weight, weight_scale, bias, quantized)
    else:
        weight_dq = dequantize(weight, weight_scale).to(x.dtype)
        out = F.linear(quantize_dequantize(rows), weight_dq, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def int8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N]: per-token int8 activations (``quantized``: already written by the
    kernel before, else one launch here), one int8 GEMM with int32 accumulation, both scales
    applied in float32 (the Triton GEMM or cuBLASLt, as ``choose_tiles`` says)."""
    from engine_core.models import w8a8_kernels as kernels  # imports triton: CUDA only

    q, scale = quantized if quantized is not None else kernels.quantize_per_token(x)
    sms = kernels.multiprocessors(x.device)
    tiles = kernels.choose_tiles(x.shape[0], weight.shape[0], x.shape[1], sms)
    if tiles is None:
        return int_mm_product(q, scale, weight, weight_scale, x.dtype, bias)
    return kernels.int8_gemm(q, scale, weight, weight_scale, x.dtype, bias, tiles)


def int_mm_product(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 q [M, K] with scale [M, 1] float32 @ weight [N, K] transposed -> [M, N] in dtype:
    cuBLASLt's int8 GEMM, then both scales (and the bias) in float32, rounded once."""
    rows = q.shape[0]
    if rows < INT_MM_MIN_ROWS:  # _int_mm refuses 16 rows or fewer
        q = F.pad(q, (0, 0, 0, INT_MM_MIN_ROWS - rows))
    acc = torch._int_mm(q, weight.t())[:rows]  # [M, N] int32
    out = acc.float() * scale * weight_scale[None, :]
    return (out if bias is None else out + bias.float()).to(dtype)
