"""Read a model's config, build our implementation and load its weights; the files a
``model`` string names are found by engine_core/model_dir.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine_core.config import Fp8Config, ModelConfig
from engine_core.embedding import embedding_model, st_max_seq_length
from engine_core.model_dir import GGUF_BLOCKS_FILE, RANDOM_PREFIX, resolve_model_dir
from engine_core.models import build_model, finish_loading, model_config_from_hf, token_ids
from engine_core.models.fp8 import check_fp8_block_on_device, check_fp8_device
from engine_core.models.layers import reset_buffers
from engine_core.models.meta_build import materialize, meta_build
from engine_core.models.quant_config import with_quantization_flag
from engine_core.models.quantize import gguf_block_names
from engine_core.models.target import BuildTarget
from engine_core.parallel import get_tp_group

logger = logging.getLogger(__name__)


# Called with the model built on the meta device (nothing allocated yet) and its config; raises
# to stop the load (engine_core/memory_plan.py: does it fit?).
FitCheck = Callable[[nn.Module, ModelConfig], None]


@dataclass
class LoadedModel:
    module: nn.Module
    config: ModelConfig
    model_dir: Path | None  # the checkpoint's folder (its tokenizer too); None for random weights
    # layer -> (K scale, V scale) of an FP8 KV cache, where the checkpoint has them.
    kv_scales: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)


def load_model(
    model: str,
    device: torch.device | str,
    dtype: torch.dtype,
    quantization: str | None = None,
    check_fit: FitCheck | None = None,
    target: BuildTarget | None = None,
    runner: str = "auto",
    keep_gguf_blocks: bool | None = None,
) -> LoadedModel:
    """Resolve ``model``, build our implementation on ``device`` in ``dtype``, load its weights.

    ``quantization`` is ``--quantization`` ('fp8': quantize plain weights as they load; FP8
    checkpoints are FP8 without it). ``random:<preset>`` (see engine_core/presets.py) builds a
    benchmark model of real shape with random weights instead. ``check_fit`` sees the model
    built on the meta device, before anything is allocated on ``device``. ``target``: the model
    is built and loaded in its final form for serving there (models/target.py); None keeps
    the plain form. ``runner`` is ``--runner``: whether the model embeds (its config's
    ``embedding``, engine_core/embedding.py) or generates. ``keep_gguf_blocks``: whether a
    GGUF model's layers hold its blocks (None: on CUDA only; tests run the blocks' reference on
    the CPU with True).
    """
    if model.startswith(RANDOM_PREFIX):
        name = model.removeprefix(RANDOM_PREFIX)
        return load_random_model(name, device, dtype, quantization, check_fit, target, runner)
    model_dir = resolve_model_dir(model)
    config = with_quantization(load_model_config(model_dir), quantization, device)
    embedding = embedding_model(runner, model_dir, config)
    max_input = st_max_seq_length(model_dir) if embedding is not None else None
    config = dataclasses.replace(config, embedding=embedding, max_input_tokens=max_input)
    config = with_gguf_blocks(config, model_dir, device, keep_gguf_blocks)
    # Built on the meta device, so no time goes into random init of weights about to be replaced.
    with meta_build(dtype):
        module = build_model(config, target)
    if check_fit is not None:
        check_fit(module, config)
    materialize(module, device)
    reset_buffers(module)
    kv_scales: dict[int, tuple[float, float]] = {}
    weights = checkpoint_with_gguf_blocks(model_dir, gguf_block_names(module, config))
    module.load_weights(take_kv_scales(normalize_fp8_names(weights), kv_scales))
    module.eval().requires_grad_(False)
    finish_loading(module, target)
    return LoadedModel(module, config, model_dir, kv_scales=kv_scales_by_layer(kv_scales, config))


def with_quantization(
    config: ModelConfig, quantization: str | None, device: torch.device | str
) -> ModelConfig:
    """``config`` with ``--quantization`` merged in; FP8 refused on a GPU without it."""
    quant = with_quantization_flag(config.quantization, quantization)
    if isinstance(quant, Fp8Config):
        check_fp8_device(torch.device(device), f"FP8 weights ({quant.source})")
        check_fp8_block_on_device(quant, torch.device(device))
    return dataclasses.replace(config, quantization=quant)


def with_gguf_blocks(
    config: ModelConfig, model_dir: Path, device: torch.device | str, keep: bool | None
) -> ModelConfig:
    """``config`` with the GGUF block types of a converted GGUF folder's kept tensors, for its
    layers to hold them (engine_core/models/gguf.py): on CUDA unless ``keep`` says otherwise, for
    dense models of Llama's layout at one tensor-parallel rank (a mixture of experts' stacked
    experts have no GGUF kernel); elsewhere the folder's floats."""
    if not (torch.device(device).type == "cuda" if keep is None else keep):
        return config
    types = gguf_block_types(model_dir)
    if not types:
        return config
    plain = config.quantization is None and config.vision is None and config.embedding is None
    dense = config.architecture == "llama" and not config.num_experts
    if not dense or not plain or get_tp_group().size > 1:
        logger.info("GGUF blocks are kept for dense Llama-layout text models at one "
                    "tensor-parallel rank; this one reads them dequantized")  # fmt: skip
        return config
    return dataclasses.replace(config, gguf_blocks=tuple(sorted(types.items())))


