"""The loader: how model strings resolve, the GGUF conversion cache, config mapping, errors.

GGUF behaviour is tested on a tiny GGUF written here with the ``gguf`` package (Q8_0 matrices,
q/k permuted the way llama.cpp's converter does), so the full conversion runs in well under a
second; the embedded default model is covered in test_default_model.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine_core.loader import CheckpointError, iter_checkpoint, load_model, load_model_config
from engine_core.model_dir import gguf_cache_dir, resolve_model_dir
from engine_core.models import model_config_from_hf
from engine_core.presets import PRESETS
from tests.factories import write_tiny_llama
from tests.paged_harness import generate_greedy, hf_greedy

CPU = torch.device("cpu")

TINY_LLAMA = {
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}


# ---------------------------------------------------------------------------------------------
# Resolution rules and errors


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_local_folder_resolves_to_itself(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "model", {"architectures": ["LlamaForCausalLM"]})
    assert resolve_model_dir(str(folder)) == folder


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model.gguf", "~/no-such-dir/x"])
def test_missing_path_is_a_clear_error(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_dir(name)


def test_plain_file_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="neither a model folder nor a .gguf"):
        resolve_model_dir(str(path))


def test_unreachable_hub_id_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Offline mode and an empty hub cache: the answer is the same with or without a network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError, match="could not get 'tandem-tests/no-such-model'"):
        resolve_model_dir("tandem-tests/no-such-model")


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    folder = write_config(tmp_path, {"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    with pytest.raises(ValueError, match="BertForMaskedLM") as info:
        load_model(str(folder), CPU, torch.float32)
    for supported in ("LlamaForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"):
        assert supported in str(info.value)


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig (expectations written out by hand from the published configs)


def test_llama31_config_with_generation_eos_list(tmp_path: Path) -> None:
    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": rope,
        "bos_token_id": 128000,
        "eos_token_id": 128009,
    }
    write_config(tmp_path, hf)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128008, 128009]})
    )
    config = load_model_config(tmp_path)
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("llama", 128, 8)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == rope
    assert config.eos_token_ids == (128009, 128001, 128008)
    assert config.bos_token_id == 128000
    assert not (config.attention_bias or config.qk_norm or config.tie_word_embeddings)
    assert config.sliding_window is None


def test_transformers5_rope_parameters_layout_and_model_type_fallback() -> None:
    hf = {
        **TINY_LLAMA,
        "model_type": "llama",
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    }
    config = model_config_from_hf(hf)
    assert (config.rope_theta, config.rope_scaling) == (100000.0, None)


def test_qwen2_gets_qkv_bias_and_no_window_unless_enabled() -> None:
    hf = {**TINY_LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768}
    config = model_config_from_hf(hf)
    assert config.attention_bias and not config.qk_norm
    assert config.sliding_window is None  # use_sliding_window is false by default
    windowed = model_config_from_hf({**hf, "use_sliding_window": True, "max_window_layers": 0})
    assert windowed.sliding_window == 32768
    with pytest.raises(ValueError, match="only some layers"):
        model_config_from_hf({**hf, "use_sliding_window": True, "max_window_layers": 1})


def test_qwen3_gets_qk_norm_and_explicit_head_dim() -> None:
    hf = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    config = model_config_from_hf(hf)
    assert config.qk_norm and not config.attention_bias
    assert config.head_dim == 32  # not hidden_size // heads == 16


def test_mistral_keeps_its_sliding_window() -> None:
    hf = {**TINY_LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert model_config_from_hf(hf).sliding_window == 4096


def test_gpt2_config() -> None:
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "n_inner": None,
        "activation_function": "gelu_new",
        "eos_token_id": 50256,
    }
    config = model_config_from_hf(hf)
    assert config.architecture == "gpt2"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (12, 12, 64)
    assert config.intermediate_size == 3072
    assert config.tie_word_embeddings and config.hidden_act == "gelu_new"
    assert config.eos_token_ids == (50256,)


def test_unsupported_rope_type_is_rejected() -> None:
    hf = {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "dynamic"}}
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        model_config_from_hf(hf)


def test_yarn_without_its_original_length_is_rejected() -> None:
    hf = {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "yarn"}}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        model_config_from_hf(hf)


# ---------------------------------------------------------------------------------------------
# pytorch_model.bin


def save_tiny_llama(folder: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_pytorch_bin_loads_like_safetensors(tmp_path: Path, zip_format: bool) -> None:
    """A .bin in torch's zip format (memory-mapped) or its legacy one (torch.save before 1.6:
    read whole) holds the safetensors' weights."""
    hf_model = save_tiny_llama(tmp_path / "st")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    state = hf_model.state_dict()
    torch.save(state, bin_dir / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
    from_st = load_model(str(tmp_path / "st"), CPU, torch.float32).module.state_dict()
    from_bin = load_model(str(bin_dir), CPU, torch.float32).module.state_dict()
    assert from_st.keys() == from_bin.keys()
    for name in from_st:
        assert torch.equal(from_st[name], from_bin[name]), name


class NotATensor:
    """Unpickling this would run arbitrary code paths; weights_only must refuse it."""


def test_pytorch_bin_with_objects_is_refused(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin cannot be read") as refused:
        load_model(str(tmp_path), CPU, torch.float32)
    assert isinstance(refused.value.__cause__, pickle.UnpicklingError)


@pytest.mark.parametrize(
    ("damage", "file"),
    [
        ("header", "model.safetensors"),
        ("cut", "model.safetensors"),
        ("garbage", "pytorch_model.bin"),
        ("cut", "pytorch_model.bin"),
    ],
)
def test_a_damaged_weights_file_is_named_in_a_value_error(
    tmp_path: Path, damage: str, file: str
) -> None:
    """A corrupt header, a file cut short or one that is no weights file at all: a
    CheckpointError (a ValueError: the CLIs print it as one line) naming the file."""
    hf_model = save_tiny_llama(tmp_path)
    path = tmp_path / file
    if file.endswith(".bin"):
        (tmp_path / "model.safetensors").unlink()
        torch.save(hf_model.state_dict(), path)
    data = path.read_bytes()
    damaged = {
        "header": b"\xff" * 8 + data[8:],
        "cut": data[: len(data) // 2],
        "garbage": b"these are not the weights you are looking for" * 100,
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError, match=f"{file} cannot be read"):
        load_model(str(tmp_path), CPU, torch.float32)


@pytest.mark.parametrize("where", ["", "text_config."])
@pytest.mark.parametrize("value", ["gptq", [1, 2], 3])
def test_a_quantization_config_that_is_no_object_is_refused(
    tmp_path: Path, where: str, value: object
) -> None:
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    section = config.setdefault("text_config", {}) if where else config
    section["quantization_config"] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{where}quantization_config must be a JSON object"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_a_config_json_that_is_no_object_is_refused(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json holds a JSON list, not an object"):
        load_model(str(tmp_path), CPU, torch.float32)


# ---------------------------------------------------------------------------------------------
# GGUF conversion and its cache


def byte_level_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one printable character per byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    unprintable = 256 - len(printable)
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(unprintable)]


def permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves); transformers undoes it on load."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path) -> LlamaForCausalLM:
    """A 2-layer Llama with GQA and tied embeddings as GGUF; returns the source HF model."""
    tokens = [*byte_level_tokens(), "hi", "ih", "<s>", "</s>"]
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": len(tokens)}, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.1)
    writer = GGUFWriter(str(path), "llama")
    add_gguf_metadata(writer, tokens)
    for name, array in gguf_tensors(model.state_dict()):
        # Matrices quantized as Q8_0 (so dequantization runs), norms kept float32 as llama.cpp does.
        qtype = GGMLQuantizationType.Q8_0 if array.ndim == 2 else None
        writer.add_tensor(name, array if qtype is None else quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def add_gguf_metadata(writer: GGUFWriter, tokens: list[str]) -> None:
    writer.add_name("tiny llama")
    writer.add_context_length(64)
    writer.add_embedding_length(TINY_LLAMA["hidden_size"])
    writer.add_block_count(TINY_LLAMA["num_hidden_layers"])
    writer.add_feed_forward_length(TINY_LLAMA["intermediate_size"])
    writer.add_head_count(TINY_LLAMA["num_attention_heads"])
    writer.add_head_count_kv(TINY_LLAMA["num_key_value_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    # Two merges: transformers 5.17 reads a one-element array back as a lone string.
    writer.add_token_merges(["h i", "i h"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)


def gguf_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray]]:
    heads, kv = TINY_LLAMA["num_attention_heads"], TINY_LLAMA["num_key_value_heads"]
    get = lambda name: state[name].float().numpy()  # noqa: E731
    out = [("token_embd.weight", get("model.embed_tokens.weight"))]
    for i in range(TINY_LLAMA["num_hidden_layers"]):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        out += [
            (blk + "attn_norm.weight", get(hf + "input_layernorm.weight")),
            (blk + "attn_q.weight", permute_for_gguf(get(hf + "self_attn.q_proj.weight"), heads)),
            (blk + "attn_k.weight", permute_for_gguf(get(hf + "self_attn.k_proj.weight"), kv)),
            (blk + "attn_v.weight", get(hf + "self_attn.v_proj.weight")),
            (blk + "attn_output.weight", get(hf + "self_attn.o_proj.weight")),
            (blk + "ffn_norm.weight", get(hf + "post_attention_layernorm.weight")),
            (blk + "ffn_gate.weight", get(hf + "mlp.gate_proj.weight")),
            (blk + "ffn_up.weight", get(hf + "mlp.up_proj.weight")),
            (blk + "ffn_down.weight", get(hf + "mlp.down_proj.weight")),
        ]
    return [*out, ("output_norm.weight", get("model.norm.weight"))]


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(root))
    return root


@pytest.fixture
def tiny_gguf_and_source(tmp_path: Path) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path / "gguf" / "tiny-llama.Q8_0.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path)


@pytest.fixture
def tiny_gguf(tiny_gguf_and_source: tuple[Path, LlamaForCausalLM]) -> Path:
    return tiny_gguf_and_source[0]


def test_gguf_converts_to_a_folder_that_matches_hf_gguf_loading(
    tiny_gguf_and_source: tuple[Path, LlamaForCausalLM], cache_root: Path
) -> None:
    tiny_gguf, source = tiny_gguf_and_source
    folder = resolve_model_dir(str(tiny_gguf))
    assert folder.parent == cache_root and folder.name.startswith("tiny-llama.Q8_0-")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert AutoTokenizer.from_pretrained(folder)("hi").input_ids[-1] == 256  # the "h i" merge
    config = load_model_config(folder)
    assert (config.eos_token_ids, config.bos_token_id, config.num_kv_heads) == ((259,), 258, 2)

    # Against the weights before GGUF: equal up to Q8_0 rounding (|w| < 0.6, so error < 0.003),
    # which also shows the q/k rows came back in HF order.
    source_state = source.state_dict()
    converted = dict(iter_checkpoint(folder))
    assert converted.keys() == source_state.keys() - {"lm_head.weight"}
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, source_state[name], atol=0.005, rtol=0)

    # Reference: transformers reading the GGUF itself (its own dequantization and q/k unpermute).
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    ours = load_model(str(tiny_gguf), CPU, torch.float32).module
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    got = generate_greedy(ours, [prompt], 16)
    ref = hf_greedy(reference, prompt, 16)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=1e-4, rtol=0)


