"""Projections with LoRA slots, and the LoRA product of a batch that mixes adapters.

Each targeted projection keeps, for every slot, one stacked A and one B sized for the largest
rank: ``a`` [slots, shards * max_rank, in] and ``b`` [slots, out, shards * max_rank]. Shard i of
a merged projection (q, k, v; gate, up) owns rank columns [i * max_rank, i * max_rank + r) and
its own output rows of B, so one shrink and one expand per slot serve all its shards; unused
ranks and shards are zeros. The scale is folded into B when a slot is written.

A step's rows are grouped by slot (``LoraBatch``): for each slot in use,
``out[rows] += (x[rows] @ a[slot].T) @ b[slot].T``. This torch form is the reference; on CUDA
a segment kernel (shrink then expand over each request's contiguous rows, grouped by slot, as
the peers' SGMV/BGMV do) can take its place from ``LoraBatch.token_slots``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.forward_context import current_lora_batch
from engine_core.lora.adapter import LoraWeights, TargetShape
from engine_core.lora.batch import LoraBatch


def add_lora(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoraBatch
) -> torch.Tensor:
    """out [T, O] += each row's slot's x @ A.T @ B.T (x [T, I], a [S, R, I], b [S, O, R])."""
    for slot, rows in batch.groups:
        if rows is None:
            out += (x @ a[slot].T) @ b[slot].T
        else:
            xs = x.index_select(0, rows)  # [n, I]
            out.index_add_(0, rows, (xs @ a[slot].T) @ b[slot].T)
    return out


class LoraLinear(nn.Module):
    """A projection with LoRA slots: the base layer's output plus, for each row whose request
    has an adapter, that adapter's delta. The base layer keeps its form (packed for the CPU,
    quantized); the delta reads the plain input."""

    def __init__(
        self,
        base: nn.Module,
        shape: TargetShape,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.shape = shape
        self.max_rank = max_rank
        width = len(shape.output_sizes) * max_rank
        out = sum(shape.output_sizes)
        # Plain attributes, not parameters: the checkpoint loader and the memory plan see the
        # base model's weights only; these are the adapters' (the runner counts them).
        self.lora_a = torch.zeros(num_slots, width, shape.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, out, width, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = current_lora_batch()
        if batch is None:
            return out
        return add_lora(out, x, self.lora_a, self.lora_b, batch)

    def write_slot(self, slot: int, parts: list[LoraWeights]) -> None:
        """Put an adapter's parts for this projection into ``slot`` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offsets = [0]
        for size in self.shape.output_sizes:
            offsets.append(offsets[-1] + size)
        for part in parts:
            shard = 0 if part.shard is None else part.shard
            cols = slice(shard * self.max_rank, shard * self.max_rank + part.rank)
            rows = (
                slice(0, offsets[-1])
                if part.shard is None
                else slice(offsets[shard], offsets[shard + 1])
            )
            self.lora_a[slot, cols].copy_(part.a)
            self.lora_b[slot, rows, cols].copy_(part.b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b))


def install_lora(
    model: nn.Module,
    shapes: dict[tuple[int, str], TargetShape],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[tuple[int, str], LoraLinear]:
    """Wrap every targetable projection of a loaded Llama-family model in a LoraLinear; the
    wrappers by (layer, module)."""
    layers = model.model.layers
    wrapped = {}
    for (layer, name), shape in shapes.items():
        parent_name, attr = name.split(".")
        parent = getattr(layers[layer], parent_name)
        base = getattr(parent, attr)
        check_shape(base, shape, layer, name)
        lora = LoraLinear(base, shape, num_slots, max_rank, dtype, device)
        setattr(parent, attr, lora)
        wrapped[layer, name] = lora
    return wrapped


def check_shape(base: nn.Module, shape: TargetShape, layer: int, name: str) -> None:
    """The model's projection is the one the adapters are checked against."""
    in_features = getattr(base, "in_features", None)
    out_features = getattr(base, "out_features", None)
    if (in_features, out_features) != (shape.in_features, sum(shape.output_sizes)):
        raise ValueError(
            f"LoRA: layer {layer}'s {name} is {in_features} -> {out_features}, not the "
            f"{shape.in_features} -> {sum(shape.output_sizes)} its config says"
        )
