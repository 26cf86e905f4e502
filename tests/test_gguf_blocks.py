"""GGUF block types: the torch reference (engine_core/models/gguf_blocks.py) computes exactly what
gguf-py (and transformers with it) reads from each block type; a tiny Llama with Q4_K and with
Q8_0 weights loads (dequantized at load, which the log says) and gives the greedy tokens of HF
transformers reading the same GGUF file."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine_core.loader import load_model
from engine_core.models.gguf_blocks import BLOCK_TYPES, dequantize
from tests.paged_harness import generate_greedy, hf_greedy
from tests.test_loader import byte_level_tokens, permute_for_gguf

SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6}  # fmt: skip


def random_blocks(type_name: str, count: int, seed: int) -> np.ndarray:
    """``count`` blocks of random bytes whose fp16 fields are modest finite numbers."""
    _, size, _ = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    fp16_fields = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
    for start in fp16_fields[type_name]:
        values = rng.uniform(-0.05, 0.05, count).astype(np.float16)
        blocks[:, start : start + 2] = values.view(np.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_the_reference_reads_blocks_as_gguf_py_does(type_name: str) -> None:
    blocks = random_blocks(type_name, 64, seed=len(type_name))
    qtype = GGMLQuantizationType[type_name]
    expected = gguf_dequantize(blocks, qtype)  # [64, values]
    got = dequantize(torch.from_numpy(blocks), type_name)
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32)))


def test_rows_of_blocks_keep_their_shape() -> None:
    weights = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = gguf_quantize(weights, GGMLQuantizationType.Q8_0)  # [6, 3 * 34]
    got = dequantize(torch.from_numpy(raw), "Q8_0")
    assert got.shape == (6, 96)
    torch.testing.assert_close(got, torch.from_numpy(weights), atol=0.02, rtol=0)
    with pytest.raises(ValueError, match="Q5_K has no reference here"):
        dequantize(torch.from_numpy(raw), "Q5_K")


# ---- a tiny Llama in Q4_K and Q8_0 ---------------------------------------------------------------


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q4_K rows [N, K / 256 * 144]: per 32-value sub-block a 6-bit scale and
    min against the super-block's fp16 d and dmin, nibbles q with x ~ d * sc * q - dmin * m."""
    rows = weight.shape[0]
    x = weight.reshape(-1, 8, 32).astype(np.float32)  # super-blocks of 8 sub-blocks
    low = np.minimum(x.min(-1), 0)
    scale, minimum = (x.max(-1) - low) / 15, -low  # [n, 8]
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-8)[:, None]), 0, 63)
    m = np.clip(np.round(minimum / np.maximum(dmin.astype(np.float32), 1e-8)[:, None]), 0, 63)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.round((x + offset) / np.maximum(step, 1e-8)), 0, 15).astype(np.uint8)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)  # fmt: skip
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk j: sub-blocks 2j, 2j + 1
    head = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8)], 1)
    return np.concatenate([head, scales, qs], axis=1).reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q6_K rows [N, K / 256 * 210]: per 16-value sub-block an int8 scale
    against the super-block's fp16 d, 6-bit q with x ~ d * sc * (q - 32); q's low 4 bits and high
    2 laid out as gguf_blocks.q6_k reads them."""
    rows = weight.shape[0]
    x = weight.reshape(-1, 16, 16).astype(np.float32)  # super-blocks of 16 sub-blocks
    step = np.abs(x).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float32), 1e-8)[:, None]), 1, 127)
    unit = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = np.clip(np.round(x / np.maximum(unit, 1e-8)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, group g of 32, t]
    low, high = q & 0x0F, q >> 4
    # A half's 64 bytes: 0-31 hold groups 0 (low nibble) and 2 (high), 32-63 groups 1 and 3.
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1
    )
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
             d.reshape(-1, 1).view(np.uint8)]  # fmt: skip
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def test_the_q6_k_writer_s_rows_come_back_near_the_weights() -> None:
    weights = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32) * 0.1
    got = dequantize(torch.from_numpy(quantize_q6_k(weights)), "Q6_K")
    torch.testing.assert_close(got, torch.from_numpy(weights), atol=0.01, rtol=0)


# Block types the tests quantize themselves (gguf-py quantizes neither).
TEST_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def write_gguf(path: Path, qtype: GGMLQuantizationType) -> dict[str, np.ndarray]:
    """A random 2-layer Llama (tied embeddings) whose matrices are ``qtype`` blocks; the
    embedding (and norms) float32, as a small llama.cpp file may keep them. Returns the
    matrices' raw blocks by GGUF name."""
    return write_typed_gguf(path, lambda name: None if name == "token_embd.weight" else qtype)


