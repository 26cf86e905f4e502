"""The pieces of the image path that need no model: the encoder cache's budget and eviction,
M-RoPE positions by hand, --limit-mm-per-prompt, file:// confinement, data URLs, the pixels'
rounding for the wire and their batching in the engine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_core.multimodal import EncoderCache, batch_pixels, mrope_positions, pixels_tensor
from frontend.vision import (
    BadImage,
    MediaOptions,
    as_rgb,
    data_url_bytes,
    fetch_http,
    parse_image_limit,
    read_local_file,
)
from protocol.messages import ImageInput, TensorBytes


def embeds(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 4)  # 16 bytes a row


def test_the_encoder_cache_evicts_the_least_recently_used_past_its_budget() -> None:
    cache = EncoderCache(budget_bytes=3 * 16)
    cache.put(b"a", embeds(1))
    cache.put(b"b", embeds(1))
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"c", embeds(2))  # 4 rows > 3: b, the least recently used, goes
    assert (cache.get(b"b"), cache.used_bytes, len(cache)) == (None, 48, 2)
    assert cache.get(b"a") is not None and cache.get(b"c") is not None
    cache.put(b"huge", embeds(4))  # larger than the whole budget: not kept, nothing evicted
    assert (cache.get(b"huge"), len(cache)) == (None, 2)
    assert (cache.hits, cache.misses) == (3, 2)


def image(offset: int, grid: tuple[int, int, int]) -> ImageInput:
    length = grid[0] * grid[1] * grid[2] // 4
    return ImageInput(b"\0" * 32, offset, length, TensorBytes("float32", (1,), b"\0" * 4), grid)


def test_mrope_positions_by_hand() -> None:
    # Two text tokens, a 2 x 3 merged grid (4 x 6 patches) at 2..7, two text tokens, then a
    # 1 x 2 grid at 10..11 and one text token. HF's get_rope_index gives, by hand:
    first, second = image(2, (1, 4, 6)), image(10, (1, 2, 4))
    expected = np.array(
        [
            [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 7, 9],  # temporal: an image's t is 0
            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 7, 9],  # rows
            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 9],  # columns
        ]
    )
    assert mrope_positions([first, second], 2, 0, 13).tolist() == expected.tolist()
    # Any window of it (a chunk, a decode step past the prompt) is the same columns.
    assert mrope_positions([first, second], 2, 4, 9).tolist() == expected[:, 4:9].tolist()
    assert mrope_positions([first, second], 2, 13, 15).tolist() == [[10, 11]] * 3


def test_limit_mm_per_prompt_takes_images_only() -> None:
    assert parse_image_limit('{"image": 2}') == 2
    assert parse_image_limit(None) == 4
    for bad, words in [('{"video": 1}', "images only"), ("[1]", "object"), ("{", "JSON"),
                       ('{"image": -1}', ">= 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_image_limit(bad)


def test_file_urls_stay_under_the_allowed_path(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(b"cat")
    (tmp_path / "secret.png").write_bytes(b"secret")
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    options = MediaOptions(allowed_local_path=root.resolve())
    assert read_local_file(f"file://{root}/cat.png", options, "p") == b"cat"
    for url in (f"file://{tmp_path}/secret.png", f"file://{root}/../secret.png",
                f"file://{root}/link.png", f"file://{root}/missing.png"):  # fmt: skip
        with pytest.raises(BadImage, match="under"):
            read_local_file(url, options, "p")
    with pytest.raises(BadImage, match="--allowed-local-media-path"):
        read_local_file(f"file://{root}/cat.png", MediaOptions(), "p")


def test_media_flags_are_checked() -> None:
    args = argparse.Namespace(
        limit_mm_per_prompt=None, allowed_media_domains=["Example.COM"],
        allowed_local_media_path="/no/such/folder", media_fetch_timeout=1.0, max_image_bytes=10,
    )  # fmt: skip
    with pytest.raises(ValueError, match="not a folder"):
        MediaOptions.from_args(args)
    args.allowed_local_media_path = None
    assert MediaOptions.from_args(args).allowed_hosts == frozenset({"example.com"})


def test_data_urls() -> None:
    assert data_url_bytes("data:image/png;base64,aGk=", "p") == b"hi"
    for url in ("data:image/png,hi", "data:text/plain;base64,aGk=", "data:image/png;base64,a"):
        with pytest.raises(BadImage):
            data_url_bytes(url, "p")


def test_a_fetch_is_bounded_in_size_and_time() -> None:
    """An allowed host's image larger than the limit, or one that never finishes arriving,
    is a BadImage (never a hang); a redirect is not followed."""
    import asyncio
    import http.server
    import threading

    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://example.com/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * (10 if self.path == "/drip" else 100))
            self.wfile.flush()
            if self.path == "/drip":
                release.wait(30)  # the rest never comes while the client waits

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    options = MediaOptions(allowed_hosts=frozenset({"127.0.0.1"}), fetch_timeout_s=0.5,
                           max_image_bytes=50)  # fmt: skip
    try:
        for path, words in [("/big", "larger than 50"), ("/drip", "within 0.5 s"),
                            ("/moved", "HTTP 302")]:  # fmt: skip
            with pytest.raises(BadImage, match=words):
                asyncio.run(fetch_http(f"{base}{path}", options, "p"))
    finally:
        release.set()
        httpd.shutdown()


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_pixels_go_on_the_wire_rounded_as_the_engine_would_cast_them(
    dtype: str, torch_dtype: torch.dtype
) -> None:
    """A 16-bit wire holds what torch's cast of the float32 pixels holds, bit for bit: random
    values, and exact ties between two representable values (rounded to even)."""
    from frontend.vision import PIXEL_ITEM_BYTES, wire_values

    rng = np.random.default_rng(0)
    pixels = rng.normal(0.0, 2.0, 4096).astype(np.float32)
    ties = (np.arange(1, 65, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # bf16 halfway
    pixels = np.concatenate([pixels, ties, -ties])
    sent = wire_values(pixels, dtype)
    assert sent.nbytes == pixels.size * PIXEL_ITEM_BYTES[dtype] == pixels.size * 2
    received = torch.frombuffer(bytearray(sent.tobytes()), dtype=torch_dtype)
    assert torch.equal(received, torch.from_numpy(pixels).to(torch_dtype))


def test_bfloat16_rounding_holds_across_its_chunks() -> None:
    """The wire's bfloat16 rounding, done a chunk at a time, is torch's cast everywhere: ties
    on both sides of a chunk's edge and a last chunk shorter than the others."""
    from frontend.vision import BFLOAT16_CHUNK, rounded_bfloat16_bits

    rng = np.random.default_rng(1)
    pixels = rng.normal(0.0, 2.0, 2 * BFLOAT16_CHUNK + 5).astype(np.float32)
    ties = (np.arange(1, 9, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    pixels[BFLOAT16_CHUNK - 4 : BFLOAT16_CHUNK + 4] = ties
    sent = rounded_bfloat16_bits(pixels.reshape(-1, 1))
    expected = torch.from_numpy(pixels).to(torch.bfloat16).view(torch.int16).numpy()
    assert sent.shape == (pixels.size, 1)
    assert np.array_equal(sent.reshape(-1).view(np.int16), expected)


def pixel_image(rows: int, dtype: str, seed: int) -> ImageInput:
    """An image of ``rows`` x 6 random pixels in ``dtype`` as the wire carries them."""
    values = torch.randn(rows * 6, generator=torch.Generator().manual_seed(seed))
    data = values.to(getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()
    return ImageInput(b"\0" * 32, 0, 1, TensorBytes(dtype, (rows, 6), data), (1, 1, 1))


def test_an_encoder_batch_holds_its_images_pixels_as_cat_would() -> None:
    """The engine's batch of images' pixels, copied once from the wire, is the concatenation
    of each image's; images of different dtypes are promoted as torch.cat promotes them."""
    same = [pixel_image(4, "bfloat16", 0), pixel_image(2, "bfloat16", 1)]
    mixed = [*same, pixel_image(3, "float32", 2)]
    for images in (same, mixed, same[:1]):
        batch = batch_pixels(images)
        expected = torch.cat([pixels_tensor(image) for image in images])
        assert batch.dtype == expected.dtype
        assert torch.equal(batch, expected)


def transparent_images() -> dict[str, Any]:
    """Images with transparency in each way PNG carries it, over colours that differ from
    white where they are transparent."""
    from PIL import Image

    rng = np.random.default_rng(5)
    rgba = rng.integers(0, 256, (12, 10, 4), dtype=np.uint8)
    rgba[:4, :, 3] = 0  # fully transparent rows over random colours
    la = rng.integers(0, 256, (12, 10, 2), dtype=np.uint8)
    palette = Image.fromarray(rng.integers(0, 4, (12, 10), dtype=np.uint8), "P")
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9])
    palette.info["transparency"] = 2  # the blue entry is transparent
    return {
        "RGBA": Image.fromarray(rgba, "RGBA"),
        "LA": Image.fromarray(la, "LA"),
        "P with transparency": palette,
        "RGB": Image.fromarray(rgba[..., :3], "RGB"),
    }


@pytest.mark.parametrize("mode", list(transparent_images()))
def test_images_become_rgb_as_hfs_processors_convert_them(mode: str) -> None:
    """Transparency over white, as transformers' convert_to_rgb does (the model's processor
    would otherwise see the colours under transparent pixels)."""
    from transformers.image_transforms import convert_to_rgb

    image = transparent_images()[mode]
    expected = np.asarray(convert_to_rgb(image))
    assert np.array_equal(np.asarray(as_rgb(image)), expected)


def test_data_urls_decode_the_base64_forms_other_encoders_write() -> None:
    """Standard base64, and as encoders also write it: MIME's line breaks (Python's
    encodebytes), no padding, URL-safe letters; all the same bytes. Not base64: BadImage."""
    import base64

    raw = bytes(range(256)) * 3 + b"\xfb\xff"  # bytes whose base64 has + / and padding
    forms = [
        base64.b64encode(raw).decode(),
        base64.encodebytes(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode(),
    ]
    assert len(set(forms)) == 4
    for form in forms:
        assert data_url_bytes(f"data:image/png;base64,{form}", "p") == raw
    for bad in ("@@@", "QUJD#", "Q"):
        with pytest.raises(BadImage, match="does not decode"):
            data_url_bytes(f"data:image/png;base64,{bad}", "p")


def test_the_tool_template_writes_images_as_the_models_own_template(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A vision model whose template ignores tools gets the packaged ChatML tool template with
    its own image marker, read from its template; where none can be read, images beside tools
    are refused (they would vanish from the prompt)."""
    from transformers import AutoTokenizer

    from engine_core.preset_folders import write_vision_tokenizer
    from frontend.tools import image_marker_text, tool_support

    write_vision_tokenizer(default_model_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert image_marker_text(tokenizer) == "<|vision_start|><|image_pad|><|vision_end|>"
    support, _ = tool_support(tokenizer, None, takes_images=True)
    assert support is not None and support.writes_images
    assert support.template is not None and "<|vision_start|><|image_pad|>" in support.template
    parts = [{"type": "text", "text": "see"}, {"type": "image"}]
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": parts}]
    text = tokenizer.apply_chat_template(messages, chat_template=support.template, tokenize=False)
    assert "<tool_response>\nsee<|vision_start|><|image_pad|><|vision_end|>\n" in text
    # A template that writes no image marker at all: no marker to read.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "<|vision_start|><|image_pad|><|vision_end|>", ""
    )
    assert image_marker_text(tokenizer) is None
    blind, how = tool_support(tokenizer, None, takes_images=True)
    assert blind is not None and not blind.writes_images and "images beside tools" in how
