"""Llama 4's vision encoder and projector in plain torch: what ``Llama4ForConditionalGeneration``
turns each image tile into (docs/design/llama4.md, "Vision").

Every tile arrives resized to the tower's one size (``image_size`` pixels square), so a batch of
tiles is one [N, 3, S, S] tensor and the tower is a ViT over it:

1. the patch embedding: each P x P patch flattened channel-major (HF's ``nn.Unfold`` order) and
   one product, no bias; a learned class embedding appended after the patches; a learned
   position embedding per row (patches and class); LayerNorm;
2. ``num_hidden_layers`` pre-LayerNorm blocks: full attention over one tile's rows with a 2D
   rotary (x and y of the patch grid, each over a quarter of the head's dims, pairs (2i, 2i + 1);
   the class row unrotated), and an exact-GELU MLP, both with biases;
3. LayerNorm, the class row dropped, the pixel shuffle (each 1/r x 1/r cell of patches becomes
   one row of r^-2 times the width), a two-product GELU MLP (the adapter), and the projector's
   one product to the language model's width.

Module and parameter names are HF's (``vision_model.`` and ``multi_modal_projector.``), so the
checkpoint loads by name. HF's modeling hard-codes the LayerNorm eps (1e-5), the GELU and a
projector without bias; a config that asks for others is refused (``check_vision_config``)
rather than served as if it had not asked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.siglip import SiglipMLP


def check_vision_config(vision: dict[str, Any]) -> None:
    """Refuse, by field name, what HF's modeling would silently ignore."""
    if vision.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"Llama 4 vision: hidden_act {vision['hidden_act']!r} is not supported")
    if vision.get("norm_eps", 1e-5) != 1e-5:
        raise ValueError(f"Llama 4 vision: norm_eps {vision['norm_eps']} is not supported")
    if vision.get("multi_modal_projector_bias", False):
        raise ValueError("Llama 4 vision: multi_modal_projector_bias is not supported")
    dims = {vision.get(k) for k in ("projector_input_dim", "projector_output_dim")}
    if len(dims | {vision.get("vision_output_dim")}) != 1:
        raise ValueError(
            "Llama 4 vision: projector_input_dim, projector_output_dim and vision_output_dim "
            "must be equal"
        )
    side = vision["image_size"] // vision["patch_size"]
    cells = side * vision["pixel_shuffle_ratio"]
    if (
        cells != int(cells)
        or vision["intermediate_size"] * vision["pixel_shuffle_ratio"] ** 2 != vision["hidden_size"]
    ):
        raise ValueError(
            "Llama 4 vision: pixel_shuffle_ratio must divide the patch grid and map hidden_size "
            "onto intermediate_size"
        )


def rope_theta(vision: dict[str, Any]) -> float:
    params = vision.get("rope_parameters") or {}
    return float(params.get("rope_theta", vision.get("rope_theta", 10000.0)))


def tokens_per_tile(vision: dict[str, Any]) -> int:
    """Language-model rows one tile becomes: the patch grid after the pixel shuffle."""
    side = vision["image_size"] // vision["patch_size"]
    return int(side * vision["pixel_shuffle_ratio"]) ** 2


