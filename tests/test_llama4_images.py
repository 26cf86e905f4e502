"""Llama 4's images in the API process (frontend/llama4_images.py, the numpy port of HF's
Llama4ImageProcessor and Llama4Processor) and through the server.

- By hand: the tile grid and resized size for several image sizes at the released models'
  settings (336-pixel tiles, at most 16), the prompt's token layout, the fixed-point resize,
  the bfloat16 arithmetic, the wire's bfloat16 bytes, refused processor fields.
- Against HF's own processor where torchvision imports (it is HF's processor's dependency, not
  ours; the tests skip without it): the grid over a sweep of sizes, and bit for bit the pixel
  values and the prompt's input_ids of a one-tile, a 1x2, a 2x2 and a tall image.
- End to end on a tiny random Llama4ForConditionalGeneration: the official openai client sends
  a one-tile and a multi-tile image as data URLs through `tandem serve` and gets HF's greedy
  tokens (HF's model fed the port's pixels and ids), the multi-tile image again after other
  text too; a bad image is a 400. (The engine with the port's tiles, and the encoder cache
  on a repeated image: tests/test_llama4_vision.py.)
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from frontend.llama4_images import (
    END,
    IMAGE,
    PATCH,
    START,
    TILE_X,
    TILE_Y,
    Llama4Tiling,
    best_grid,
    resize,
    supported_grids,
    to_bfloat16,
)
from frontend.vision import VisionProcessor
from tests.test_llama4_vision import SIZE, hf_tokens, random_llama4_vl, vision_config
from tests.vision_factories import png_bytes, random_image

MAX_TILES = 4
NEW_TOKENS = 6
LLAMA4_TOKENS = (PATCH, START, IMAGE, END, TILE_X, TILE_Y)
# A ChatML template (the default tokenizer's turns) writing Llama 4's <|image|> per image part,
# as Llama 4's own template does.
CHAT_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}
{%- else %}{% for part in message['content'] %}
{%- if part['type'] == 'image' %}<|image|>
{%- elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# (height, width) -> tiles, on 32-pixel tiles, at most 4: one tile, 1x2, 2x2, tall (4x1).
SHAPES = {(20, 30): (1, 1), (30, 60): (1, 2), (40, 70): (2, 2), (100, 30): (4, 1)}


# ---- by hand ----------------------------------------------------------------------------------

RELEASED = Llama4Tiling(tile=336, max_tiles=16, tokens_per_tile=144)


@pytest.mark.parametrize(
    ("size", "grid", "fitted"),
    [
        # Fits one tile: no upscaling past the tile, width 300 -> 336 (x1.12), height 224.
        ((200, 300), (1, 1), (224, 336)),
        # Scales >= 1: (2, 3) and (3, 3), (4, 3), (5, 3) all give 1.008; the least area wins;
        # the image is not upscaled at all (it already exceeds a tile), only padded.
        ((500, 1000), (2, 3), (500, 1000)),
        ((1000, 300), (3, 1), (1000, 300)),  # tall: 1.008 for (3, 1), narrower than (4, 1)
        ((4000, 4000), (4, 4), (1344, 1344)),  # none upscales: the least downscale, 0.336
        ((10, 20), (1, 1), (168, 336)),  # tiny: up to one tile's side, x16.8
        ((336, 336), (1, 1), (336, 336)),
    ],
)
def test_the_tile_grid_by_hand(
    size: tuple[int, int], grid: tuple[int, int], fitted: tuple[int, int]
) -> None:
    assert RELEASED.grid(*size) == grid
    assert RELEASED.fitted_size(*size, *grid) == fitted


def test_the_prompt_layout_by_hand() -> None:
    tiling = Llama4Tiling(tile=32, max_tiles=4, tokens_per_tile=2)
    run = PATCH * 2
    assert tiling.prompt_text(1, 1) == START + IMAGE + run + END
    row = run + TILE_X + run + TILE_X + run + TILE_Y
    assert tiling.prompt_text(2, 3) == START + row + row + IMAGE + run + END
    assert RELEASED.prompt_text(2, 3).count(PATCH) == 7 * 144  # six tiles and the global view


def test_each_marker_becomes_its_own_image_s_text() -> None:
    """The rendered prompt's i-th <|image|> becomes image i's text (each grid writes its own),
    and the expansions' own <|image|> are not markers; another count of markers is a 400."""
    from frontend.errors import OpenAIError
    from frontend.tokenizer import expand_images

    one, four = RELEASED.prompt_text(1, 1), RELEASED.prompt_text(2, 2)
    assert expand_images(f"a{IMAGE}b{IMAGE}c", IMAGE, (four, one)) == f"a{four}b{one}c"
    with pytest.raises(OpenAIError, match="2 image markers for 1 images"):
        expand_images(f"a{IMAGE}b{IMAGE}c", IMAGE, (one,))


