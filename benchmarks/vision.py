"""Images through a vision-language model: the vision encoder alone, then time to first token
over HTTP for one image and a short text per request.

    python -m benchmarks vision --model qwen2.5-vl-7b
    python -m benchmarks vision --model qwen3-vl-8b
    python -m benchmarks vision --model gemma-3-4b
    python -m benchmarks vision --model mistral-small-3.1-24b

1. **The encoder**: the model's vision tower (random weights of its real shape, the model's
   dtype) on batches of ``--image-size`` square images, as the engine core encodes a step's
   images in one call: images per second at each batch size of ``--batches``.
2. **Time to first token**: ``tandem serve --model random:PRESET`` (or the model folder), and
   per request one fresh random ``--image-size`` square PNG (as a data URL) and a random text of
   ``--text-tokens`` tokens in one chat user turn, streamed, one token asked for. Every image
   is new, so neither the encoder cache nor the prefix cache ever hits: each request pays the
   API process's image processing, the pixels' trip to the engine, the encoder and the
   prefill of the image's tokens and the text. ``--requests`` requests at each concurrency of
   ``--concurrency`` (each worker sends its next when its last one's stream ends), after
   ``--warmup`` requests not kept. TTFT p50 and p99 per level; the prompt's tokens as the
   server counted them (usage), the image's included.

With ``--vllm-python``, vLLM serves the same model after Tandem (one server at a time, the
same images and texts in the same order): for a preset, a folder with its config.json, its
tokenizer and image processor config (benchmarks/servers.py ``peer_model_dir``) and dummy
weights; ``--device cpu`` runs vLLM's CPU build. Both tables print, and vLLM's TTFT over
Tandem's per level.

``--model`` is a preset name (engine_core/presets.py: ``qwen2.5-vl-7b``, ``qwen3-vl-8b``,
``gemma-3-4b``, ``mistral-small-3.1-24b``) or a Qwen2.5-VL, Qwen3-VL, Gemma 3 or Mistral 3
model folder (the tests run the tiny ones on the CPU).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import shlex
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.first_token import first_sse_token, random_prompt
from benchmarks.report import (
    Provenance,
    fmt,
    format_table,
    parse_ints,
    percentile,
    ratio,
    write_json,
)
from benchmarks.servers import (
    SERVED_NAME,
    Server,
    VllmInstall,
    context_bound,
    free_port,
    imports,
    peer_model_dir,
    running,
    tandem_serve_command,
    vllm_server,
)
from benchmarks.serving import add_vllm_args
from engine_core.config import ModelConfig, VisionConfig

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class EncoderRow:
    batch: int  # images per encoder call
    patches_per_image: int
    tokens_per_image: int  # the language model's placeholders each image fills
    ms_per_batch: float  # the mean over the timed calls

    @property
    def images_per_s(self) -> float:
        return self.batch / self.ms_per_batch * 1e3


@dataclass
class TtftRow:
    concurrency: int
    ttft_ms: list[float] = field(default_factory=list)  # one per kept request
    prompt_tokens: list[int] = field(default_factory=list)  # as the server counted them

    @property
    def p50(self) -> float:
        return percentile(self.ttft_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.ttft_ms, 99)


# ---- the model's shape --------------------------------------------------------------------------


def model_hf_config(model: str) -> dict[str, Any]:
    """The HF config.json of ``model``: a preset's, or a model folder's."""
    from engine_core.presets import PRESETS, hf_config

    if model in PRESETS:
        return hf_config(model)
    return json.loads((Path(model) / "config.json").read_text())


class Gemma3Encoder(torch.nn.Module):
    """Gemma 3's encoder as the engine runs it (models/gemma3_mm.py ``encode_images``): the
    SigLIP tower, then the projector's pooling to ``tokens_per_image`` tokens an image; called
    as Qwen's tower is, with pixels [N, C, S, S] and their (unused) grids."""

    def __init__(self, vision: VisionConfig, hidden_size: int) -> None:
        from engine_core.models.siglip import Gemma3MultiModalProjector, SiglipVisionModel

        super().__init__()
        self.image_size = vision.tower["image_size"]
        self.channels = vision.tower.get("num_channels", 3)
        self.vision_tower = SiglipVisionModel(vision.tower)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision.tower, hidden_size, vision.tokens_per_image
        )

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels)).flatten(0, 1)


