"""gpt-oss's mixture of experts: a biased router whose top-k logits are softmaxed, and experts
with biases and a clamped SwiGLU, in bf16 or in MXFP4 (models/mxfp4.py) as published.

As HF computes it (transformers' GptOssMLP): the router's logits (x W^T + b) give each token its
top k experts, weighted by the softmax over those k logits alone. An expert computes
``gate_up = x W13^T + b13``, clamps gate above at ``limit`` and up within +-``limit``, and
returns ``((up + 1) * gate * sigmoid(alpha * gate)) W2^T + b2``.

The weights are stacked as the other MoE layers keep them (models/moe.py): ``w13 [E, 2I, H]``
(gate rows, then up rows: HF's interleaved columns are sorted at load, models/gpt_oss.py) and
``w2 [E, H, I]``. With ``expert_format == "mxfp4"`` they are held as e2m1 blocks and e8m0
scales (``w13_blocks [E, 2I, H/2]``, ``w13_scales [E, 2I, H/32]``, likewise ``w2_*``) and each
expert's rows are dequantized to the activations' dtype when it runs: memory holds 4.25 bits a
weight, and the result is the dequantized model's exactly.

On CUDA the MXFP4 experts run through mxfp4_moe.py's kernels (no host sync); bf16 experts, and
every expert on the CPU, through ``moe.grouped_experts`` (torch, one host sync a layer).

Under tensor parallelism every expert is split along its width I, as models/moe.py splits
experts: each rank keeps its 1/size of the gate and up rows (and of ``b13``) and of the down
columns, and the ranks' partial outputs are summed. MXFP4's down columns are split in whole
32-value blocks (a split inside a block is refused by name); ``b2`` is added once, by rank 0's
share (the others hold zeros). The router is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import ModelConfig
from engine_core.models import mxfp4
from engine_core.models.layers import TPSharded, check_divisible, rank_rows, use_triton
from engine_core.models.moe import grouped_experts
from engine_core.parallel import SINGLE, TPGroup


class GptOssMoE(nn.Module, TPSharded):
    """Router (``router``, with bias) and the stacked experts, plain or MXFP4; under tensor
    parallelism this rank's share of every expert's width."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        if tp.expert_parallel:
            raise ValueError(
                "--enable-expert-parallel: gpt-oss's experts split along their width only; "
                "serve it with --tensor-parallel-size alone"
            )
        inter = check_divisible(
            "expert width (intermediate_size)", config.moe_intermediate_size, tp
        )
        self.tp = tp
        self.top_k, self.num_experts = config.num_experts_per_tok, experts
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.router = nn.Linear(hidden, experts, bias=True)
        self.mxfp4 = config.expert_format == "mxfp4"
        # bf16 experts are grouped on the host (one sync a layer); MXFP4 ones run kernels that
        # read no host values (on the CPU nothing is captured either way).
        self.cuda_graph_safe = self.mxfp4
        if self.mxfp4:
            for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
                if cols % mxfp4.BLOCK:
                    split = f" (this rank's 1/{tp.size} of it)" if tp.size > 1 else ""
                    raise ValueError(
                        f"MXFP4 experts need widths of whole {mxfp4.BLOCK}-value blocks; {name} "
                        f"has {cols} input columns{split}: --tensor-parallel-size {tp.size} "
                        f"does not split intermediate_size {config.moe_intermediate_size} on "
                        "block boundaries"
                    )
                blocks = torch.empty(experts, rows, cols // 2, dtype=torch.uint8)
                scales = torch.empty(experts, rows, cols // mxfp4.BLOCK, dtype=torch.uint8)
                self.register_parameter(f"{name}_blocks", nn.Parameter(blocks, False))
                self.register_parameter(f"{name}_scales", nn.Parameter(scales, False))
        else:
            self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.b13 = nn.Parameter(torch.empty(experts, 2 * inter))
        self.b2 = nn.Parameter(torch.empty(experts, hidden))

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        """This rank's share of a stacked expert tensor in our layout (models/gpt_oss.py):
        gate and up rows each split, down's columns (bytes of MXFP4 blocks, or their scales)
        split, b2 kept by rank 0 alone."""
        if self.tp.size == 1:
            return tensor
        if param_name == "b2":
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        if param_name.startswith("w2"):  # [E, H, I], [E, H, I/2] bytes, [E, H, I/32] scales
            return rank_rows(tensor, self.tp, dim=2)
        gate, up = tensor.chunk(2, dim=1)  # w13* [E, 2I, ...], b13 [E, 2I]
        return torch.cat((rank_rows(gate, self.tp, 1), rank_rows(up, self.tp, 1)), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        out = self.local_experts(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def local_experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the experts' output, [T, hidden]."""
        weights, ids = route_gpt_oss(self.router(x), self.top_k)  # [T, K] each
        if not self.mxfp4:
            return grouped_experts(x, weights, ids, self.num_experts, self.dense_expert)
        if use_triton(x):
            from engine_core.models.mxfp4_moe import mxfp4_moe  # imports triton

            return mxfp4_moe(x, self.mxfp4_experts(), weights, ids)
        return experts_reference(x, self.mxfp4_experts(), weights, ids)

    def dense_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """bf16 expert ``expert`` on its tokens' rows x [n, H] -> [n, H]."""
        return biased_swiglu_expert(
            x, (self.w13[expert], self.b13[expert]), (self.w2[expert], self.b2[expert]),
            self.limit, self.alpha,
        )  # fmt: skip

    def mxfp4_experts(self) -> mxfp4.Mxfp4Experts:
        """The MXFP4 experts' tensors and the activation's constants, as the GEMMs read them."""
        return mxfp4.Mxfp4Experts(
            self.w13_blocks, self.w13_scales, self.b13,
            self.w2_blocks, self.w2_scales, self.b2, self.limit, self.alpha,
        )  # fmt: skip


def experts_reference(
    x: torch.Tensor, experts: mxfp4.Mxfp4Experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """MXFP4 experts in torch (the CPU path, and the kernels' oracle): sum over k of
    weights[t, k] * expert ids[t, k] (x[t]), each expert dequantized as it runs, [T, H]."""

    def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return mxfp4_expert_reference(experts, expert, rows)

    return grouped_experts(x, weights, ids, experts.w13_blocks.shape[0], run)


def mxfp4_expert_reference(
    experts: mxfp4.Mxfp4Experts, expert: int, x: torch.Tensor
) -> torch.Tensor:
    """One MXFP4 expert on its tokens' rows x [n, H] -> [n, H], its weights dequantized to
    x's dtype."""
    e = experts
    w13 = mxfp4.dequantize(e.w13_blocks[expert], e.w13_scales[expert], x.dtype)  # [2I, H]
    w2 = mxfp4.dequantize(e.w2_blocks[expert], e.w2_scales[expert], x.dtype)  # [H, I]
    return biased_swiglu_expert(x, (w13, e.b13[expert]), (w2, e.b2[expert]), e.limit, e.alpha)


def biased_swiglu_expert(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],  # (w13 [2I, H], b13 [2I])
    down: tuple[torch.Tensor, torch.Tensor],  # (w2 [H, I], b2 [H])
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """gpt-oss's expert on rows x [n, H] -> [n, H]."""
    gate, up = F.linear(x, *gate_up).chunk(2, dim=-1)  # [n, I] each
    return F.linear(clamped_swiglu(gate, up, limit, alpha), *down)


def route_gpt_oss(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K], expert ids [T, K]): the top-k logits, softmaxed
    among themselves in the logits' dtype (HF's GptOssTopKRouter)."""
    top, ids = logits.topk(top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """gpt-oss's activation: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), where g is the
    gate clamped above at limit."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
