"""Qwen3-VL's vision tower, in plain torch, run eagerly on the engine core's device
(docs/design/vision.md, "Qwen3-VL"). A model of its own so that another model whose tower is
this one (Qwen3.5's ConditionalGeneration: the same blocks, no DeepStack) builds it as it is.

Pixels arrive as for Qwen2.5-VL (one row per patch of ``temporal_patch x patch x patch`` pixels
of each channel, each image's rows merge block by merge block). What differs from Qwen2.5-VL's
tower (models/qwen2_5_vl_vision.py):

1. the patch embedding has a bias, and a learned position table (``pos_embed``, a square grid
   of ``num_position_embeddings``) is resampled bilinearly (corners aligned) to each image's
   patch grid and added to it;
2. every block attends over each whole image (frame): no windows, so no reordering;
3. blocks are LayerNorm, attention with the same 2D rotary, and a plain GELU MLP
   (``linear_fc1``, ``linear_fc2``);
4. **DeepStack**: after each block in ``deepstack_visual_indexes`` the hidden states go
   through a merger of their own (LayerNorm after the merge blocks' rows are concatenated);
   the language model adds these features to its first layers' outputs at the image's rows.

The tower's output is one tensor per image token: the final merger's embedding followed by
the DeepStack features, ``[tokens, out_hidden * (1 + len(deepstack_visual_indexes))]``, so
that the encoder cache, a chunk's slice of an image and the step's rows carry all of them
together (engine_core/multimodal.py needs no change for them).

Parameter names follow HF's checkpoint (``model.visual.blocks.0.attn.qkv.weight``, ...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.qwen2_5_vl_vision import (
    VISION_ACTIVATIONS,
    VisionAttention,
    group_segments,
    image_bounds,
    vision_rotary,
)


class PatchEmbedWithBias(nn.Module):
    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, dim, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C * T * P * P] -> [N, dim]: one product per patch, plus the bias."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = VISION_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, heads)
        self.mlp = GeluMLP(dim, hidden, act)

    def forward(
        self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """Each merge block's rows as one token: LayerNorm (over a row, or with ``after_merge``
    over the concatenated rows: the DeepStack mergers'), then a GELU MLP to ``out_dim``."""

    def __init__(self, out_dim: int, dim: int, merge: int, after_merge: bool) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.width if after_merge else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> [N / merge^2, out_dim]."""
        x = self.norm(x.view(-1, self.width)) if self.after_merge else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


class Qwen3VisionTransformer(nn.Module):
    """The vision tower for a checkpoint's ``vision_config`` (a dict, HF's field names)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        act = config.get("hidden_act", "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise ValueError(f"Qwen3-VL vision_config: unsupported hidden_act {act!r}")
        dim, heads = config["hidden_size"], config["num_heads"]
        self.merge = config.get("spatial_merge_size", 2)
        self.head_dim = dim // heads
        self.theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbedWithBias(
            config.get("in_channels", 3),
            config.get("temporal_patch_size", 2),
            config["patch_size"],
            dim,
        )
        positions = config.get("num_position_embeddings", 2304)
        self.grid_side = int(positions**0.5)
        self.pos_embed = nn.Embedding(positions, dim)
        self.blocks = nn.ModuleList(
            Qwen3VisionBlock(dim, heads, config["intermediate_size"], act)
            for _ in range(config["depth"])
        )
        out_dim = config["out_hidden_size"]
        self.merger = Qwen3PatchMerger(out_dim, dim, self.merge, after_merge=False)
        self.deepstack_indexes = list(config.get("deepstack_visual_indexes") or ())
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(out_dim, dim, self.merge, after_merge=True)
            for _ in self.deepstack_indexes
        )

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [patches, C * T * P * P] of the images ``grids`` names, one after another ->
        [patches / merge^2, out_dim * (1 + DeepStack layers)]: each token's embedding, then
        its DeepStack features in layer order."""
        device = pixels.device
        x = self.patch_embed(pixels)
        x = x + self.interpolated_positions(grids).to(x.dtype)
        cos, sin = vision_rotary(grids, self.merge, self.head_dim, self.theta, device)
        images = group_segments(image_bounds(grids), device)
        features: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x = block(x, images, cos, sin)
            if index in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(index)]
                features.append(merger(x))
        return torch.cat([self.merger(x), *features], dim=-1)

    def interpolated_positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[patches, dim] float32: the learned position grid resampled (bilinear, corners
        aligned, as HF's) to each image's h x w patches, in the processor's row order (merge
        block by merge block), repeated for each of its frames."""
        side, dim = self.grid_side, self.pos_embed.weight.shape[1]
        table = self.pos_embed.weight.float().view(side, side, dim).permute(2, 0, 1)[None]
        m = self.merge
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            blocks = grid.view(dim, h // m, m, w // m, m).permute(1, 3, 2, 4, 0)
            out.append(blocks.reshape(h * w, dim).repeat(t, 1))
        return torch.cat(out)
