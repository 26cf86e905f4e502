"""The memory plan reserves a vision-language model's encoder (engine_core/memory_plan.py
encoder_bytes): the bound ``encoder_peak_bytes`` computes from the tower's shapes covers the
peak the encoder's largest run really holds, measured on the CPU by an independent count (every
tensor an op makes, alive until its last reference dies), for the tiny Qwen2.5-VL, Qwen3-VL
(its DeepStack features widen the embeddings) and Gemma 3 at the largest images their
processors make, several to a run. The plan adds it, the
encoder cache's budget included, to what a model needs."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine_core.config import EngineConfig
from engine_core.loader import load_model
from engine_core.memory_plan import Budget, encoder_peak_bytes, plan_memory
from engine_core.models import build_model, model_config_from_hf
from engine_core.multimodal import MultimodalRunner
from protocol.messages import ImageInput, TensorBytes
from tests.vision_factories import (
    QWEN3_PATCH,
    write_tiny_gemma3_vl,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_vl,
)


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among the tensors ops make under it
    (views share their base's storage; an input made outside is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, storage.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


def wire_image(seed: int, shape: tuple[int, ...], grid: tuple[int, int, int], merge: int) -> Any:
    pixels = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    data = pixels.numpy().tobytes()
    length = grid[0] * grid[1] * grid[2] // merge**2
    return ImageInput(bytes([seed]) * 32, 0, length, TensorBytes("float32", shape, data), grid)


@pytest.fixture(scope="module")
def qwen_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), default_model_dir)


@pytest.fixture(scope="module")
def gemma_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_vl(tmp_path_factory.mktemp("tiny-gemma3-vl"), default_model_dir)


def measured_and_planned(folder: Path, images: list[Any], largest: int) -> tuple[int, int]:
    """The measured peak of one encoder run over ``images`` (as the engine makes it: pixels
    from their wire bytes, the tower, the split into images) and the plan's bound for a run of
    that many tokens, images of at most ``largest`` tokens."""
    loaded = load_model(str(folder), "cpu", torch.float32)
    vision = dataclasses.replace(loaded.config.vision, max_image_tokens=largest)
    tokens = sum(image.length for image in images)
    runner = MultimodalRunner(loaded.module, vision, torch.device("cpu"), 0, tokens)
    with PeakBytes() as counter:
        embeds = runner._encode(images)
    assert sum(e.shape[0] for e in embeds) == tokens  # one run, every image
    hidden = loaded.config.hidden_size
    return counter.peak, encoder_peak_bytes(vision, hidden, tokens, torch.float32)


def test_the_plan_covers_qwen2_5_vl_s_encoder_peak(qwen_dir: Path) -> None:
    """Three images of the tiny processor's largest size (64 merged tokens, 16x16 patches of
    2 frames of 14x14 pixels)."""
    images = [wire_image(i, (256, 3 * 2 * 14 * 14), (1, 16, 16), 2) for i in range(3)]
    measured, planned = measured_and_planned(qwen_dir, images, 64)
    assert measured <= planned <= 8 * measured


def test_the_plan_covers_qwen3_vl_s_encoder_peak(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Three images of the tiny processor's largest size (64 merged tokens, 16x16 patches of
    2 frames of 16x16 pixels), each token 64 wide and two DeepStack features more."""
    folder = write_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"), default_model_dir)
    width = 3 * 2 * QWEN3_PATCH * QWEN3_PATCH
    images = [wire_image(i, (256, width), (1, 16, 16), 2) for i in range(3)]
    measured, planned = measured_and_planned(folder, images, 64)
    assert measured <= planned <= 8 * measured


def test_the_plan_covers_gemma3_s_encoder_peak(gemma_dir: Path) -> None:
    """Six images (16 tokens each, 8x8 patches of 7x7 pixels pooled 2x2)."""
    images = [wire_image(i, (1, 3, 56, 56), (1, 8, 8), 2) for i in range(6)]
    measured, planned = measured_and_planned(gemma_dir, images, 16)
    assert measured <= planned <= 8 * measured


def test_the_plan_adds_the_encoder_to_what_a_vision_model_needs(gemma_dir: Path) -> None:
    import json

    model_config = model_config_from_hf(json.loads((gemma_dir / "config.json").read_text()))
    with torch.device("meta"):
        module = build_model(model_config)
    config = EngineConfig(
        model=str(gemma_dir), encoder_cache_memory_gb=0.25, num_kv_blocks=64
    ).with_max_num_seqs(large_gpu=False)
    budget = Budget(2**40, "test")
    plan = plan_memory(config, model_config, module, torch.device("cpu"), torch.float32,
                       torch.float32, budget)  # fmt: skip
    tokens = max(config.token_budget, 16)  # a step's budget, or one image
    peak = encoder_peak_bytes(model_config.vision, 64, tokens, torch.float32)
    assert plan.encoder_bytes == 2**28 + peak
    text_only = dataclasses.replace(model_config, vision=None)
    assert plan_memory(config, text_only, module, torch.device("cpu"), torch.float32,
                       torch.float32, budget).encoder_bytes == 0  # fmt: skip
