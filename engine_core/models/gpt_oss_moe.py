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

The experts run through ``moe.grouped_experts`` (torch, one host sync a layer) on every device:
no fused GPU kernel yet, so a CUDA engine runs these models without CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import ModelConfig
from engine_core.models import mxfp4
from engine_core.models.moe import grouped_experts


class GptOssMoE(nn.Module):
    """Router (``router``, with bias) and the stacked experts, plain or MXFP4."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = (
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.top_k, self.num_experts = config.num_experts_per_tok, experts
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.router = nn.Linear(hidden, experts, bias=True)
        self.mxfp4 = config.expert_format == "mxfp4"
        if self.mxfp4:
            for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
                if cols % mxfp4.BLOCK:
                    raise ValueError(
                        f"MXFP4 experts need widths of whole {mxfp4.BLOCK}-value blocks; {name} "
                        f"has {cols} input columns"
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = route_gpt_oss(self.router(x), self.top_k)  # [T, K] each
        return grouped_experts(x, weights, ids, self.num_experts, self.run_expert)

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` on its tokens' rows x [n, H] -> [n, H]."""
        w13, w2 = self.expert_weights(expert, x.dtype)
        gate, up = F.linear(x, w13, self.b13[expert]).chunk(2, dim=-1)  # [n, I] each
        act = clamped_swiglu(gate, up, self.limit, self.alpha)
        return F.linear(act, w2, self.b2[expert])

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of one expert in ``dtype``: MXFP4 ones dequantized."""
        if not self.mxfp4:
            return self.w13[expert], self.w2[expert]
        return (
            mxfp4.dequantize(self.w13_blocks[expert], self.w13_scales[expert], dtype),
            mxfp4.dequantize(self.w2_blocks[expert], self.w2_scales[expert], dtype),
        )


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