class Mistral3Encoder(torch.nn.Module):
    """Mistral 3's encoder as the engine runs it (models/mistral3.py ``encode_images``):
    Pixtral's tower and the projector's patch merger, called as Qwen's tower is, with patch
    rows [patches, C * P * P] and their grids."""

    def __init__(self, config: ModelConfig) -> None:
        from engine_core.models.pixtral import Mistral3MultiModalProjector, PixtralVisionModel

        super().__init__()
        vision = config.vision
        assert vision is not None
        self.vision_tower = PixtralVisionModel(vision.tower)
        self.multi_modal_projector = Mistral3MultiModalProjector(
            vision.tower, config.hidden_size, vision.spatial_merge_size, config.norm_eps, False
        )

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        from engine_core.models.pixtral import pixtral_embeddings

        return pixtral_embeddings(self.vision_tower, self.multi_modal_projector, pixels, grids)


def build_vision_tower(model: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """``model``'s vision tower with random weights (the encoder's time does not depend on
    them) on ``device`` in ``dtype``, in eval mode: Qwen2.5-VL's, or Gemma 3's with its
    projector."""
    from engine_core.models import model_config_from_hf
    from engine_core.models.layers import reset_buffers
    from engine_core.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from engine_core.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from engine_core.presets import init_random_weights

    config = model_config_from_hf(model_hf_config(model))
    vision = config.vision
    towers = {
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration.vision_tower,
        "qwen3_vl": Qwen3VLForConditionalGeneration.vision_tower,
    }
    known = vision is not None and (
        vision.tokens_per_image or config.architecture in (*towers, "mistral3")
    )
    if vision is None or not known:
        raise ValueError(
            f"{model}: the benchmark takes Qwen2.5-VL, Qwen3-VL, Gemma 3 and Mistral 3 models"
        )
    with torch.device("meta"):
        if vision.tokens_per_image:  # one size of image, pooled to a fixed count: Gemma 3
            tower = Gemma3Encoder(vision, config.hidden_size)
        elif config.architecture == "mistral3":
            tower = Mistral3Encoder(config)
        else:
            tower = towers[config.architecture](vision.tower)
    tower = tower.to(dtype).to_empty(device=device)
    reset_buffers(tower)
    init_random_weights(tower)
    return tower.eval().requires_grad_(False)


def model_folder(model: str) -> Path:
    """The folder the server's API process reads for ``model``: a preset's (written from the
    default tokenizer with the vision tokens, engine_core/preset_folders.py) or the model's."""
    from engine_core.model_dir import tokenizer_dir_for_preset
    from engine_core.presets import PRESETS

    return tokenizer_dir_for_preset(model) if model in PRESETS else Path(model)


def image_grid(folder: Path, size: int) -> tuple[int, int, int]:
    """The patch grid the model's HF image processor (the server's, frontend/vision.py) gives
    a ``size`` x ``size`` image."""
    from frontend.vision import VisionProcessor

    processor = VisionProcessor.load(folder)
    if processor is None:
        raise ValueError(f"{folder} holds no vision-language model")
    image = random_png(size, np.random.default_rng(0))
    (processed,) = processor.process([image], ["image"])
    return processed.grid_thw


def image_patches(
    grid: tuple[int, int, int], count: int, device: str, seed: int = 0, width: int = 1176
) -> torch.Tensor:
    """The pixels of ``count`` images of patch grid ``grid`` [count * patches, width] (1,176:
    Qwen2.5-VL's 2 x 14 x 14 x 3; Qwen3-VL's 16-pixel patches 1,536), normal random values as
    normalised pixels are."""
    rows = count * grid[0] * grid[1] * grid[2]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(device)


def patch_width(tower: torch.nn.Module) -> int:
    """The pixels one patch row holds: the patch embedding's input width."""
    if isinstance(tower, Mistral3Encoder):
        return tower.vision_tower.patch_conv.weight[0].numel()
    return tower.patch_embed.proj.weight[0].numel()


def encoder_pixels(
    tower: torch.nn.Module, grid: tuple[int, int, int], count: int, device: str
) -> torch.Tensor:
    """``count`` images' pixels as ``tower`` takes them: Gemma 3's [count, C, S, S] (the grid
    is its patches, S / patch a side), else Qwen2.5-VL's patch rows."""
    if not isinstance(tower, Gemma3Encoder):
        return image_patches(grid, count, device, width=patch_width(tower))
    side = tower.image_size
    gen = torch.Generator().manual_seed(0)
    return torch.randn(count, tower.channels, side, side, generator=gen).to(device)


def measure_encoder(
    tower: torch.nn.Module,
    grid: tuple[int, int, int],
    batches: list[int],
    trials: int,
    device: str,
) -> list[EncoderRow]:
    """Each batch size's mean time per encoder call over ``trials`` calls after one warm-up,
    on images of patch grid ``grid``."""
    rows = []
    dtype = next(tower.parameters()).dtype
    for batch in batches:
        pixels = encoder_pixels(tower, grid, batch, device).to(dtype)
        grids = [grid] * batch
        with torch.inference_mode():
            tower(pixels, grids)
            synchronize(device)
            started = time.perf_counter()
            for _ in range(trials):
                tokens = tower(pixels, grids).shape[0] // batch
            synchronize(device)
        ms = (time.perf_counter() - started) / trials * 1e3
        rows.append(EncoderRow(batch, grid[0] * grid[1] * grid[2], tokens, ms))
    return rows


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- requests over HTTP -------------------------------------------------------------------------


def random_png(size: int, rng: np.random.Generator) -> Any:
    """A ``size`` x ``size`` PIL image of random pixels."""
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def png_data_url(size: int, rng: np.random.Generator) -> str:
    """A fresh ``size`` x ``size`` PNG of random pixels, as a data URL."""
    image = random_png(size, rng)
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class _TextVocabulary:
    """A tokenizer whose random prompts draw only from its own vocabulary, never the special
    tokens added after it (an ``<|image_pad|>`` in the text would be a placeholder without an
    image)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def get_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def chat_bodies(
    count: int, size: int, text_tokens: int, tokenizer: Any, seed: int
) -> list[dict[str, Any]]:
    """``count`` streamed chat requests, each a user turn of one fresh random image and a
    random text of ``text_tokens`` tokens, one token asked for."""
    rng, text_rng = np.random.default_rng(seed), random.Random(seed)
    vocabulary = _TextVocabulary(tokenizer)
    bodies = []
    for _ in range(count):
        _, text = random_prompt(text_rng, vocabulary, text_tokens)
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(size, rng)}},
            {"type": "text", "text": text},
        ]
        bodies.append(
            {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 1,
                "temperature": 0,
            }
        )
    return bodies


def measure_ttft(url: str, bodies: list[dict[str, Any]], concurrency: int) -> TtftRow:
    """Every body sent with at most ``concurrency`` in flight; their TTFTs and prompt tokens."""
    import httpx

    row = TtftRow(concurrency)
    endpoint = f"{url}/v1/chat/completions"
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        for ms, prompt_tokens in pool.map(lambda b: first_sse_token(client, endpoint, b), bodies):
            row.ttft_ms.append(ms)
            row.prompt_tokens.append(prompt_tokens)
    return row


def build_servers(args: argparse.Namespace, folder: Path, log_dir: Path) -> list[Server]:
    """Tandem (unless --no-tandem), then vLLM where --vllm-python names its interpreter."""
    from engine_core.presets import PRESETS

    preset = args.model in PRESETS
    model = f"random:{args.model}" if preset else args.model
    max_model_len = args.max_model_len or context_bound(model, DEFAULT_MAX_MODEL_LEN)
    servers = []
    if not args.no_tandem:
        port = args.port or free_port()
        extra = ["--device", args.device, "--served-model-name", SERVED_NAME]
        extra += shlex.split(args.tandem_args)
        command = tandem_serve_command(model, port, max_model_len, extra)
        servers.append(Server("tandem", command, port))
    if args.vllm_python:
        install = VllmInstall(args.vllm_python, args.vllm_pythonpath, cpu=args.device == "cpu")
        model_dir = peer_model_dir(args.model, folder, log_dir / "model") if preset else folder
        extra = shlex.split(args.vllm_args)
        servers.append(
            vllm_server(install, model_dir.resolve(), free_port(), max_model_len, preset, extra)
        )
    if not servers:
        raise SystemExit("nothing to run: --no-tandem and no --vllm-python")
    return servers


def serve_and_measure(
    args: argparse.Namespace, folder: Path, tokenizer: Any
) -> tuple[dict[str, list[TtftRow]], list[Server]]:
    """Each server in turn: start it, warm it, measure each concurrency level, stop it; every
    server gets the same bodies in the same order. A server that fails is reported and left
    out of the results."""
    import httpx

    log_dir = Path(tempfile.mkdtemp(prefix="tandem-vision-"))
    servers = build_servers(args, folder, log_dir)
    levels = parse_ints(args.concurrency)
    total = args.warmup + args.requests * len(levels)
    bodies = chat_bodies(total, args.image_size, args.text_tokens, tokenizer, args.seed)
    results = {}
    for server in servers:
        if server.name == "vllm" and not imports(server, "torchvision"):
            # Its vision models import transformers' image processors, which import torchvision.
            print("  vllm skipped: its Python cannot import torchvision", flush=True)
            continue
        try:
            with running(server, log_dir):
                results[server.name] = measure_levels(server, bodies, levels, args)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            print(f"  {server.name} failed: {exc}", flush=True)
    return results, servers


def measure_levels(
    server: Server, bodies: list[dict[str, Any]], levels: list[int], args: argparse.Namespace
) -> list[TtftRow]:
    """The warm-up requests one at a time, then --requests at each concurrency level."""
    measure_ttft(server.url, bodies[: args.warmup], 1)
    rows, at = [], args.warmup
    for level in levels:
        rows.append(measure_ttft(server.url, bodies[at : at + args.requests], level))
        at += args.requests
        print(f"  {server.name} concurrency {level}: TTFT p50 {rows[-1].p50:.1f} ms", flush=True)
    return rows


def load_tokenizer(folder: Path) -> Any:
    """The ``tokenizers`` tokenizer of the server's folder (a preset's has the vision tokens)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


