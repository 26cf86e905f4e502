"""Projections with LoRA slots, and the LoRA product of a batch that mixes adapters.

Each targeted projection keeps, for every slot, one stacked A and one B sized for the largest
rank: ``a`` [slots, shards * max_rank, in] and ``b`` [slots, out, shards * max_rank]. Shard i of
a merged projection (q, k, v; gate, up) owns rank columns [i * max_rank, i * max_rank + r) and
its own output rows of B, so one shrink and one expand serve all its shards; unused ranks and
shards are zeros. The scale is folded into B when a slot is written. The tensors are allocated
once: writing a slot copies into them in place, so captured CUDA graphs keep reading them.

A step's rows are grouped by slot (``LoraBatch``): for each slot in use,
``out[rows] += (x[rows] @ a[slot].T) @ b[slot].T``. This torch form is the reference, which the
CPU runs; on CUDA the tile kernels of ``triton_lora.py`` take its place, in eager steps and in
CUDA graphs alike. An MoE layer's experts carry slots of their own (``LoraExperts``).

Under tensor parallelism a slot holds this rank's share of each adapter, cut as the base layer
is (``rank_share``): a column-parallel projection (qkv, gate_up) keeps A whole and its own rows
of each shard's B; a row-parallel one (o, down) its own input columns of A and B whole, and its
delta is added to the rank's partial product before the layer's one all-reduce sums both.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.forward_context import current_lora_batch
from engine_core.lora.adapter import EXPERTS, LoraWeights, TargetShape, rank_shape
from engine_core.lora.batch import LoraBatch
from engine_core.models.layers import RowParallelLinear, rank_rows, silu_and_mul, use_triton
from engine_core.models.moe import SparseMoE
from engine_core.parallel import SINGLE, PendingSum, TPGroup


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoraBatch,
    output_sizes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """out [T, O] += each row's slot's x @ A.T @ B.T (x [T, I], a [S, R, I], b [S, O, R]; a
    fused projection's shards ``output_sizes``, None: one): the tile kernels on CUDA
    (triton_lora.py), the torch reference elsewhere."""
    if use_triton(x):
        from engine_core.lora.triton_lora import add_lora_tiles  # imports triton

        return add_lora_tiles(out, x, a, b, batch.tiles, output_sizes)
    return add_lora_reference(out, x, a, b, batch)


def add_lora_reference(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoraBatch
) -> torch.Tensor:
    """The torch form: rows grouped by slot, one gather, shrink, expand and index_add_ each."""
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
    quantized); the delta reads the plain input. ``shape`` is the whole model's projection (what
    adapters are checked against); the slots hold this tensor-parallel rank's share of it."""

    def __init__(
        self,
        base: nn.Module,
        shape: TargetShape,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.base = base
        self.shape = shape
        self.tp = tp
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.local = rank_shape(shape, tp.size)  # install_lora checks it against the base's
        self.max_rank = max_rank
        width = len(shape.output_sizes) * max_rank
        inp, out = self.local.in_features, sum(self.local.output_sizes)
        # Plain attributes, not parameters: the checkpoint loader and the memory plan see the
        # base model's weights only; these are the adapters' (the runner counts them).
        self.lora_a = torch.zeros(num_slots, width, inp, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, out, width, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor | PendingSum:
        batch = current_lora_batch()
        if self.row_parallel:  # the delta joins the partial product, summed with it
            partial = self.base.matmul(x)  # [T, out], this rank's input columns
            if batch is not None:
                add_lora(partial, x, self.lora_a, self.lora_b, batch, self.local.output_sizes)
            return self.base.sum_partial(partial)
        out = self.base(x)
        if batch is None:
            return out
        return add_lora(out, x, self.lora_a, self.lora_b, batch, self.local.output_sizes)

    def write_slot(self, slot: int, parts: list[LoraWeights]) -> None:
        """Put this rank's share of an adapter's parts for this projection into ``slot`` (zeros
        where it has none). A part of the whole fused output (Phi-3's qkv_proj) is written as
        one part per shard, each into its shard's own columns, so that shard i's output rows
        read only columns of shard i (the expand kernel's reads)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offsets = [0]
        for size in self.local.output_sizes:
            offsets.append(offsets[-1] + size)
        for part in rank_share(parts, self.shape, self.tp, self.row_parallel):
            assert part.shard is not None
            cols = slice(part.shard * self.max_rank, part.shard * self.max_rank + part.rank)
            rows = slice(offsets[part.shard], offsets[part.shard + 1])
            self.lora_a[slot, cols].copy_(part.a)
            self.lora_b[slot, rows, cols].copy_(part.b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b))


def rank_share(
    parts: list[LoraWeights], shape: TargetShape, tp: TPGroup, row_parallel: bool
) -> list[LoraWeights]:
    """This rank's share of an adapter's parts for one projection, one part per shard: a
    row-parallel projection's A narrowed to the rank's input columns (B whole: each rank's
    delta is a partial sum, as its product is); a column-parallel one's B narrowed to the
    rank's rows of its shard (A whole), a whole-output part first split into its shards."""
    share = []
    for part in parts:
        if row_parallel:
            share.append(LoraWeights(rank_rows(part.a, tp, dim=1), part.b, part.shard))
        elif part.shard is not None:
            share.append(LoraWeights(part.a, rank_rows(part.b, tp), part.shard))
        else:
            blocks = part.b.split(list(shape.output_sizes))
            share += [LoraWeights(part.a, rank_rows(b, tp), i) for i, b in enumerate(blocks)]
    return share


class LoraExperts(nn.Module):
    """An MoE layer (models/moe.py SparseMoE) with LoRA slots on every expert's gate_up and down
    projections: per slot and expert, ``a13`` [R, H] / ``b13`` [2I, R] and ``a2`` [R, I] /
    ``b2`` [H, R]. A step without adapter rows runs the layer as it is; one with adapter rows
    runs the fused MoE with each slot's deltas on CUDA (lora/triton_moe.py: fixed shapes, so
    decode runs in CUDA graphs), and in torch elsewhere, (token, k) pairs grouped by expert and
    slot (``lora_experts``, the reference)."""

    def __init__(
        self,
        base: SparseMoE,
        shape: TargetShape,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.base = base
        self.tp = tp
        experts, hidden = shape.num_experts, shape.in_features
        gate_up = shape.output_sizes[0] // tp.size  # this rank's gate and up rows, as w13's
        self.max_rank = max_rank

        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(num_slots, experts, *size, dtype=dtype, device=device)

        self.a13, self.b13 = zeros(max_rank, hidden), zeros(gate_up, max_rank)
        self.a2, self.b2 = zeros(max_rank, gate_up // 2), zeros(hidden, max_rank)
        # The torch form reads per-step counts on the host; the kernels take the bf16/float
        # experts only (a quantized layer with LoRA runs the torch form, eagerly).
        self.cuda_graph_safe = not base.quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = current_lora_batch()
        if batch is None:
            return self.base(x)
        if batch.token_slots is None:
            raise RuntimeError("a LoRA step without its rows' slots for the MoE experts")
        out = self.partial_output(x, batch.token_slots)
        # Under TP each rank's experts hold its share of the intermediate dimension and the
        # slots theirs (``rank_expert_share``): the rank's output is a partial sum, as the base
        # layer's is, and the one all-reduce sums the deltas with it.
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def partial_output(self, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """This rank's share of the experts' weighted sum, each row with its slot's deltas."""
        weights, ids = self.base.route_tokens(x)  # [T, K] each
        if use_triton(x) and not self.base.quantized:
            from engine_core.lora.triton_moe import ExpertLora  # imports triton
            from engine_core.models.fused_moe import fused_moe

            slots = ExpertLora(self.a13, self.b13, self.a2, self.b2, token_slots, ids.shape[1])
            return fused_moe(x, self.base.w13, self.base.w2, weights, ids, deltas=slots)
        return lora_experts(x, self.base, weights, ids, token_slots, self)

    def write_slot(self, slot: int, parts: list[LoraWeights]) -> None:
        self.clear_slot(slot)
        for part in parts:
            a, b = (self.a13, self.b13) if part.shard == 0 else (self.a2, self.b2)
            part_a, part_b = rank_expert_share(part, self.tp)
            a[slot, :, : part.rank].copy_(part_a)
            b[slot, :, :, : part.rank].copy_(part_b)

    def clear_slot(self, slot: int) -> None:
        for t in (self.a13, self.b13, self.a2, self.b2):
            t[slot].zero_()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a13, self.b13, self.a2, self.b2))


def rank_expert_share(part: LoraWeights, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A [E, r, in], B [E, out, r]) of an expert pair, cut as SparseMoE cuts
    the experts: gate_up's A whole and its own rows of gate and of up in B; down's own input
    columns of A and B whole."""
    if tp.size == 1:
        return part.a, part.b
    if part.shard == 0:
        gate, up = part.b.chunk(2, dim=1)
        return part.a, torch.cat([rank_rows(gate, tp, 1), rank_rows(up, tp, 1)], dim=1)
    return rank_rows(part.a, tp, dim=2), part.b


def lora_experts(
    x: torch.Tensor,
    moe: SparseMoE,
    weights: torch.Tensor,
    ids: torch.Tensor,
    token_slots: torch.Tensor,
    lora: LoraExperts,
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert ids[t, k] (x[t]) with row t's adapter on that
    expert (x [T, H] -> [T, H]): the (token, k) pairs grouped by (expert, slot), one SwiGLU per
    group with the slot's deltas added to its gate_up and down products. float32 sum, as the
    base model's reference (models/moe.py grouped_experts)."""
    num_slots = lora.a13.shape[0] + 1  # slot -1 (the base model) is key 0
    top_k = ids.shape[1]
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)  # [T*K]
    keys = ids.flatten().long() * num_slots + token_slots.long()[tokens] + 1
    order = keys.argsort(stable=True)
    counts = torch.bincount(keys, minlength=moe.w13.shape[0] * num_slots).tolist()
    pair_weights = weights.flatten()[order]
    tokens = tokens[order]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for key, count in enumerate(counts):
        if count:
            expert, slot = divmod(key, num_slots)
            rows = tokens[start : start + count]
            y = expert_with_lora(x.index_select(0, rows), moe, lora, expert, slot - 1)
            out.index_add_(0, rows, y.float() * pair_weights[start : start + count, None])
        start += count
    return out.to(x.dtype)


def expert_with_lora(
    x: torch.Tensor, moe: SparseMoE, lora: LoraExperts, expert: int, slot: int
) -> torch.Tensor:
    """One expert's SwiGLU over rows x [n, H], with slot ``slot``'s deltas (none for -1)."""
    gate_up = x @ moe.w13[expert].T  # [n, 2I]
    if slot >= 0:
        gate_up += (x @ lora.a13[slot, expert].T) @ lora.b13[slot, expert].T
    act = silu_and_mul(gate_up)  # [n, I]
    y = act @ moe.w2[expert].T  # [n, H]
    if slot >= 0:
        y += (act @ lora.a2[slot, expert].T) @ lora.b2[slot, expert].T
    return y


LoraModule = LoraLinear | LoraExperts


def install_lora(
    model: nn.Module,
    shapes: dict[tuple[int, str], TargetShape],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
) -> dict[tuple[int, str], LoraModule]:
    """Wrap every targetable projection of a loaded Llama-family model in a LoraLinear (an MoE
    layer's experts in a LoraExperts); the wrappers by (layer, module), each holding this
    tensor-parallel rank's share."""
    layers = model.model.layers
    wrapped: dict[tuple[int, str], LoraModule] = {}
    for (layer, name), shape in shapes.items():
        parent_name, attr = name.split(".")
        if name == EXPERTS:
            parent, attr = layers[layer], "mlp"
        else:
            parent = getattr(layers[layer], parent_name)
        base = getattr(parent, attr)
        lora: LoraModule
        if name == EXPERTS:
            if not isinstance(base, SparseMoE):
                raise ValueError(f"LoRA: layer {layer}'s MLP is a {type(base).__name__}")
            lora = LoraExperts(base, shape, num_slots, max_rank, dtype, device, tp)
        else:
            lora = LoraLinear(base, shape, num_slots, max_rank, dtype, device, tp)
            check_shape(base, lora.local, layer, name)
        setattr(parent, attr, lora)
        wrapped[layer, name] = lora
    return wrapped


def check_shape(base: nn.Module, shape: TargetShape, layer: int, name: str) -> None:
    """The model's projection (this rank's part of it) is the one the adapters are checked
    against."""
    in_features = getattr(base, "in_features", None)
    out_features = getattr(base, "out_features", None)
    if (in_features, out_features) != (shape.in_features, sum(shape.output_sizes)):
        raise ValueError(
            f"LoRA: layer {layer}'s {name} is {in_features} -> {out_features}, not the "
            f"{shape.in_features} -> {sum(shape.output_sizes)} its config says"
        )
