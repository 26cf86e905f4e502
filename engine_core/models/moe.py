"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router sends each token to its top-k experts and
the layer sums their SwiGLU outputs, weighted by the routing probabilities.

The experts' weights are stacked: ``w13 [E, 2*I, H]`` (gate rows, then up rows, as llama's merged
gate_up_proj) and ``w2 [E, H, I]``. Checkpoints hold them either expert by expert (the Hub's
layout, which transformers' ``save_pretrained`` still writes) or already stacked (transformers 5's
in-memory layout, ``save_pretrained(save_original_format=False)``); both load.

Under tensor parallelism every rank holds 1/N of every expert's intermediate dimension (its rows
of the gate and up halves of w13, its columns of w2): the same split as llama's column-parallel
gate_up_proj and row-parallel down_proj, so each rank's output is a partial sum, all-reduced like
a row-parallel linear's. The router is replicated, so every rank routes every token alike.
FP8 and W4A16 experts split the same way, their scales (and zero points) with the rows or
columns they scale (``width_dim``), in whole blocks or groups (docs/design/quantization.md).

With ``--enable-expert-parallel`` (``tp.expert_parallel``) rank r holds experts
[r*E/N, (r+1)*E/N) whole instead, and the layer replaces TP's all-reduce by an all-to-all
dispatch and combine (engine_core/models/expert_dispatch.py): each rank routes its own slice of
the (replicated) tokens, sends each (token, k) pair to the rank of its expert, which runs its
experts over the rows it received only, gets the results back, weighs and sums them, and an
all-gather rebuilds every token on every rank (docs/design/multi-node.md, "Expert parallelism").
The split sizes are read on the host, so such a layer runs eagerly (``cuda_graph_safe``).

The experts run through the fused Triton kernels of engine_core/models/fused_moe.py on CUDA (no
host sync, so decode is captured in CUDA graphs) and through ``experts_reference`` elsewhere.

FP8 experts (``make_fp8``: an FP8 checkpoint's e4m3 experts with a scale per output row or per
block, or a plain checkpoint's quantized per row as it loads under ``--quantization fp8``;
``w13_scale`` and ``w2_scale`` stacked like the weights) run on CUDA through the fused FP8
kernels of engine_core/models/fp8_moe_kernels.py (no host sync: CUDA graphs capture them), and
elsewhere expert by expert through the dequantizing reference of engine_core/models/fp8.py;
both quantize activations per token (and column group) as the checkpoint says.

INT8 experts (``make_int8``: a compressed-tensors W8A8 checkpoint's int8 experts with one scale
per output row, or a plain checkpoint's quantized per row as it loads under ``--quantization
w8a8``) run on CUDA through the same fused kernels with int8 tiles and int32 accumulation
(``fused_moe_int8``), and elsewhere expert by expert through int8.py's reference; both quantize
each expert's inputs to int8 per token, as compressed-tensors' scheme says.

W4A16 experts (``make_w4a16``: AWQ, GPTQ or compressed-tensors checkpoints, each expert's
tensors repacked into w4a16.py's layout as they load, stacked per expert) run on CUDA through
the fused kernels of engine_core/models/w4a16_moe_kernels.py, or for long steps dequantized first
(w4a16_prefill.py; w4a16_moe.py chooses; no host sync either way), and elsewhere expert by
expert through w4a16.py's dequantizing reference (``w4a16_expert_mlp``).

A Llama-family decoder layer builds its MLP with ``make_mlp`` in engine_core/models/llama.py,
which picks ``SparseMoE`` for the layers ``ModelConfig.is_moe_layer`` names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import Fp8Config, Int8Config, ModelConfig, W4A16Config
from engine_core.models.expert_dispatch import dispatch_combine, gather_tokens, token_slice
from engine_core.models.fp8 import (
    FP8_DTYPE,
    Fp8Experts,
    fp8_linear,
    quantize_rows,
    weight_scale_shape,
)
from engine_core.models.int8 import Int8Experts, int8_linear
from engine_core.models.int8 import quantize_rows as int8_rows
from engine_core.models.layers import (
    LoadsQuantized,
    ShardedParameters,
    ShardIndex,
    TPSharded,
    check_divisible,
    check_held_dtype,
    check_plain_weight,
    check_positive,
    check_w4a16_shapes,
    checkpoint_scale,
    copy_into,
    empty_param,
    rank_rows,
    silu_and_mul,
    use_triton,
)
from engine_core.models.w4a16 import (
    PACK,
    W4A16Experts,
    act_order_permutation,
    check_trivial_g_idx,
    check_weight_shape,
    held_name,
    permute_columns,
    to_layout,
    w4a16_linear,
)
from engine_core.parallel import SINGLE, TPGroup

# route(tokens [n, hidden]) -> (the experts' input [n, hidden], weights [n, K], expert ids [n, K])
Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Router = Callable[[torch.Tensor], Routing]

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")

# Fields of other MoE families that would change the output, with the values that would not.
# Present with any other value: refused, never silently ignored.
_REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "shared_expert_intermediate_size": (None, 0),  # Qwen2-MoE's shared expert
    "n_shared_experts": (None, 0),  # DeepSeek's shared experts
    "num_shared_experts": (None, 0),
    "routed_scaling_factor": (None, 1, 1.0),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
}

