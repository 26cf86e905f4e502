"""Quantized checkpoints at TP=2 on two CUDA GPUs (NCCL or the peer all-reduce; each rank's
share through the W4A16 GEMM and fused-MoE kernels, the block-FP8 GEMM and fused FP8 MoE; decode
graphs), in float32, against HF transformers on the CPU: a Qwen3-MoE with a dense layer, sized
so each rank's shares are whole 128-column groups (AWQ) and whole 128 x 128 blocks (FP8).

W4A16 leaves activations in float32: the same tokens, logprobs within 1e-3. Block FP8 rounds
activations to e4m3 per token and 128 columns; each rank's inputs are whole such groups, but a
sum in another order now and then lands one value on the other side of a rounding boundary:
the same tokens, most logprobs within 1e-3 and all within 0.5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from tests.paged_harness import random_prompts
from tests.quant_fixtures import (
    awq_tensors,
    e4m3_per_token,
    quantize_expert_inputs,
    quantize_inputs,
)
from tests.test_fp8 import fp8_block_format, write_quantized
from tests.test_w4a16 import awq_qc
from tests.test_w4a16_moe import scaled_head, write_w4a16_moe
from tests.tp_cases import Greedy, assert_same_greedy_quantized, engine_greedy, hf_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
VOCAB = 256
NEW_TOKENS = 12
PROMPTS = random_prompts(VOCAB, (5, 11, 23, 40))
BLOCK = (128, 128)


def make_qwen3_moe() -> nn.Module:
    """Every split width 128 per rank at TP=2: q and k/v rows (4 heads of 64, 4 KV heads), o's
    input, each expert's width (256), the dense layer's (512: two per rank)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=128,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1,
        mlp_only_layers=[1], norm_topk_prob=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    return scaled_head(AutoModelForCausalLM.from_config(config).eval(), 0)


def on_two_gpus(folder: Path) -> Greedy:
    return engine_greedy(
        folder, PROMPTS, NEW_TOKENS, tp=2, device="cuda", dtype="float32", block_size=16
    )


def test_tp2_awq_on_two_gpus_matches_hf(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    make_qwen3_moe().save_pretrained(plain)
    packer = (lambda w, _: awq_tensors(w, 128), awq_qc(128))
    folder, reference = write_w4a16_moe(plain, tmp_path, "awq-g128", packer)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    want = hf_reference(hf, PROMPTS, NEW_TOKENS)
    tokens, logprobs = on_two_gpus(folder)
    assert tokens == want[0]
    torch.testing.assert_close(logprobs, want[1], atol=1e-3, rtol=0)


def test_tp2_block_fp8_on_two_gpus_matches_hf(tmp_path: Path) -> None:
    fmt = fp8_block_format(BLOCK)
    write_quantized(make_qwen3_moe(), fmt, tmp_path / "fp8", tmp_path / "ref")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    round_trip = lambda x: e4m3_per_token(x, BLOCK[1])  # noqa: E731
    quantize_inputs(hf, round_trip)
    quantize_expert_inputs(hf, round_trip)
    want = hf_reference(hf, PROMPTS, NEW_TOKENS)
    assert_same_greedy_quantized(on_two_gpus(tmp_path / "fp8"), want, atol=1e-3)
