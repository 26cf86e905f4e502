"""What an embedding checkpoint's sentence-transformers files say that both the engine (the
offline API) and the API process act on: the default prompt put before every text input."""

from __future__ import annotations

import json
from pathlib import Path


def default_prompt(model_dir: Path | None) -> str:
    """The prompt sentence-transformers puts before every input where the checkpoint names a
    default one (config_sentence_transformers.json: ``prompts[default_prompt_name]``), else "".
    ValueError where that name is none of its prompts (sentence-transformers refuses it too)."""
    settings = model_dir / "config_sentence_transformers.json" if model_dir else None
    if settings is None or not settings.is_file():
        return ""
    config = json.loads(settings.read_text(encoding="utf-8"))
    name = config.get("default_prompt_name")
    if name is None:
        return ""
    prompts = config.get("prompts") or {}
    if name not in prompts:
        raise ValueError(f"{settings}: default_prompt_name {name!r} names none of its prompts")
    return str(prompts[name])
