"""Llama 4's image processing in the API process, with numpy: what HF's
``Llama4ImageProcessor`` and ``Llama4Processor`` do (transformers' ``models/llama4``), without
torch or torchvision, which the API process never imports.

An image is resized without distortion onto the best canvas of ``rows x cols`` tiles (at most
``max_patches`` of them), padded with black at the bottom and right, rescaled and normalised
in bfloat16 as HF does, and cut into tiles row by row; an image of more than one tile also gets
the global view (the whole image squeezed to one tile) after them. Its prompt text is HF's:
``<|image_start|>``, each tile's run of ``<|patch|>`` (``<|tile_x_separator|>`` between the tiles
of a row, ``<|tile_y_separator|>`` after each row), then ``<|image|>``, the global view's run
(the only run when there is one tile) and ``<|image_end|>``. Each run is one tile's rows, one
``ImageInput`` on the wire (docs/design/llama4.md, "Vision").

The resize is torch's antialiased bilinear resize of uint8 images, which HF's processor runs
through torchvision, written out (``resize``): PIL's filter, but with weights rounded to 16-bit
fixed point at a precision chosen per axis, so PIL's own resize differs by a level on a few
pixels in a hundred. tests/test_llama4_images.py checks the pixels against HF's processor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

PATCH = "<|patch|>"
IMAGE = "<|image|>"  # what the chat template writes per image; also the global view's marker
TILE_X = "<|tile_x_separator|>"
TILE_Y = "<|tile_y_separator|>"
START, END = "<|image_start|>", "<|image_end|>"
# Preprocessor fields this port follows only when true (check_preprocessor).
REQUIRED_TRUE = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
BILINEAR = 2  # PIL's code for it, as processor configs name it: the one filter ported here


@dataclass(frozen=True)
class Llama4Tiling:
    """One model's image processing: tile side, the most tiles, the normalisation, and the
    rows one tile becomes in the language model."""

    tile: int
    max_tiles: int
    tokens_per_tile: int
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resize_to_max_canvas: bool = False

    @classmethod
    def load(cls, model_dir: Path, config: dict[str, Any]) -> Llama4Tiling:
        """From the folder's preprocessor_config.json and config.json's vision_config;
        ValueError naming a field this port would not honour."""
        path = model_dir / "preprocessor_config.json"
        pre = json.loads(path.read_text()) if path.is_file() else {}
        vision = config["vision_config"]
        check_preprocessor(pre, vision["image_size"], path)
        side = vision["image_size"] // vision["patch_size"]
        downsample = round(1 / vision["pixel_shuffle_ratio"] ** 2)
        return cls(
            tile=vision["image_size"],
            max_tiles=int(setting(pre, "max_patches", 16)),
            tokens_per_tile=side * side // downsample,
            mean=channels(setting(pre, "image_mean", cls.mean)),
            std=channels(setting(pre, "image_std", cls.std)),
            rescale=float(setting(pre, "rescale_factor", cls.rescale)),
            resize_to_max_canvas=bool(setting(pre, "resize_to_max_canvas", False)),
        )

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles an image of this size is laid out on."""
        return best_grid(height, width, self.tile, supported_grids(self.max_tiles),
                         self.resize_to_max_canvas)  # fmt: skip

    def tiles(self, image: Any) -> tuple[np.ndarray, tuple[int, int]]:
        """An RGB PIL image -> (pixels [tiles (+1 global view), 3, tile, tile] float32 holding
        bfloat16 values, as HF's processor makes them; (rows, cols))."""
        original = np.asarray(image)  # [H, W, 3] uint8
        height, width = original.shape[:2]
        rows, cols = self.grid(height, width)
        pixels = resize(original, *self.fitted_size(height, width, rows, cols))
        canvas = np.zeros((rows * self.tile, cols * self.tile, 3), np.uint8)
        canvas[: pixels.shape[0], : pixels.shape[1]] = pixels
        tiles = split_tiles(self.normalize(canvas), rows, cols)
        if rows * cols > 1:
            whole = resize(original, self.tile, self.tile)
            tiles = np.concatenate([tiles, self.normalize(whole)[None]])
        return np.ascontiguousarray(tiles), (rows, cols)

    def fitted_size(self, height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
        """(height, width) the image is resized to on a canvas of rows x cols tiles: as large
        as fits without distortion, but not upscaled past one tile's side unless asked."""
        target_h, target_w = rows * self.tile, cols * self.tile
        if not self.resize_to_max_canvas:
            target_h = min(max(height, self.tile), target_h)
            target_w = min(max(width, self.tile), target_w)
        new_h, new_w = size_without_distortion(height, width, target_h, target_w)
        return max(new_h, 1), max(new_w, 1)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [H, W, 3] -> [3, H, W]: each value looked up by its level and channel."""
        return np.stack([self.levels[c][pixels[..., c]] for c in range(3)])

    @cached_property
    def levels(self) -> np.ndarray:
        """[3, 256]: each channel's value for each uint8 level: x * rescale, then (x - mean) /
        std, each step rounded to bfloat16 as HF's processor computes it (in bfloat16, which
        its comment says the original implementation does)."""
        x = to_bfloat16(np.arange(256, dtype=np.float32) * np.float32(self.rescale))
        mean = to_bfloat16(np.array(self.mean, np.float32))[:, None]
        std = to_bfloat16(np.array(self.std, np.float32))[:, None]
        return to_bfloat16(to_bfloat16(x[None] - mean) / std)

    def prompt_text(self, rows: int, cols: int) -> str:
        """The text that stands for an image of rows x cols tiles (HF's _prompt_split_image)."""
        run = PATCH * self.tokens_per_tile
        text = START
        if rows * cols > 1:
            text += (TILE_X.join([run] * cols) + TILE_Y) * rows
        return text + IMAGE + run + END


def setting(pre: dict[str, Any], key: str, default: Any) -> Any:
    """A preprocessor_config.json field; absent or null is the processor's default, as for HF."""
    value = pre.get(key)
    return default if value is None else value


def channels(value: float | list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """A mean or std: one per channel, or one for all three."""
    return tuple(float(v) for v in np.broadcast_to(np.asarray(value, np.float64), (3,)))


def check_preprocessor(pre: dict[str, Any], image_size: int, path: Path) -> None:
    """ValueError naming a field whose value this port would not follow: a step switched off
    (HF's bfloat16 arithmetic is only for rescale and normalise together), a tile size other
    than the tower's, fewer than one tile."""
    for name in REQUIRED_TRUE:
        if setting(pre, name, True) is not True:
            raise ValueError(f"{path}: {name} false is not supported for Llama 4 images")
    size = setting(pre, "size", {"height": 336, "width": 336})
    if size.get("height") != size.get("width") or size.get("height") != image_size:
        raise ValueError(
            f"{path}: size {size} must be square and equal vision_config.image_size "
            f"({image_size}), the tile the vision tower reads"
        )
    if int(setting(pre, "max_patches", 16)) < 1:
        raise ValueError(f"{path}: max_patches must be at least 1")
    if setting(pre, "resample", BILINEAR) != BILINEAR:
        raise ValueError(f"{path}: resample must be {BILINEAR} (bilinear) for Llama 4 images")


def supported_grids(max_tiles: int) -> list[tuple[int, int]]:
    """Every (rows, cols) of at most ``max_tiles`` tiles, in HF's order (find_supported_
    resolutions: grouped by aspect ratio in order of first appearance, counts falling), which
    decides between canvases of equal scale and area."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [grid for grids in by_ratio.values() for grid in grids]


def best_grid(
    height: int, width: int, tile: int, grids: list[tuple[int, int]], to_max: bool
) -> tuple[int, int]:
    """HF's get_best_fit: the canvas that upscales least (or, ``to_max``, most) without
    distortion, else the one that downscales least; ties to the smallest area. float32 as HF's
    torch code computes it, so that ties fall the same way."""
    sizes = np.array(grids, np.int64) * tile
    scale_h = sizes[:, 0].astype(np.float32) / np.float32(height)
    scale_w = sizes[:, 1].astype(np.float32) / np.float32(width)
    scales = np.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if len(up) else scales.max()
    candidates = np.flatnonzero(scales == chosen)
    areas = sizes[candidates, 0] * sizes[candidates, 1]
    return grids[int(candidates[int(np.argmin(areas))])]


def size_without_distortion(
    height: int, width: int, target_h: int, target_w: int
) -> tuple[int, int]:
    """The largest (height, width) of the image's aspect ratio inside the target (HF's
    get_max_res_without_distortion)."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_h), target_w
    return target_h, min(math.floor(width * scale_h), target_w)


def resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> [height, width, C] as torch's antialiased bilinear resize of uint8
    (what HF's processor calls through torchvision): the width first, then the height, each
    pass rounded to uint8."""
    if pixels.shape[1] != width:
        by_column = np.ascontiguousarray(pixels.transpose(1, 0, 2))
        pixels = resample_rows(by_column, width).transpose(1, 0, 2)
    if pixels.shape[0] != height:
        pixels = resample_rows(np.ascontiguousarray(pixels), height)
    return np.ascontiguousarray(pixels)


def resample_rows(x: np.ndarray, size: int) -> np.ndarray:
    """uint8 [N, ...] -> [size, ...] along the first axis (whole rows gathered per tap, the
    fast way for numpy): each output row a fixed-point weighted sum of its input rows."""
    starts, weights, precision = aa_weights(x.shape[0], size)
    shape = (size,) + (1,) * (x.ndim - 1)
    acc = np.full((size, *x.shape[1:]), 1 << (precision - 1), np.int32)
    term = np.empty_like(acc)
    for j in range(weights.shape[1]):
        rows = np.minimum(starts + j, x.shape[0] - 1)  # past a row's taps the weight is 0
        np.multiply(x[rows], weights[:, j].reshape(shape), out=term)
        acc += term
    acc >>= precision
    return np.clip(acc, 0, 255).astype(np.uint8)


@lru_cache(maxsize=64)
def aa_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One axis of torch's uint8 antialiased bilinear resize (aten's UpSampleKernel.cpp,
    _compute_index_ranges_int16_weights): each output's first input index [out], its weights
    [out, taps] as int32 holding int16 values, and their fixed-point precision in bits. PIL's
    triangle filter, stretched by the scale when shrinking; the weights normalised in float64,
    then scaled by the largest power of two that keeps the largest under 2^15."""
    scale = in_size / out_size
    support = max(scale, 1.0)
    invscale = 1.0 / support  # multiplied, not divided by: the same rounding as aten's
    taps = math.ceil(support) * 2 + 1
    starts = np.zeros(out_size, np.int64)
    real = np.zeros((out_size, taps), np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        count = min(max(min(int(center + support + 0.5), in_size) - first, 0), taps)
        ws = [max(0.0, 1.0 - abs((j + first - center + 0.5) * invscale)) for j in range(count)]
        total = sum(ws)  # in order from 0.0, as aten's loop adds them
        starts[i] = first
        real[i, :count] = [w / total for w in ws] if total else ws
    precision = 0
    while precision < 22 and int(0.5 + real.max() * (1 << (precision + 1))) < 1 << 15:
        precision += 1
    return starts, np.trunc(0.5 + real * (1 << precision)).astype(np.int32), precision


def split_tiles(pixels: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[C, rows * S, cols * S] -> [rows * cols, C, S, S], tiles row by row."""
    c, h, w = pixels.shape
    tiles = pixels.reshape(c, rows, h // rows, cols, w // cols).transpose(1, 3, 0, 2, 4)
    return tiles.reshape(rows * cols, c, h // rows, w // cols)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), kept as float32 (numpy
    has no bfloat16)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded & np.uint32(0xFFFF0000)).view(np.float32)
