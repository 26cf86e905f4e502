"""Building blocks shared by the models: norms, rotary embeddings, merged linears, weight loading.

Numerics follow Hugging Face transformers (the reference our tests compare against): norms
compute in float32 and cast back, rotary cos/sin are computed in float32 then cast to the
activations' dtype.

The norms, rotary and activations dispatch: CUDA tensors go through the fused Triton kernels of
engine_core/models/triton_ops.py (a decode step of a small model is launch-bound, and each
of these is one launch there instead of several), everything else through the plain torch code
(the ``*_torch`` functions), which alone reproduces HF bit for bit. triton is imported only on the
CUDA branch, so CPU use never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import Fp8Config, Int8Config, W4A16Config
from engine_core.models.cpu_gemm import can_pack, pack_weight, packed_linear
from engine_core.models.fp8 import (
    FP8_DTYPE,
    FP8_DTYPES,
    attach_fp8_rows,
    fp8_linear,
    quantize_rows,
    weight_scale_shape,
)
from engine_core.models.gguf import GgufLayout, HoldsGgufBlocks, gguf_linear
from engine_core.models.int8 import attach_int8_rows, int8_linear
from engine_core.models.int8 import quantize_rows as int8_rows
from engine_core.models.meta_build import computed_buffer
from engine_core.models.pipeline import held_elsewhere
from engine_core.models.w4a16 import (
    PACK,
    act_order_permutation,
    check_trivial_g_idx,
    check_weight_shape,
    held_name,
    permute_columns,
    tile_qweight,
    to_layout,
    w4a16_linear,
)
from engine_core.parallel import SINGLE, PendingSum, TPGroup

# An HF checkpoint name -> (our parameter name, shard index in a merged parameter or None),
# or None for a checkpoint entry the model does not use (rotary caches, a tied lm_head).
NameMap = Callable[[str], tuple[str, int | None] | None]


def use_triton(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the fused Triton kernels: CUDA tensors do, all others not."""
    return x.is_cuda


