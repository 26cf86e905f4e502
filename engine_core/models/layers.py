"""Building blocks shared by the models: norms, rotary embeddings, merged linears, weight loading.

Numerics follow Hugging Face transformers (the reference our tests compare against): norms
compute in float32 and cast back, rotary cos/sin are computed in float32 then cast to the
activations' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# An HF checkpoint name -> (our parameter name, shard index in a merged parameter or None),
# or None for a checkpoint entry the model does not use (rotary caches, a tied lm_head).
NameMap = Callable[[str], tuple[str, int | None] | None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dim, in float32 as HF does, then scale in the input dtype."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout), with the "linear" and "llama3" scalings.

    cos/sin are computed from the positions on the fly: one [T, D] product per forward, shared by
    all layers, no max-length table and nothing data-dependent (CUDA-graph friendly).
    """

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.base, self.scaling = head_dim, base, scaling
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute inv_freq in place (after ``to_empty`` turned a meta model into real memory)."""
        inv_freq = compute_inv_freq(self.head_dim, self.base, self.scaling)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def reset_buffers(model: nn.Module) -> None:
    """Recompute every computed (non-checkpoint) buffer, e.g. after ``model.to_empty(...)``."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()


def compute_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32 for the supported rope types."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return scale_llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D] -> x rotated, rotate-half layout."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MergedLinear(nn.Linear):
    """Several linears sharing one input, stacked along the output dim: one GEMM instead of many.

    ``output_sizes`` gives each shard's rows in order (q, k, v or gate, up); checkpoints still
    hold them apart, and ``shard_slice`` says where shard i lives.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU (HF "gelu_new"), written out as HF does."""
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
    for hf_name, tensor in weights:
        target = map_name(hf_name)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} maps to unknown parameter {name!r}")
        copy_into(params[name], tensor, shard_rows(model, name, shard), hf_name)
        expected.discard((name, shard))
    if expected:
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected)
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")


def expected_shards(model: nn.Module) -> set[tuple[str, int | None]]:
    """(parameter name, shard) for every tensor a checkpoint must provide."""
    expected: set[tuple[str, int | None]] = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, MergedLinear):
                expected.update((name, i) for i in range(module.num_shards))
            else:
                expected.add((name, None))
    return expected


def shard_rows(model: nn.Module, name: str, shard: int | None) -> slice | None:
    """The rows of parameter ``name`` that shard ``shard`` fills (None: the whole tensor)."""
    if shard is None:
        return None
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if not isinstance(module, MergedLinear):
        raise ValueError(f"{name} is not a merged parameter but got shard {shard}")
    return module.shard_slice(shard)


def copy_into(param: nn.Parameter, tensor: torch.Tensor, rows: slice | None, hf_name: str) -> None:
    target = param.data if rows is None else param.data[rows]
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)
