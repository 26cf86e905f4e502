"""SigLIP's vision tower and Gemma 3's multi-modal projector, in plain torch: the encoder of
``Gemma3ForConditionalGeneration`` (models/gemma3_mm.py), run eagerly on the engine core's
device (docs/design/vision.md).

Every image arrives resized to the tower's one size (``image_size`` pixels square, pan-and-scan
off), so a batch of images is one [N, 3, S, S] tensor and the tower is a plain ViT over it:

1. the patch embedding (a convolution whose stride is its kernel) plus a learned position
   embedding per patch;
2. ``num_hidden_layers`` pre-LayerNorm blocks: full attention over the image's patches (no
   mask, images never attend to each other) and a GELU (tanh) MLP, both with biases;
3. the post LayerNorm;
4. the projector: the patch grid average-pooled to ``mm_tokens_per_image`` cells, RMSNorm with
   Gemma's (1 + w) weight, one product to the language model's width.

Parameter names follow HF's checkpoint under ``vision_tower.vision_model.`` and
``multi_modal_projector.``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiglipEmbeddings(nn.Module):
    def __init__(self, channels: int, patch: int, image_size: int, dim: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((image_size // patch) ** 2, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, patches, dim], patches row by row."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(weight.dtype))  # [N, dim, S/P, S/P]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, L, dim] -> [N, L, dim]: every patch of an image attends to all of its patches."""
        n, length, dim = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, length, self.num_heads, -1).transpose(1, 2)  # [N, H, L, D]

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        out = F.scaled_dot_product_attention(q, k, v)  # [N, H, L, D]
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))


class SiglipMLP(nn.Module):
    """fc1, GELU, fc2, with biases; ``approximate``: F.gelu's ("none" in Llama 4's tower)."""

    def __init__(self, dim: int, hidden: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, dim: int, hidden: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, num_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = SiglipMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, tower: dict[str, Any]) -> None:
        super().__init__()
        dim, eps = tower["hidden_size"], tower.get("layer_norm_eps", 1e-6)
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(dim, tower["intermediate_size"], tower["num_attention_heads"], eps)
            for _ in range(tower["num_hidden_layers"])
        )


class SiglipVisionModel(nn.Module):
    """HF's SiglipVisionTransformer without its pooling head (Gemma 3 reads the patches)."""

    def __init__(self, tower: dict[str, Any]) -> None:
        super().__init__()
        dim = tower["hidden_size"]
        channels = tower.get("num_channels", 3)
        self.embeddings = SiglipEmbeddings(channels, tower["patch_size"], tower["image_size"], dim)
        self.encoder = SiglipEncoder(tower)
        self.post_layernorm = nn.LayerNorm(dim, eps=tower.get("layer_norm_eps", 1e-6))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, patches, dim]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class GemmaRMSNorm(nn.Module):
    """RMSNorm in float32 with Gemma's (1 + w) weight, as HF's Gemma3RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3MultiModalProjector(nn.Module):
    """[N, patches, vision dim] -> [N, tokens_per_image, text dim]: each side's patches
    average-pooled to sqrt(tokens_per_image) cells, normed, projected."""

    def __init__(self, tower: dict[str, Any], text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        dim = tower["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(dim, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(dim, tower.get("layer_norm_eps", 1e-6))
        self.patches_per_side = tower["image_size"] // tower["patch_size"]
        self.kernel = self.patches_per_side // int(tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, dim = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(n, dim, side, side)  # [N, dim, side, side]
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)  # [N, tokens, dim]
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)