def triton_ops() -> ModuleType:
    """The fused kernels' module, imported on first use: importing it imports triton."""
    from engine_core.models import triton_ops as ops

    return ops


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for a plain weight: on CUDA, in a CUDA graph, decode-sized products
    by the skinny GEMM where it takes them (engine_core/models/skinny_gemm.py ``decode_linear``),
    the rest by ``F.linear``."""
    if use_triton(x):
        from engine_core.models import skinny_gemm

        out = skinny_gemm.decode_linear(x, weight, bias) if skinny_gemm.graphed() else None
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def attach_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mark x with the per-token quantized form a fused kernel wrote beside it, where the linear
    of that format looks for it (int8 or e4m3 rows); returns x."""
    if rows[0].dtype == torch.int8:
        return attach_int8_rows(x, rows)
    return attach_fp8_rows(x, rows)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] -> [rows, N] with unit stride along N, as the row kernels index it."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``weight``, or with ``unit_offset`` (Gemma) by ``1 + weight``: Gemma
    checkpoints store the scale minus one."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        # Set when the norm feeds FP8 or INT8 linears on CUDA (fuse_quantizers in
        # models/llama.py): the kernel then also writes the per-token form of its output in this
        # dtype, e4m3 (models/fp8.py) or int8 (models/int8.py).
        self.quantize_output: torch.dtype | None = None

    def forward(
        self, x: torch.Tensor | PendingSum, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x [..., N] over its last dim. With ``residual`` (x's shape), normalize
        ``x + residual`` instead and return (normed, x + residual): the block's residual add
        rides in the next norm, one launch on CUDA. ``x`` may be a row-parallel layer's
        PendingSum (tensor parallelism): the same launch then sums it over the ranks first where
        the peer all-reduce's norm kernel takes it."""
        peer = None
        if isinstance(x, PendingSum):
            x, peer = x.for_norm() if residual is not None else (x.reduced(), None)
        if use_triton(x):
            # The kernel rounds the normalized x to x's dtype before scaling, as Llama does;
            # Gemma scales first. Identical in float32, within one rounding in bf16.
            weight = self.weight + 1.0 if self.unit_offset else self.weight
            rows, res = as_rows(x), residual_rows(residual)
            ops = triton_ops()
            dtype = self.quantize_output
            quantized = ops.quantized_rows(*rows.shape, dtype, rows.device) if dtype else None
            out = as_shape(ops.rms_norm(rows, weight, self.eps, res, quantized, peer), x.shape)
            if quantized is not None:
                attach_rows(out[0] if isinstance(out, tuple) else out, quantized)
            return out
        norm = gemma_rms_norm_torch if self.unit_offset else rms_norm_torch
        if residual is None:
            return norm(x, self.weight, self.eps)
        x = x + residual
        return norm(x, self.weight, self.eps), x


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalize in float32, round to the input dtype, then scale in that dtype."""
    dtype = x.dtype
    if dtype == torch.float32:  # no casts to dispatch: at one token a step they cost as much
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def gemma_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma RMSNorm: normalize and scale by (1 + weight) in float32, then round."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def norm_between(
    first: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: nn.Module,
    second: nn.Module,
    glu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(second(norm(first(x) + residual)), first(x) + residual) in two launches, the norm in
    neither of its own: on CUDA, in a CUDA graph, where the skinny GEMM takes both products
    (skinny_gemm ``decode_norm_between``; with ``glu`` ``second`` is an interleaved gate/up
    projection and the result its SiLU-and-mul). None where the three run as they are: no
    residual yet, a norm other than a plain RMSNorm (Gemma's, one that quantizes for FP8), a
    row-parallel ``first`` (tensor parallelism sums it in the norm), FP8 or packed weights,
    eager steps, larger products."""
    plain_norm = type(norm) is RMSNorm and not norm.unit_offset and not norm.quantize_output
    if residual is None or not plain_norm or not use_triton(x) or x.dim() != 2:
        return None
    if type(first) is not Linear or not plain_weights(first) or not plain_weights(second):
        return None
    from engine_core.models import skinny_gemm

    if not skinny_gemm.graphed():
        return None
    return skinny_gemm.decode_norm_between(
        x, first.weight, first.bias, as_rows(residual), norm.weight, norm.eps, second.weight,
        second.bias, glu,
    )  # fmt: skip


def plain_weights(linear: nn.Module) -> bool:
    """Whether ``linear`` is a Linear holding a plain (not quantized, not CPU-packed) weight."""
    return isinstance(linear, Linear) and not linear.quantized and linear.packed_weight is None


def residual_rows(residual: torch.Tensor | None) -> torch.Tensor | None:
    return None if residual is None else as_rows(residual)


def as_shape(
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor], shape: torch.Size
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A row kernel's output (or its pair of outputs) viewed in the input's shape again."""
    if isinstance(out, tuple):
        return out[0].view(shape), out[1].view(shape)
    return out.view(shape)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, same torch numerics) that can take the residual add in."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x [..., N]; with ``residual`` (x's shape), normalize ``x + residual`` and
        return (normed, x + residual), one launch on CUDA."""
        if use_triton(x) and self.weight is not None and self.bias is not None:
            rows, res = as_rows(x), residual_rows(residual)
            out = triton_ops().layer_norm(rows, self.weight, self.bias, self.eps, res)
            return as_shape(out, x.shape)
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) over the first ``rotary_dim`` dims of each
    head, with the "linear", "llama3" and "longrope" scalings.

    cos/sin are computed from the positions on the fly: one [T, rotary_dim] product per forward,
    shared by all layers, no max-length table and nothing data-dependent (CUDA-graph friendly);
    on CUDA in one Triton launch (triton_ops.rotary_cos_sin), bit for bit the torch code's.

    LongRoPE rotates with one factor set, chosen when the config is read (``use_long_factor``:
    the long set when the model's context exceeds its original one), and multiplies cos/sin by
    ``attention_factor``. HF switches sets as a sequence grows past the original length and
    then recomputes the whole cache; one fixed set keeps every cached key valid (prefix cache,
    chunks, preemption) and equals HF for prompts beyond the original length.
    """

    def __init__(self, rotary_dim: int, base: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.base, self.scaling = rotary_dim, base, scaling
        # LongRoPE and YaRN scale cos/sin (their config's attention_factor, resolved when read).
        scaled = rope_type_of(scaling) in ("longrope", "yarn")
        self.attention_factor = float(scaling["attention_factor"]) if scaled else 1.0
        inv_freq = computed_buffer(lambda: compute_inv_freq(rotary_dim, base, scaling))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute inv_freq in place (after ``to_empty`` turned a meta model into real memory)."""
        inv_freq = compute_inv_freq(self.head_dim, self.base, self.scaling)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, rotary_dim] in ``dtype``."""
        if use_triton(positions):  # the same numbers in one launch (seven in the torch code)
            ops = triton_ops()
            return ops.rotary_cos_sin(positions, self.inv_freq, self.attention_factor, dtype)
        return rotary_cos_sin_torch(positions, self.inv_freq, self.attention_factor, dtype)


def rotary_cos_sin_torch(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> (cos, sin), each [T, rotary_dim] in ``dtype``: float32 inside, the
    halves equal (rotate-half layout)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def reset_buffers(model: nn.Module) -> None:
    """Recompute every computed (non-checkpoint) buffer, e.g. after ``model.to_empty(...)``:
    each module that has them says how in its own ``reset_buffers`` (RotaryEmbedding,
    SparseMoE)."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if module is not model and callable(reset):  # a root that delegates here would recurse
            reset()


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def compute_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32 for the supported rope types."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return scale_llama3(inv_freq, scaling)
    if rope_type == "longrope":
        factors = scaling["long_factor" if scaling["use_long_factor"] else "short_factor"]
        return scale_longrope(head_dim, base, factors)
    if rope_type == "yarn":
        return scale_yarn(inv_freq, head_dim, base, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def scale_longrope(dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's per-frequency stretch, 1 / (factor_i * base^(2i / dim)), as HF computes it."""
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries, expected {dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)


def scale_yarn(
    inv_freq: torch.Tensor, dim: int, base: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (gpt-oss, DeepSeek-V3): each frequency blends the original one (extrapolation, the
    fast ones) and the one divided by factor (interpolation, the slow ones) along a linear ramp
    between the correction dims of beta_fast and beta_slow rotations, as HF computes it."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [dim / 2]
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def scale_llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] rotated by cos/sin [T, D] (as RotaryEmbedding builds them).

    On CUDA q and k are rotated in place, both in one launch, and returned: the callers hand in
    views of their own qkv projection, which nothing else reads. Elsewhere ``apply_rotary``, out
    of place: where k's heads follow q's in one tensor, once for both, and q and k come back as
    views of that one output (not contiguous past one token).
    A cos/sin narrower than the head (partial rotary) rotates its leading dims only.
    """
    if use_triton(q):
        rot = cos.shape[-1]
        triton_ops().rotary_inplace(q[..., :rot], k[..., :rot], cos, sin)
        return q, k
    both = adjacent_heads(q, k)
    if both is None:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # One rotation for q's and k's heads: at one token a step the ops' fixed cost, not their
    # work, is the time (half the ops, for a decoding layer on the CPU).
    rotated = apply_rotary(both, cos, sin)
    return rotated[:, : q.shape[1]], rotated[:, q.shape[1] :]


def adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, KVH, D] as one [T, H + KVH, D] view where k's heads follow q's in
    each row of one tensor (as a qkv projection's output splits), else None."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.shape[0] != k.shape[0]:
        return None
    tokens, heads, head_dim = q.shape
    # A single row's stride is arbitrary (views give a size-one dim any stride).
    same_rows = tokens <= 1 or q.stride(0) == k.stride(0)
    same_rows = same_rows and q.stride()[1:] == k.stride()[1:] == (head_dim, 1)
    follows = k.data_ptr() == q.data_ptr() + heads * head_dim * q.element_size()
    if not (same_rows and follows and k.shape[2] == head_dim):
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    return q.as_strided((tokens, heads + k.shape[1], head_dim), q.stride())


def norm_and_rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] through their per-head norms where the model has them
    (Qwen3), then rotated (rotate_qk). On CUDA, norms with a plain weight and a rotary over
    whole heads run with the rotary in one launch, in place."""
    if q_norm is None or k_norm is None:
        return rotate_qk(q, k, cos, sin)
    fusable = not (q_norm.unit_offset or k_norm.unit_offset) and cos.shape[-1] == q.shape[-1]
    if fusable and use_triton(q):
        triton_ops().qk_norm_rotary_inplace(
            q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps, cos, sin
        )
        return q, k
    return rotate_qk(q_norm(q), k_norm(k), cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, R] -> x with its first R dims rotated, rotate-half layout
    (torch, out of place)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary: the rest of each head passes through
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TPSharded:
    """A module whose parameters hold one tensor-parallel rank's part of a checkpoint tensor."""

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        """This rank's part of the full checkpoint ``tensor`` for parameter ``param_name``."""
        raise NotImplementedError


# Where a shard lives in its parameter: an index for ``param.data[...]`` (rows of a merged linear;
# (expert, rows) of stacked experts; (all groups, rows) of a W4A16 layer's per-group scales;
# (expert, all groups, rows) of W4A16 experts' scales).
ShardIndex = slice | int | tuple[int, slice] | tuple[slice, slice] | tuple[int, slice, slice]


class ShardedParameters:
    """A module some of whose parameters checkpoints may provide in pieces ("shards"): q, k and v
    apart for a merged qkv, or expert by expert for stacked experts. A whole tensor (shard None)
    fills every shard of its parameter at once."""

    def checkpoint_shards(self, param_name: str) -> range:
        """The shards a checkpoint provides parameter ``param_name`` in (empty: only whole)."""
        raise NotImplementedError

    def shard_index(self, param_name: str, shard: int) -> ShardIndex:
        """Where shard ``shard`` of parameter ``param_name`` lives in it."""
        raise NotImplementedError

    def holds_shard(self, param_name: str, shard: int) -> bool:
        """Whether this rank keeps shard ``shard`` at all (expert parallelism keeps only its
        own experts' shards; the others are other ranks')."""
        return True


def rank_rows(tensor: torch.Tensor, tp: TPGroup, dim: int = 0) -> torch.Tensor:
    """Rank ``tp.rank``'s contiguous 1/size of ``tensor`` along ``dim``."""
    if tp.size == 1:
        return tensor
    size = tensor.shape[dim] // tp.size
    return tensor.narrow(dim, tp.rank * size, size)


def check_divisible(what: str, value: int, tp: TPGroup) -> int:
    """value // tp.size, or a ValueError naming what cannot be split."""
    if value % tp.size:
        raise ValueError(
            f"--tensor-parallel-size {tp.size} does not divide the model's {what} ({value})"
        )
    return value // tp.size


class LoadsQuantized:
    """A module that takes the tensors of a quantized checkpoint its own way (scales in its
    layout, weights checked to be in its format) once it holds a quantized format."""

    @property
    def quantized(self) -> bool:
        raise NotImplementedError

    def load_quantized(
        self, param_name: str, tensor: torch.Tensor, index: ShardIndex | None, hf_name: str
    ) -> None:
        raise NotImplementedError

    def quantized_form(
        self, param_name: str, tensor: torch.Tensor, hf_name: str
    ) -> list[tuple[str, torch.Tensor]]:
        """[(parameter name, tensor)] the module holds for a checkpoint tensor of
        ``param_name``: as it is, unless the module quantizes plain weights as they load."""
        return [(param_name, tensor)]


def check_plain_weight(tensor: torch.Tensor, hf_name: str) -> None:
    """A weight to quantize as it loads must be a plain float one: an integer or FP8 tensor
    needs the quantization_config that says how to read its scales."""
    if not tensor.is_floating_point() or tensor.dtype in FP8_DTYPES:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is already {tensor.dtype}, but config.json declares "
            "no quantization_config that says how to read its scales"
        )


def check_held_dtype(tensor: torch.Tensor, dtype: torch.dtype, source: str, hf_name: str) -> None:
    """A quantized checkpoint's weight is in the format its quantization_config declares."""
    if tensor.dtype != dtype:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is {tensor.dtype}, but the checkpoint's "
            f"quantization_config ({source}) makes this layer {dtype}"
        )


def checkpoint_scale(
    tensor: torch.Tensor, target: torch.Tensor, per_channel: bool, hf_name: str
) -> torch.Tensor:
    """A checkpoint scale as parameter ``target`` holds it: float32; per-channel scales as
    [rows] (a per-tensor scale spread over its rows); checked finite and positive."""
    tensor = tensor.float()
    check_positive(tensor, hf_name)
    if per_channel:
        if tensor.numel() == 1:
            return tensor.reshape(()).expand(target.shape)
        if tensor.dim() == 2 and tensor.shape[1] == 1:  # compressed-tensors: [rows, 1]
            return tensor[:, 0]
    return tensor


class Linear(nn.Linear, LoadsQuantized, HoldsGgufBlocks):
    """nn.Linear whose weight may be held in a quantized format, chosen before it loads:

    - ``make_fp8`` (engine_core/models/fp8.py): ``weight`` e4m3, ``weight_scale`` (and, with
      static activations, ``input_scale``);
    - ``make_int8`` (W8A8, engine_core/models/int8.py): ``weight`` int8, ``weight_scale``;
    - ``make_w4a16`` (engine_core/models/w4a16.py): ``qweight``, ``scales``, ``zeros`` and, with
      act-order, ``g_idx`` in place of ``weight``; checkpoint tensors are repacked into that
      layout as they load (``w4a16_form``) and act-order columns sorted once they are in
      (``finish_loading``);
    - ``make_gguf`` (engine_core/models/gguf.py): ``gguf_blocks``, each part's GGUF blocks as
      planes, in place of ``weight``; each part's raw rows load into their planes.

    ``load_quantized`` takes the checkpoint's tensors into them. Under ``--quantization fp8`` or
    ``w8a8`` the loader quantizes plain weights first (``held_form``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fp8: Fp8Config | None = None
        self.int8: Int8Config | None = None
        self.w4a16: W4A16Config | None = None
        self.group_size = 0  # W4A16: input columns per scale
        self.w4a16_tiled = False  # W4A16 on CUDA: qweight in the kernel's layout
        self.gguf: GgufLayout | None = None
        # The weight in oneDNN's layout (models/cpu_gemm.py), once ``pack_for_cpu`` has run.
        self.packed_weight: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        """Whether the weight is held in a quantized format."""
        formats = (self.fp8, self.int8, self.w4a16, self.gguf)
        return any(config is not None for config in formats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        if not self.quantized:
            return dense_linear(x, self.weight, self.bias)
        if self.int8 is not None:  # the bias in the GEMM's epilogue: one rounding
            return int8_linear(x, self.weight, self.weight_scale, self.bias)
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ weight.T -> [..., out], without the bias."""
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, None)
        if self.gguf is not None:
            return gguf_linear(x, self.gguf_planes(), self.out_features)
        if self.w4a16 is not None:
            return w4a16_linear(
                x, self.qweight, self.scales, self.zeros, self.perm, self.group_size
            )
        if self.int8 is not None:
            return int8_linear(x, self.weight, self.weight_scale)
        if self.fp8 is None:
            return dense_linear(x, self.weight)
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.fp8)

    def pack_for_cpu(self) -> None:
        """Hold a plain CPU weight in oneDNN's layout from now on (after loading; quantized
        weights stay as they are). The packed copy replaces the plain one, so the model is not
        held twice."""
        if self.quantized or not can_pack(self.weight):
            return
        self.packed_weight = pack_weight(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    @property
    def num_input_scales(self) -> int:
        """How many static activation scales a checkpoint gives (one per merged part)."""
        return 1

    @property
    def output_parts(self) -> list[int]:
        """The row counts of the linears this one holds (one; a merged linear's parts)."""
        return [self.out_features]

    @property
    def checkpoint_shape(self) -> tuple[list[int], int]:
        """(the row counts of the checkpoint's parts, its input columns): the layer's own
        sizes at TP=1; under tensor parallelism the whole tensors', of which it holds a share."""
        return self.output_parts, self.in_features

    def make_fp8(self, config: Fp8Config) -> None:
        """Hold the weight in FP8 from now on (call before loading, on any device)."""
        (rows, cols), device = self.weight.shape, self.weight.device
        self.weight = empty_param((rows, cols), FP8_DTYPE, device)
        self.weight_scale = empty_param(
            weight_scale_shape(config, rows, cols), torch.float32, device
        )
        if config.dynamic_activations:
            self.register_parameter("input_scale", None)
        else:
            self.input_scale = empty_param((self.num_input_scales,), torch.float32, device)
        self.fp8 = config

    def make_int8(self, config: Int8Config) -> None:
        """Hold the weight in int8 with a scale per row from now on (W8A8)."""
        (rows, cols), device = self.weight.shape, self.weight.device
        self.weight = empty_param((rows, cols), torch.int8, device)
        self.weight_scale = empty_param((rows,), torch.float32, device)
        self.int8 = config

    def make_w4a16(self, config: W4A16Config, where: str) -> None:
        """Hold the weight in the W4A16 layout from now on (engine_core/models/w4a16.py);
        ``where`` names the layer in errors about shapes the format cannot hold."""
        (rows, cols), device = self.weight.shape, self.weight.device
        self.group_size = check_w4a16_shapes(config, cols, self.output_parts, where)
        groups = cols // self.group_size
        self.register_parameter("weight", None)
        self.qweight = empty_param((rows, cols // PACK), torch.int32, device)
        self.scales = empty_param((groups, rows), torch.float32, device)
        zeros = empty_param((groups, rows), torch.uint8, device) if config.zero_points else None
        self.register_parameter("zeros", zeros)
        g_idx = empty_param((self.num_input_scales, cols), torch.int32, device)
        self.register_parameter("g_idx", g_idx if config.act_order else None)
        self.register_buffer("perm", None)  # finish_loading sets it for act-order columns
        self.w4a16 = config

    def make_gguf(self, types: tuple[str, ...]) -> None:
        """Hold the weight as GGUF blocks from now on, part i of type ``types[i]``
        (engine_core/models/gguf.py)."""
        layout = GgufLayout(types, tuple(self.output_parts), self.in_features)
        device = self.weight.device
        self.register_parameter("weight", None)
        self.gguf_blocks = empty_param((layout.nbytes,), torch.uint8, device)
        self.gguf = layout

    @property
    def quantizes_at_load(self) -> bool:
        """Whether this layer quantizes plain checkpoint weights (``--quantization fp8``,
        ``w8a8``)."""
        config = self.fp8 or self.int8
        return config is not None and not config.prequantized

    def w4a16_form(
        self, param_name: str, tensor: torch.Tensor, hf_name: str
    ) -> list[tuple[str, torch.Tensor]]:
        """[(our parameter, tensor)] for a W4A16 layer's checkpoint tensor: repacked into our
        layout, or checked and dropped (compressed-tensors' weight_shape, GPTQ's g_idx without
        act-order)."""
        config = self.w4a16
        assert config is not None
        if param_name == "weight":
            raise ValueError(
                f"checkpoint tensor {hf_name!r} is a plain weight, but the checkpoint's "
                f"quantization_config ({config.source}) makes this layer 4-bit"
            )
        name = held_name(config, param_name)
        if name is None:
            check_weight_shape(tensor, *self.checkpoint_shape, hf_name)
            return []
        if name == "g_idx" and not config.act_order:
            check_trivial_g_idx(tensor, config.group_size, hf_name)
            return []
        held = to_layout(config, name, tensor, hf_name)
        return [(name, held.reshape(1, -1) if name == "g_idx" else held)]

    def load_quantized(
        self, param_name: str, tensor: torch.Tensor, index: ShardIndex | None, hf_name: str
    ) -> None:
        """Load checkpoint tensor ``hf_name`` (this rank's part, in our layout) into
        ``param_name`` at ``index`` (None: all of it) of this quantized layer."""
        if param_name == "gguf_blocks":
            assert not isinstance(index, tuple | slice)  # a merged layer's part number
            self.load_gguf_part(tensor, index, hf_name)
            return
        if param_name == "weight" and self.w4a16 is None:
            config, dtype = (self.int8, torch.int8) if self.int8 else (self.fp8, FP8_DTYPE)
            check_held_dtype(tensor, dtype, config.source, hf_name)
        if param_name in ("weight_scale", "input_scale"):
            tensor = self.scale_for(param_name, tensor, index, hf_name)
        if param_name == "scales":
            check_positive(tensor, hf_name)
        copy_into(getattr(self, param_name), tensor, index, hf_name)

    def scale_for(
        self, param_name: str, tensor: torch.Tensor, index: ShardIndex | None, hf_name: str
    ) -> torch.Tensor:
        """A checkpoint scale as our parameter holds it (``checkpoint_scale``)."""
        target = getattr(self, param_name).data
        target = target if index is None else target[index]
        per_channel = param_name == "input_scale" or self.fp8 is None or self.fp8.block is None
        return checkpoint_scale(tensor, target, per_channel, hf_name)

    def finish_loading(self, name: str) -> None:
        """After the last tensor: merged parts share one input, so one static activation scale
        serves them all: the largest, which clips none of them. An act-order W4A16 layer sorts
        its columns by group (w4a16.py: ``perm``)."""
        if self.fp8 is not None and self.input_scale is not None and self.input_scale.numel() > 1:
            self.input_scale = nn.Parameter(self.input_scale.amax().reshape(1), requires_grad=False)
        if self.w4a16 is not None and self.g_idx is not None:
            perm = act_order_permutation(self.g_idx.data, self.group_size, name)
            if perm is not None:
                self.qweight.data = permute_columns(self.qweight.data, perm)
                self.perm = perm
            self.register_parameter("g_idx", None)
        self.tile_w4a16_for_cuda()

    def tile_w4a16_for_cuda(self) -> None:
        """On CUDA, hold a loaded W4A16 weight's words in the GEMM kernel's layout from now on
        (w4a16.py ``tile_qweight``); on the CPU they stay as loaded, which the reference reads.
        Once: tiling twice would scramble them."""
        if self.w4a16 is None or self.w4a16_tiled or not self.qweight.is_cuda:
            return
        self.qweight = nn.Parameter(tile_qweight(self.qweight.data), requires_grad=False)
        self.w4a16_tiled = True
        # The repack's temporaries (about 8 bytes a weight) and the loaded words go back to the
        # driver, not the allocator's cache, which the KV cache's sizing would count as used.
        torch.cuda.empty_cache()


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter (on the meta device while a model is built)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def check_positive(scale: torch.Tensor, hf_name: str) -> None:
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ValueError(f"checkpoint scale {hf_name!r} has values that are not positive")


def check_w4a16_shapes(config: W4A16Config, cols: int, parts: list[int], where: str) -> int:
    """The layer's group size (``cols`` for -1), or a ValueError naming what the checkpoint's
    format cannot hold: every layout packs eight columns to a word, and AWQ's weights and every
    zero point eight rows."""
    group = cols if config.group_size == -1 else config.group_size
    if cols % PACK:
        raise ValueError(f"{where}: W4A16 needs the input size ({cols}) to be a multiple of 8")
    if cols % group:
        raise ValueError(
            f"quantization_config.group_size {config.group_size} does not divide the input size "
            f"({cols}) of {where}"
        )
    packs_rows = config.source == "awq" or config.zero_points
    if packs_rows and any(part % PACK for part in parts):
        raise ValueError(f"{where}: {config.source} packs 8 output rows to a word, and its "
                         f"parts have {parts} rows")  # fmt: skip
    return group


class MergedLinear(Linear, TPSharded, ShardedParameters):
    """Several linears sharing one input, stacked along the output dim: one GEMM instead of many.

    ``output_sizes`` gives each shard's rows in order (q, k, v or gate, up); checkpoints still
    hold them apart, and ``shard_slice`` says where shard i lives. Column-parallel under tensor
    parallelism: each rank holds its 1/size of every shard, so the local output is still
    (q, k, v) in order, each ``output_sizes[i]`` (the local size) wide.
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup = SINGLE
    ) -> None:
        local = [check_divisible("projection width", size, tp) for size in output_sizes]
        super().__init__(in_features, sum(local), bias=bias)
        self.output_sizes = local
        self.tp = tp

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def checkpoint_shards(self, param_name: str) -> range:
        return range(self.num_shards)

    def shard_index(self, param_name: str, shard: int) -> ShardIndex:
        if param_name in ("input_scale", "gguf_blocks"):  # one per part; GGUF: the part's blocks
            return shard
        if param_name == "g_idx":  # W4A16 act-order: one row per part
            return slice(shard, shard + 1)
        if param_name in ("scales", "zeros"):  # W4A16: [groups, rows]
            return slice(None), self.shard_slice(shard)
        if param_name == "weight_scale" and self.fp8 is not None and self.fp8.block is not None:
            rows = self.shard_slice(shard)
            block_rows = self.fp8.block[0]
            return slice(rows.start // block_rows, rows.stop // block_rows)
        return self.shard_slice(shard)

    @property
    def num_input_scales(self) -> int:
        return self.num_shards

    @property
    def output_parts(self) -> list[int]:
        return list(self.output_sizes)

    @property
    def checkpoint_shape(self) -> tuple[list[int], int]:
        return [size * self.tp.size for size in self.output_sizes], self.in_features

    def make_fp8(self, config: Fp8Config) -> None:
        if config.block is not None and any(size % config.block[0] for size in self.output_sizes):
            raise ValueError(
                f"block-wise FP8 ({config.block[0]}-row blocks) needs every part of a merged "
                f"projection to be whole blocks; this rank's parts are {self.output_sizes} rows"
            )
        super().make_fp8(config)

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        if one_scale(param_name, tensor):  # for the whole part: every rank keeps it
            return tensor
        if param_name == "g_idx":  # W4A16 act-order: every rank reads every input column
            return tensor
        return rank_rows(tensor, self.tp, dim=output_dim(param_name))


class ColumnParallelLinear(Linear, TPSharded):
    """A linear whose output rows are split across ranks; the checkpoint holds it as one tensor.

    ``pieces`` are the full row counts of the blocks stacked in that tensor (GPT-2's c_attn holds
    q, k and v together); each piece is split, so the local output keeps the blocks in order.
    """

    def __init__(self, in_features: int, pieces: list[int], bias: bool, tp: TPGroup) -> None:
        local = [check_divisible("projection width", size, tp) for size in pieces]
        super().__init__(in_features, sum(local), bias=bias)
        self.pieces = list(pieces)
        self.tp = tp

    @property
    def checkpoint_shape(self) -> tuple[list[int], int]:
        """The whole tensor's rows, all pieces together (compressed-tensors' weight_shape says
        it of the checkpoint, of which this rank holds a share)."""
        return [sum(self.pieces)], self.in_features

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        """Each piece's rank rows; a scale tensor (block FP8's [row blocks, column blocks],
        W4A16's [groups, rows]) holds the pieces' rows in blocks, split the same way
        (``check_quantized_split`` makes every share whole blocks)."""
        dim = output_dim(param_name)
        if one_scale(param_name, tensor):  # for the whole layer: every rank keeps it
            return tensor
        rows_per_entry = sum(self.pieces) // tensor.shape[dim]
        parts = tensor.split([piece // rows_per_entry for piece in self.pieces], dim=dim)
        return torch.cat([rank_rows(part, self.tp, dim) for part in parts], dim=dim)


class RowParallelLinear(Linear, TPSharded):
    """A linear whose input columns are split across ranks: partial products, summed by an
    all-reduce; the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(check_divisible("projection input", in_features, tp), out_features, bias)
        self.tp = tp
        # Set (bias-less layers only) where the output goes straight into an RMSNorm with the
        # residual, which then does the all-reduce (models/llama.py defer_row_parallel_sums).
        self.defer_sum = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | PendingSum:
        return self.sum_partial(self.matmul(x))

    def sum_partial(self, partial: torch.Tensor) -> torch.Tensor | PendingSum:
        """This rank's partial product [T, out] summed over the ranks (or left to the next
        norm), then the bias. LoRA adds its own partial delta before the sum (lora/layers.py)."""
        if self.defer_sum:
            return PendingSum(partial, self.tp)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def make_fp8(self, config: Fp8Config) -> None:
        if config.block is not None and self.in_features % config.block[1]:
            raise ValueError(
                f"block-wise FP8 ({config.block[1]}-column blocks) needs this rank's share of "
                f"a row-parallel projection's input ({self.in_features}) to be whole blocks"
            )
        super().make_fp8(config)

    @property
    def checkpoint_shape(self) -> tuple[list[int], int]:
        return self.output_parts, self.in_features * self.tp.size

    def make_w4a16(self, config: W4A16Config, where: str) -> None:
        group = config.group_size
        if self.in_features % PACK or (group != -1 and self.in_features % group):
            raise ValueError(
                f"{where}: W4A16 under --tensor-parallel-size {self.tp.size} needs each rank's "
                f"share of the input ({self.in_features} of {self.in_features * self.tp.size} "
                f"columns) to be whole words of 8 columns and whole groups of {group}"
            )
        super().make_w4a16(config, where)

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        # Weights (and block scales, and W4A16's groups) split along the input; per-row scales
        # stay whole, and so does W4A16's one group over the whole input (group size -1).
        blockwise = self.fp8 is not None and self.fp8.block is not None
        if param_name in ("weight", "qweight") or (param_name == "weight_scale" and blockwise):
            return rank_rows(tensor, self.tp, dim=1)
        if param_name == "g_idx":
            return self.rank_groups(rank_rows(tensor, self.tp, dim=1))
        one_group = self.w4a16 is not None and self.w4a16.group_size == -1
        if param_name in ("scales", "zeros") and not one_group:  # [groups, rows]
            return rank_rows(tensor, self.tp, dim=0)
        return tensor

    def rank_groups(self, g_idx: torch.Tensor) -> torch.Tensor:
        """Act-order ``g_idx`` [1, K / size] of this rank's input columns, numbered within the
        rank's own groups; a ValueError where they lie in other ranks' groups: an act-order
        quantizer orders columns by the activations' statistics, so a group may span ranks."""
        if self.w4a16 is None or self.w4a16.group_size == -1:  # one group: the same on every rank
            return g_idx
        groups = self.in_features // self.group_size
        local = g_idx - self.tp.rank * groups
        if bool(((local < 0) | (local >= groups)).any()):
            raise ValueError(
                f"act-order g_idx puts some of tensor-parallel rank {self.tp.rank}'s input "
                f"columns of a row-parallel layer in other ranks' groups: its groups do not "
                f"split over --tensor-parallel-size {self.tp.size}; serve this checkpoint with "
                "--tensor-parallel-size 1, or one quantized without act-order (desc_act)"
            )
        return local


class VocabParallelEmbedding(nn.Module, TPSharded):
    """Embedding rows split across ranks in contiguous slices of ceil(vocab / size) rows, the last
    slice padded with zero rows. Also the weight of a vocabulary-parallel LM head.

    A lookup zeroes the tokens other ranks own and sums over the ranks with an all-reduce.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.rows)  # [T]
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(out.masked_fill(elsewhere[:, None], 0.0))

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        part = tensor[self.start : self.start + self.rows]
        if part.shape[0] == self.rows:
            return part
        padded = tensor.new_zeros(self.rows, tensor.shape[1])
        padded[: part.shape[0]] = part
        return padded


def one_scale(param_name: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is an FP8 per-tensor weight or input scale (one value)."""
    return param_name in ("weight_scale", "input_scale") and tensor.numel() == 1


def output_dim(param_name: str) -> int:
    """The dim of a checkpoint tensor that runs along the layer's output rows: 1 for W4A16's
    per-group scales and zero points ([groups, rows]), 0 for the rest."""
    return 1 if param_name in ("scales", "zeros") else 0


def column_parallel_linear(
    in_features: int, pieces: list[int], bias: bool, tp: TPGroup
) -> nn.Linear:
    """nn.Linear at TP=1, else its column-parallel form (see ColumnParallelLinear)."""
    if tp.size == 1:
        return Linear(in_features, sum(pieces), bias=bias)
    return ColumnParallelLinear(in_features, pieces, bias, tp)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup) -> Linear:
    """Linear at TP=1, else RowParallelLinear."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TPGroup) -> nn.Module:
    """nn.Embedding at TP=1, else VocabParallelEmbedding."""
    if tp.size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(vocab_size: int, hidden_size: int, tp: TPGroup) -> nn.Module:
    """An untied LM head's weight holder: nn.Linear at TP=1, else vocabulary-parallel rows."""
    if tp.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def project_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tp: TPGroup,
    vocab_size: int,
    packed: torch.Tensor | None = None,
    widen: bool = True,
) -> torch.Tensor | None:
    """hidden [N, hidden] -> logits [N, vocab] float32; under tensor parallelism the vocabulary
    shards are gathered to rank 0, and the other ranks get None. ``packed``: the same weight in
    oneDNN's layout (CPU), used instead of ``weight`` where given. ``widen=False`` leaves them in
    the product's dtype (the sampler widens them only for rows that need more than an argmax:
    at 256 rows and a 128k vocabulary the float32 copy is 0.1 ms of HBM traffic a step)."""
    # [N, vocab / tp]
    logits = F.linear(hidden, weight) if packed is None else packed_linear(hidden, packed, None)
    if tp.size == 1:
        return logits.float() if widen else logits
    return tp.gather_vocab(logits, vocab_size, widen)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]; one launch on CUDA."""
    if use_triton(gate_up):
        return triton_ops().silu_and_mul(as_rows(gate_up))
    return silu_and_mul_torch(gate_up)


def interleaved_silu_glu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] of x [T, K] through a gate/up weight whose rows
    skinny_gemm.interleave_gate_up arranged (CUDA only, models/llama.py interleave_gate_ups): in
    a CUDA graph, in the skinny GEMM's epilogue where it takes the product (decode sizes), else
    the product by cuBLAS and a SiLU-and-mul that reads the interleaved columns."""
    from engine_core.models import skinny_gemm

    rows = as_rows(x)
    act = skinny_gemm.decode_glu(rows, weight) if skinny_gemm.graphed() else None
    if act is None:
        act = triton_ops().silu_and_mul(F.linear(rows, weight), skinny_gemm.GLU_HALF)
    return act.view(*x.shape[:-1], act.shape[-1])


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> gelu_tanh(gate) * up, [T, I]: Gemma's GeGLU (HF's
    "gelu_pytorch_tanh"); torch on every device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# hidden_act -> the gated activation of a merged gate/up projection's output.