def rotary_angles(side: int, head_dim: int, theta: float) -> torch.Tensor:
    """[side^2 + 1, head_dim / 2] float32 angles: pair i of a patch at (x, y) turns by
    (x + 1) * f_i for the first quarter of the head's dims, (y + 1) * f_i for the second; the
    class row (last) by 0, as HF's ``Llama4VisionRotaryEmbedding``."""
    quarter = head_dim // 4
    freq = 1.0 / theta ** (torch.arange(0, 2 * quarter, 2)[:quarter].float() / (head_dim // 2))
    index = torch.arange(side * side)
    x = (index % side + 1).float()[:, None] * freq  # [side^2, quarter]
    y = (index // side + 1).float()[:, None] * freq
    angles = torch.cat([x, y], dim=-1)
    return torch.cat([angles, angles.new_zeros(1, 2 * quarter)])


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, L, H, D] with pairs (2i, 2i + 1) rotated by cos, sin [L, 1, D/2], in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Llama4UnfoldConvolution(nn.Module):
    def __init__(self, channels: int, patch: int, dim: int) -> None:
        super().__init__()
        self.patch = patch
        self.linear = nn.Linear(channels * patch * patch, dim, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, (S/P)^2, dim], patches row by row, each flattened as
        (channel, row, column) as ``nn.Unfold`` does."""
        n, c, s, _ = pixels.shape
        p, side = self.patch, s // self.patch
        patches = pixels.view(n, c, side, p, side, p).permute(0, 2, 4, 1, 3, 5)
        return self.linear(patches.reshape(n, side * side, c * p * p).to(self.linear.weight.dtype))


class Llama4VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, L, dim] -> [N, L, dim]: each tile's rows attend to all of its rows."""
        n, length, dim = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (proj(x).view(n, length, self.num_heads, -1) for proj in projs)
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )  # [N, H, L, D]
        return self.o_proj(out.transpose(1, 2).reshape(n, length, dim))


class Llama4VisionEncoderLayer(nn.Module):
    def __init__(self, dim: int, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.self_attn = Llama4VisionAttention(dim, num_heads)
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.mlp = SiglipMLP(dim, hidden, approximate="none")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionEncoder(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim, hidden = vision["hidden_size"], vision["intermediate_size"]
        heads = vision["num_attention_heads"]
        self.layers = nn.ModuleList(
            Llama4VisionEncoderLayer(dim, hidden, heads) for _ in range(vision["num_hidden_layers"])
        )


class Llama4VisionMLP2(nn.Module):
    """The adapter after the pixel shuffle: two products without bias, each followed by GELU."""

    def __init__(self, shuffled: int, projector: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(shuffled, projector, bias=False)
        self.fc2 = nn.Linear(projector, projector, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """x [N, side^2, C] -> [N, (side * ratio)^2, C / ratio^2]: each 1/ratio x 1/ratio cell of
    patches folded into one row, in HF's ``pixel_shuffle`` order (rows and columns swapped
    twice, so a cell's channels run column-major over its patches)."""
    n, patches, channels = x.shape
    side = int(patches**0.5)
    narrow = int(side * ratio)
    x = x.view(n, side, narrow, int(channels / ratio)).permute(0, 2, 1, 3)
    x = x.reshape(n, narrow, narrow, int(channels / ratio**2)).permute(0, 2, 1, 3)
    return x.reshape(n, narrow * narrow, -1)


class Llama4VisionPixelShuffleMLP(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.ratio = vision["pixel_shuffle_ratio"]
        self.mlp = Llama4VisionMLP2(vision["intermediate_size"], vision["projector_output_dim"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(x, self.ratio))


class Llama4VisionModel(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        check_vision_config(vision)
        dim, patch = vision["hidden_size"], vision["patch_size"]
        side = vision["image_size"] // patch
        self.image_size = vision["image_size"]
        self.patch_embedding = Llama4UnfoldConvolution(vision.get("num_channels", 3), patch, dim)
        self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.positional_embedding_vlm = nn.Parameter(torch.zeros(side * side + 1, dim))
        self.layernorm_pre = nn.LayerNorm(dim)
        self.layernorm_post = nn.LayerNorm(dim)
        self.model = Llama4VisionEncoder(vision)
        self.vision_adapter = Llama4VisionPixelShuffleMLP(vision)
        self.grid_side = side
        self.head_dim = dim // vision["num_attention_heads"]
        self.rope_theta = rope_theta(vision)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] of N tiles -> [N, tokens_per_tile, projector_output_dim]."""
        x = self.patch_embedding(pixels)  # [N, side^2, dim]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = self.layernorm_pre(torch.cat([x, cls], dim=1) + self.positional_embedding_vlm)
        # Built per call, not kept as a buffer: the loader makes the model's tensors from the
        # checkpoint alone, and this is [side^2 + 1, D/2], small beside one block.
        angles = rotary_angles(self.grid_side, self.head_dim, self.rope_theta)
        angles = angles.to(x.device)[:, None, :]  # [L, 1, D/2]
        cos, sin = angles.cos(), angles.sin()
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.vision_adapter(self.layernorm_post(x)[:, :-1])


class Llama4MultiModalProjector(nn.Module):
    def __init__(self, vision_output_dim: int, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_output_dim, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class Llama4VisionTower(nn.Module):
    """The tower and the projector under HF's names: tiles in, language-model rows out."""

    def __init__(self, vision: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.vision_model = Llama4VisionModel(vision)
        self.multi_modal_projector = Llama4MultiModalProjector(
            vision["vision_output_dim"], text_hidden
        )

    @torch.inference_mode()
    def encode_tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N * tokens_per_tile, text_hidden], tile after tile."""
        return self.multi_modal_projector(self.vision_model(pixels)).flatten(0, 1)
