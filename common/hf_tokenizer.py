"""A model folder's Hugging Face tokenizer, as AutoTokenizer loads it, for the processes that
need only the tokenizer (the API process, the load generator): where AutoTokenizer's choice is
known to be TokenizersBackend, that class is loaded directly, without AutoTokenizer's import of
transformers' configuration classes, which imports torch (1.5 s of CPU a process)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Model types for which AutoTokenizer, given a folder whose tokenizer_config.json names
# TokenizersBackend and no auto_map, loads TokenizersBackend itself (transformers'
# models/auto/tokenization_auto.py: none of its per-model-type overrides applies to them).
# tests/test_tokenizer_encode.py checks each against AutoTokenizer.
DIRECT_BACKEND_MODEL_TYPES = frozenset({"llama"})


# What a model folder's tokenizer is read from (one of them, beside tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class TokenizerError(ValueError):
    """The model's tokenizer cannot be loaded (here, where `tandem serve` can catch it without
    importing the HTTP stack)."""


RAW_ENGINE_HINT = "token ids go to the raw engine: `tandem engine`, `tandem client --token-ids`"


def load_explained(
    load: Callable[[Path], Any], model_dir: Path, without_it: str = RAW_ENGINE_HINT
) -> Any:
    """``load(model_dir)``; where the folder's tokenizer does not load, TokenizerError saying
    why in one line (transformers' own message for a folder without one advises installing
    sentencepiece), and ``without_it``: how to serve that model without one."""
    try:
        return load(model_dir)
    except (OSError, ValueError) as exc:
        if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
            reason = f"it has none of {', '.join(TOKENIZER_FILES)}"
        else:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerError(
            f"cannot load the tokenizer of {model_dir} ({reason}): text in and out needs the "
            f"model's own tokenizer files ({without_it})"
        ) from None


def load_pretrained_tokenizer(model_dir: Path) -> Any:
    """``model_dir``'s tokenizer: the class AutoTokenizer would choose, as it would load it."""
    if loads_backend_directly(model_dir):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def loads_backend_directly(model_dir: Path) -> bool:
    """Whether AutoTokenizer would load ``model_dir``'s tokenizer as TokenizersBackend (for the
    model types in DIRECT_BACKEND_MODEL_TYPES), so that it can be loaded as one directly."""
    try:
        tokenizer_config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(tokenizer_config, dict)
        and isinstance(config, dict)
        and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in tokenizer_config
        and "auto_map" not in config
        and config.get("model_type") in DIRECT_BACKEND_MODEL_TYPES
    )
