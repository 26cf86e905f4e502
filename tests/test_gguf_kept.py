"""GGUF weights kept in their blocks (engine_core/models/gguf.py), on the CPU through the blocks'
torch reference (``load_model(keep_gguf_blocks=True)``; CUDA keeps them by default).

A tiny Llama written by gguf's writer mixes the types: q Q4_0, k Q4_1, v Q8_0 (a merged qkv of
three types), gate and up Q4_1, down Q8_0, the output projection Q4_K, layer 1's down Q6_K and
v Q5_0 (no kernel: its whole qkv read as floats), and a Q8_0 token embedding tied to the LM
head. Expectations come from gguf-py (the file's raw rows, HF transformers reading the file).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine_core.loader import load_model
from engine_core.memory_plan import module_bytes
from engine_core.model_dir import GGUF_BLOCKS_FILE, convert_gguf_cached, default_gguf_path
from engine_core.models.gguf import KERNEL_TYPES, dequantize
from engine_core.models.gguf_layers import GgufEmbedding
from engine_core.models.layers import Linear
from tests.paged_harness import generate_greedy, hf_greedy
from tests.test_gguf_blocks import SIZES, write_typed_gguf
from tests.test_loader import permute_for_gguf

# llama.cpp's tensor name in a layer -> its block type (layer 1's attn_v: TYPES_LAYER_1).
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_K",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}  # fmt: skip
TYPES_LAYER_1 = {**TYPES, "attn_v": "Q5_0", "ffn_down": "Q6_K"}


def block_type(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "Q8_0"
    layer, kind = gguf_name.split(".")[1:3]
    return (TYPES_LAYER_1 if layer == "1" else TYPES)[kind]


def write_mixed_gguf(path: Path) -> dict[str, np.ndarray]:
    """The tiny Llama with the types above; returns each quantized tensor's raw rows."""
    return write_typed_gguf(path, lambda name: GGMLQuantizationType[block_type(name)])


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.mixed.gguf"
    return path, write_mixed_gguf(path)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def test_the_converted_folder_keeps_the_raw_rows_of_the_types_with_a_kernel(
    mixed_gguf: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, raw = mixed_gguf
    with safe_open(str(convert_gguf_cached(path) / GGUF_BLOCKS_FILE), framework="pt") as f:
        kept = {name: f.get_tensor(name).numpy() for name in f.keys()}  # noqa: SIM118
    heads, kv = SIZES["num_attention_heads"], SIZES["num_key_value_heads"]
    # llama.cpp permuted q/k rows; transformers un-permutes them, so the kept rows are un-permuted.
    unpermute = {"attn_q": heads, "attn_k": kv}
    expected = {}
    for name, rows in raw.items():
        if block_type(name) not in KERNEL_TYPES:
            continue
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in unpermute:  # permuting twice with the rows' halves swapped back undoes it
            rows = unpermute_rows(rows, unpermute[kind])
        expected[hf_name(name)] = rows
    assert sorted(kept) == sorted(expected)
    for name, rows in expected.items():
        assert np.array_equal(kept[name], rows), name


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """``permute_for_gguf``'s inverse on whole rows (raw blocks move with their rows)."""
    order = np.arange(rows.shape[0])
    permuted = permute_for_gguf(order[:, None], heads)[:, 0]
    return rows[np.argsort(permuted)]


HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}  # fmt: skip


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[kind]}.weight"


@pytest.fixture(scope="module")
def hf_reference(mixed_gguf: tuple[Path, dict[str, np.ndarray]]) -> torch.nn.Module:
    path, _ = mixed_gguf
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_kept_planes_dequantize_to_gguf_py_s_values_and_the_tokens_are_hf_s(
    mixed_gguf: tuple[Path, dict[str, np.ndarray]],
    hf_reference: torch.nn.Module,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, _ = mixed_gguf
    with caplog.at_level(logging.INFO):
        ours = load_model(str(path), "cpu", torch.float32, keep_gguf_blocks=True).module
    assert "read as floats: 1 ['model.layers.1.self_attn.qkv_proj']" in caplog.text
    assert "without a kernel are read dequantized: F32 5, Q5_0 1" in caplog.text
    reference = dict(hf_reference.named_parameters())
    layers = ours.model.layers
    kept = {
        "model.layers.0.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "model.layers.0.mlp.gate_up_proj": ("gate_proj", "up_proj"),
        "model.layers.0.mlp.down_proj": ("down_proj",),
        "model.layers.0.self_attn.o_proj": ("o_proj",),
        "model.layers.1.mlp.gate_up_proj": ("gate_proj", "up_proj"),
        "model.layers.1.self_attn.o_proj": ("o_proj",),
        "model.layers.1.mlp.down_proj": ("down_proj",),
    }
    for name, parts in kept.items():
        module = ours.get_submodule(name)
        assert isinstance(module, Linear) and module.gguf is not None, name
        held = torch.cat([dequantize(planes) for _, planes in module.gguf_planes()])
        parent = name.rpartition(".")[0]
        expected = torch.cat([reference[f"{parent}.{part}.weight"] for part in parts])
        assert torch.equal(held, expected), name
    assert layers[1].self_attn.qkv_proj.gguf is None  # a Q5_0 part: all floats
    embed = ours.model.embed_tokens
    assert isinstance(embed, GgufEmbedding)
    ids = torch.arange(embed.vocab_size)
    assert torch.equal(embed(ids), reference["model.embed_tokens.weight"])
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    got = generate_greedy(ours, [prompt], 12)
    ref = hf_greedy(hf_reference, prompt, 12)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=1e-4, rtol=0)


def test_the_cpu_serves_the_floats_unless_asked(
    mixed_gguf: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, _ = mixed_gguf
    ours = load_model(str(path), "cpu", torch.float32).module
    assert not any(isinstance(m, Linear) and m.gguf is not None for m in ours.modules())
    assert isinstance(ours.model.embed_tokens, torch.nn.Embedding)


def test_the_default_model_holds_the_file_s_block_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its kept bytes are the file's bytes of the tensors of the types with a kernel; the ratio of
    its weights to bf16's is printed (tests/test_gguf_gpu.py prints it on CUDA)."""
    monkeypatch.delenv("TANDEM_CACHE_DIR")  # the default model's shared conversion
    model = load_model("default", "cpu", torch.float32, keep_gguf_blocks=True).module
    reader = GGUFReader(str(default_gguf_path()))
    file_blocks = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name in KERNEL_TYPES)
    held = [m.gguf_blocks for m in model.modules() if getattr(m, "gguf", None) is not None]
    assert sum(t.numel() for t in held) == file_blocks
    bf16 = 2 * sum(int(np.prod(t.shape)) for t in reader.tensors)
    print(f"default model: {module_bytes(model) / bf16:.4f}x of bf16's {bf16} bytes")
