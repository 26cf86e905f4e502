"""4-bit weights, 16-bit activations (W4A16): the one layout that AWQ, GPTQ and compressed-tensors
checkpoints are repacked into once, as they load; its dequantizing reference; the GPU kernel's
entry (engine_core/models/w4a16_kernels.py, imported only on CUDA: it imports triton).

The layout a W4A16 ``Linear`` holds (layers.py ``make_w4a16``), for a weight W [N, K]:

- ``qweight`` int32 [N, K / 8]: row n's 4-bit values q (0..15) along K, eight to a word: column
  8j + i in bits 4i..4i+3 of word j. A kernel reads a tile of rows with K contiguous, and
  unpacks a word into eight consecutive columns with shifts. It is compressed-tensors' own
  packing, GPTQ's transposed, and AWQ's with its nibbles put in order.
- ``scales`` float32 [G, N], G = K / group_size (one group over K for group size -1): a group's
  scales for a tile of rows are one contiguous read. float32 holds the checkpoints' fp16 and
  bf16 scales exactly (at group size 128 it is 6% of the packed weight's bytes).
- ``zeros`` uint8 [G, N] where the checkpoint stores zero points (AWQ, GPTQ, asymmetric
  compressed-tensors): 0..15, and 16 where GPTQ's original format stores 15 (it stores zero - 1
  and its readers add one back without wrapping). Without: every zero point is 8.
- ``perm`` int32 [K], after loading, for act-order checkpoints (GPTQ desc_act, compressed-tensors
  actorder "group") whose ``g_idx`` is not the identity's: ``finish_w4a16`` sorts the columns by
  group, so the groups are contiguous again, and the layer reads its input in that order,
  x[:, perm]. Each group must hold group_size columns.

On CUDA the layer holds ``qweight`` in the GEMM kernel's layout instead, int32 [Kp / 8, N]
(``tile_qweight``, once loaded: blocks of 128 columns, each word holding eight columns 16
apart, so one shifted tile of words is 16 consecutive columns); scales and zeros stay as they
are.

A weight is ``(q - zero) * scale`` of its row and group, which is what each format's own code
computes (AutoAWQ's dequantize_gemm, AutoGPTQ's and vLLM's GPTQ readers, compressed-tensors'
dequantize); the CPU reference does exactly that in float32 (exact: a 5-bit integer times an
fp16 or bf16 scale) and multiplies in the activations' dtype, activations not quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine_core.config import W4A16Config

PACK = 8  # 4-bit values per int32 word
# AutoAWQ packs column 8j + AWQ_ORDER[i] of a word's eight into nibble i (its WQLinear_GEMM).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SYMMETRIC_ZERO = 8


@dataclass(frozen=True)
class W4A16Experts:
    """One MoE layer's W4A16 experts as SparseMoE (moe.py) holds them: the layout above stacked
    per expert, ``w13`` (gate rows, then up rows) for [2I, H] and ``w2`` for [H, I]; the
    fused kernels (w4a16_moe_kernels.py) read it as loaded."""

    w13_qweight: torch.Tensor  # [E, 2I, H / 8] int32
    w13_scales: torch.Tensor  # [E, H / group, 2I] float32
    w13_zeros: torch.Tensor | None  # [E, H / group, 2I] uint8
    w2_qweight: torch.Tensor  # [E, H, I / 8] int32
    w2_scales: torch.Tensor  # [E, I / group, H] float32
    w2_zeros: torch.Tensor | None  # [E, I / group, H] uint8
    groups: tuple[int, int]  # input columns per scale of w13 (of H), of w2 (of I)
    # Act-order: each expert's column order (its columns sorted by group; the input is x[:, perm]),
    # [E, H] int32 for w13 and [E, I] for w2; None where every expert's columns were in order.
    w13_perm: torch.Tensor | None = None
    w2_perm: torch.Tensor | None = None


def w4a16_kernels() -> ModuleType:
    """The CUDA kernels' module, imported on first use: importing it imports triton."""
    from engine_core.models import w4a16_kernels as kernels

    return kernels


# ---- packing ------------------------------------------------------------------------------------