ACT_AND_MUL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU (HF "gelu_new"); one launch on CUDA."""
    if use_triton(x):
        return triton_ops().gelu_new(x)
    return gelu_new_torch(x)


def gelu_new_torch(x: torch.Tensor) -> torch.Tensor:
    """gelu_new written out as HF does."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def load_mapped_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], map_name: NameMap
) -> None:
    """Copy checkpoint tensors into ``model`` through ``map_name``; every parameter must be set.

    Raises ValueError on an unknown checkpoint name, a shape mismatch, or a parameter (or a shard
    of a merged one) that the checkpoint never provided.
    """
    params = dict(model.named_parameters())
    expected = expected_shards(model)
    for hf_name, whole in weights:
        target = map_name(hf_name)
        if target is None or held_elsewhere(model, target[0]):  # another pipeline stage's
            continue
        name, shard = target
        for held, full in held_form(model, name, whole, hf_name):
            if held not in params:
                raise unknown_parameter(hf_name, held)
            if shard is not None and not holds_shard(model, held, shard):
                continue
            tensor = narrow_for_rank(model, held, full, shard)
            load_tensor(model, held, tensor, shard_rows(model, held, shard), hf_name)
            expected.discard((held, shard))
            if shard is None:  # a whole tensor fills every shard of its parameter
                expected.difference_update((held, i) for i in checkpoint_shards(model, held))
    if expected:
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected)
        raise ValueError(
            f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]} (the model's names: "
            "a checkpoint's q/k/v or gate/up projections, or experts, fill the shards [i] of "
            "merged ones, qzeros or weight_zero_point fill zeros, weight_scale_inv fills "
            "weight_scale)"
        )
    for module_name, module in model.named_modules():
        finish = getattr(module, "finish_loading", None)  # Linear's, SparseMoE's
        if finish is not None:
            finish(module_name)