def test_normalisation_rounds_to_bfloat16_as_hf_does() -> None:
    """x/255 rounded to bfloat16, minus 0.5 rounded, over 0.5: 1 -> 2^-8 -> -127/128 (float32
    arithmetic would give -0.99216); 128 -> 0.50390625 -> 1/128."""
    pixels = np.array([[[0, 1, 128], [255, 255, 255]]], np.uint8)  # [H=1, W=2, 3]
    out = RELEASED.normalize(pixels)
    assert out.shape == (3, 1, 2)
    assert out[:, 0, 0].tolist() == [-1.0, -127 / 128, 1 / 128]
    assert out[:, 0, 1].tolist() == [1.0, 1.0, 1.0]
    assert to_bfloat16(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)).tolist() == [
        1.0,  # a tie: to the even mantissa
        1 + 2**-6,
    ]


def test_the_resize_by_hand() -> None:
    """torch's antialiased bilinear on uint8, worked by hand: [0, 255] stretched to four
    (weights 3/4 and 1/4 in 14-bit fixed point: 63.75 -> 64, 191.25 -> 191) and squeezed to one
    (1/2 each: 127.5 -> 128); the height the same way, after the width."""
    row = np.array([[[0, 0, 0], [255, 255, 255]]], np.uint8)  # [H=1, W=2, 3]
    assert resize(row, 1, 4)[0, :, 0].tolist() == [0, 64, 191, 255]
    assert resize(row, 1, 1)[0, :, 0].tolist() == [128]
    assert resize(row.transpose(1, 0, 2), 4, 1)[:, 0, 0].tolist() == [0, 64, 191, 255]


def test_tiles_come_row_by_row_then_the_global_view() -> None:
    """An image exactly 2x2 tiles, each tile one colour: the tiles in row order, then the whole
    image squeezed to one tile."""
    from PIL import Image

    colours = np.array([[[0, 0, 0], [255, 0, 0]], [[0, 255, 0], [0, 0, 255]]], np.uint8)
    image = Image.fromarray(colours.repeat(32, axis=0).repeat(32, axis=1))
    tiles, grid = Llama4Tiling(tile=32, max_tiles=4, tokens_per_tile=16).tiles(image)
    assert grid == (2, 2) and tiles.shape == (5, 3, 32, 32)
    corners = [tuple(t[:, 0, 0].tolist()) for t in tiles]
    assert corners[:4] == [(-1, -1, -1), (1, -1, -1), (-1, 1, -1), (-1, -1, 1)]
    whole = tiles[4]  # the global view: the four colours at its corners
    ends = [tuple(whole[:, y, x].tolist()) for y in (0, -1) for x in (0, -1)]
    assert ends == corners[:4]


def test_a_checkpoint_without_a_vision_config_takes_no_images(tmp_path: Path) -> None:
    """The engine serves such a Llama4ForConditionalGeneration's text only, so the API process
    has no image processor for it (image parts are a 400)."""
    config = {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert VisionProcessor.load(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(config | {"vision_config": vision_config()}))
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"height": SIZE, "width": SIZE}})
    )
    loaded = VisionProcessor.load(tmp_path)
    assert loaded is not None and loaded.marker.placeholder_id == 200_092  # Llama 4's <|patch|>


def test_the_released_processor_config_loads(tmp_path: Path) -> None:
    """Llama-4-Scout's preprocessor_config.json (written from memory of the released file; its
    nulls are HF's defaults) and its tower's shapes: 336-pixel tiles of 24x24 patches,
    pixel-shuffled to 144 rows."""
    released = {
        "crop_size": None, "data_format": "channels_first", "default_to_square": True,
        "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True,
        "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Llama4ImageProcessorFast", "image_std": [0.5, 0.5, 0.5],
        "input_data_format": None, "max_patches": 16, "processor_class": "Llama4Processor",
        "resample": 2, "rescale_factor": 0.00392156862745098, "resize_to_max_canvas": False,
        "return_tensors": None, "size": {"height": 336, "width": 336},
    }  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(released))
    tower = {"image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5}
    assert Llama4Tiling.load(tmp_path, {"vision_config": tower}) == RELEASED


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("do_normalize", False),
        ("do_rescale", False),
        ("size", 64),
        ("max_patches", 0),
        ("resample", 3),
    ],
)
def test_a_processor_config_the_port_would_not_follow_is_refused(
    tmp_path: Path, field: str, value: Any
) -> None:
    value = {"height": value, "width": value} if field == "size" else value
    fields = {"size": {"height": SIZE, "width": SIZE}} | {field: value}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=field):
        Llama4Tiling.load(tmp_path, {"vision_config": vision_config()})