def unpack_int4(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: word j's nibble i (bits 4i..4i+3) is column 8j + i, or
    column 8j + order[i] where the packer interleaved them (AWQ)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 0xF  # [R, C, 8]: nibble i
    if order is not None:
        placed = torch.empty_like(nibbles)
        placed[..., list(order)] = nibbles
        nibbles = placed
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * PACK).to(torch.uint8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] (each 0..15, C a multiple of 8) -> int32 [R, C / 8], sequential nibbles."""
    rows, cols = values.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (values.to(torch.int64).reshape(rows, cols // PACK, PACK) << shifts).sum(-1)
    # Words past 2^31 are negative as int32: wrapped here, not left to an out-of-range cast.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ---- checkpoint tensors into the layout ---------------------------------------------------------

# Checkpoint parameter name -> ours, by source. None: read to check it, then dropped.
CHECKPOINT_NAMES = {
    "awq": {"qweight": "qweight", "qzeros": "zeros", "scales": "scales"},
    "gptq": {"qweight": "qweight", "qzeros": "zeros", "scales": "scales", "g_idx": "g_idx"},
    "compressed-tensors": {
        "weight_packed": "qweight",
        "weight_scale": "scales",
        "weight_zero_point": "zeros",
        "weight_g_idx": "g_idx",
        "weight_shape": None,
    },
}
CHECKPOINT_DTYPES = {
    "qweight": (torch.int32,),
    "zeros": (torch.int32,),
    "g_idx": (torch.int32, torch.int64),
}


def held_name(config: W4A16Config, param_name: str) -> str | None:
    """Our parameter for checkpoint parameter ``param_name`` (None: checked and dropped); a name
    the format does not have is returned as it is (``bias``)."""
    return CHECKPOINT_NAMES[config.source].get(param_name, param_name)


def to_layout(config: W4A16Config, name: str, tensor: torch.Tensor, hf_name: str) -> torch.Tensor:
    """A checkpoint tensor (for our parameter ``name``) in our layout; shapes are checked when it
    is copied in."""
    expected = CHECKPOINT_DTYPES.get(name)
    if expected is not None and tensor.dtype not in expected:
        raise ValueError(f"checkpoint tensor {hf_name!r} is {tensor.dtype}, expected {expected[0]}")
    if name == "qweight":
        return qweight_layout(config.source, tensor)
    if name == "zeros":
        return zeros_layout(config, tensor)
    if name == "scales":
        return (tensor.t() if config.source == "compressed-tensors" else tensor).float()
    if name == "g_idx":
        return tensor.to(torch.int32)
    return tensor


def qweight_layout(source: str, tensor: torch.Tensor) -> torch.Tensor:
    """AWQ [K, N/8] (interleaved) or GPTQ [K/8, N] or compressed-tensors [N, K/8] -> [N, K/8]."""
    if source == "awq":
        return pack_int4(unpack_int4(tensor, AWQ_ORDER).t())
    if source == "gptq":
        return tensor.t().contiguous()  # GPTQ packs along K already, in order
    return tensor


def zeros_layout(config: W4A16Config, tensor: torch.Tensor) -> torch.Tensor:
    """AWQ [G, N/8] (interleaved), GPTQ [G, N/8], compressed-tensors [N/8, G] -> uint8 [G, N].
    compressed-tensors stores a zero point z in -8..7 as z + 8, as it stores the weights."""
    if config.source == "awq":
        return unpack_int4(tensor, AWQ_ORDER)
    if config.source == "gptq":
        return unpack_int4(tensor) + config.zero_offset
    return unpack_int4(tensor.t())


def check_weight_shape(tensor: torch.Tensor, parts: list[int], cols: int, hf_name: str) -> None:
    """compressed-tensors' ``weight_shape`` must be the shape of one of the layer's parts."""
    shape = tensor.tolist()
    if len(shape) != 2 or shape[0] not in parts or shape[1] != cols:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} says the weight is {shape}, but the model's parts "
            f"are {[[rows, cols] for rows in parts]}"
        )


def check_trivial_g_idx(g_idx: torch.Tensor, group_size: int, hf_name: str) -> None:
    """Without act-order the groups are contiguous runs of group_size columns (the checkpoint's:
    -1 for one group over all of them): a stored g_idx must say so (GPTQ stores one either
    way)."""
    expected = torch.arange(g_idx.numel()) // (g_idx.numel() if group_size == -1 else group_size)
    stored = g_idx.to(torch.int64).flatten().cpu()
    groups = int(expected[-1]) + 1 if expected.numel() else 0
    if stored.numel() and not 0 <= int(stored.min()) <= int(stored.max()) < groups:
        raise ValueError(f"checkpoint tensor {hf_name!r} has groups outside 0..{groups - 1}")
    if not torch.equal(stored, expected):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} assigns columns to groups out of order, but "
            "quantization_config.desc_act is false"
        )


# ---- after loading: act-order -------------------------------------------------------------------


def act_order_permutation(g_idx: torch.Tensor, group_size: int, where: str) -> torch.Tensor | None:
    """g_idx [parts, K] (one row per merged part, all equal) -> the column order that makes
    each group contiguous, or None where it already is."""
    if not bool((g_idx == g_idx[:1]).all()):
        raise ValueError(
            f"{where}: the merged parts' g_idx differ; their merged projection needs one column "
            "order (the parts share their input, so act-order quantizers give them the same)"
        )
    order = g_idx[0].to(torch.int64)
    groups = order.numel() // group_size
    if int(order.min()) < 0 or int(order.max()) >= groups:
        raise ValueError(f"{where}: g_idx has groups outside 0..{groups - 1}")
    counts = torch.bincount(order, minlength=groups)
    if not bool((counts == group_size).all()):
        raise ValueError(f"{where}: g_idx groups are not all {group_size} columns wide")
    perm = torch.argsort(order, stable=True)
    if torch.equal(perm, torch.arange(order.numel(), device=perm.device)):
        return None
    return perm.to(torch.int32)


def permute_columns(qweight: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """qweight [N, K/8] with its K columns in the order ``perm`` (column j takes column perm[j])."""
    return pack_int4(unpack_int4(qweight)[:, perm.long()])


# ---- the kernel's layout (CUDA) -----------------------------------------------------------------

TILE_K = 128  # input columns of one interleaved block of the kernel's layout
PLANE = TILE_K // PACK  # words per row of a block: the columns one nibble position holds


def padded_columns(k: int) -> int:
    """K rounded up to whole blocks of the kernel's layout."""
    return -(-k // TILE_K) * TILE_K


def tile_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """The loaded layout [N, K/8] -> the CUDA kernel's int32 [Kp/8, N], Kp = K rounded up to a
    block of 128 columns (the extra columns hold zeros, never read: the kernel masks them off
    the activations). In block b, word row j, nibble i of row n's word holds column
    128b + 16i + j: the words of a block's 16 rows shifted by 4i give, in one [16, BLOCK_N]
    tile, the 16 consecutive columns 128b + 16i + (0..15), a slice of K that a tensor-core
    product takes as it is. Words run along N, so a tile's rows are contiguous loads."""
    rows = qweight.shape[0]
    q = unpack_int4(qweight)  # [N, K]
    q = F.pad(q, (0, padded_columns(q.shape[1]) - q.shape[1]))
    blocks = q.shape[1] // TILE_K
    q = q.reshape(rows, blocks, PACK, PLANE).permute(1, 3, 0, 2)  # [B, j, N, i]
    return pack_int4(q.reshape(-1, PACK)).reshape(blocks * PLANE, rows)


def untile_qweight(tiled: torch.Tensor, k: int) -> torch.Tensor:
    """``tile_qweight``'s inverse: int32 [Kp/8, N] -> [N, K/8] for K input columns."""
    rows = tiled.shape[1]
    blocks = tiled.shape[0] // PLANE
    q = unpack_int4(tiled.reshape(-1, 1)).reshape(blocks, PLANE, rows, PACK)  # [B, j, N, i]
    q = q.permute(2, 0, 3, 1).reshape(rows, blocks * TILE_K)
    return pack_int4(q[:, :k].contiguous())


# ---- the reference ------------------------------------------------------------------------------


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """The layout -> float32 W [N, K] (in the sorted column order, where there is a perm)."""
    q = unpack_int4(qweight).float()  # [N, K]
    zero = zeros.float() if zeros is not None else torch.full_like(scales, SYMMETRIC_ZERO)
    return (q - per_column(zero, group_size)) * per_column(scales, group_size)


def per_column(per_group: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G, N] -> [N, K]: each group's value repeated over its columns."""
    return per_group.t().repeat_interleave(group_size, dim=1)


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (no bias): on CUDA the Triton kernels (qweight
    in their layout, ``tile_qweight``), elsewhere the weights dequantized and multiplied in x's
    dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if perm is not None:
        rows = rows.index_select(1, perm)
    if rows.is_cuda:
        out = w4a16_kernels().w4a16_gemm(rows, qweight, scales, zeros, group_size)
    else:
        out = F.linear(rows, dequantize(qweight, scales, zeros, group_size).to(x.dtype))
    return out.view(*x.shape[:-1], out.shape[-1])
