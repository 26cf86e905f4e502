"""FP8 (e4m3) weights: quantizing at load, dequantizing for reference, and the FP8 matmul.

A linear layer in FP8 (``Linear`` in layers.py, with ``fp8`` set) holds ``weight`` [N, K] in
e4m3, ``weight_scale`` in float32 ([N], one per output row; or [ceil(N / bn), ceil(K / bk)],
one per block of the block-wise format) and, with static activations, ``input_scale`` [1]. The
real weight is ``weight * scale`` of its row or block.

The matmul dispatches on the device:

- CUDA (compute capability 8.9 or newer): activations are quantized to e4m3 (per token, per
  token and 128-column group for block weights, or with the static scale) and multiplied on the
  FP8 tensor cores (engine_core/models/fp8_kernels.py, imported only there: it imports triton).
- anywhere else: the dequantizing reference, which CI runs. Weights are dequantized (in float32,
  then cast to the activations' dtype); activations are quantized to e4m3 and back as the scheme
  says (``quantize_dequantize``: per token, per token and column group for block weights, or
  with the static scale), in the activations' dtype, the way compressed-tensors computes it (and
  HF transformers with it, running such a checkpoint): scale = absmax / 448, x / scale clamped
  to +-448 and rounded to e4m3, times the scale. So the CPU computes the model the GPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine_core.config import Fp8Config
from engine_core.models.fp8_config import (
    BLOCK_GEMM_COLUMNS,
    BLOCK_GEMM_ROW_MULTIPLE,
    block_gemm_takes,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
# A row of zeros still gets a finite, positive scale.
MIN_SCALE = 1e-12


@dataclass(frozen=True)
class Fp8Experts:
    """One MoE layer's FP8 experts as SparseMoE (moe.py) holds them, for the fused kernels
    (fp8_moe_kernels.py). ``block`` None: one scale per output row (``w13_scale [E, 2I]``,
    ``w2_scale [E, H]``); else one per block of (rows, cols) weights."""

    w13: torch.Tensor  # [E, 2I, H] e4m3
    w13_scale: torch.Tensor  # [E, 2I] or [E, 2I / rows, H / cols] float32
    w2: torch.Tensor  # [E, H, I] e4m3
    w2_scale: torch.Tensor  # [E, H] or [E, H / rows, I / cols] float32
    block: tuple[int, int] | None


def fp8_kernels() -> ModuleType:
    """The CUDA kernels' module, imported on first use: importing it imports triton."""
    from engine_core.models import fp8_kernels as kernels

    return kernels


