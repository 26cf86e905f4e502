"""Embedding models: what a checkpoint says about its pooling, and whether an engine embeds.

A decoder checkpoint is an embedding model where its files say so (``--runner auto``):

- the sentence-transformers layout (Qwen3-Embedding, e5-mistral): ``modules.json`` lists a
  Pooling module whose ``config.json`` sets ``pooling_mode_lasttoken`` or
  ``pooling_mode_mean_tokens``, and a Normalize module where the vectors are L2-normalised;
- or a bare body for its architecture (``Qwen3Model``, ``LlamaModel``, ``MistralModel``,
  ``Qwen2Model``: saved without an LM head, it has nothing to generate with).

``--runner pooling`` (vLLM's spelling) embeds with any checkpoint of a family we run; where its
files name no pooling, the last token's hidden state, normalised (what vLLM does with a decoder
model). ``--runner generate`` generates, and refuses a bare body. Matryoshka (a vector whose
first N values embed too) is read as vLLM reads it: ``is_matryoshka`` or
``matryoshka_dimensions`` in config.json (or in config_sentence_transformers.json).

A sentence-transformers module or option that would change the vector and that the engine does
not compute (a Dense layer, CLS or max pooling, a lower-cased tokenizer, a prompt left out of
the mean) is refused when the model loads, never ignored. Its ``max_seq_length`` caps the
context (``st_max_seq_length``); its default prompt goes before every text input, in the API
process and the offline API (common/sentence_transformers.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.sentence_transformers import default_prompt
from engine_core.config import ModelConfig
from protocol.messages import EmbeddingModel, PoolingKind, PoolingParams

# The sentence-transformers modules whose work the engine does (models/: the Transformer; the
# pooler: Pooling and Normalize), by the last part of their type.
ST_MODULES = ("Transformer", "Pooling", "Normalize")
ST_POOLING_MODES = {
    "pooling_mode_lasttoken": PoolingKind.LAST,
    "pooling_mode_mean_tokens": PoolingKind.MEAN,
}
DEFAULT_POOLING = (PoolingKind.LAST, True)  # --runner pooling where the files name none


def embedding_model(
    runner: str, model_dir: Path | None, config: ModelConfig
) -> EmbeddingModel | None:
    """How the engine runs the model: None to generate, else the pooling of its vectors.
    ValueError where the runner and the checkpoint cannot go together."""
    from engine_core.models import is_bare_body  # torch: not for `tandem generate --help`

    hf = config.hf_config
    pooling = sentence_transformers_pooling(model_dir) if model_dir is not None else None
    bare = is_bare_body(hf)
    if runner == "generate":
        if bare:
            raise ValueError(
                f"{hf.get('architectures')} is a model body without an LM head: it can only "
                "embed (--runner pooling, or auto)"
            )
        return None
    if runner == "auto" and pooling is None and not bare:
        return None
    kind, normalize = pooling or DEFAULT_POOLING
    default_prompt(model_dir)  # one naming none of the prompts is refused at load
    matryoshka, dims = matryoshka_of(hf, model_dir, config.hidden_size)
    return EmbeddingModel(kind, normalize, config.hidden_size, matryoshka, dims)


def sentence_transformers_pooling(model_dir: Path) -> tuple[PoolingKind, bool] | None:
    """(pooling, normalize) as the folder's sentence-transformers modules say, or None where
    it has no modules.json with a Pooling module."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file)
    kinds = [module_kind(m) for m in modules]
    unknown = [k for k in kinds if k not in ST_MODULES]
    if unknown:
        raise ValueError(
            f"{modules_file}: the sentence-transformers module(s) {unknown} are not supported "
            f"(only {', '.join(ST_MODULES)})"
        )
    if "Pooling" not in kinds:
        return None
    for folder in transformer_folders(model_dir, modules):
        check_st_transformer(folder)
    pooling = modules[kinds.index("Pooling")]
    config = read_json(model_dir / pooling.get("path", "") / "config.json")
    return pooling_kind(config), "Normalize" in kinds


def pooling_kind(config: dict[str, Any]) -> PoolingKind:
    """The pooling a sentence-transformers Pooling config.json names (exactly one mode)."""
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
    if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
        raise ValueError(
            f"sentence-transformers pooling {modes or 'none'} is not supported; supported: "
            f"one of {', '.join(ST_POOLING_MODES)}"
        )
    kind = ST_POOLING_MODES[modes[0]]
    if kind == PoolingKind.MEAN and config.get("include_prompt") is False:
        # The mean would leave out an instruction prefix that only the client knows.
        raise ValueError("sentence-transformers mean pooling without the prompt is not supported")
    return kind


def st_max_seq_length(model_dir: Path | None) -> int | None:
    """The sentence-transformers Transformer module's ``max_seq_length`` (its
    sentence_bert_config.json, in the module's folder), or None where it names none."""
    modules_file = model_dir / "modules.json" if model_dir is not None else None
    if modules_file is None or not modules_file.is_file():
        return None
    for folder in transformer_folders(model_dir, read_json(modules_file)):
        settings = folder / "sentence_bert_config.json"
        if settings.is_file() and (limit := read_json(settings).get("max_seq_length")):
            return int(limit)
    return None


def module_kind(module: dict[str, Any]) -> str:
    """A modules.json entry's kind: the last part of its type (``Transformer``, ``Pooling``)."""
    return str(module.get("type", "")).rpartition(".")[2]


def transformer_folders(model_dir: Path, modules: list[dict[str, Any]]) -> list[Path]:
    """The folders of the Transformer modules that modules.json lists."""
    return [model_dir / m.get("path", "") for m in modules if module_kind(m) == "Transformer"]


def check_st_transformer(folder: Path) -> None:
    """Refuse a Transformer module whose tokenization the engine's tokenizer would not do."""
    settings = folder / "sentence_bert_config.json"
    if settings.is_file() and read_json(settings).get("do_lower_case"):
        raise ValueError(f"{settings}: do_lower_case is not supported")


def matryoshka_of(
    hf: dict[str, Any], model_dir: Path | None, size: int
) -> tuple[bool, tuple[int, ...]]:
    """(whether vectors may be cut short, the only lengths allowed or () for any of 1..size)."""
    st_file = model_dir / "config_sentence_transformers.json" if model_dir else None
    st = read_json(st_file) if st_file is not None and st_file.is_file() else {}
    dims = hf.get("matryoshka_dimensions") or st.get("matryoshka_dimensions") or ()
    dims = tuple(int(d) for d in dims)
    if any(not 1 <= d <= size for d in dims):
        raise ValueError(f"matryoshka_dimensions {list(dims)} must lie in [1, {size}]")
    flag = bool(dims) or bool(hf.get("is_matryoshka") or st.get("is_matryoshka"))
    return flag, dims


def check_pooling(pooling: PoolingParams, model: EmbeddingModel) -> None:
    """ValueError (a message for the client) where the model cannot pool as asked."""
    refusal = None if pooling.dimensions is None else model.refuses_dimensions(pooling.dimensions)
    if refusal is not None:
        raise ValueError(refusal)


def read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return json.load(f)
