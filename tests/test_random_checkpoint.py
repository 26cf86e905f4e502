"""benchmarks/random_checkpoint.py: one random checkpoint both servers load beside a peer.

The folder must be what a peer loads as a published checkpoint (HF's loader finds every weight,
the experts under their per-expert names) and what our loader reads as the same model (HF's
greedy tokens); gpt-oss's experts are written as published MXFP4 and match HF running the
dequantized values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DeepseekV2Config

from benchmarks import random_checkpoint
from benchmarks.random_checkpoint import write_random_checkpoint
from engine_core.models import mxfp4
from engine_core.models.gpt_oss_moe import GptOssMoE
from tests.paged_harness import (
    assert_matches,
    generate_greedy,
    hf_greedy,
    load_float32,
    random_prompts,
)
from tests.test_models_deepseek import MOE, SIZES
from tests.test_models_gpt_oss import PUBLISHED_QUANTIZATION, dequantized_copy, gpt_oss_config

VOCAB = 320
PROMPTS = random_prompts(VOCAB, (5, 11))
NEW_TOKENS = 8
ATOL = 1e-4


def deepseek_v2_config() -> dict:
    """tests/test_models_deepseek.py's tiny DeepSeek-V2-Lite (MLA without a query LoRA, 8
    experts of which 2 a token, one dense layer first) with the published n_group/topk_group."""
    config = DeepseekV2Config(**SIZES, **MOE, q_lora_rank=None, n_group=1, topk_group=1)
    return config.to_dict()


def test_a_deepseek_checkpoint_loads_in_hf_and_gives_its_tokens_through_ours(
    tmp_path: Path,
) -> None:
    write_random_checkpoint(deepseek_v2_config(), tmp_path, "cpu")
    names = load_file(tmp_path / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names  # the published layout
    hf, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    got = generate_greedy(load_float32(tmp_path), PROMPTS, NEW_TOKENS)
    assert_matches(got, [hf_greedy(hf.eval(), p, NEW_TOKENS) for p in PROMPTS], ATOL)


def test_gpt_oss_experts_are_written_as_published_mxfp4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In shards small enough that the index is rewritten too (the real model's 13 GB are)."""
    monkeypatch.setattr(random_checkpoint, "SHARD_SIZE", "200KB")
    config = gpt_oss_config().to_dict() | {"quantization_config": PUBLISHED_QUANTIZATION}
    write_random_checkpoint(config, tmp_path, "cpu", seed=3)
    tensors = {}
    for shard in sorted(tmp_path.glob("model*.safetensors")):
        tensors |= load_file(shard)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in tensors
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"] == PUBLISHED_QUANTIZATION
    torch.manual_seed(3)  # the writer's own weights, before its experts were quantized
    written = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.bfloat16).float()
    reference = dequantized_copy(written, tensors).eval()
    for proj in ("gate_up_proj", "down_proj"):  # the reference's experts: the written ones
        original = getattr(written.model.layers[1].mlp.experts, proj).transpose(1, 2)
        blocks = tensors[f"model.layers.1.mlp.experts.{proj}_blocks"].flatten(-2)
        scales = tensors[f"model.layers.1.mlp.experts.{proj}_scales"]
        step = torch.exp2(scales.float() - mxfp4.SCALE_BIAS).repeat_interleave(32, dim=-1)
        back = mxfp4.dequantize(blocks, scales, torch.float32)
        assert bool(((back - original).abs() <= step).all()), proj  # within MXFP4's rounding
    model = load_float32(tmp_path)
    assert isinstance(model.model.layers[0].mlp, GptOssMoE) and model.model.layers[0].mlp.mxfp4
    got = generate_greedy(model, PROMPTS, NEW_TOKENS)
    assert_matches(got, [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS], ATOL)
