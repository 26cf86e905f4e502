"""Images in the API process: fetched or decoded, checked, processed by the model's HF image
processor, and placed in the prompt as runs of placeholder tokens (what goes on the wire).

The chat template renders each image part as the model's image marker (Qwen2.5-VL's
``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>``); after
tokenizing, each marker token becomes the run of placeholders the image's embeddings fill (its
patch grid over the merge size squared), with what the model's HF processor writes around it
(Gemma 3: ``\n\n<start_of_image>``, 256 ``<image_soft_token>``, ``<end_of_image>\n\n``).
The processor's pixels travel with their grid in the dtype the engine's tower takes them in
(its Ready's ``pixel_dtype``: bfloat16 on a bfloat16 engine, half float32's bytes, rounded as
the engine's cast would round them), named by a SHA-256 over what the encoder reads
(engine_core/multimodal.py).

Every failure here is the client's image: a ``BadImage`` naming the part, which the route turns
into a 400 (frontend/chat.py), never a 500 and never an engine error.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import hashlib
import io
import json
import math
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from engine_core.cpu_malloc import keep_freed_memory
from frontend.llama4_images import IMAGE, Llama4Tiling
from protocol.codec import MAX_IMAGES
from protocol.messages import ImageInput, TensorBytes

# Architectures whose image side the engine implements (engine_core/models/qwen2_5_vl.py,
# qwen3_vl.py, qwen3_5_vl.py, gemma3_mm.py, llama4_mm.py, mistral3.py).
VISION_ARCHITECTURES = (
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Llama4ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
)
# The wire's frame limit is 64 MiB (protocol/codec.py): a prompt's pixels stay under this.
MAX_PIXEL_BYTES = 48 << 20
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/webp")


class ImageRefused(Exception):
    """The model's HF image processor refused an image (``VisionProcessor.hf_images``)."""


class BadImage(ValueError):
    """An image part the server cannot take; ``param`` names it (``messages[1].content[0]``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class MediaOptions:
    """How the API process may get images: hosts it may fetch http(s) URLs from (empty: none),
    the folder ``file://`` URLs may name (None: none), the limits on a fetch, the most images a
    prompt may hold and the most pixels an image may decode to."""

    allowed_hosts: frozenset[str] = frozenset()
    allowed_local_path: Path | None = None
    max_images: int = 4
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20
    max_decoded_pixels: int = 64 << 20

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaOptions:
        """From tandem serve's flags (frontend/serve.py add_media_args); ValueError for a bad
        one."""
        return cls.from_flags(
            args.limit_mm_per_prompt,
            args.allowed_media_domains,
            args.allowed_local_media_path,
            args.media_fetch_timeout,
            args.max_image_bytes,
        )

    @classmethod
    def from_flags(
        cls,
        limit_mm_per_prompt: str | None,
        allowed_media_domains: Sequence[str] | None,
        allowed_local_media_path: str | None,
        fetch_timeout_s: float,
        max_image_bytes: int,
    ) -> MediaOptions:
        local = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        if local is not None and not local.is_dir():
            raise ValueError(f"--allowed-local-media-path {local} is not a folder")
        return cls(
            allowed_hosts=frozenset(h.lower() for h in allowed_media_domains or ()),
            allowed_local_path=local,
            max_images=parse_image_limit(limit_mm_per_prompt),
            fetch_timeout_s=fetch_timeout_s,
            max_image_bytes=max_image_bytes,
        )


def parse_image_limit(text: str | None) -> int:
    """``--limit-mm-per-prompt`` as vLLM spells it ('{"image": 4}'): the most images a prompt
    may hold. A modality the server cannot take is refused, not ignored."""
    if text is None:
        return MediaOptions.max_images
    try:
        limits = json.loads(text)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt must be JSON, got {text!r}") from None
    if not isinstance(limits, dict):
        raise ValueError('--limit-mm-per-prompt must be an object such as {"image": 4}')
    unknown = sorted(set(limits) - {"image"})
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: this server takes images only, not {unknown}")
    count = limits.get("image", MediaOptions.max_images)
    if type(count) is not int or count < 0:
        raise ValueError(f"--limit-mm-per-prompt: image must be a count >= 0, got {count!r}")
    return count


# ---- getting the bytes ------------------------------------------------------------------------


def data_url_bytes(url: str, param: str) -> bytes:
    """The image bytes of a ``data:image/...;base64,...`` URL."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise BadImage("a data URL image must be base64: data:image/png;base64,...", param)
    mime = header.removeprefix("data:").removesuffix(";base64").lower()
    if mime not in IMAGE_MIME_TYPES:
        raise BadImage(f"a data URL image must be one of {', '.join(IMAGE_MIME_TYPES)}", param)
    try:
        # Strict mode rejects what b64decode(validate=True) rejects, without that one's regular
        # expression pass over the megabytes first.
        return binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        pass
    try:  # the forms other encoders write: line breaks (MIME's), no padding, URL-safe letters
        return binascii.a2b_base64(loose_base64(payload), strict_mode=True)
    except (binascii.Error, ValueError):
        raise BadImage("the data URL's base64 does not decode", param) from None


