"""Pixtral's vision encoder and Mistral 3's multi-modal projector, in plain torch: the image
side of ``Mistral3ForConditionalGeneration`` (Mistral-Small-3.1/3.2), run eagerly on the engine
core's device (docs/design/vision.md).

Images keep their own size (each side a multiple of patch * spatial_merge_size pixels after the
processor's resize), so a batch is padded to its largest image and every image carries its
(height, width) in pixels:

1. the patch convolution (no bias), cropped to each image's patches, then RMSNorm (``ln_pre``);
2. ``num_hidden_layers`` pre-RMSNorm blocks: attention with a 2D RoPE over the patch grid
   (half of each rotated pair's frequencies follow the row, half the column) inside each image
   only (block-diagonal: run here one image at a time), and a gated MLP (SiLU in the released
   models), no biases;
3. the projector: RMSNorm, the patch merger (each 2 x 2 cell of patches concatenated and
   projected back to the tower's width), then linear, GELU, linear to the text model's width.

Parameter names follow HF's checkpoint under ``vision_tower.`` and ``multi_modal_projector.``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.layers import RMSNorm
from engine_core.models.meta_build import computed_buffer


def axial_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies: the even-indexed ones rotate with the patch row, the
    odd-indexed with the column (HF's PixtralVisionRotaryEmbedding)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return torch.cat([inv_freq[0::2], inv_freq[1::2]])


def grid_rope(rows: int, cols: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows * cols, head_dim] for a patch grid read row by row."""
    quarter = inv_freq.numel() // 2
    r = torch.arange(rows, device=inv_freq.device, dtype=torch.float)
    c = torch.arange(cols, device=inv_freq.device, dtype=torch.float)
    row_angles = torch.outer(r, inv_freq[:quarter])[:, None, :].expand(rows, cols, quarter)
    col_angles = torch.outer(c, inv_freq[quarter:])[None, :, :].expand(rows, cols, quarter)
    half = torch.cat([row_angles, col_angles], dim=-1).reshape(rows * cols, 2 * quarter)
    angles = torch.cat([half, half], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PixtralAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [L, dim] of one image, cos/sin [L, head_dim] -> [L, dim]."""
        length, dim = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(length, self.num_heads, -1).transpose(0, 1)  # [H, L, D]

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v)  # [H, L, D]
        return self.o_proj(out.transpose(0, 1).reshape(length, dim))


# The released checkpoints gate with SiLU; PixtralVisionConfig's default is exact GELU.
GATE_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def gate_activation(tower: dict[str, Any]) -> Any:
    """The MLP gate's function from ``vision_config.hidden_act``, refusing any other."""
    name = tower.get("hidden_act", "gelu")
    if name not in GATE_ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {name!r}: only silu and gelu are supported")
    return GATE_ACTIVATIONS[name]


class PixtralMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Any) -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralAttentionLayer(nn.Module):
    def __init__(self, dim: int, hidden: int, num_heads: int, act: Any) -> None:
        super().__init__()
        # HF fixes the tower's norms at 1e-5 whatever the config says.
        self.attention_norm = RMSNorm(dim, eps=1e-5)
        self.attention = PixtralAttention(dim, num_heads)
        self.ffn_norm = RMSNorm(dim, eps=1e-5)
        self.feed_forward = PixtralMLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, tower: dict[str, Any]) -> None:
        super().__init__()
        dim, hidden, heads = (
            tower["hidden_size"],
            tower["intermediate_size"],
            tower["num_attention_heads"],
        )
        act = gate_activation(tower)
        self.layers = nn.ModuleList(
            PixtralAttentionLayer(dim, hidden, heads, act)
            for _ in range(tower["num_hidden_layers"])
        )


def rope_theta(tower: dict[str, Any]) -> float:
    """The tower's RoPE base, from transformers 5's ``rope_parameters`` or 4's ``rope_theta``."""
    params = tower.get("rope_parameters") or {}
    if params.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(f"vision_config.rope_parameters.rope_type {params['rope_type']!r}")
    return float(params.get("rope_theta", tower.get("rope_theta", 10000.0)))