# ---- the report ---------------------------------------------------------------------------------


def format_encoder(rows: list[EncoderRow]) -> str:
    headers = ["images a call", "patches an image", "tokens an image", "ms a call", "images/s"]
    table = [
        [
            str(r.batch),
            str(r.patches_per_image),
            str(r.tokens_per_image),
            fmt(r.ms_per_batch, ".1f"),
            fmt(r.images_per_s, ".1f"),
        ]
        for r in rows
    ]
    return format_table(headers, table)


def format_ttft(rows: list[TtftRow]) -> str:
    headers = ["concurrency", "requests", "prompt tokens", "TTFT p50 ms", "TTFT p99 ms"]
    table = [
        [
            str(r.concurrency),
            str(len(r.ttft_ms)),
            fmt(float(np.mean(r.prompt_tokens)), ".0f"),
            fmt(r.p50, ".1f"),
            fmt(r.p99, ".1f"),
        ]
        for r in rows
    ]
    return format_table(headers, table)


def format_ratios(ttft: dict[str, list[TtftRow]]) -> str:
    """vLLM's TTFT over Tandem's at each level (above 1: Tandem's first token comes sooner)."""
    headers = ["concurrency", "p50 vllm / tandem", "p99 vllm / tandem"]
    table = [
        [str(t.concurrency), fmt(ratio(v.p50, t.p50), ".2f"), fmt(ratio(v.p99, t.p99), ".2f")]
        for t, v in zip(ttft["tandem"], ttft["vllm"], strict=True)
    ]
    return format_table(headers, table)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-vl-7b", help="a preset or a model folder")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--image-size", type=int, default=1024, help="pixels a side")
    parser.add_argument("--batches", default="1,4,16", help="images per encoder call")
    parser.add_argument("--encoder-trials", type=int, default=5, help="timed calls a batch")
    parser.add_argument("--concurrency", default="1,4,16", help="requests in flight, per level")
    parser.add_argument("--requests", type=int, default=32, help="kept requests per level")
    parser.add_argument("--warmup", type=int, default=3, help="requests first, not kept")
    parser.add_argument("--text-tokens", type=int, default=128, help="each request's text")
    parser.add_argument(
        "--max-model-len", type=int,
        help=f"both servers' (default: {DEFAULT_MAX_MODEL_LEN:,}, or the model's limit where "
        "shorter)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="default: a free one")
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    add_vllm_args(parser)
    parser.add_argument("--skip-http", action="store_true", help="the encoder's table only")
    parser.add_argument("--json", type=Path, help="write the provenance and every figure here")


def run(args: argparse.Namespace) -> int:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    folder = model_folder(args.model)
    grid = image_grid(folder, args.image_size)
    tower = build_vision_tower(args.model, args.device, dtype)
    batches = parse_ints(args.batches)
    encoder = measure_encoder(tower, grid, batches, args.encoder_trials, args.device)
    del tower
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the server's memory plan must see the whole GPU
    provenance = Provenance.here(args.argv)
    print(f"\n{provenance.format()}")
    size = f"{args.image_size}x{args.image_size}"
    print(f"\n{args.model}: the vision encoder alone, {size} images, {str(dtype)[6:]}\n")
    print(format_encoder(encoder), flush=True)  # before the server: kept if the HTTP part fails
    ttft: dict[str, list[TtftRow]] = {}
    servers: list[Server] = []
    if not args.skip_http:
        ttft, servers = serve_and_measure(args, folder, load_tokenizer(folder))
    for server in servers:
        print(f"\n{server.name}: {server.shown()}")
        print(f"one {size} image (fresh each request) + {args.text_tokens} text tokens\n")
        print(format_ttft(ttft[server.name]) if server.name in ttft else "failed: see above")
    if {"tandem", "vllm"} <= ttft.keys():
        print(f"\n{format_ratios(ttft)}")
    if args.json:
        commands = {server.name: server.shown() for server in servers}
        figures = {"encoder": encoder, "ttft": ttft, "servers": commands}
        write_json(args.json, provenance, figures)
    return 0