def write_typed_gguf(
    path: Path, type_of: Callable[[str], GGMLQuantizationType | None]
) -> dict[str, np.ndarray]:
    """``write_gguf`` with each matrix in the block type ``type_of`` gives its GGUF name (None:
    float32); norms float32."""
    tokens = [*byte_level_tokens(), "hi", "ih", "<s>", "</s>"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES, vocab_size=len(tokens), tie_word_embeddings=True))
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.1)
    writer = GGUFWriter(str(path), "llama")
    add_metadata(writer, tokens)
    raw = {}
    for name, array in llama_tensors(model.state_dict()):
        qtype = None if array.ndim == 1 else type_of(name)
        if qtype is None:
            writer.add_tensor(name, array)
            continue
        quantize = TEST_QUANTIZERS.get(qtype.name)
        raw[name] = quantize(array) if quantize else gguf_quantize(array, qtype)
        writer.add_tensor(name, raw[name], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw


def add_metadata(writer: GGUFWriter, tokens: list[str]) -> None:
    writer.add_context_length(SIZES["max_position_embeddings"])
    writer.add_embedding_length(SIZES["hidden_size"])
    writer.add_block_count(SIZES["num_hidden_layers"])
    writer.add_feed_forward_length(SIZES["intermediate_size"])
    writer.add_head_count(SIZES["num_attention_heads"])
    writer.add_head_count_kv(SIZES["num_key_value_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(SIZES["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    # Two merges: transformers 5.17 reads a one-element array back as a lone string.
    writer.add_token_merges(["h i", "i h"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)


# HF name in a decoder layer -> llama.cpp's (q and k apart: their rows are permuted).
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray]]:
    """HF Llama tensors under llama.cpp's names, q/k rows in its rotary order."""
    heads, kv = SIZES["num_attention_heads"], SIZES["num_key_value_heads"]
    out = [("token_embd.weight", state["model.embed_tokens.weight"].numpy())]
    for i in range(SIZES["num_hidden_layers"]):
        get = {name.removeprefix(f"model.layers.{i}.").removesuffix(".weight"): t.numpy()
               for name, t in state.items() if name.startswith(f"model.layers.{i}.")}  # fmt: skip
        out += [(f"blk.{i}.{g}.weight", get[h]) for h, g in GGUF_NAMES.items()]
        out.append((f"blk.{i}.attn_q.weight", permute_for_gguf(get["self_attn.q_proj"], heads)))
        out.append((f"blk.{i}.attn_k.weight", permute_for_gguf(get["self_attn.k_proj"], kv)))
    return [*out, ("output_norm.weight", state["model.norm.weight"].numpy())]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0])
def test_a_gguf_model_gives_hf_gguf_greedy_tokens(
    qtype: GGMLQuantizationType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny.{qtype.name}.gguf"
    raw = write_gguf(path, qtype)
    with caplog.at_level(logging.INFO, logger="engine_core.model_dir"):
        ours = load_model(str(path), torch.device("cpu"), torch.float32).module
    assert "dequantized to float32 at load" in caplog.text and f"{qtype.name} 14" in caplog.text
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    # The reference reads the blocks as gguf_blocks does (v_proj's rows are not permuted).
    v_proj = dequantize(torch.from_numpy(raw["blk.0.attn_v.weight"]), qtype.name)
    assert torch.equal(v_proj, reference.model.layers[0].self_attn.v_proj.weight)
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    got = generate_greedy(ours, [prompt], 12)
    ref = hf_greedy(reference, prompt, 12)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=1e-4, rtol=0)