# The tensors quantized checkpoints hold beside (or instead of) a weight: AWQ/GPTQ, compressed-
# tensors and FP8 names.
QUANTIZED_TENSOR_NAMES = {
    "qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape",
    "weight_zero_point", "weight_scale_inv", "input_scale",
}  # fmt: skip


def unknown_parameter(hf_name: str, held: str) -> ValueError:
    """The error for a checkpoint tensor with no parameter to go to: named as quantized where
    it is one of a layer we hold unquantized (a vision tower's or the LM head's, which the
    checkpoint's ignore list did not leave in float), else as unknown."""
    if hf_name.rpartition(".")[2] in QUANTIZED_TENSOR_NAMES:
        return ValueError(
            f"checkpoint tensor {hf_name!r} is quantized, but Tandem holds that layer "
            "unquantized (quantized vision towers and LM heads are not implemented: the "
            "checkpoint's quantization_config must leave the layer out)"
        )
    return ValueError(f"checkpoint tensor {hf_name!r} maps to unknown parameter {held!r}")


def held_form(
    model: nn.Module, name: str, tensor: torch.Tensor, hf_name: str
) -> list[tuple[str, torch.Tensor]]:
    """[(parameter name, full tensor)] for the checkpoint tensor of parameter ``name``: as it
    is; for a W4A16 layer, in its layout (or nothing: a tensor only checked); for the weight of
    a layer that quantizes as it loads, its e4m3 or int8 rows and their scales. Whole rows are
    quantized before tensor parallelism narrows them, so every rank holds TP=1's values."""
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return [(name, tensor)]  # no such module: reported as an unknown parameter
    if not isinstance(module, LoadsQuantized) or not module.quantized:
        return [(name, tensor)]
    if not isinstance(module, Linear):
        form = module.quantized_form(param_name, tensor, hf_name)
        return [(f"{module_name}.{p}", t) for p, t in form]
    if module.w4a16 is not None:
        return [
            (f"{module_name}.{p}", t) for p, t in module.w4a16_form(param_name, tensor, hf_name)
        ]
    if module.gguf is not None and param_name == "weight":
        return [(f"{module_name}.gguf_blocks", tensor)]
    if param_name != "weight" or not module.quantizes_at_load:
        return [(name, tensor)]
    check_plain_weight(tensor, hf_name)
    quantize = int8_rows if module.int8 is not None else quantize_rows
    quantized, scale = quantize(tensor.to(module.weight.device))
    return [(name, quantized), (f"{module_name}.weight_scale", scale)]


