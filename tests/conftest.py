"""Shared fixtures: the default model's converted folder, resolved once per session."""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: worker threads that spin while waiting starve every
# other process on the 2-core CI machine (engine processes, HF references, the suite itself);
# measured 28 s vs 6 s for the same greedy run under load. Child processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine_core.loader import resolve_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted on first use,
    ~30 s on two cores, then cached under $TANDEM_CACHE_DIR or ~/.cache/tandem)."""
    return resolve_model_dir("default")
