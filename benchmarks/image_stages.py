"""`image-stages`: one chat image's CPU path, stage by stage, from the data URL to the engine's
tensor of its pixels.

    python -m benchmarks image-stages --model qwen2.5-vl-7b --image-size 1024

A fresh random ``--image-size`` square PNG as a data URL (as ``vision`` sends), through each
stage the API process and the engine core run on it, each timed alone ``--repeats`` times
(median and least, ms): the data URL's base64, the PNG's decoding, the model's HF image
processor (the backend AutoImageProcessor picks here: torchvision where it is installed, else
PIL), the rounding to the wire's dtype, the SHA-256 that names the image, the AddRequest's
encoding and decoding (the pixels a frame of their own) and the engine's batch of pixels. The
last row runs processing, rounding and hashing together, as a server does per request. The
processor is the preset's folder's (engine_core/preset_folders.py), loaded as the API process
loads it, which keeps freed memory for the next image (frontend/vision.py).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import Provenance, format_table, write_json
from benchmarks.vision import random_png

Row = tuple[str, float, float]  # stage, median ms, least ms


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-vl-7b", help="a Qwen2.5-VL or Qwen3-VL preset")
    parser.add_argument("--image-size", type=int, default=1024, help="pixels a side")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs a stage")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--json", type=Path, help="write the provenance and figures here")


def timed(name: str, repeats: int, fn: Callable[[], Any], rows: list[Row]) -> Any:
    """``fn()``'s last result; its median and least time appended to ``rows``."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(1000 * (time.perf_counter() - start))
    rows.append((name, float(np.median(times)), min(times)))
    return out


def data_url(size: int) -> str:
    out = io.BytesIO()
    random_png(size, np.random.default_rng(0)).save(out, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def measure(args: argparse.Namespace, vision: Any) -> tuple[list[Row], str]:
    """The stages' rows, and a line saying what the image became."""
    from engine_core.multimodal import batch_pixels
    from frontend.vision import MediaOptions, data_url_bytes, decode_image, wire_values
    from protocol.codec import decode_client_message, encode_frames
    from protocol.messages import AddRequest, SamplingParams

    rows: list[Row] = []
    n, url = args.repeats, data_url(args.image_size)
    raw = timed("base64 of the data URL", n, lambda: data_url_bytes(url, "p"), rows)
    image = timed("PNG decode (PIL)", n, lambda: decode_image(raw, MediaOptions(), "p"), rows)
    hf = vision.hf
    result = timed(
        f"HF {type(hf).__name__}", n, lambda: hf(images=[image], return_tensors="np"), rows
    )
    pixels = np.ascontiguousarray(result["pixel_values"], dtype=np.float32)
    sent = timed(f"rounding to {args.dtype}", n, lambda: wire_values(pixels, args.dtype), rows)
    data = memoryview(sent).cast("B")
    timed("SHA-256 of the wire pixels", n, lambda: hashlib.sha256(data).digest(), rows)
    processed = vision.process_one(image)
    length = vision.num_tokens(processed)
    images = (processed.wire(0, length),)
    msg = AddRequest("r", [0] * length, SamplingParams(max_tokens=1), images=images)
    frames = timed("AddRequest encode", n, lambda: encode_frames(msg), rows)
    wire = [bytes(frame) for frame in frames]
    got = timed("AddRequest decode", n, lambda: decode_client_message(wire[0], wire[1:]), rows)
    timed("engine: the batch's pixels", n, lambda: batch_pixels(got.images), rows)
    timed("processor + rounding + SHA-256", n, lambda: one_request(vision, image), rows)
    what = f"{len(raw) / 1e6:.2f} MB PNG -> pixels {list(pixels.shape)}, {data.nbytes / 1e6:.2f} MB"
    return rows, what


def one_request(vision: Any, image: Any) -> None:
    """One request's processing: the processor's pixels, rounded and hashed, then dropped."""
    vision.process_one(image).prepare_wire()


def run(args: argparse.Namespace) -> int:
    from engine_core.model_dir import tokenizer_dir_for_preset
    from frontend.vision import VisionProcessor

    vision = VisionProcessor.load(tokenizer_dir_for_preset(args.model), args.dtype)
    if vision is None:
        raise SystemExit(f"--model {args.model!r} takes no images")
    rows, what = measure(args, vision)
    provenance = Provenance.here(args.argv, device="cpu")
    print(provenance.format())
    print(f"\n{args.model}: one {args.image_size}x{args.image_size} image, {what}\n")
    cells = [[name, f"{median:.1f}", f"{least:.1f}"] for name, median, least in rows]
    print(format_table(["stage", "median ms", "least ms"], cells))
    if args.json:
        figures = [
            {"stage": name, "median_ms": med, "least_ms": least} for name, med, least in rows
        ]
        write_json(args.json, provenance, {"image": what, "stages": figures})
    return 0