def load_tensor(
    model: nn.Module, name: str, tensor: torch.Tensor, rows: ShardIndex | None, hf_name: str
) -> None:
    """Copy one checkpoint tensor into parameter ``name``; a quantized layer takes it its own
    way; a quantized tensor is refused for a plain parameter."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, LoadsQuantized) and module.quantized:
        module.load_quantized(param_name, tensor, rows, hf_name)
        return
    param = getattr(module, param_name)
    # A parameter that is itself integer (MXFP4 experts' codes and scales) takes integers.
    if tensor.dtype in FP8_DTYPES or (not tensor.is_floating_point() and param.is_floating_point()):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is {tensor.dtype}, but config.json declares no "
            "quantization_config for it (or lists its module as not quantized)"
        )
    copy_into(param, tensor, rows, hf_name)


def expected_shards(model: nn.Module) -> set[tuple[str, int | None]]:
    """(parameter name, shard) for every tensor a checkpoint must provide."""
    expected: set[tuple[str, int | None]] = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            shards = checkpoint_shards(model, name)
            if shards:
                expected.update((name, i) for i in shards)
            else:
                expected.add((name, None))
    return expected


def checkpoint_shards(model: nn.Module, name: str) -> range:
    """The shards a checkpoint may provide parameter ``name`` in (empty: only whole)."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, ShardedParameters):
        return module.checkpoint_shards(param_name)
    return range(0)


