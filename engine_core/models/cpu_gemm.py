"""Linear layers on the CPU through oneDNN, each weight packed once after loading.

torch's float32 CPU matmul goes through MKL, which on the project's 2-core AMD EPYC machine read
a decode GEMV's weights at about 15 GB/s and was 2.5-3.5x slower than oneDNN at 16 and 64 rows;
oneDNN with its weights reordered once into its blocked layout read 50-60 GB/s
(docs/design/cpu-backend.md, "Linears: oneDNN with weights packed once"). bf16 linears already
run on oneDNN; packing saves them the reorder on every call. The packed tensor is opaque (torch's
mkldnn layout): only ``packed_linear`` reads it.

Results equal ``F.linear``'s to float32 rounding (another summation order), not bit for bit.
"""

from __future__ import annotations

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packs(dtype: torch.dtype) -> bool:
    """Whether CPU weights of ``dtype`` are packed for oneDNN here: float32 or bf16, torch built
    with oneDNN, and for bf16 a CPU with oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; without them the reorder raises, and the layer keeps ``F.linear``)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [out, in] can be packed for oneDNN: a CPU matrix of a dtype ``packs``."""
    return weight.device.type == "cpu" and weight.dim() == 2 and packs(weight.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same matrix in oneDNN's blocked layout, for ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) -> [..., out], with ``packed`` from ``pack_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
