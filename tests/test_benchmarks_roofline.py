"""The rooflines' byte and FLOP counts against sums worked out by hand from the presets' shapes
(DESIGN.md, "Benchmark models"), not from the model code."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.roofline import experts_touched, model_bytes, prefill_flops, step_bytes

VOCAB = 49152


def llama_params(hidden: int, layers: int, q: int, kv: int, mlp: int, tied: bool) -> int:
    """Parameters of a Llama: embedding (and an untied head), per layer the q, k, v and o
    projections, gate, up and down, two norms; the final norm. ``q``/``kv``: their widths."""
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * mlp + 2 * hidden
    return VOCAB * hidden * (1 if tied else 2) + layers * per_layer + hidden


def test_smollm2_weights_and_kv_bytes_by_hand() -> None:
    params = llama_params(576, 30, 576, 3 * 64, 1536, tied=True)
    assert params == 134_515_008
    bytes_ = model_bytes("smollm2-135m")
    assert bytes_.weights == 2 * params
    assert bytes_.kv_per_token == 2 * 30 * 3 * 64 * 2  # K and V, layers, KV heads, head dim, bf16
    assert bytes_.dense == bytes_.weights and bytes_.moe_layers == 0


def test_decode_64_step_reads_weights_and_kv_at_the_mean_context() -> None:
    # 64 sequences of 128 prompt tokens and 256 output tokens: 256 tokens on average.
    expected = 2 * 134_515_008 + 64 * 256 * 23_040
    assert step_bytes(model_bytes("smollm2-135m"), 64, 128 + 256 / 2) == expected == 646_517_376


def test_llama_8b_counts_its_untied_head() -> None:
    params = llama_params(4096, 32, 4096, 8 * 128, 14336, tied=False)
    assert model_bytes("llama-8b").weights == 2 * params == 14_764_482_560
    assert model_bytes("llama-8b").kv_per_token == 2 * 32 * 8 * 128 * 2


def test_fp8_halves_the_linears_and_adds_a_scale_per_row() -> None:
    # llama-1b: q/k/v, o, gate/up, down in FP8 (1 byte) with a float32 scale per output row;
    # the tied embedding and the norms stay bf16.
    hidden, mlp, kv = 2048, 8192, 8 * 64
    linear = hidden * (hidden + 2 * kv) + hidden * hidden + 2 * hidden * mlp + mlp * hidden
    rows = (hidden + 2 * kv) + hidden + 2 * mlp + hidden
    per_layer = linear + 4 * rows + 2 * hidden * 2
    expected = 16 * per_layer + VOCAB * hidden * 2 + hidden * 2
    assert model_bytes("llama-1b", quantization="fp8").weights == expected
    assert model_bytes("llama-1b", kv_cache_dtype="fp8").kv_per_token == 2 * 16 * 8 * 64


def test_moe_dense_part_and_expert_size_by_hand() -> None:
    # qwen3-30b-a3b: 48 layers, hidden 2048, 32 query and 4 KV heads of 128, q/k norms, a
    # 128-expert router, experts of width 768; untied embedding and head.
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048
    dense = 48 * attention + 2 * VOCAB * 2048 + 2048
    bytes_ = model_bytes("qwen3-30b-a3b")
    assert bytes_.dense == 2 * dense == 2_240_180_224
    assert bytes_.expert == 3 * 2048 * 768 * 2  # gate, up and down in bf16: 9 MiB
    assert (bytes_.moe_layers, bytes_.num_experts, bytes_.top_k) == (48, 128, 8)


def test_experts_touched_under_uniform_routing() -> None:
    assert experts_touched(128, 8, 1) == pytest.approx(8.0)  # one token: exactly its top-k
    # Two tokens: each expert is missed by both with probability (120/128)^2.
    assert experts_touched(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert experts_touched(128, 8, 256) == pytest.approx(128.0, abs=1e-4)


def test_moe_step_reads_the_experts_a_batch_touches() -> None:
    bytes_ = model_bytes("qwen3-30b-a3b")
    touched = 128 * (1 - (120 / 128) ** 64)
    kv = 64 * 256 * 98_304
    expected = int(2_240_180_224 + 48 * touched * 9_437_184 + kv)
    assert step_bytes(bytes_, 64, 256.0) == expected


def test_prefill_flops_by_hand() -> None:
    # smollm2-135m: 2 FLOPs per parameter a token passes through (not the tied embedding),
    # plus causal attention: 2 T^2 x head dim per head and layer.
    per_token = 2 * (134_515_008 - VOCAB * 576)
    attention = 2 * 2048**2 * 64 * 9 * 30
    assert prefill_flops("smollm2-135m", 64, 2048) == pytest.approx(
        64 * (2048 * per_token + attention)
    )


def test_moe_prefill_counts_only_the_top_k_experts() -> None:
    expert = 3 * 2048 * 768
    all_params = model_bytes("qwen3-30b-a3b").weights // 2
    active = all_params - 2 * VOCAB * 2048 - 48 * (128 - 8) * expert
    attention = 2 * 100**2 * 128 * 32 * 48
    assert prefill_flops("qwen3-30b-a3b", 1, 100) == pytest.approx(100 * 2 * active + attention)


def test_mxfp4_experts_count_as_held() -> None:
    # gpt-oss-20b: each expert's gate/up (5,760 rows) and down (2,880 rows) over 2,880 inputs
    # in MXFP4, half a byte a value and a one-byte scale per 32, and their bf16 biases.
    rows, inputs = 5760 + 2880, 2880
    assert model_bytes("gpt-oss-20b").expert == rows * inputs // 2 + rows * inputs // 32 + 2 * rows


def test_a_linear_attention_state_is_read_and_written_each_step() -> None:
    # qwen3-next-80b's preset: 18 DeltaNet layers of its 24, each with 32 value heads' 128 x 128
    # states and the convolution's last 3 inputs of 2 x 16 x 128 + 32 x 128 channels, in bf16.
    per_layer = 32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)
    bytes_ = model_bytes("qwen3-next-80b")
    both_ways = 2 * 18 * per_layer * 2
    assert bytes_.state_per_sequence == both_ways
    without = dataclasses.replace(bytes_, state_per_sequence=0)
    assert step_bytes(bytes_, 8, 100.0) - step_bytes(without, 8, 100.0) == 8 * both_ways
