"""Qwen2.5-VL's vision tower, in plain torch: the reference encoder, run eagerly on the engine
core's device (docs/design/vision.md).

Pixels arrive as the HF image processor makes them: one row per patch of ``temporal_patch x
patch x patch`` pixels of each channel, the rows of each image ordered merge block by merge block
(the ``merge x merge`` patches that become one language-model token are consecutive). Then:

1. a patch embedding (HF's Conv3d with stride = kernel, i.e. one matrix product per row);
2. the rows reordered window by window (each window: ``window_size`` pixels square of merge
   blocks), since most blocks attend only within a window; the 2D rotary angles (each patch's
   row and column, half the rotary dims each) reordered with them;
3. ``depth`` pre-norm blocks (RMSNorm, attention with 2D rotary over the image or the window,
   SiLU-gated MLP with biases); the blocks in ``fullatt_block_indexes`` attend over each whole
   image, the others within each window; images never attend to each other; one attention
   call per segment length (the windows of a size, or the images of a size, batched);
4. the patch merger: RMSNorm, each merge block's rows concatenated, a GELU MLP to the language
   model's width; the rows put back in image order.

Parameter names follow HF's checkpoint (``visual.blocks.0.attn.qkv.weight``, ...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VISION_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As HF's: normalised in float32, cast back, then scaled."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C * T * P * P] -> [N, dim]: a convolution whose stride is its kernel is
        one product per patch."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x [N, dim] -> [N, dim]: attention within each segment; ``segments`` holds them
        grouped by length (``group_segments``), so that one attention call serves every
        window (or image) of a size, not one call each."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, H, D] each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = torch.empty_like(q)
        for rows in segments:  # [segments of this length, length]
            count, length = rows.shape
            flat = rows.flatten()
            seg = [
                t[flat].view(count, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v)
            ]
            attended = F.scaled_dot_product_attention(*seg)  # [count, H, length, D]
            out[flat] = attended.transpose(1, 2).reshape(count * length, self.num_heads, -1)
        return self.proj(out.reshape(n, -1))


def group_segments(bounds: list[int], device: torch.device) -> list[torch.Tensor]:
    """The segments of cumulative bounds ``bounds`` grouped by length: for each length, the
    rows of every segment of it [count, length] on ``device``. A large image's windows are
    mostly of one size (only those at its right and bottom edges are cut), so a few groups
    cover hundreds of windows."""
    starts: dict[int, list[int]] = {}
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            starts.setdefault(hi - lo, []).append(lo)
    return [
        (torch.tensor(firsts)[:, None] + torch.arange(length)).to(device)
        for length, firsts in starts.items()
    ]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in float32, as HF's apply_rotary_pos_emb_vision: x [N, H, D]."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = VISION_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMLP(dim, hidden, act)

    def forward(
        self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> [N / merge^2, out_dim]: each merge block's rows as one."""
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2_5_VisionTransformer(nn.Module):
    """The vision tower for a checkpoint's ``vision_config`` (a dict, HF's field names)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        act = config.get("hidden_act", "silu")
        if act not in VISION_ACTIVATIONS:
            raise ValueError(f"Qwen2.5-VL vision_config: unsupported hidden_act {act!r}")
        dim, heads = config["hidden_size"], config["num_heads"]
        self.patch = config.get("patch_size", 14)
        self.merge = config.get("spatial_merge_size", 2)
        self.window = config.get("window_size", 112)
        self.full_blocks = frozenset(config.get("fullatt_block_indexes", ()))
        self.theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.head_dim = dim // heads
        self.patch_embed = PatchEmbed(
            config.get("in_channels", 3), config.get("temporal_patch_size", 2), self.patch, dim
        )
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, config["intermediate_size"], act)
            for _ in range(config["depth"])
        )
        self.merger = PatchMerger(config["out_hidden_size"], dim, self.merge)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [patches, C * T * P * P] of the images ``grids`` names, one after another ->
        their embeddings [patches / merge^2, out_dim], in the same order."""
        device = pixels.device
        order, windows = window_order(grids, self.merge, self.window // self.merge // self.patch)
        unit = self.merge * self.merge
        rows = (order[:, None] * unit + torch.arange(unit)).flatten().to(device)
        x = self.patch_embed(pixels)[rows]
        cos, sin = vision_rotary(grids, self.merge, self.head_dim, self.theta, device)
        cos, sin = cos[rows], sin[rows]
        images = group_segments(image_bounds(grids), device)
        windowed = group_segments(windows, device)
        for index, block in enumerate(self.blocks):
            x = block(x, images if index in self.full_blocks else windowed, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order).to(device)]


def vision_rotary(
    grids: list[tuple[int, int, int]], merge: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's 2D rotary (cos, sin) [patches, head_dim] in float32, patches in the
    processor's order: its row's angles on the first quarter of frequencies, its column's on
    the second, both halves alike (rotate-half). Qwen2.5-VL's and Qwen3-VL's towers alike."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    positions = patch_positions(grids, merge).float()  # [patches, 2]: row, column
    freqs = (positions[:, :, None] * inv_freq).flatten(1)  # [patches, spatial]
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos(), emb.sin()


def image_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch counts: each image's frames (t) attend within themselves."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[patches, 2] int64: each patch's (row, column) in its image, in the processor's order
    (merge block by merge block, row-major within each)."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        pos = [p.reshape(shape).transpose(1, 2).flatten() for p in (rows, cols)]
        out.append(torch.stack(pos, dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(
    grids: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of every image reordered window by window (windows of ``window`` x
    ``window`` blocks, row-major, the last ones cut at the image's edge), and the windows'
    cumulative patch counts; as HF's get_vision_window_index."""
    order: list[torch.Tensor] = []
    bounds = [0]
    first = 0
    for t, h, w in grids:
        bh, bw = h // merge, w // merge
        blocks = torch.arange(t * bh * bw).view(t, bh, bw) + first
        for frame in blocks:
            for top in range(0, bh, window):
                for left in range(0, bw, window):
                    cell = frame[top : top + window, left : left + window].flatten()
                    order.append(cell)
                    bounds.append(bounds[-1] + cell.numel() * merge * merge)
        first += t * bh * bw
    return torch.cat(order), bounds