def gguf_block_types(model_dir: Path) -> dict[str, str]:
    """HF tensor name -> GGUF block type of the raw blocks a converted GGUF folder keeps; the
    tensors of the file's other types are logged as read dequantized."""
    path = model_dir / GGUF_BLOCKS_FILE
    if not path.is_file():
        return {}
    with open_safetensors(path) as f:
        metadata = f.metadata() or {}
    others = json.loads(metadata.get("gguf_dequantized", "{}"))
    counts = ", ".join(f"{name} {count}" for name, count in others.items())
    logger.info("GGUF tensors of types without a kernel are read dequantized: %s", counts or "none")
    return json.loads(metadata.get("gguf_types", "{}"))


def checkpoint_with_gguf_blocks(
    model_dir: Path, kept: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors, those in ``kept`` as their raw GGUF blocks instead of floats."""
    floats = iter_checkpoint(model_dir, skip=kept)
    if not kept:
        return floats
    return chain(floats, iter_safetensors(model_dir / GGUF_BLOCKS_FILE, sorted(kept)))


# Where checkpoints from before transformers' quantization_config keep it (AutoGPTQ, AutoAWQ).
QUANT_SIDECARS = ("quantize_config.json", "quant_config.json")


def load_random_model(
    preset: str,
    device: torch.device | str,
    dtype: torch.dtype,
    quantization: str | None = None,
    check_fit: FitCheck | None = None,
    target: BuildTarget | None = None,
    runner: str = "auto",
) -> LoadedModel:
    from engine_core.presets import PRESETS, build_random_model

    if quantization == "fp8":
        check_fp8_device(torch.device(device), f"--quantization {quantization}")
    # A preset is a causal LM: it embeds only when asked to (--runner pooling).
    embedding = embedding_model(runner, None, PRESETS[preset]) if preset in PRESETS else None
    module, config = build_random_model(
        preset,
        device,
        dtype,
        quantization=quantization,
        check_fit=check_fit,
        target=target,
        embedding=embedding,
    )
    # No folder: an engine process (or a tensor-parallel worker) never needs a tokenizer, and the
    # default model's, which random presets borrow, may be absent where only benchmarks run.
    return LoadedModel(module=module, config=config, model_dir=None)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def peek_model_config(model: str) -> ModelConfig | None:
    """The model's config without its weights (None for an unknown preset: the load says why)."""
    if model.startswith(RANDOM_PREFIX):
        from engine_core.presets import PRESETS

        return PRESETS.get(model.removeprefix(RANDOM_PREFIX))
    return load_model_config(resolve_model_dir(model))


def load_model_config(model_dir: Path) -> ModelConfig:
    """ModelConfig from config.json, with stop ids merged from generation_config.json and the
    quantization config from a ``quantize_config.json`` beside it where config.json has none
    (older AutoGPTQ and AutoAWQ checkpoints keep it there)."""
    hf = read_json(model_dir / "config.json")
    check_quantization_objects(hf)
    if not (hf.get("quantization_config") or hf.get("compression_config")):
        for name in QUANT_SIDECARS:
            if (model_dir / name).is_file():
                hf["quantization_config"] = read_json(model_dir / name)
                break
    config = model_config_from_hf(hf)
    generation = model_dir / "generation_config.json"
    gen = read_json(generation) if generation.is_file() else {}
    eos = tuple(dict.fromkeys(config.eos_token_ids + token_ids(gen.get("eos_token_id"))))
    bos = config.bos_token_id if config.bos_token_id is not None else gen.get("bos_token_id")
    return dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` (a ValueError naming it where the file holds another
    value)."""
    with path.open(encoding="utf-8") as f:
        value = json.load(f)
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def check_quantization_objects(hf: dict[str, Any]) -> None:
    """config.json's quantization settings (its own and its text model's) are JSON objects
    where they are given: every reader asks them for their method."""
    sections = [("", hf)]
    if isinstance(hf.get("text_config"), dict):
        sections.append(("text_config.", hf["text_config"]))
    for where, section in sections:
        for key in ("quantization_config", "compression_config"):
            value = section.get(key)
            if value is not None and not isinstance(value, dict):
                raise ValueError(
                    f"config.json: {where}{key} must be a JSON object, not a "
                    f"{type(value).__name__} ({value!r:.60})"
                )


# ---------------------------------------------------------------------------------------------
# Checkpoint reading


def iter_checkpoint(
    model_dir: Path, skip: set[str] | frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor in the folder's safetensors (or .bin) files, but
    those named in ``skip`` (of safetensors: read elsewhere)."""
    files = checkpoint_files(model_dir, "model.safetensors.index.json", "*.safetensors")
    files = [file for file in files if file.name != GGUF_BLOCKS_FILE]
    if files:
        for file in files:
            yield from iter_safetensors(file, None, skip)
        return
    files = checkpoint_files(model_dir, "pytorch_model.bin.index.json", "pytorch_model*.bin")
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors or pytorch_model.bin weights")
    for file in files:
        yield from load_bin(file).items()


def load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model*.bin's tensors: memory-mapped where the file is torch's zip format,
    read whole where it is the legacy one (torch.save before torch 1.6), which cannot be
    mapped. weights_only: a .bin is a pickle, and only plain tensors may come out of it."""
    mmap = zipfile.is_zipfile(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except MemoryError:
        raise
    except Exception as exc:  # the unpickler fails on garbage in any number of ways
        # Its first line: torch's advice that follows (weights_only=False) is not ours to give.
        lines = str(exc).strip().splitlines()
        reason = lines[0] if lines else type(exc).__name__
        raise CheckpointError(f"{file} cannot be read as PyTorch weights: {reason}") from exc


class CheckpointError(ValueError):
    """A weights file that cannot be read (corrupt, cut short, not what its name says)."""


def iter_safetensors(
    file: Path, names: list[str] | None, skip: set[str] | frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of ``names`` (None: all) in ``file``, but those in ``skip``."""
    with open_safetensors(file) as f:
        for name in names if names is not None else list(f.keys()):
            if name not in skip:
                yield name, f.get_tensor(name)


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)``, whose errors (a corrupt header, a file cut short) are a
    CheckpointError naming the file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointError(f"{file} cannot be read as safetensors: {exc}") from exc


# A checkpoint's FP8 K/V scale names: compressed-tensors' self_attn.k_scale, and the older
# k_proj.output_scale.
_KV_SCALE = re.compile(
    r".*layers\.(\d+)\.self_attn\.(k_scale|v_scale|k_proj\.output_scale|v_proj\.output_scale)"
)


def normalize_fp8_names(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The block-wise FP8 format names its weight scales ``weight_scale_inv`` (they multiply,
    despite the name); ours are ``weight_scale``, as compressed-tensors names them."""
    for name, tensor in weights:
        yield name.removesuffix("_inv") if name.endswith(".weight_scale_inv") else name, tensor


def take_kv_scales(
    weights: Iterator[tuple[str, torch.Tensor]], into: dict[tuple[int, str], float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the model's tensors on; keep FP8 K/V cache scales in ``into`` ((layer, "k" or "v")
    -> scale) for the KV cache instead, which the model runner owns."""
    for name, tensor in weights:
        match = _KV_SCALE.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"KV cache scale {name!r} has {tensor.numel()} values, expected one")
        into[(int(match.group(1)), match.group(2)[0])] = float(tensor.float().reshape(()))


def kv_scales_by_layer(
    scales: dict[tuple[int, str], float], config: ModelConfig
) -> dict[int, tuple[float, float]]:
    """layer -> (K scale, V scale); a checkpoint whose config declares K/V scales must hold
    both for every layer, and every scale must be positive."""
    declared = config.quantization is not None and config.quantization.kv_scales
    if not scales and not declared:
        return {}
    out = {}
    for layer in range(config.num_layers):
        pair = (scales.get((layer, "k")), scales.get((layer, "v")))
        if None in pair:
            raise ValueError(f"checkpoint lacks the FP8 KV cache scales of layer {layer}")
        if min(pair) <= 0 or not all(map(math.isfinite, pair)):
            raise ValueError(f"layer {layer}'s FP8 KV cache scales {pair} are not positive")
        out[layer] = pair
    return out


def checkpoint_files(model_dir: Path, index_name: str, pattern: str) -> list[Path]:
    index = model_dir / index_name
    if index.is_file():
        return [model_dir / name for name in sorted(set(read_json(index)["weight_map"].values()))]
    return sorted(model_dir.glob(pattern))