_URL_SAFE = str.maketrans("-_", "+/", " \t\r\n")


def loose_base64(payload: str) -> str:
    """``payload`` as standard, padded base64: whitespace removed, URL-safe letters made
    standard, padding added."""
    text = payload.translate(_URL_SAFE).rstrip("=")
    return text + "=" * (-len(text) % 4)


async def fetch_image_bytes(url: str, options: MediaOptions, param: str) -> bytes:
    """The bytes behind an image URL: a data URL's, an allowed host's (fetched within the time
    and size limits) or an allowed local file's."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        raw = data_url_bytes(url, param)
    elif scheme in ("http", "https"):
        raw = await fetch_http(url, options, param)
    elif scheme == "file":
        raw = await asyncio.to_thread(read_local_file, url, options, param)
    else:
        raise BadImage(f"image URLs must be data:, http(s): or file:, not {scheme or url!r}", param)
    if len(raw) > options.max_image_bytes:
        raise BadImage(f"the image is larger than {options.max_image_bytes} bytes", param)
    return raw


async def fetch_http(url: str, options: MediaOptions, param: str) -> bytes:
    """GET an allowed host's image, at most ``max_image_bytes`` of it within the time limit;
    redirects are not followed (they could leave the allowed hosts)."""
    import httpx

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in options.allowed_hosts:
        raise BadImage(
            f"this server fetches image URLs only from the hosts --allowed-media-domains names "
            f"(not {host!r}); send the image as a data: URL",
            param,
        )
    limit, seconds = options.max_image_bytes, options.fetch_timeout_s
    try:
        # httpx's timeout bounds each read; this bounds the whole fetch (a slow drip too).
        async with (
            asyncio.timeout(seconds),
            httpx.AsyncClient(timeout=seconds) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise BadImage(f"fetching the image gave HTTP {response.status_code}", param)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise BadImage(f"the image is larger than {limit} bytes", param)
            return bytes(body)
    except TimeoutError:
        raise BadImage(f"the image was not fetched within {seconds} s", param) from None
    except httpx.HTTPError as exc:
        raise BadImage(f"could not fetch the image: {type(exc).__name__}", param) from None


def read_local_file(url: str, options: MediaOptions, param: str) -> bytes:
    """A ``file://`` image, only from under --allowed-local-media-path (symlinks resolved first,
    so none leads out of it)."""
    root = options.allowed_local_path
    if root is None:
        raise BadImage(
            "file:// images need a server started with --allowed-local-media-path", param
        )
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise BadImage(f"file:// images must be files under {root}", param)
    if path.stat().st_size > options.max_image_bytes:
        raise BadImage(f"the image is larger than {options.max_image_bytes} bytes", param)
    return path.read_bytes()


def decode_image(raw: bytes, options: MediaOptions, param: str) -> Any:
    """PNG, JPEG or WebP bytes as an RGB PIL image, fully decoded (a truncated file fails here,
    not in the processor); images that would decode to too many pixels are refused unread."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.format not in ("PNG", "JPEG", "WEBP"):
                raise BadImage(f"images must be PNG, JPEG or WebP, not {image.format}", param)
            width, height = image.size
            if width * height > options.max_decoded_pixels:
                raise BadImage(
                    f"the image has {width}x{height} pixels, more than "
                    f"{options.max_decoded_pixels}",
                    param,
                )
            image.load()
            return as_rgb(image)
    except UnidentifiedImageError:
        raise BadImage("the bytes are not a PNG, JPEG or WebP image", param) from None
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, BadImage):
            raise
        raise BadImage(f"the image does not decode: {exc}", param) from None