# HF per-expert names: (layer prefix, expert, projection, tensor); Mixtral calls the block
# block_sparse_moe and its projections w1 (gate), w3 (up), w2 (down). The tensor: a weight, an
# FP8 scale, or a W4A16 format's tensors (w4a16.CHECKPOINT_NAMES).
_PER_EXPERT = re.compile(
    r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|qweight|qzeros|scales|g_idx|weight_packed|weight_zero_point|"
    r"weight_shape|weight_g_idx)$"
)
# A per-expert tensor -> the suffix of our parameter it maps to (w13<suffix>, w2<suffix>); the
# W4A16 ones are put into the layout by SparseMoE.quantized_form.
_TENSOR_SUFFIX = {"weight": "", "weight_scale": "_scale"}
# Stacked experts: (layer prefix, gate_up_proj [E, 2I, H] or down_proj [E, H, I]).
_STACKED = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(.*)\.block_sparse_moe\.gate\.weight$")
_GATE_UP_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


class SparseMoE(nn.Module, TPSharded, ShardedParameters, LoadsQuantized):
    """Router (``gate``, replicated) and stacked experts (``w13``, ``w2``, this rank's slice of
    every expert's intermediate dimension)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        width = config.moe_intermediate_size
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        self.first_expert = 0
        if self.expert_parallel:  # whole experts, 1/size of them
            self.inter = width
            local = check_divisible("number of experts (num_experts)", experts, tp)
            self.first_expert = tp.rank * local
        else:  # every expert, 1/size of its width
            self.inter = check_divisible("expert width (moe_intermediate_size)", width, tp)
            local = experts
        self.local_experts = local
        self.width = width  # every expert's whole width, as checkpoints hold it
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.tp = tp
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, self.inter))
        # The one-token router's arrival count (fused_moe.route_one_token): zero between calls,
        # which this layer's forward makes one at a time.
        self.register_buffer("router_arrived", torch.zeros(1, dtype=torch.int32), persistent=False)
        self.fp8: Fp8Config | None = None  # set by make_fp8, before loading
        self.int8: Int8Config | None = None  # set by make_int8, before loading
        self.w4a16: W4A16Config | None = None  # set by make_w4a16, before loading
        self.w4a16_groups = (0, 0)  # W4A16: input columns per scale of w13, of w2
        if self.expert_parallel:  # the all-to-all's split sizes are read on the host
            self.cuda_graph_safe = False

    def make_fp8(self, config: Fp8Config) -> None:
        """Hold the experts in e4m3 from now on, with ``w13_scale`` [E, rows or row blocks, 1 or
        column blocks] and ``w2_scale`` alike (call before loading, on any device)."""
        if not config.dynamic_activations:
            raise ValueError(
                f"{config.source}: FP8 experts with static activation scales (input_scale) are "
                "not implemented; only dynamic activations are"
            )
        self.refuse_expert_parallel("FP8")
        if config.block is not None and self.inter % config.block[0]:
            raise ValueError(
                f"{config.source}: the experts' width ({self.inter}) is not a whole number of "
                f"{config.block[0]}-row blocks, so the gate and up scales cannot be stacked"
            )
        if config.block is not None and self.tp.size > 1 and self.inter % config.block[1]:
            raise ValueError(
                f"{config.source}: --tensor-parallel-size {self.tp.size} splits the experts' "
                f"width ({self.width}) into {self.inter} columns of down_proj each, not a whole "
                f"number of {config.block[1]}-column blocks"
            )
        (experts, rows, hidden), device = self.w13.shape, self.w13.device
        self.w13 = empty_param((experts, rows, hidden), FP8_DTYPE, device)
        self.w2 = empty_param((experts, hidden, self.inter), FP8_DTYPE, device)
        scale_13 = weight_scale_shape(config, rows, hidden)
        scale_2 = weight_scale_shape(config, hidden, self.inter)
        self.w13_scale = empty_param((experts, *scale_13), torch.float32, device)
        self.w2_scale = empty_param((experts, *scale_2), torch.float32, device)
        self.fp8 = config

    def make_int8(self, config: Int8Config) -> None:
        """Hold the experts in int8 from now on, with one float32 scale per output row:
        ``w13_scale`` [E, 2I], ``w2_scale`` [E, H] (call before loading, on any device)."""
        self.refuse_expert_parallel("W8A8 (int8)")
        (experts, rows, hidden), device = self.w13.shape, self.w13.device
        self.w13 = empty_param((experts, rows, hidden), torch.int8, device)
        self.w2 = empty_param((experts, hidden, self.inter), torch.int8, device)
        self.w13_scale = empty_param((experts, rows), torch.float32, device)
        self.w2_scale = empty_param((experts, hidden), torch.float32, device)
        self.int8 = config

    def make_w4a16(self, config: W4A16Config, where: str) -> None:
        """Hold the experts in the W4A16 layout of w4a16.py, stacked per expert, from now on:
        ``w13_qweight`` int32 [E, 2I, H/8], ``w13_scales`` float32 [E, G, 2I], ``w13_zeros``
        uint8 [E, G, 2I] (with zero points), and ``w2_*`` alike for [H, I] (call before
        loading, on any device). Act-order checkpoints also load each expert's ``g_idx``
        (``w13_g_idx`` [E, 2, H]: gate's and up's, which share their input and so their order;
        ``w2_g_idx`` [E, I]); ``finish_loading`` sorts each expert's columns by group."""
        if config.act_order and self.tp.size > 1:
            field = "desc_act" if config.source == "gptq" else "actorder"
            raise ValueError(
                f"quantization_config.{field}: act-order W4A16 experts under "
                f"--tensor-parallel-size {self.tp.size} are not implemented (a rank's slice of "
                "the down projection's columns would need its own order); serve it on one GPU"
            )
        self.refuse_expert_parallel("W4A16")
        experts, rows, hidden = self.w13.shape
        group13 = check_w4a16_shapes(config, hidden, [self.inter, self.inter], f"{where}.w13")
        group2 = check_w4a16_shapes(config, self.inter, [hidden], f"{where}.w2")
        self.register_parameter("w13", None)
        self.register_parameter("w2", None)
        self.hold_w4a16("w13", (experts, rows, hidden), group13, config.zero_points)
        self.hold_w4a16("w2", (experts, hidden, self.inter), group2, config.zero_points)
        self.w4a16, self.w4a16_groups = config, (group13, group2)
        device = self.gate.weight.device
        act_order = config.act_order
        g_idx13 = empty_param((experts, 2, hidden), torch.int32, device) if act_order else None
        g_idx2 = empty_param((experts, self.inter), torch.int32, device) if act_order else None
        self.register_parameter("w13_g_idx", g_idx13)
        self.register_parameter("w2_g_idx", g_idx2)
        # finish_loading sets these where an expert's columns were sorted: [E, H], [E, I].
        self.register_buffer("w13_perm", None)
        self.register_buffer("w2_perm", None)

    def finish_loading(self, name: str) -> None:
        """After the last tensor: act-order experts' columns sorted by group (w4a16.py
        ``act_order_permutation``), each expert's order kept to gather its inputs by."""
        if self.w4a16 is None or getattr(self, "w13_g_idx", None) is None:
            return
        group13, group2 = self.w4a16_groups
        g_idx13, g_idx2 = self.w13_g_idx.data, self.w2_g_idx.data[:, None]
        perm13 = self.sort_expert_columns("w13", g_idx13, group13, name)
        perm2 = self.sort_expert_columns("w2", g_idx2, group2, name)
        if perm13 is not None or perm2 is not None:  # the kernels take both orders or neither
            self.w13_perm = identity_orders(g_idx13) if perm13 is None else perm13
            self.w2_perm = identity_orders(g_idx2) if perm2 is None else perm2
        self.register_parameter("w13_g_idx", None)
        self.register_parameter("w2_g_idx", None)

    def sort_expert_columns(
        self, proj: str, g_idx: torch.Tensor, group: int, name: str
    ) -> torch.Tensor | None:
        """Sort each expert's ``<proj>_qweight`` columns by its g_idx [E, parts, K]; the orders
        [E, K] (an expert already in order keeps the identity), or None if all were."""
        qweight = getattr(self, f"{proj}_qweight").data
        orders = []
        for expert in range(g_idx.shape[0]):
            where = f"{name}.experts.{self.first_expert + expert}.{proj}"
            perm = act_order_permutation(g_idx[expert], group, where)
            if perm is not None:
                qweight[expert] = permute_columns(qweight[expert], perm)
            orders.append(perm)
        if all(perm is None for perm in orders):
            return None
        pairs = zip(identity_orders(g_idx), orders, strict=True)
        return torch.stack([i if p is None else p.to(g_idx.device) for i, p in pairs])

    def refuse_expert_parallel(self, name: str) -> None:
        """Whole experts per rank would load as they are, but no test has run them."""
        if self.expert_parallel:
            raise ValueError(
                f"{name} experts under --enable-expert-parallel are not implemented yet; serve "
                "this model without it (tensor parallelism splits every expert's width)"
            )

    def hold_w4a16(
        self, name: str, shape: tuple[int, int, int], group: int, zero_points: bool
    ) -> None:
        """Empty W4A16 parameters ``<name>_qweight``, ``_scales``, ``_zeros`` for stacked
        weights of ``shape`` [E, rows, cols]."""
        (experts, rows, cols), device = shape, self.gate.weight.device
        per_group = (experts, cols // group, rows)
        qweight = empty_param((experts, rows, cols // PACK), torch.int32, device)
        self.register_parameter(f"{name}_qweight", qweight)
        self.register_parameter(f"{name}_scales", empty_param(per_group, torch.float32, device))
        zeros = empty_param(per_group, torch.uint8, device) if zero_points else None
        self.register_parameter(f"{name}_zeros", zeros)

    def reset_buffers(self) -> None:
        """Zero the arrival count (after ``to_empty`` gave it uninitialised memory)."""
        self.router_arrived.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.routed_output(x, self.softmax_route)

    def softmax_route(self, x: torch.Tensor) -> Routing:
        return (x, *self.route_tokens(x))

    def routed_output(self, x: torch.Tensor, route: Router) -> torch.Tensor:
        """The routed experts' weighted sum for every token of x [T, hidden], whole on every
        rank: ``route(tokens) -> (the experts' input, weights [n, K], ids [n, K])``. Under
        tensor parallelism each rank's partial sum, all-reduced; under expert parallelism each
        rank's slice of the tokens dispatched to the experts' ranks, then gathered."""
        if self.expert_parallel:
            return self.expert_parallel_output(x, route)
        out = self.run_routed(*route(x))
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def expert_parallel_output(self, x: torch.Tensor, route: Router) -> torch.Tensor:
        """``routed_output`` by all-to-all (models/expert_dispatch.py): a collective."""
        part = x[token_slice(x.shape[0], self.tp.rank, self.tp.size)]  # [t, hidden], t >= 0
        if part.shape[0]:
            inputs, weights, ids = route(part)
        else:  # nothing to route (a rank past the last token), but the collectives still run
            inputs = part
            weights = torch.empty((0, self.top_k), dtype=torch.float32, device=x.device)
            ids = torch.empty((0, self.top_k), dtype=torch.int64, device=x.device)
        local = self.local_experts
        out = dispatch_combine(inputs, weights, ids, local, self.tp, self.run_local_experts)
        return gather_tokens(out, x.shape[0], self.tp)

    def run_local_experts(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows [R, hidden] each through this rank's expert ``experts[i]`` (weight one):
        what the all-to-all dispatch sent here."""
        ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
        return self.run_routed(rows, ones, experts[:, None])

    @property
    def quantized(self) -> bool:
        return self.fp8 is not None or self.int8 is not None or self.w4a16 is not None

    def load_quantized(
        self, param_name: str, tensor: torch.Tensor, index: ShardIndex | None, hf_name: str
    ) -> None:
        """An FP8 or INT8 expert's weight (checked e4m3 or int8) or scale (per-channel scales as
        [rows]), a W4A16 expert's tensors (scales checked positive); the layer's other
        parameters (a router's bias) as they are."""
        target = getattr(self, param_name).data
        target = target if index is None else target[index]
        if param_name.endswith("_scales"):  # W4A16
            check_positive(tensor, hf_name)
        elif param_name in ("w13_scale", "w2_scale"):
            per_channel = self.int8 is not None or (self.fp8 is not None and self.fp8.block is None)
            tensor = checkpoint_scale(tensor, target, per_channel, hf_name)
        elif param_name in ("w13", "w2") and self.fp8 is not None:
            check_held_dtype(tensor, FP8_DTYPE, self.fp8.source, hf_name)
        elif param_name in ("w13", "w2") and self.int8 is not None:
            check_held_dtype(tensor, torch.int8, self.int8.source, hf_name)
        copy_into(getattr(self, param_name), tensor, index, hf_name)

    def quantized_form(
        self, param_name: str, tensor: torch.Tensor, hf_name: str
    ) -> list[tuple[str, torch.Tensor]]:
        """A plain checkpoint's expert weight under ``--quantization fp8`` or ``w8a8``: its e4m3
        or int8 rows and one absmax scale per row (one expert's gate, up or down, or all of them
        stacked); a W4A16 expert's tensors in our layout (``w4a16_form``)."""
        if self.w4a16 is not None:
            return self.w4a16_form(param_name, tensor, hf_name)
        config = self.fp8 or self.int8
        if param_name not in ("w13", "w2") or config is None or config.prequantized:
            return [(param_name, tensor)]
        check_plain_weight(tensor, hf_name)
        rows = tensor.to(self.w13.device).reshape(-1, tensor.shape[-1])
        quantized, scale = (int8_rows if self.int8 is not None else quantize_rows)(rows)
        return [
            (param_name, quantized.view(tensor.shape)),
            (f"{param_name}_scale", scale.view(tensor.shape[:-1])),
        ]

    def w4a16_form(
        self, param_name: str, tensor: torch.Tensor, hf_name: str
    ) -> list[tuple[str, torch.Tensor]]:
        """[(our parameter, tensor)] for one expert's W4A16 checkpoint tensor (``map_moe_name``
        named it w13_<tensor> or w2_<tensor>): in the layout of w4a16.py, or checked and dropped
        (compressed-tensors' weight_shape, a g_idx without act-order)."""
        config = self.w4a16
        assert config is not None
        proj, _, rest = param_name.partition("_")
        if proj not in ("w13", "w2"):
            return [(param_name, tensor)]
        checkpoint_name = {"": "weight", "scale": "weight_scale"}.get(rest, rest)
        if checkpoint_name == "weight":
            raise ValueError(
                f"checkpoint tensor {hf_name!r} is a plain weight, but the checkpoint's "
                f"quantization_config ({config.source}) makes the experts 4-bit"
            )
        name = held_name(config, checkpoint_name)
        hidden = self.w13_qweight.shape[2] * PACK
        rows, cols = (self.width, hidden) if proj == "w13" else (hidden, self.width)
        if name is None:
            check_weight_shape(tensor, [rows], cols, hf_name)
            return []
        if name == "g_idx" and config.act_order:
            return [(f"{proj}_g_idx", tensor.to(torch.int32))]
        if name == "g_idx":
            check_trivial_g_idx(tensor, config.group_size, hf_name)
            return []
        return [(f"{proj}_{name}", to_layout(config, name, tensor, hf_name))]

    def run_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert ids[t, k] (x[t]), [T, hidden], over the experts
        this rank holds (ids index them: under expert parallelism, its local ones)."""
        if self.fp8 is not None and use_triton(x):
            from engine_core.models.fp8_moe_kernels import fused_moe_fp8  # imports triton

            return fused_moe_fp8(x, self.fp8_experts(), weights, ids)
        if self.fp8 is not None:
            return grouped_experts(x, weights, ids, self.local_experts, self.fp8_expert)
        if self.int8 is not None and use_triton(x):
            from engine_core.models.fp8_moe_kernels import fused_moe_int8  # imports triton

            return fused_moe_int8(x, self.int8_experts(), weights, ids)
        if self.int8 is not None:
            return grouped_experts(x, weights, ids, self.local_experts, self.int8_expert)
        if self.w4a16 is not None and use_triton(x):
            from engine_core.models.w4a16_moe import w4a16_moe  # imports triton

            return w4a16_moe(x, self.w4a16_experts(), weights, ids)
        if self.w4a16 is not None:
            return grouped_experts(x, weights, ids, self.local_experts, self.w4a16_expert)
        return run_experts(x, self.w13, self.w2, weights, ids)

    def fp8_experts(self) -> Fp8Experts:
        """The FP8 experts as the fused kernels take them (fp8_moe_kernels.py)."""
        assert self.fp8 is not None
        return Fp8Experts(self.w13, self.w13_scale, self.w2, self.w2_scale, self.fp8.block)

    def fp8_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One FP8 expert's SwiGLU over its tokens x [n, H] -> [n, H]: the reference, which the
        CPU serves with and the fused kernels are tested against."""
        config = self.fp8
        assert config is not None
        gate_up = fp8_linear(x, self.w13[expert], self.w13_scale[expert], None, config)
        down = self.w2[expert], self.w2_scale[expert]
        return fp8_linear(silu_and_mul(gate_up), *down, None, config)

    def int8_experts(self) -> Int8Experts:
        """The INT8 experts as the fused kernels take them (fp8_moe_kernels.fused_moe_int8)."""
        return Int8Experts(self.w13, self.w13_scale, self.w2, self.w2_scale)

    def int8_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One INT8 expert's SwiGLU over its tokens x [n, H] -> [n, H], each product's input
        quantized per token (int8.py's reference off CUDA): what the fused kernels compute."""
        gate_up = int8_linear(x, self.w13[expert], self.w13_scale[expert])
        return int8_linear(silu_and_mul(gate_up), self.w2[expert], self.w2_scale[expert])

    def w4a16_experts(self) -> W4A16Experts:
        """The W4A16 experts as the fused kernels take them (w4a16_moe_kernels.py)."""
        return W4A16Experts(
            self.w13_qweight, self.w13_scales, self.w13_zeros,
            self.w2_qweight, self.w2_scales, self.w2_zeros, self.w4a16_groups,
            self.w13_perm, self.w2_perm,
        )  # fmt: skip

    def w4a16_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One W4A16 expert's SwiGLU over its tokens (``w4a16_expert_mlp``)."""
        return w4a16_expert_mlp(self.w4a16_experts(), expert, x)

    def route_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's linear, then moe.route; for one token on CUDA both in one launch
        (fused_moe.route_one_token), which does not call ``self.gate``: forward hooks on the
        router see only batches of two tokens or more."""
        gate = self.gate.weight
        if x.shape[0] == 1 and use_triton(x) and gate.dtype == x.dtype and gate.is_contiguous():
            from engine_core.models.fused_moe import route_one_token  # imports triton

            return route_one_token(x, gate, self.router_arrived, self.top_k, self.renormalize)
        return route(self.gate(x), self.top_k, self.renormalize)

    def checkpoint_shards(self, param_name: str) -> range:
        # w13: expert e's gate is shard 2e, its up 2e + 1; w2: expert e's down is shard e (e
        # over the whole model: under expert parallelism, this rank's experts only); their FP8
        # scales and W4A16 tensors alike.
        first, experts = self.first_expert, self.local_experts
        if param_name.startswith("w13"):
            return range(2 * first, 2 * (first + experts))
        return range(first, first + experts)

    def holds_shard(self, param_name: str, shard: int) -> bool:
        return shard in self.checkpoint_shards(param_name)

    def shard_index(self, param_name: str, shard: int) -> ShardIndex:
        if param_name.startswith("w2"):
            return shard - self.first_expert
        expert, half = divmod(shard, 2)
        if param_name == "w13_g_idx":  # [E, 2, H]: gate's, then up's
            return expert - self.first_expert, half
        # W4A16 scales and zeros are [E, groups, rows]: the gate's rows are along the last dim.
        along_last = param_name in ("w13_scales", "w13_zeros")
        rows = getattr(self, param_name).shape[2 if along_last else 1] // 2  # the gate's rows
        half_rows = slice(half * rows, (half + 1) * rows)
        if along_last:
            return expert - self.first_expert, slice(None), half_rows
        return expert - self.first_expert, half_rows

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        if self.tp.size == 1:
            return tensor
        if self.expert_parallel:  # this rank's experts of a stacked tensor, whole
            return tensor if shard is not None else rank_rows(tensor, self.tp)
        dim = self.width_dim(param_name, tensor)
        if dim is None:
            return tensor
        if shard is not None:  # one expert's gate, up or down
            return rank_rows(tensor, self.tp, dim)
        dim += 1  # stacked, [E, ...]
        if not param_name.startswith("w13"):
            return rank_rows(tensor, self.tp, dim)
        gate, up = tensor.chunk(2, dim=dim)  # each split alike, as llama's gate_up_proj
        return torch.cat([rank_rows(gate, self.tp, dim), rank_rows(up, self.tp, dim)], dim=dim)

    def width_dim(self, param_name: str, tensor: torch.Tensor) -> int | None:
        """The dim of one expert's checkpoint tensor for ``param_name`` (in our layout) that
        runs along the expert's width, which tensor parallelism splits; None: every rank keeps
        it whole (a scale per tensor, per row of down, or one W4A16 group over the width)."""
        if param_name.endswith("_scale") and tensor.numel() == 1:
            return None
        if param_name in ("w13", "w13_scale", "w13_qweight", "w2_scales", "w2_zeros"):
            one_group = self.w4a16 is not None and self.w4a16.group_size == -1
            return None if param_name.startswith("w2") and one_group else 0
        if param_name == "w2_scale":  # per row of down [H], or per block [H / b, I / b]
            return 1 if self.fp8 is not None and self.fp8.block is not None else None
        if param_name in ("w13_scales", "w13_zeros", "w2", "w2_qweight"):
            return 1
        return None


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K]): the top-k of the
    softmax, renormalised to sum to one where the model does so (HF's numerics). On CUDA one
    Triton launch (fused_moe.route_topk, int32 ids), elsewhere torch's ops (int64 ids)."""
    if use_triton(logits) and logits.dim() == 2:
        from engine_core.models.fused_moe import route_topk  # imports triton

        return route_topk(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def run_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert ids[t, k] (x[t]), [T, hidden]: the fused Triton
    kernels on CUDA, the torch reference elsewhere."""
    if use_triton(x):
        from engine_core.models.fused_moe import fused_moe  # imports triton

        return fused_moe(x, w13, w2, weights, ids)
    return experts_reference(x, w13, w2, weights, ids)


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The experts in torch: (token, k) pairs grouped by expert, and for each expert with tokens
    one gate_up and one down matmul over its tokens, scaled and added into the output.

    One host sync (the per-expert counts), so this is no path for CUDA graphs; the sum is float32
    and rounded to x's dtype once at the end.
    """

    def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return expert_mlp(rows, w13[expert], w2[expert])

    return grouped_experts(x, weights, ids, w13.shape[0], run)


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    run: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over k of weights[t, k] * run(ids[t, k], x[t]) [T, hidden]: the (token, k) pairs
    grouped by expert, ``run(expert, rows [n, H]) -> [n, H]`` once per expert with tokens.
    Pairs with an id of ``num_experts`` or more (another rank's expert) add nothing."""
    top_k = ids.shape[1]
    flat = ids.flatten()  # [T*K]
    order = flat.argsort(stable=True)  # pairs by expert, in token order within one
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k  # [T*K] token of each sorted pair
    pair_weights = weights.flatten()[order]  # [T*K]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, hidden]
    start = 0
    for expert, count in enumerate(counts[:num_experts]):  # the others' pairs sort last
        if count:
            rows = tokens[start : start + count]
            y = run(expert, x.index_select(0, rows))  # [n, hidden]
            out.index_add_(0, rows, y.float() * pair_weights[start : start + count, None])
        start += count
    return out.to(x.dtype)


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU: x [n, H], w13 [2I, H], w2 [H, I] -> [n, H]."""
    return F.linear(silu_and_mul(F.linear(x, w13)), w2)


def identity_orders(g_idx: torch.Tensor) -> torch.Tensor:
    """[E, K] int32 rows 0..K-1: the order of experts whose columns were already sorted, for
    g_idx [E, parts, K]."""
    experts, columns = g_idx.shape[0], g_idx.shape[-1]
    identity = torch.arange(columns, dtype=torch.int32, device=g_idx.device)
    return identity.expand(experts, columns).contiguous()


def w4a16_expert_mlp(experts: W4A16Experts, expert: int, x: torch.Tensor) -> torch.Tensor:
    """W4A16 expert ``expert``'s SwiGLU over its tokens x [n, H] -> [n, H]: the dequantizing
    reference (w4a16.py), which the CPU serves with and the fused kernels are tested against."""
    e, (group13, group2) = experts, experts.groups
    zeros13 = None if e.w13_zeros is None else e.w13_zeros[expert]
    zeros2 = None if e.w2_zeros is None else e.w2_zeros[expert]
    perm13 = None if e.w13_perm is None else e.w13_perm[expert]
    perm2 = None if e.w2_perm is None else e.w2_perm[expert]
    gate_up = w4a16_linear(x, e.w13_qweight[expert], e.w13_scales[expert], zeros13, perm13, group13)
    act = silu_and_mul(gate_up)
    return w4a16_linear(act, e.w2_qweight[expert], e.w2_scales[expert], zeros2, perm2, group2)


def map_moe_name(hf_name: str) -> tuple[str, int | None] | None:
    """An HF MoE checkpoint name -> (our parameter, shard), or None when it is no MoE name.

    Our layer lives at ``<layer>.mlp`` with parameters ``gate.weight`` (router), ``w13``, ``w2``.
    """
    if match := _PER_EXPERT.match(hf_name):
        prefix, expert, proj = match[1], int(match[2]), match[3]
        suffix = _TENSOR_SUFFIX.get(match[4], f"_{match[4]}")
        if proj in ("w2", "down_proj"):
            return f"{prefix}.mlp.w2{suffix}", expert
        return f"{prefix}.mlp.w13{suffix}", 2 * expert + _GATE_UP_HALF[proj]
    if match := _STACKED.match(hf_name):
        return f"{match[1]}.mlp.{'w13' if match[2] == 'gate_up_proj' else 'w2'}", None
    if match := _ROUTER.match(hf_name):
        return f"{match[1]}.mlp.gate.weight", None
    return None


def moe_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ModelConfig fields of an MoE config.json on top of its Llama-family ones (attention,
    norms, rope). Raises ValueError for a field we do not implement."""
    refuse_unsupported(hf, architecture)
    # Hub configs of Qwen3-MoE say num_experts; transformers 5 writes num_local_experts.
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ValueError(
            f"{architecture}: num_experts_per_tok ({top_k}) must be between 1 and the number of "
            f"experts ({experts})"
        )
    fields = {"num_experts": experts, "num_experts_per_tok": top_k}
    if architecture == "MixtralForCausalLM":
        # Mixtral always renormalises; its experts have the config's intermediate_size.
        return fields | {
            "moe_intermediate_size": hf["intermediate_size"],
            "norm_topk_prob": True,
            "sliding_window": hf.get("sliding_window"),
        }
    return fields | {
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "qk_norm": True,
        # Qwen3-MoE windows every layer when use_sliding_window (transformers 5 does the same).
        "sliding_window": hf.get("sliding_window") if hf.get("use_sliding_window") else None,
        "dense_layers": qwen3_dense_layers(hf),
    }


def refuse_unsupported(
    hf: dict[str, Any], architecture: str, implemented: tuple[str, ...] = ()
) -> None:
    """ValueError for a field of ``_REFUSED_FIELDS`` with a value that changes the output,
    but for those the architecture ``implemented`` (Qwen3-Next: its shared expert)."""
    for name, neutral in _REFUSED_FIELDS.items():
        if name not in implemented and hf.get(name) not in neutral:
            raise ValueError(
                f"{architecture}: config field {name}={hf[name]!r} is not supported "
                "(only softmax top-k routing, and no shared experts but Qwen3-Next's one)"
            )


def qwen3_dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """Layers with a dense MLP: those in ``mlp_only_layers`` and, with ``decoder_sparse_step``
    s, every layer i where (i + 1) is not a multiple of s (transformers' rule)."""
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"Qwen3MoeForCausalLM: decoder_sparse_step must be >= 1, got {step!r}")
    only_dense = set(hf.get("mlp_only_layers") or ())
    layers = range(hf["num_hidden_layers"])
    return tuple(i for i in layers if i in only_dense or (i + 1) % step)
