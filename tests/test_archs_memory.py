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
    engine = EngineConfig(
        model="random:deepseek-v3-4l", max_model_len=4096, num_kv_blocks=256
    ).with_max_num_seqs(large_gpu=False)
    plan = plan_memory(
        engine, PRESETS["deepseek-v3-4l"], model, torch.device("cpu"), torch.bfloat16,
        torch.bfloat16, Budget(16 * 2**30, "a 16 GiB test budget"),
    )  # fmt: skip
    assert plan.kv_bytes == 256 * 16 * 4 * 576 * 2
    with pytest.raises(ModelTooLargeError, match=r"weights 6\d\.\d\d GiB \+ KV cache 0\.02 GiB"):
        check_fits(plan)


def test_llama4_scout_preset_fits_one_h200_in_bf16() -> None:
    """Scout's layer shapes on 24 of its 48 layers: per layer q/o 5120 x 5120, k/v 5120 x 1024,
    16 experts and a shared one of 3 x 5120 x 8192, a router of 16 rows; about 108 GB in bf16,
    with room for the KV cache on a 141 GB H200 (the whole 48 would not fit)."""
    config = PRESETS["llama4-scout"]
    assert (config.num_layers, config.num_experts, config.attention_chunk_size) == (24, 16, 8192)
    assert config.nope_layers == (3, 7, 11, 15, 19, 23) and config.dense_layers == ()
    per_layer = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 17 * 3 * 5120 * 8192 + 16 * 5120 + 2 * 5120
    embeddings = 2 * 49152 * 5120 + 5120  # input, untied head, final norm
    model = meta_model("llama4-scout")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights == 2 * (24 * per_layer + embeddings)
    assert 100e9 < module_bytes(model) < 110e9  # with the buffers (inv_freq, router counts)