def test_tiles_travel_as_bfloat16_bytes_that_the_engine_reads_back_exactly() -> None:
    """Each tile is an ImageInput of bfloat16 bytes (torch's own bfloat16 of the same values,
    an independent encoding), named by a hash of them, and the engine's reading of the bytes
    gives the processor's values back."""
    import torch

    from engine_core.multimodal import pixels_tensor
    from frontend.vision import ImageMarker, Llama4VisionProcessor

    tiling = Llama4Tiling(tile=8, max_tiles=4, tokens_per_tile=1)
    vision = Llama4VisionProcessor(tiling, ImageMarker(5, 2, (IMAGE, ""), (1, 2, 2)))
    (image,) = vision.process([random_image(3, 16, 12)], ["image"])
    ids = [0, 5, 9, 5, 9, 5, 9, 5, 9, 5]  # four tile runs and the global view's, one token each
    _, wire = vision.place(ids, [image])
    assert [(w.offset, w.length) for w in wire] == [(1, 1), (3, 1), (5, 1), (7, 1), (9, 1)]
    for tile, w in zip(image.pixels, wire, strict=True):
        expected = torch.from_numpy(tile[None].copy()).to(torch.bfloat16)
        assert w.pixels.dtype == "bfloat16" and w.pixels.shape == (1, 3, 8, 8)
        assert w.pixels.data == expected.view(torch.int16).numpy().tobytes()
        assert torch.equal(pixels_tensor(w).float(), torch.from_numpy(tile[None]))
    assert len({w.hash for w in wire}) == 5


def test_more_tiles_than_a_request_carries_is_a_bad_image() -> None:
    """Each tile is an image on the wire (at most MAX_IMAGES a request): 16 images of 16
    tiles and a global view each come to 272, and the 16th image is the one named."""
    from frontend.vision import BadImage, ImageMarker, Llama4VisionProcessor
    from protocol.codec import MAX_IMAGES

    tiling = Llama4Tiling(tile=8, max_tiles=16, tokens_per_tile=1)
    vision = Llama4VisionProcessor(tiling, ImageMarker(0, 2, (IMAGE, ""), (1, 2, 2)))
    images = [random_image(seed, 32, 32) for seed in range(16)]
    assert MAX_IMAGES == 256 and tiling.grid(32, 32) == (4, 4)
    assert len(vision.process(images[:15], ["x"] * 15)) == 15  # 255 tiles
    with pytest.raises(BadImage, match="272 tiles") as caught:
        vision.process(images, [f"image {i}" for i in range(16)])
    assert caught.value.param == "image 15"


# ---- against HF's processor -------------------------------------------------------------------


# HF's processor, run in a child interpreter: its torchvision is a test-only oracle that the
# test process never imports. The package index's torchvision is a CUDA build; on the CPU torch
# its compiled detection ops do not load, so their fake-tensor registrations (which no image
# transform uses) are skipped while it imports.
HF_ORACLE = """
import json, sys
import numpy as np
import torch, torch.library
spec = json.loads(sys.argv[1])
sys.path[:0] = spec["path"]
register = torch.library.register_fake
torch.library.register_fake = lambda *args, **kwargs: lambda fn: fn
import torchvision
torch.library.register_fake = register
from PIL import Image
from transformers import AutoTokenizer, Llama4Processor
from transformers.image_utils import SizeDict
from transformers.models.llama4 import image_processing_llama4 as hf
resolutions = hf.find_supported_resolutions(16, SizeDict(height=336, width=336))
table = torch.tensor(resolutions)
fits = [[int(n) for n in hf.get_best_fit(tuple(size), table, to_max)]
        for size in spec["sizes"] for to_max in (False, True)]
size = {"height": spec["tile"], "width": spec["tile"]}
images = hf.Llama4ImageProcessor(size=size, max_patches=spec["max_tiles"])
tokenizer = AutoTokenizer.from_pretrained(spec["folder"])
processor = Llama4Processor(images, tokenizer, patch_size=spec["patch"], pixel_shuffle_ratio=0.5)
out, ids, ratios = {}, [], []
for i, path in enumerate(spec["images"]):
    done = processor(text=spec["text"], images=[Image.open(path)], add_special_tokens=False,
                     return_tensors="pt")
    out[f"pixels{i}"] = done["pixel_values"].float().numpy()
    ids.append(done["input_ids"][0].tolist())
    ratios.append(images([Image.open(path)], return_tensors="pt")["aspect_ratios"][0].tolist())
np.savez(spec["out"], **out)
print(json.dumps({"resolutions": resolutions, "fits": fits, "ids": ids, "ratios": ratios}))
"""
SWEEP = [(h, w) for h in (1, 50, 224, 335, 336, 337, 600, 1000, 2000, 5000)
         for w in (1, 90, 336, 448, 700, 1008, 1500, 4000)]  # fmt: skip