class PixtralVisionModel(nn.Module):
    def __init__(self, tower: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = tower["hidden_size"], tower["num_attention_heads"]
        self.patch_size = tower["patch_size"]
        self.patch_conv = nn.Conv2d(
            tower.get("num_channels", 3), dim, self.patch_size, self.patch_size, bias=False
        )
        self.ln_pre = RMSNorm(dim, eps=1e-5)
        self.transformer = PixtralTransformer(tower)
        self.rotary_dim, self.theta = tower.get("head_dim") or dim // heads, rope_theta(tower)
        inv_freq = computed_buffer(lambda: axial_inv_freq(self.rotary_dim, self.theta))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute inv_freq (after a meta-device build was given memory)."""
        self.inv_freq = axial_inv_freq(self.rotary_dim, self.theta).to(self.inv_freq.device)

    def forward(self, pixels: torch.Tensor, sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """pixels [N, C, H, W] padded to the largest image, sizes: each image's (height, width)
        in pixels -> per image [rows * cols, dim], patches row by row."""
        weight = self.patch_conv.weight
        grids = self.patch_conv(pixels.to(weight.dtype))  # [N, dim, H/P, W/P]
        outputs = []
        for grid, (height, width) in zip(grids, sizes, strict=True):
            rows, cols = height // self.patch_size, width // self.patch_size
            outputs.append(self.blocks(grid[:, :rows, :cols].flatten(1).t(), rows, cols))
        return outputs

    def forward_patches(
        self, patches: torch.Tensor, grids: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """patches [sum of rows * cols, C * P * P] of several images, each image's patches row
        by row and each patch's values channel, row, column (the convolution's order, so the
        patch embedding is one product), grids: each image's (rows, cols) -> per image
        [rows * cols, dim]. Images of different sizes travel this way without padding."""
        weight = self.patch_conv.weight
        embedded = patches.to(weight.dtype) @ weight.flatten(1).t()  # [patches, dim]
        sizes = [rows * cols for rows, cols in grids]
        return [
            self.blocks(x, rows, cols)
            for x, (rows, cols) in zip(embedded.split(sizes), grids, strict=True)
        ]

    def blocks(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """One image's patch embeddings [rows * cols, dim] through ln_pre and the blocks."""
        x = self.ln_pre(x)
        cos, sin = grid_rope(rows, cols, self.inv_freq)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        return x


class Mistral3PatchMerger(nn.Module):
    def __init__(self, dim: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(dim * merge * merge, dim, bias=False)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """patches [rows * cols, dim] of one image -> [(rows/m) * (cols/m), dim]; each cell's
        features in unfold's order (channel-major, then the cell's row, then column)."""
        dim = patches.shape[-1]
        grid = patches.view(rows, cols, dim).permute(2, 0, 1).unsqueeze(0)  # [1, dim, rows, cols]
        cells = F.unfold(grid, kernel_size=self.merge, stride=self.merge)  # [1, dim*m*m, cells]
        return self.merging_layer(cells.view(dim * self.merge**2, -1).t())


class Mistral3MultiModalProjector(nn.Module):
    def __init__(
        self, tower: dict[str, Any], text_hidden: int, merge: int, eps: float, bias: bool
    ) -> None:
        super().__init__()
        dim = tower["hidden_size"]
        self.norm = RMSNorm(dim, eps=eps)
        self.patch_merger = Mistral3PatchMerger(dim, merge)
        self.linear_1 = nn.Linear(dim, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """One image's patches [rows * cols, dim] -> its embeddings [cells, text hidden]."""
        merged = self.patch_merger(self.norm(patches), rows, cols)
        return self.linear_2(F.gelu(self.linear_1(merged)))


def pixtral_embeddings(
    tower: PixtralVisionModel,
    projector: Mistral3MultiModalProjector,
    patches: torch.Tensor,
    grids: list[tuple[int, int, int]],
) -> torch.Tensor:
    """patches [sum of rows * cols, C * P * P] of one or more images (each row by row, its
    patch grid (1, rows, cols) in ``grids``) -> their embeddings [sum of cells, text hidden],
    one per merge x merge cell, each image's row by row."""
    patch_grids = [(rows, cols) for _, rows, cols in grids]
    outputs = tower.forward_patches(patches, patch_grids)
    merged = [
        projector(x, rows, cols) for x, (rows, cols) in zip(outputs, patch_grids, strict=True)
    ]
    return torch.cat(merged)