def test_second_resolve_reuses_the_cache(tiny_gguf: Path, cache_root: Path) -> None:
    first = resolve_model_dir(str(tiny_gguf))
    weights = first / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    second = resolve_model_dir(str(tiny_gguf))
    assert second == first
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == before  # nothing rewritten
    assert sorted(p.name for p in cache_root.iterdir()) == [first.name]  # no temp leftovers


def test_changed_gguf_gets_a_new_cache_entry(tiny_gguf: Path, cache_root: Path) -> None:
    before = gguf_cache_dir(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_cache_dir(tiny_gguf) != before
    assert gguf_cache_dir(tiny_gguf).parent == cache_root


def test_failed_conversion_leaves_no_cache(tmp_path: Path, cache_root: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(Exception):  # noqa: B017 (the gguf reader's error type is not ours)
        resolve_model_dir(str(broken))
    assert list(cache_root.iterdir()) == []


def test_default_model_resolves_to_its_cache(default_model_dir: Path) -> None:
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model_dir("default") == default_model_dir
    assert weights.stat().st_mtime_ns == before


# ---- random:<preset> benchmark models ---------------------------------------------------------


def test_a_random_model_needs_no_model_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine processes and tensor-parallel workers build `random:` models where only benchmarks
    run and the default model (whose tokenizer the presets borrow) may be absent: building one
    must not resolve any folder."""
    import engine_core.loader as loader

    def no_folders(model: str) -> Path:
        raise AssertionError(f"resolved {model!r} to build a random model")

    monkeypatch.setattr(loader, "resolve_model_dir", no_folders)
    monkeypatch.delenv("TANDEM_TOKENIZER_DIR", raising=False)
    loaded = loader.load_model("random:gpt2", "cpu", torch.float32)
    assert loaded.model_dir is None and loaded.config.vocab_size == 49152


def test_the_offline_llm_finds_the_tokenizer_of_a_random_model(default_model_dir: Path) -> None:
    from engine_core.llm import LLM

    llm = LLM("random:gpt2", device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)
    ids = llm.tokenizer("The capital of France is")["input_ids"]
    assert (
        ids
        == AutoTokenizer.from_pretrained(str(default_model_dir))("The capital of France is")[
            "input_ids"
        ]
    )


def test_building_a_model_does_not_import_dynamo(tmp_path: Path) -> None:
    """Building a model imports no torch._dynamo (about 0.7 s of CPU a process): in a fresh
    interpreter, a tiny Llama checkpoint loaded (built on the meta device, given memory, its
    buffers recomputed, its weights read) and every preset built on the meta device, each
    architecture's constructors with their init fills and computed buffers."""
    write_tiny_llama(tmp_path, vocab_size=49152)
    script = (
        "import sys\n"
        "import torch\n"
        "from engine_core.loader import load_model\n"
        "from engine_core.models import build_model\n"
        "from engine_core.models.meta_build import meta_build\n"
        "from engine_core.presets import PRESETS\n"
        f"load_model({str(tmp_path)!r}, torch.device('cpu'), torch.float32)\n"
        "for config in PRESETS.values():\n"
        "    with meta_build(torch.bfloat16):\n"
        "        build_model(config)\n"
        "print(len(PRESETS), sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"{len(PRESETS)} []", done.stdout


def test_the_default_models_conversion_is_shared_by_every_install_of_its_package(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh environment (another venv, a clean clone's) installs the same package version at
    another path: ``--model default`` there must find the folder converted for the first one
    (here, a folder made to stand for it), not convert again; a file of our own at another path
    is keyed by its path."""
    from engine_core import model_dir

    installed = model_dir.default_gguf_path()
    converted = gguf_cache_dir(installed, model_dir.installed_identity(installed))
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    elsewhere = tmp_path / "another-venv" / installed.name
    elsewhere.parent.mkdir()
    shutil.copyfile(installed, elsewhere)  # the same bytes under another path
    monkeypatch.setattr(model_dir, "default_gguf_path", lambda: elsewhere)
    assert resolve_model_dir("default") == converted
    assert gguf_cache_dir(elsewhere) != gguf_cache_dir(installed)  # path-keyed: not shared


def test_the_clis_name_a_damaged_weights_file_in_one_line(tmp_path: Path) -> None:
    """`tandem generate` on a folder whose safetensors file was cut short: exit 2 and one line
    naming the file, no traceback (`tandem engine` and `tandem serve` print it the same way:
    engine_cli.py catches the same ValueError)."""
    save_tiny_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    cli = [sys.executable, "-m", "frontend.cli", "generate", "--model", str(tmp_path)]
    run = subprocess.run([*cli, "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"tandem generate: {weights} cannot be read as safetensors")