# (height, width) of the images compared with HF's: SHAPES and two that need no resize for
# their tiles (the global view of the 2x2 one halves it).
HF_SHAPES = [*SHAPES, (32, 32), (64, 64)]
ORACLE_TEXT = f"a{IMAGE}b"


@pytest.fixture(scope="module")
def hf_oracle(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """HF's grid for SWEEP, and its pixels, aspect ratios and input_ids for HF_SHAPES' images;
    a skip where torchvision is neither importable nor in $TANDEM_TEST_TORCHVISION_DIR."""
    import importlib.util
    import os
    import subprocess
    import sys

    extra = os.environ.get("TANDEM_TEST_TORCHVISION_DIR")
    if not extra and importlib.util.find_spec("torchvision") is None:
        pytest.skip(
            "HF's Llama 4 image processor needs torchvision (set TANDEM_TEST_TORCHVISION_DIR)"
        )
    folder = tmp_path_factory.mktemp("llama4-oracle")
    paths = []
    for seed, (height, width) in enumerate(HF_SHAPES):
        paths.append(str(folder / f"{seed}.png"))
        random_image(seed, width, height).save(paths[-1])
    spec = {"path": [extra] if extra else [], "sizes": SWEEP, "tile": SIZE, "patch": 4,
            "max_tiles": MAX_TILES, "folder": str(vl_dir), "images": paths,
            "text": ORACLE_TEXT, "out": str(folder / "pixels.npz")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", HF_ORACLE, json.dumps(spec)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    pixels = np.load(folder / "pixels.npz")
    return result | {"pixels": [pixels[f"pixels{i}"] for i in range(len(HF_SHAPES))]}


def test_the_grid_is_hf_s_over_a_sweep_of_sizes(hf_oracle: dict[str, Any]) -> None:
    assert [(h // 336, w // 336) for h, w in hf_oracle["resolutions"]] == supported_grids(16)
    grids = supported_grids(16)
    ours = [best_grid(h, w, 336, grids, to_max) for h, w in SWEEP for to_max in (False, True)]
    assert ours == [(h // 336, w // 336) for h, w in hf_oracle["fits"]]


def test_pixels_and_input_ids_are_hf_s(vl_dir: Path, hf_oracle: dict[str, Any]) -> None:
    """Bit for bit: the resize (upscaled, downscaled, squeezed to the global view), the
    padding, the bfloat16 arithmetic, the tile order; and the prompt's token ids."""
    from transformers import AutoTokenizer

    ours = VisionProcessor.load(vl_dir)
    assert ours is not None
    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    grids = [*SHAPES.values(), (1, 1), (2, 2)]
    for seed, (height, width) in enumerate(HF_SHAPES):
        (mine,) = ours.process([random_image(seed, width, height)], ["image"])
        assert tuple(hf_oracle["ratios"][seed]) == grids[seed]
        expected = hf_oracle["pixels"][seed]
        assert mine.pixels.shape == expected.shape == (len(mine.pieces()), 3, SIZE, SIZE)
        assert np.array_equal(mine.pixels, expected), (height, width)
        text = ORACLE_TEXT.replace(IMAGE, ours.image_text([mine])[1][0])
        assert tokenizer.encode(text, add_special_tokens=False) == hf_oracle["ids"][seed]


# ---- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_and_dir(
    default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path]:
    """The tiny Llama 4 with images, as a user would hand it over: save_pretrained's weights,
    the default tokenizer with Llama 4's image tokens and an image-aware chat template, and a
    preprocessor_config.json as Llama 4's (32-pixel tiles, at most 4)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("llama4-images")
    tokenizer = AutoTokenizer.from_pretrained(str(default_tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(LLAMA4_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    model = random_llama4_vl(tokenizer.convert_tokens_to_ids(PATCH), len(tokenizer))
    model.save_pretrained(folder)
    processor = {"image_processor_type": "Llama4ImageProcessorFast", "max_patches": MAX_TILES}
    processor |= {"size": {"height": SIZE, "width": SIZE}, "resample": 2}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return model, folder


@pytest.fixture(scope="module")
def vl_dir(hf_and_dir: tuple[Any, Path]) -> Path:
    return hf_and_dir[1]


def test_the_api_process_tiles_an_image_without_torch_or_transformers(vl_dir: Path) -> None:
    """The port's reason to exist: loading the processor, tiling an image and placing its runs
    import neither torch nor transformers (tests/test_startup_imports.py's watch, in a fresh
    interpreter)."""
    from tests.test_startup_imports import imported

    code = """
    import numpy as np
    from PIL import Image
    from pathlib import Path
    from frontend.vision import VisionProcessor
    vision = VisionProcessor.load(Path(MODEL))
    image = Image.fromarray(np.zeros((40, 70, 3), np.uint8))
    (processed,) = vision.process([image], ["image"])
    ids = [vision.marker.placeholder_id] * 16 + [0]
    assert len(vision.place(ids * 5, [processed])[1]) == 5
    """
    assert imported(code, vl_dir, ("torch", "transformers", "torchvision")) == []


def chat_prompt(
    vl_dir: Path, images: list[Any], first: str = "Describe"
) -> tuple[Any, list[int], Any, list[Any]]:
    """A user turn of text and ``images``, rendered and placed as the API process does:
    (the tokenizer's decode, token ids, wire images, the tiles' pixels in prompt order)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    vision = VisionProcessor.load(vl_dir)
    assert vision is not None
    content = [{"type": "text", "text": first}] + [{"type": "image"} for _ in images]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    processed = vision.process(images, [f"image {i}" for i in range(len(images))])
    marker, texts = vision.image_text(processed) or ("", ())
    pieces = text.split(marker)
    text = pieces[0] + "".join(t + p for t, p in zip(texts, pieces[1:], strict=True))
    ids, wire = vision.place(tokenizer.encode(text, add_special_tokens=False), processed)
    import torch

    tiles = [torch.from_numpy(piece.pixels) for image in processed for piece in image.pieces()]
    return tokenizer.decode, ids, wire, tiles


@pytest.mark.slow
def test_the_openai_client_gets_hf_s_tokens_through_a_real_server(
    hf_and_dir: tuple[Any, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    import httpx
    import openai

    from tests.server_fixture import start_server, stop_server

    model, folder = hf_and_dir
    images = [random_image(1, 30, 20), random_image(2, 70, 40)]
    args = ["--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-batched-tokens", "32"]
    args += ["--max-num-seqs", "8"]
    srv = start_server(tmp_path_factory.mktemp("serve-llama4"), model=str(folder),
                       args=[*args, "--served-model-name", "llama4"])  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        # The multi-tile image twice, the second time after other text (no prefix hit past it).
        texts = ["Describe", "Describe", "Explain"]
        for image, text in zip([*images, images[1]], texts, strict=True):
            decode, ids, wire, tiles = chat_prompt(folder, [image], text)
            tokens = hf_tokens(model, ids, tiles, ids[wire[0].offset], NEW_TOKENS)
            url = f"data:image/png;base64,{base64.b64encode(png_bytes(image)).decode()}"
            part = {"type": "image_url", "image_url": {"url": url}}
            reply = chat(client, part, text)
            assert reply.choices[0].message.content == decode(tokens, skip_special_tokens=True)
            assert reply.usage.prompt_tokens == len(ids)
        # /tokenize renders and places images as chat does: the last prompt's ids exactly.
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, part]}]}
        assert httpx.post(f"{srv.base_url}/tokenize", json=body, timeout=60).json()["tokens"] == ids
        bad = base64.b64encode(b"not an image").decode()
        with pytest.raises(openai.BadRequestError) as caught:
            chat(
                client, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{bad}"}}
            )
        error = caught.value.body
        assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_image"
        assert (
            error["type"] == "invalid_request_error"
            and "not a PNG, JPEG or WebP" in error["message"]
        )
    finally:
        stop_server(srv)


def chat(client: Any, image_part: dict[str, Any], text: str = "Describe") -> Any:
    content = [{"type": "text", "text": text}, image_part]
    return client.chat.completions.create(
        model="llama4",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