def as_rgb(image: Any) -> Any:
    """The PIL image in RGB, transparency laid over white, as HF's processors convert it
    (transformers.image_transforms.convert_to_rgb): a plain ``convert("RGB")`` drops the alpha
    and leaves the colour under it, which the model would see instead."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


# ---- the model's processor --------------------------------------------------------------------


@dataclass(frozen=True)
class ImageMarker:
    """How a model's prompt holds an image: the placeholder token its embeddings fill, how
    many patches per side merge into one embedding, and how the chat template's marker
    becomes the placeholders' run."""

    placeholder_id: int
    merge_size: int
    # (marker, expansion): the text the template writes once per image and what the model's
    # processor writes in its place, its run of placeholders included, replaced before
    # tokenizing so that the prompt tokenizes as HF's processor's does (Gemma 3's
    # "\n\n<start_of_image>" merges with the newlines before it). None: the template writes
    # the placeholder once and ``place`` repeats it after tokenizing (Qwen2.5-VL).
    text_expansion: tuple[str, str] | None = None
    # Where every image is resized to one size (Gemma 3's SigLIP): the patch grid it reads.
    fixed_grid: tuple[int, int, int] | None = None


@dataclass
class VisionProcessor:
    """The model's HF image processor and its prompt convention, for one model folder."""

    # The image processor: HF's (its torchvision backend where torchvision imports, else its
    # PIL one), or for Llama 4, whose HF processor needs torchvision, the port in
    # frontend/llama4_images.py.
    hf: Any
    marker: ImageMarker
    pixel_bytes_limit: int = MAX_PIXEL_BYTES
    # What the pixels travel in: the engine's dtype (Ready.pixel_dtype), which its tower casts
    # them to anyway.
    pixel_dtype: str = "float32"

    @classmethod
    def load(cls, model_dir: Path, pixel_dtype: str = "float32") -> VisionProcessor | None:
        """The folder's image processor, or None for a model that takes no images; its pixels
        sent in ``pixel_dtype`` (Llama 4's in bfloat16, which its processor computes in)."""
        processor = cls._load(model_dir)
        if processor is not None:
            processor.pixel_dtype = pixel_dtype
            # Each image's pixels are tens of megabytes of temporaries (the resize, the
            # normalised array, the wire's copy): kept in the heap once freed, the next image
            # reuses them instead of faulting fresh pages in (about 25 ms a 1,024^2 image on
            # the CPU machine); the API process keeps its peak, a few hundred megabytes.
            keep_freed_memory()
        return processor

    @classmethod
    def _load(cls, model_dir: Path) -> VisionProcessor | None:
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            return None
        config = json.loads(config_path.read_text())
        architectures = set(config.get("architectures") or ())
        if not architectures & set(VISION_ARCHITECTURES):
            return None
        if "Llama4ForConditionalGeneration" in architectures:
            # Without a vision_config the engine serves its text only (models/__init__.py).
            if not config.get("vision_config"):
                return None
            return Llama4VisionProcessor.load_llama4(model_dir, config)
        from transformers import AutoImageProcessor

        hf = AutoImageProcessor.from_pretrained(str(model_dir))
        if "Gemma3ForConditionalGeneration" in architectures:
            return cls(hf, gemma3_marker(model_dir, config, hf))
        if "Mistral3ForConditionalGeneration" in architectures:
            return PixtralVisionProcessor.load_pixtral(model_dir, config, hf)
        merge = int(getattr(hf, "merge_size", config["vision_config"].get("spatial_merge_size", 2)))
        return cls(hf, ImageMarker(int(config["image_token_id"]), merge))

    def process(self, images: list[Any], params: list[str]) -> list[ProcessedImage]:
        """Each image's pixels and patch grid, as the HF processor makes them (run off the event
        loop: resizing and normalising take milliseconds per image)."""
        out, total, pieces = [], 0, 0
        for image, param in zip(images, params, strict=True):
            try:
                processed = self.process_one(image)
            except ImageRefused as exc:
                raise BadImage(f"the model's image processor refuses it: {exc}", param) from None
            total += processed.wire_nbytes
            pieces += len(processed.pieces())
            if total > self.pixel_bytes_limit:
                raise BadImage(
                    f"the prompt's images come to {total} bytes of pixels after resizing, more "
                    f"than {self.pixel_bytes_limit}: send fewer or smaller images",
                    param,
                )
            if pieces > MAX_IMAGES:  # Llama 4's tiles, each an image on the wire
                raise BadImage(
                    f"the prompt's images come to {pieces} tiles, more than the {MAX_IMAGES} "
                    "a request carries: send fewer or smaller images",
                    param,
                )
            processed.prepare_wire()
            out.append(processed)
        return out

    def hf_images(self, image: Any, **options: Any) -> Any:
        """The HF processor's arrays for one image; what it refuses (a ValueError: Qwen2-VL's
        for an aspect ratio past 200) as ImageRefused, which the client is told of. Only
        there: a ValueError of our own code after it is a bug, a 500 with its traceback."""
        try:
            return self.hf(images=[image], return_tensors="np", **options)
        except ValueError as exc:
            raise ImageRefused(str(exc)) from None

    def process_one(self, image: Any) -> ProcessedImage:
        result = self.hf_images(image)
        pixels = np.ascontiguousarray(result["pixel_values"], dtype=np.float32)
        grid = self.marker.fixed_grid or tuple(int(n) for n in result["image_grid_thw"][0])
        return ProcessedImage(pixels, (grid[0], grid[1], grid[2]), wire_dtype=self.pixel_dtype)

    def image_text(self, images: list[ProcessedImage]) -> tuple[str, tuple[str, ...]] | None:
        """(marker, each image's text): how the rendered prompt's image markers expand before
        tokenizing, one image after another; None where ``place`` repeats the placeholder after
        tokenizing instead (Qwen2.5-VL)."""
        expansion = self.marker.text_expansion
        if expansion is None:
            return None
        texts = (expansion[1] if image.text is None else image.text for image in images)
        return expansion[0], tuple(texts)

    def num_tokens(self, image: ProcessedImage) -> int:
        t, h, w = image.grid_thw
        return t * h * w // (self.marker.merge_size**2)

    def place(
        self, token_ids: list[int], images: list[ProcessedImage]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image's placeholder token repeated for its embeddings, and the
        images as they go on the wire; ValueError where the template wrote another count."""
        placeholder = self.marker.placeholder_id
        if self.marker.text_expansion is not None:
            return token_ids, self.expanded_runs(token_ids, images)
        found = [i for i, t in enumerate(token_ids) if t == placeholder]
        if len(found) != len(images):
            raise ValueError(
                f"the chat template wrote {len(found)} image placeholders for {len(images)} images"
            )
        ids: list[int] = []
        inputs: list[ImageInput] = []
        previous = 0
        for at, image in zip(found, images, strict=True):
            ids += token_ids[previous:at]
            run = self.run_ids(image)
            inputs.append(image.wire(len(ids), len(run)))
            ids += run
            previous = at + 1
        ids += token_ids[previous:]
        return ids, tuple(inputs)

    def run_ids(self, image: ProcessedImage) -> list[int]:
        """The tokens an image's placeholder becomes: the placeholder, once an embedding."""
        return [self.marker.placeholder_id] * self.num_tokens(image)

    def expanded_runs(
        self, token_ids: list[int], images: list[ProcessedImage]
    ) -> tuple[ImageInput, ...]:
        """The wire images of a prompt whose markers were expanded in text: one run of
        placeholders an image, each as long as its image's embeddings."""
        runs = placeholder_runs(token_ids, self.marker.placeholder_id)
        pieces = [piece for image in images for piece in image.pieces()]
        if len(runs) != len(pieces):
            raise ValueError(f"the prompt holds {len(runs)} image runs for {len(pieces)} images")
        for (_, length), piece in zip(runs, pieces, strict=True):
            if length != self.num_tokens(piece):
                raise ValueError(
                    f"an image's placeholder run is {length} tokens, not {self.num_tokens(piece)}"
                )
        return tuple(piece.wire(at, n) for (at, n), piece in zip(runs, pieces, strict=True))


@dataclass
class Llama4VisionProcessor(VisionProcessor):
    """Llama 4: each image tiled by the port of HF's processor (frontend/llama4_images.py), its
    prompt text written per image (the tile grid decides it), each tile one run of
    ``<|patch|>`` and one ImageInput of one tile's pixels."""

    @classmethod
    def load_llama4(cls, model_dir: Path, config: dict[str, Any]) -> Llama4VisionProcessor:
        vision = config["vision_config"]
        side = vision["image_size"] // vision["patch_size"]
        marker = ImageMarker(
            # The engine's default too: Llama 4's <|patch|> (models/__init__.py).
            placeholder_id=int(
                config.get("image_token_index", config.get("image_token_id", 200_092))
            ),
            merge_size=round(1 / vision["pixel_shuffle_ratio"]),
            text_expansion=(IMAGE, ""),  # each image's text is its own (ProcessedImage.text)
            fixed_grid=(1, side, side),
        )
        return cls(Llama4Tiling.load(model_dir, config), marker)

    def process_one(self, image: Any) -> ProcessedImage:
        assert self.marker.fixed_grid is not None
        tiles, (rows, cols) = self.hf.tiles(image)
        text = self.hf.prompt_text(rows, cols)
        return ProcessedImage(tiles, self.marker.fixed_grid, text, wire_dtype="bfloat16")


@dataclass
class PixtralVisionProcessor(VisionProcessor):
    """Mistral 3 (Pixtral's processor): images keep their aspect, scaled to fit the
    processor's ``longest_edge`` and rounded up to whole merge blocks (patch x merge pixels);
    each image's run is rows of [IMG], each row closed by [IMG_BREAK] and the last by
    [IMG_END], as HF's PixtralProcessor writes it. HF's processor class needs torchvision; its
    image processor's PIL backend does not, and the run is the few lines of ``run_ids``. The
    pixels travel as patches ([rows * cols, C * P * P], grid (1, rows, cols)), so images of
    different sizes go in one encoder batch without padding."""

    patch: int = 16
    row_break_id: int = 0
    end_id: int = 0

    @classmethod
    def load_pixtral(
        cls, model_dir: Path, config: dict[str, Any], hf: Any
    ) -> PixtralVisionProcessor:
        from transformers import AutoTokenizer

        if not hf.do_resize:  # unresized sides are not whole patches: HF's model crops them
            raise ValueError(
                f"{model_dir}: the image processor sets do_resize false, which this server "
                "does not implement; set it to true in preprocessor_config.json"
            )
        names = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]"}
        names["image_end_token"] = "[IMG_END]"
        processor_config = model_dir / "processor_config.json"
        if processor_config.is_file():  # a processor may name other tokens (HF's kwargs)
            saved = json.loads(processor_config.read_text())
            names = {key: saved.get(key, token) for key, token in names.items()}
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        image, row_break, end = (tokenizer.convert_tokens_to_ids(t) for t in names.values())
        placeholder = int(config.get("image_token_index", config.get("image_token_id", 10)))
        if image != placeholder:
            raise ValueError(
                f"{model_dir}: the tokenizer's {names['image_token']} is {image}, not the "
                f"config's image_token_index {placeholder}"
            )
        marker = ImageMarker(placeholder, int(config.get("spatial_merge_size", 2)))
        patch = int(config["vision_config"]["patch_size"])
        return cls(hf, marker, patch=patch, row_break_id=row_break, end_id=end)

    def process_one(self, image: Any) -> ProcessedImage:
        block = self.patch * self.marker.merge_size
        result = self.hf_images(image, patch_size={"height": block, "width": block})
        pixels = np.asarray(result["pixel_values"][0], dtype=np.float32)  # [C, H, W]
        channels, height, width = pixels.shape
        rows, cols, p = height // self.patch, width // self.patch, self.patch
        patches = pixels.reshape(channels, rows, p, cols, p).transpose(1, 3, 0, 2, 4)
        flat = np.ascontiguousarray(patches.reshape(rows * cols, channels * p * p))
        return ProcessedImage(flat, (1, rows, cols), wire_dtype=self.pixel_dtype)

    def run_ids(self, image: ProcessedImage) -> list[int]:
        _, rows, cols = image.grid_thw
        merge = self.marker.merge_size
        row = [self.marker.placeholder_id] * (cols // merge) + [self.row_break_id]
        ids = row * (rows // merge)
        ids[-1] = self.end_id
        return ids


def placeholder_runs(token_ids: list[int], placeholder: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``placeholder`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != placeholder:
            continue
        if runs and sum(runs[-1]) == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def gemma3_marker(model_dir: Path, config: dict[str, Any], hf: Any) -> ImageMarker:
    """Gemma 3's prompt convention, as its HF processor (Gemma3Processor) writes it: the chat
    template's ``<start_of_image>`` becomes ``\n\n<start_of_image>``, mm_tokens_per_image
    soft tokens and ``<end_of_image>\n\n``. Pan-and-scan (extra crops of a long image) is not
    implemented: a processor configured for it is refused by name, not run without it."""
    if getattr(hf, "do_pan_and_scan", False):
        raise ValueError(
            f"{model_dir}: the image processor sets do_pan_and_scan, which this server does not "
            "implement; set it to false in preprocessor_config.json"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokens = int(config.get("mm_tokens_per_image", 256))
    tower = config.get("vision_config") or {}
    side = tower.get("image_size", 224) // tower.get("patch_size", 16)
    ids = {
        "boi": config.get("boi_token_index", config.get("boi_token_id", 255_999)),
        "eoi": config.get("eoi_token_index", config.get("eoi_token_id", 256_000)),
        "image": config.get("image_token_index", config.get("image_token_id", 262_144)),
    }
    boi, eoi, image = (tokenizer.convert_ids_to_tokens(int(i)) for i in ids.values())
    return ImageMarker(
        placeholder_id=int(ids["image"]),
        merge_size=side // math.isqrt(tokens),
        text_expansion=(boi, f"\n\n{boi}{image * tokens}{eoi}\n\n"),
        fixed_grid=(1, side, side),
    )


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # [patches, channels * temporal patch * patch * patch] float32
    grid_thw: tuple[int, int, int]
    # Llama 4: the image's own prompt text (its tiles' runs and separators), and pixels
    # [tiles, 3, side, side], each tile one run of placeholders with grid_thw its patch grid.
    text: str | None = None
    # What the pixels travel in (one of PIXEL_ITEM_BYTES): the engine's dtype, or bfloat16 for
    # Llama 4 (its processor computes in it), rounded to nearest as a cast in the engine would.
    wire_dtype: str = "float32"

    def pieces(self) -> list[ProcessedImage]:
        """What travels as one ImageInput each: the image, or each of Llama 4's tiles."""
        return [self] if self.text is None else list(self._tiles)

    @cached_property
    def _tiles(self) -> tuple[ProcessedImage, ...]:
        # Never holds ``self``: an image cached in its own attributes is a reference cycle,
        # and its pixels (37 MB for a 1024 x 1024 image) would wait for the cyclic collector.
        return tuple(
            ProcessedImage(self.pixels[i : i + 1], self.grid_thw, wire_dtype=self.wire_dtype)
            for i in range(len(self.pixels))
        )

    def prepare_wire(self) -> None:
        """Hash every piece's pixels now: called on the processing thread, so that the SHA-256
        of megabytes (which lets go of the interpreter lock) never runs on the event loop."""
        for piece in self.pieces():
            _ = piece._wire_pixels

    @property
    def wire_nbytes(self) -> int:
        return self.pixels.size * PIXEL_ITEM_BYTES[self.wire_dtype]

    def wire(self, offset: int, length: int) -> ImageInput:
        """The image as an AddRequest carries it, its placeholders at ``offset``."""
        digest, pixels = self._wire_pixels
        return ImageInput(digest, offset, length, pixels, self.grid_thw)

    @cached_property
    def _wire_pixels(self) -> tuple[bytes, TensorBytes]:
        """The pixels' hash and wire form, made once (``prepare_wire``: off the loop)."""
        # The array's own memory, uncopied: the client sends it as a frame of its own.
        data = memoryview(wire_values(self.pixels, self.wire_dtype)).cast("B")
        shape = tuple(int(n) for n in self.pixels.shape)
        digest = hashlib.sha256()
        digest.update(f"{self.wire_dtype}{shape}{self.grid_thw}".encode())
        digest.update(data)
        return digest.digest(), TensorBytes(self.wire_dtype, shape, data)


PIXEL_ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def wire_values(pixels: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``pixels`` in the wire's ``dtype``: as they are, or rounded to nearest (ties to
    even, as torch casts) to bfloat16's bits or float16."""
    if dtype == "bfloat16":
        return rounded_bfloat16_bits(pixels)
    if dtype == "float16":
        return np.ascontiguousarray(pixels, dtype=np.float16)
    return pixels


# Elements rounded at a time: a 1 MiB scratch that stays in cache, where whole-array steps
# each wrote a fresh array of the image's size (a 1024 x 1024 image: 25 MiB each, 3x slower).
BFLOAT16_CHUNK = 1 << 18


def rounded_bfloat16_bits(pixels: np.ndarray) -> np.ndarray:
    """float32 ``pixels`` rounded to bfloat16 (to nearest, ties to even, as torch casts) as
    bfloat16's bits, uint16 of the same shape."""
    bits = np.ascontiguousarray(pixels, np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.size, np.uint16)
    scratch = np.empty(min(bits.size, BFLOAT16_CHUNK), np.uint32)
    for start in range(0, bits.size, BFLOAT16_CHUNK):
        chunk = bits[start : start + BFLOAT16_CHUNK]
        out[start : start + chunk.size] = round_bits_high_half(chunk, scratch[: chunk.size])
    return out.reshape(pixels.shape)


def round_bits_high_half(bits: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """The high 16 bits of float32 ``bits`` rounded to nearest even on the low 16, computed in
    ``scratch`` (as large as ``bits``) in place: add 0x7FFF plus the kept half's lowest bit."""
    np.right_shift(bits, 16, out=scratch)
    scratch &= 1
    scratch += 0x7FFF
    scratch += bits
    scratch >>= 16
    return scratch


# ---- a chat request's images ------------------------------------------------------------------


@dataclass(frozen=True)
class ImagePartRef:
    """An image part of a chat request, with the name a 400 gives it."""

    param: str  # "messages[1].content[0]"
    url: str
    detail: str | None


NO_IMAGES = "this model takes no images: send text parts only"


async def chat_images(
    vision: VisionProcessor | None,
    media: MediaOptions,
    parts: list[ImagePartRef],
) -> list[ProcessedImage]:
    """A chat request's images, fetched, decoded and processed (off the event loop), in order;
    BadImage for the first part the server cannot take."""
    if not parts:
        return []
    if vision is None:
        raise BadImage(NO_IMAGES, parts[0].param)
    if len(parts) > media.max_images:
        raise BadImage(
            f"at most {media.max_images} images a prompt (--limit-mm-per-prompt), got {len(parts)}",
            parts[media.max_images].param,
        )
    for part in parts:
        if part.detail not in (None, "auto"):
            raise BadImage(
                f"detail {part.detail!r} is not supported: the model's processor sizes every "
                "image by its own pixel bounds; send 'auto' or leave it out",
                f"{part.param}.image_url.detail",
            )
    raws = await asyncio.gather(*(fetch_image_bytes(p.url, media, p.param) for p in parts))
    return await asyncio.to_thread(decode_and_process, vision, media, list(raws), parts)


def decode_and_process(
    vision: VisionProcessor, media: MediaOptions, raws: list[bytes], parts: list[ImagePartRef]
) -> list[ProcessedImage]:
    params = [p.param for p in parts]
    images = [decode_image(raw, media, param) for raw, param in zip(raws, params, strict=True)]
    return vision.process(images, params)
