"""Images on the engine core: the vision encoder's runs, its cache, and what a step's forward
takes from them (the embeddings that replace placeholder rows, M-RoPE positions).

A request's images arrive processed (``ImageInput``: pixels, patch grid, hash, placeholder run;
the API process ran the model's HF image processor). At each step whose chunks hold any of an
image's placeholders, the image's embeddings come from the encoder cache (by hash), or the
encoder runs once over every image the step misses, batched across its requests. A chunk that
holds only part of an image's placeholders (chunked prefill, or a prefix-cache hit that ends
inside the run) takes the matching slice of the whole image's embeddings: the encoder always
encodes whole images, and the cache keeps them for the next chunk.

The encoder cache holds embeddings up to a byte budget, least recently used evicted first. An
entry in use by the step being built is held by the step itself, so evicting it mid-step only
means the next chunk encodes the image again. An image larger than the whole budget is encoded
for its step and not kept.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from engine_core.config import VisionConfig
from engine_core.request import Request, SchedulerOutput
from protocol.messages import ImageInput, TensorBytes

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class MultimodalStep:
    """What a step's forward takes from its images: ``embeds`` [K, hidden] go to the rows
    ``rows`` [K] of the token embeddings; ``positions`` [3, T] are every row's M-RoPE
    (temporal, height, width) positions (None: the model rotates by the plain ones);
    ``key_ends`` [T] int32, where an image's tokens attend to each other both ways (Gemma 3),
    one past the last position each row attends to (its own for text, its image's last for an
    image's token; None: every row is causal)."""

    rows: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor | None
    key_ends: torch.Tensor | None = None

    def place(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] (the token embeddings) with the image rows written in."""
        if self.rows.numel():
            hidden[self.rows] = self.embeds.to(hidden.dtype)
        return hidden


class EncoderCache:
    """Image embeddings by image hash, least recently used evicted past ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0  # lookups that found the image's embeddings
        self.misses = 0  # lookups that had to encode it

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image_hash: bytes) -> torch.Tensor | None:
        embeds = self._entries.get(image_hash)
        if embeds is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(image_hash)
        return embeds

    def put(self, image_hash: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.budget_bytes or image_hash in self._entries:
            return
        while self.used_bytes + size > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= evicted.numel() * evicted.element_size()
        self._entries[image_hash] = embeds
        self.used_bytes += size


def image_cells(image: ImageInput, merge: int) -> int:
    """The embeddings one image's encoder run gives: its patches over merge x merge."""
    t, h, w = image.grid_thw
    return t * h * w // (merge * merge)


def image_tokens(image: ImageInput, merge: int, row_breaks: bool = False) -> int:
    """The tokens of one image's run: its embeddings' placeholders, and with ``row_breaks``
    one more token after each row of its merged grid (Pixtral's [IMG_BREAK] / [IMG_END])."""
    t, h, _ = image.grid_thw
    return image_cells(image, merge) + (t * h // merge if row_breaks else 0)


def cell_positions(
    image: ImageInput, merge: int, row_breaks: bool, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray]:
    """For the tokens ``[lo, hi)`` of an image's run (counted from its start): the ones the
    image's embeddings fill, and the embedding each takes. Without row breaks every token is
    the next embedding's; with them, a row of ``cols`` embeddings takes ``cols + 1`` tokens and
    its last token keeps its own (text) embedding."""
    k = np.arange(lo, hi, dtype=np.int64)
    if not row_breaks:
        return k, k
    width = image.grid_thw[2] // merge + 1
    k = k[k % width != width - 1]
    return k, k - k // width


def whole_image_chunk(images: Sequence[ImageInput], start: int, num_new: int) -> int:
    """How many of ``num_new`` tokens from ``start`` a chunk may take so that it ends at no
    point inside an image's placeholder run (a model whose image tokens attend both ways needs
    the whole image in the cache when they attend): ``num_new``, or fewer ending where the cut
    image starts, or 0 where the chunk starts inside that image (it waits for a budget that
    takes the rest of it)."""
    end = start + num_new
    for image in images:
        first, last = image.offset, image.offset + image.length
        if first < end < last:
            return max(first - start, 0)
    return num_new


def image_key_ends(images: Sequence[ImageInput], lo: int, hi: int) -> np.ndarray:
    """[hi - lo] int32: one past the last position each of a request's tokens ``[lo, hi)``
    attends to: its own position for text, its image's last for an image's token (HF Gemma 3's
    bidirectional mask within an image)."""
    ends = np.arange(lo + 1, hi + 1, dtype=np.int32)
    for image in images:
        first, last = max(image.offset, lo), min(image.offset + image.length, hi)
        if first < last:
            ends[first - lo : last - lo] = image.offset + image.length
    return ends


def mrope_positions(images: Sequence[ImageInput], merge: int, lo: int, hi: int) -> np.ndarray:
    """[3, hi - lo] int64: the M-RoPE positions of a request's tokens ``[lo, hi)``, as HF's
    Qwen2.5-VL get_rope_index gives them. A text token's three are equal: its index plus the
    shift the images before it left. An image's token at grid cell (t, y, x) is at the image's
    start position plus (t, y, x); the text after an image goes on from one past its largest
    position, so each image shifts what follows by max(t, h, w) - its token count."""
    index = np.arange(lo, hi, dtype=np.int64)
    out = np.repeat(index[None, :], 3, axis=0)
    shift = 0
    for image in images:
        start, end = image.offset, image.offset + image.length
        if start >= hi:
            break
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
        inside = (index >= start) & (index < end)
        if inside.any():
            cell = index[inside] - start
            base = start + shift
            out[0, inside] = base + cell // (h * w)
            out[1, inside] = base + (cell // w) % h
            out[2, inside] = base + cell % w
        shift += max(t, h, w) - image.length
        out[:, index >= end] += max(t, h, w) - image.length
    return out


# The warm-up image's size where images vary (Qwen's towers): a 1,024 x 1,024-pixel image's
# tokens at Qwen2.5-VL's 28-pixel merged patches (1,369), rounded down to a square grid.
WARM_UP_IMAGE_TOKENS = 1_024


def warm_up_image(vision: VisionConfig, most_tokens: int) -> ImageInput | None:
    """A black image in the model's pixel layout for the start-up warm-up (engine_core/
    warm_up.py), of at most ``most_tokens`` placeholders (None where none fits): the tower's
    one size where every image is that size (Gemma 3, Llama 4's tiles), else a square patch
    grid of about WARM_UP_IMAGE_TOKENS tokens (Qwen's towers). Its offset is 0: the plan
    places it."""
    tower, merge = vision.tower, vision.spatial_merge_size
    channels = tower.get("num_channels", tower.get("in_channels", 3))
    if vision.tokens_per_image:
        size = tower["image_size"]
        side, shape = size // tower["patch_size"], (1, channels, size, size)
    else:
        most = min(WARM_UP_IMAGE_TOKENS, most_tokens, vision.max_image_tokens)
        cells = math.isqrt(most)
        if vision.row_breaks and cells * (cells + 1) > most:  # a break token closes each row
            cells -= 1
        side = cells * merge
        # Pixtral's patches are 2D (no temporal_patch_size); Qwen's are two frames deep.
        temporal = 1 if vision.row_breaks else tower.get("temporal_patch_size", 2)
        patch = channels * temporal * tower.get("patch_size", 14) ** 2
        shape = (side * side, patch)
    pixels = TensorBytes("float32", shape, bytes(4 * math.prod(shape)))
    image = ImageInput(b"warm-up".ljust(32, b"\0"), 0, 0, pixels, (1, side, side))
    length = image_tokens(image, merge, vision.row_breaks)
    if not 0 < length <= most_tokens:
        return None
    return replace(image, length=length)


def placeholder_run(image: ImageInput, vision: VisionConfig) -> list[int]:
    """The ids of an image's run as a client's prompt holds them: the placeholder where its
    embeddings go, and with row breaks another token (not the placeholder) closing each row."""
    merge, placeholder = vision.spatial_merge_size, vision.image_token_id
    run = [0 if placeholder else 1] * image.length
    cells, _ = cell_positions(image, merge, vision.row_breaks, 0, image.length)
    for k in cells.tolist():
        run[k] = placeholder
    return run


def pixels_tensor(image: ImageInput) -> torch.Tensor:
    """An image's pixels as a tensor, from its wire bytes (copied: the bytes are read-only)."""
    pixels = image.pixels
    data = torch.frombuffer(bytearray(pixels.data), dtype=_TORCH_DTYPES[pixels.dtype])
    return data.view(pixels.shape)


def batch_pixels(images: Sequence[ImageInput]) -> torch.Tensor:
    """The images' pixels concatenated on their first dim, as ``torch.cat`` of each one's
    ``pixels_tensor`` gives them, but copied once from the wire bytes into the batch (megabytes
    an image: copying each into a tensor of its own and then into the batch took twice)."""
    first = images[0].pixels
    if any(image.pixels.dtype != first.dtype for image in images):  # cat promotes: let it
        return torch.cat([pixels_tensor(image) for image in images])
    rows = sum(image.pixels.shape[0] for image in images)
    out = torch.empty((rows, *first.shape[1:]), dtype=_TORCH_DTYPES[first.dtype])
    dest = out.view(-1).view(torch.uint8).numpy()  # the batch's bytes, written in place
    at = 0
    for image in images:
        data = np.frombuffer(image.pixels.data, np.uint8)
        dest[at : at + data.size] = data
        at += data.size
    return out


class MultimodalRunner:
    """The model runner's image side: checks a request's images against the model, runs the
    encoder (batched, cached) and builds each step's ``MultimodalStep``."""

    def __init__(
        self,
        model: nn.Module,
        vision: VisionConfig,
        device: torch.device,
        budget_bytes: int,
        call_tokens: int,
    ) -> None:
        """``call_tokens``: the most placeholder tokens one encoder run takes (more images
        than that are encoded in several runs): the memory plan's bound on the encoder's
        activations (engine_core/memory_plan.py encoder_call_tokens)."""
        self.model = model
        self.call_tokens = call_tokens
        self.vision = vision
        self.merge = vision.spatial_merge_size
        self.device = device
        self.cache = EncoderCache(budget_bytes)
        self.encoded_images = 0  # images run through the encoder (a batch counts each)

    def forget(self) -> None:
        """Empty the encoder cache and its counts (after the warm-up's image)."""
        self.cache = EncoderCache(self.cache.budget_bytes)
        self.encoded_images = 0

    def check(self, request: Request) -> None:
        """ValueError (fit for the client) where the request's images do not match its prompt:
        each image's run is its placeholder token, as many as its grid gives, and no
        placeholder stands outside a run."""
        ids = request.prompt_token_ids
        placeholder = self.vision.image_token_id
        largest = self.vision.max_image_tokens
        breaks = self.vision.row_breaks
        for image in request.images:
            self._check_pixels(image)
            expected = image_tokens(image, self.merge, breaks)
            if expected > largest:
                raise ValueError(
                    f"an image of grid {list(image.grid_thw)} fills {expected} placeholders, "
                    f"more than the {largest} this engine plans its encoder's memory for"
                )
            if image.length != expected:
                raise ValueError(
                    f"an image of grid {list(image.grid_thw)} fills {expected} placeholders, "
                    f"not {image.length}"
                )
            run = ids[image.offset : image.offset + image.length]
            cells, _ = cell_positions(image, self.merge, breaks, 0, len(run))
            if len(run) != image.length or any(run[k] != placeholder for k in cells):
                raise ValueError(
                    f"an image's placeholder run at {image.offset} is not all {placeholder}"
                )
        filled = sum(image_cells(image, self.merge) for image in request.images)
        if ids.count(placeholder) != filled:
            raise ValueError(
                f"the prompt holds image placeholder tokens ({placeholder}) with no image"
            )

    def _check_pixels(self, image: ImageInput) -> None:
        """Where every image is the tower's one size (Gemma 3's SigLIP), that the pixels are
        one such image [1, C, S, S] and its grid the patch grid the tokens are pooled from."""
        if not self.vision.tokens_per_image:
            return
        tower = self.vision.tower
        size, channels = tower["image_size"], tower.get("num_channels", 3)
        side = size // tower["patch_size"]
        if image.pixels.shape != (1, channels, size, size) or image.grid_thw != (1, side, side):
            raise ValueError(
                f"an image's pixels must be [1, {channels}, {size}, {size}] with grid "
                f"[1, {side}, {side}], not {list(image.pixels.shape)} with "
                f"{list(image.grid_thw)}"
            )

    def prepare(
        self, out: SchedulerOutput, query_start_loc: Sequence[int]
    ) -> MultimodalStep | None:
        """The step's image embeddings and M-RoPE positions; None where no scheduled request
        has an image (its positions are then the plain ones, which M-RoPE equals)."""
        if not any(s.request.images for s in out.scheduled):
            return None
        num_rows = int(query_start_loc[len(out.scheduled)])
        mrope, bidirectional = bool(self.vision.mrope_section), self.vision.bidirectional_images
        positions = np.empty((3, num_rows), dtype=np.int64) if mrope else None
        key_ends = np.empty(num_rows, dtype=np.int32) if bidirectional else None
        pieces: list[tuple[ImageInput, int, int, int]] = []  # image, slice lo/hi, first row
        for i, s in enumerate(out.scheduled):
            lo, hi, row = s.start, s.start + s.num_new_tokens, int(query_start_loc[i])
            images = s.request.images
            if positions is not None:
                positions[:, row : row + hi - lo] = mrope_positions(images, self.merge, lo, hi)
            if key_ends is not None:
                key_ends[row : row + hi - lo] = image_key_ends(images, lo, hi)
            for image in images:
                a, b = max(lo, image.offset), min(hi, image.offset + image.length)
                if a < b:
                    pieces.append((image, a - image.offset, b - image.offset, row + a - lo))
        embeds = self._embeddings({image.hash: image for image, *_ in pieces})
        rows: list[np.ndarray] = []
        parts: list[torch.Tensor] = []
        for image, lo, hi, row in pieces:
            tokens, cells = cell_positions(image, self.merge, self.vision.row_breaks, lo, hi)
            rows.append(tokens - lo + row)
            whole = embeds[image.hash]
            breaks = self.vision.row_breaks  # else the cells are one slice: no gather
            parts.append(whole[torch.from_numpy(cells).to(self.device)] if breaks else whole[lo:hi])
        return MultimodalStep(
            rows=torch.from_numpy(np.concatenate(rows or [np.empty(0, np.int64)])).to(self.device),
            embeds=torch.cat(parts) if parts else torch.empty(0, device=self.device),
            positions=None if positions is None else torch.from_numpy(positions).to(self.device),
            key_ends=None if key_ends is None else torch.from_numpy(key_ends).to(self.device),
        )

    def _embeddings(self, images: dict[bytes, ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings [tokens, hidden]: from the cache, or encoded in one batch."""
        found: dict[bytes, torch.Tensor] = {}
        missing: list[ImageInput] = []
        for image_hash, image in images.items():
            embeds = self.cache.get(image_hash)
            if embeds is None:
                missing.append(image)
            else:
                found[image_hash] = embeds
        if missing:
            for image, embeds in zip(missing, self._encode(missing), strict=True):
                self.cache.put(image.hash, embeds)
                found[image.hash] = embeds
        return found

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings, in order: encoder runs of at most ``call_tokens``
        placeholder tokens each (an image is never split)."""
        out: list[torch.Tensor] = []
        batch: list[ImageInput] = []
        for image in images:
            if batch and sum(i.length for i in batch) + image.length > self.call_tokens:
                out += self._encode_batch(batch)
                batch = []
            batch.append(image)
        return out + self._encode_batch(batch)

    def _encode_batch(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """One encoder run over ``images``: each image's embeddings, in order."""
        pixels = batch_pixels(images).to(self.device)
        grids = [image.grid_thw for image in images]
        embeds = self.model.encode_images(pixels, grids)  # [sum of tokens, hidden]
        self.encoded_images += len(images)
        return list(embeds.split([image_cells(image, self.merge) for image in images]))