def check_fp8_device(device: torch.device, what: str) -> None:
    """Refuse FP8 on a CUDA device without FP8 tensor cores (before Ada, sm_89)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{what} needs a GPU with FP8 support (compute capability 8.9 or newer: Ada, Hopper "
            f"or later); {name} has {capability[0]}.{capability[1]}"
        )


def check_fp8_block_on_device(config: Fp8Config, device: torch.device) -> None:
    """Refuse at load a block shape the CUDA block GEMM cannot run (it would fail at the first
    step); the CPU reference takes any."""
    if device.type != "cuda" or config.block is None:
        return
    if not block_gemm_takes(config.block):
        rows, cols = config.block
        raise ValueError(
            f"{config.source}: block-wise FP8 weights of {rows} x {cols} blocks; the GPU's "
            f"block-scaled FP8 GEMM takes blocks of a multiple of {BLOCK_GEMM_ROW_MULTIPLE} "
            f"rows by {' or '.join(map(str, BLOCK_GEMM_COLUMNS))} columns"
        )


def weight_scale_shape(config: Fp8Config, rows: int, cols: int) -> tuple[int, ...]:
    """The shape of ``weight_scale`` for a [rows, cols] weight."""
    if config.block is None:
        return (rows,)
    block_rows, block_cols = config.block
    return (-(-rows // block_rows), -(-cols // block_cols))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (e4m3 [N, K], scale [N] float32), one scale per row:
    absmax / 448, so each row uses e4m3's whole range."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)  # [N]
    quantized = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, config: Fp8Config) -> torch.Tensor:
    """e4m3 weight [N, K] and its scales -> float32 [N, K] (the values the weight stands for)."""
    if config.block is None:
        return weight.float() * scale[:, None]
    rows, cols = weight.shape
    block_rows, block_cols = config.block
    expanded = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)
    return weight.float() * expanded[:, :cols]


# An activation that the kernel which wrote it also quantized (per token, e4m3: an RMSNorm in
# front of FP8 linears, models/llama.py fuse_quantizers) carries that form under this
# attribute, (e4m3 [T, K], scale [T, 1]); the linear then skips its own quantizer launch.
FP8_ROWS_ATTR = "_tandem_fp8_rows"


def attach_fp8_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mark x [T, K] with its per-token e4m3 form (rows); returns x."""
    setattr(x, FP8_ROWS_ATTR, rows)
    return x


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    config: Fp8Config,
) -> torch.Tensor:
    """x [..., K] @ the FP8 weight [N, K] transposed -> [..., N] in x's dtype (no bias)."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        quantized = getattr(x, FP8_ROWS_ATTR, None)
        if quantized is not None and input_scale is None and config.block is None:
            xq, x_scale = quantized
            out = fp8_kernels().fp8_rowwise_gemm(xq, x_scale, weight, weight_scale, x.dtype)
            return out.view(*x.shape[:-1], out.shape[-1])
        out = fp8_linear_cuda(rows, weight, weight_scale, input_scale, config)
    else:
        rows = quantize_dequantize(rows, input_scale, config)
        out = F.linear(rows, dequantize(weight, weight_scale, config).to(x.dtype))
    return out.view(*x.shape[:-1], out.shape[-1])


def quantize_dequantize(
    x: torch.Tensor, input_scale: torch.Tensor | None, config: Fp8Config
) -> torch.Tensor:
    """x [T, K] as its e4m3 form stands for it, in x's dtype: per token (dynamic), per token and
    ``block[1]``-column group (block weights), or with the static ``input_scale``."""
    if input_scale is not None:
        return e4m3_round_trip(x.float(), input_scale.float().reshape(())).to(x.dtype)
    if config.block is None:
        return e4m3_round_trip(x, dynamic_scales(x))
    if x.shape[-1] % config.block[1]:  # a last, narrower group
        parts = x.split(config.block[1], dim=-1)
        return torch.cat([e4m3_round_trip(part, dynamic_scales(part)) for part in parts], -1)
    groups = x.unflatten(-1, (-1, config.block[1]))  # [T, K / bk, bk]
    return e4m3_round_trip(groups, dynamic_scales(groups)).flatten(-2)


def dynamic_scales(x: torch.Tensor) -> torch.Tensor:
    """absmax / 448 over the last dim, keepdim, in x's dtype; a zero scale becomes the dtype's
    eps (compressed-tensors' calculate_qparams)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    eps = torch.finfo(scale.dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def e4m3_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale clamped to e4m3's range, rounded to e4m3, times scale (x's dtype)."""
    scaled = torch.clamp(x / scale, -FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE).to(scaled.dtype) * scale


def takes_fp8_rows(linear: torch.nn.Module) -> bool:
    """Whether an FP8 linear quantizes its input per token (dynamic activations, row-wise
    weights): then an input that arrives already quantized (FP8_ROWS_ATTR) can be used as is."""
    config = getattr(linear, "fp8", None)
    return config is not None and config.block is None and linear.input_scale is None


def fp8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    config: Fp8Config,
) -> torch.Tensor:
    """x [M, K] -> [M, N] on the FP8 tensor cores: activations quantized, then one GEMM."""
    kernels = fp8_kernels()
    if config.block is not None:
        xq, x_scale = kernels.quantize_per_token_group(x, config.block[1])  # [M, K], [M, K/bk]
        return kernels.fp8_block_gemm(xq, x_scale, weight, weight_scale, config.block, x.dtype)
    if input_scale is None:
        xq, x_scale = kernels.quantize_per_token(x)  # [M, K], [M, 1]
    else:
        xq = kernels.quantize_static(x, input_scale)
        x_scale = input_scale.view(1, 1).expand(x.shape[0], 1)
    return kernels.fp8_rowwise_gemm(xq, x_scale, weight, weight_scale, x.dtype)