def holds_shard(model: nn.Module, name: str, shard: int) -> bool:
    """Whether this rank keeps shard ``shard`` of parameter ``name``."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    return not isinstance(module, ShardedParameters) or module.holds_shard(param_name, shard)


def narrow_for_rank(
    model: nn.Module, name: str, tensor: torch.Tensor, shard: int | None
) -> torch.Tensor:
    """The part of a full checkpoint tensor that this tensor-parallel rank holds (all at TP=1)."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, TPSharded):
        return module.narrow_checkpoint(param_name, tensor, shard)
    return tensor


def shard_rows(model: nn.Module, name: str, shard: int | None) -> ShardIndex | None:
    """Where in parameter ``name`` shard ``shard`` goes (None: the whole tensor)."""
    if shard is None:
        return None
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if not isinstance(module, ShardedParameters):
        raise ValueError(f"{name} is not a merged parameter but got shard {shard}")
    return module.shard_index(param_name, shard)


def copy_into(
    param: nn.Parameter, tensor: torch.Tensor, rows: ShardIndex | None, hf_name: str
) -> None:
    target = param.data if rows is None else param.data[rows]
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


def pack_cpu_weights(model: nn.Module) -> None:
    """Pack every plain linear of a CPU model, and its LM head (a copy: a tied embedding still
    needs the plain matrix for lookups), for oneDNN."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()
    logits_weight = model.logits_weight()
    if logits_weight is not None and can_pack(logits_weight):  # None: another stage's head
        model.packed_logits_weight = pack_weight(logits_weight)
