"""The memory plan for the new architectures, on the real shapes built on the meta device:
MXFP4 experts counted at 4.25 bits a weight, MLA's cache at its latent and rotary key per
token (not K and V per head), and a model that does not fit refused naming the parts."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.memory_plan import (
    Budget,
    ModelTooLargeError,
    check_fits,
    kv_block_bytes,
    module_bytes,
    plan_memory,
)
from engine_core.models import build_model
from engine_core.presets import PRESETS


def meta_model(name: str) -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return build_model(PRESETS[name])
    finally:
        torch.set_default_dtype(previous)


def test_mxfp4_experts_are_counted_as_mxfp4() -> None:
    model = meta_model("gpt-oss-20b")
    config = PRESETS["gpt-oss-20b"]
    weights = 24 * 32 * 3 * 2880 * 2880  # gate, up and down of every expert
    expert_bytes = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(("_blocks", "_scales"))
    )
    assert expert_bytes == weights // 2 + weights // 32  # half a byte each, a byte per 32
    bf16_experts = 2 * weights
    assert module_bytes(model) < bf16_experts / 3  # the whole model, MXFP4 experts and all
    assert config.expert_format == "mxfp4"


def test_mla_cache_is_counted_per_token() -> None:
    """DeepSeek-V3's 576 latent + rotary values per token and layer, where K and V of its 128
    heads of 192 / 128 dims would be 40,960."""
    config = PRESETS["deepseek-v3-4l"]
    assert kv_block_bytes(config, config.num_kv_heads, 16, torch.bfloat16) == 16 * 4 * 576 * 2
    assert config.kv_bytes_per_token == 4 * 576 * 2


def test_a_model_that_does_not_fit_is_refused_naming_the_parts() -> None:
    model = meta_model("deepseek-v3-4l")
    engine = EngineConfig(model="random:deepseek-v3-4l", max_model_len=4096, num_kv_blocks=256)
    plan = plan_memory(
        engine, PRESETS["deepseek-v3-4l"], model, torch.device("cpu"), torch.bfloat16,
        torch.bfloat16, Budget(16 * 2**30, "a 16 GiB test budget"),
    )  # fmt: skip
    assert plan.kv_bytes == 256 * 16 * 4 * 576 * 2
    with pytest.raises(ModelTooLargeError, match=r"weights 6\d\.\d\d GiB \+ KV cache 0\.02 GiB"):
        check_fits(plan)
