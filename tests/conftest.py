"""Shared fixtures: the default model's converted folder, resolved once per session, and a tiny
random model that `tandem serve` can serve (it borrows the default model's tokenizer)."""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: worker threads that spin while waiting starve every
# other process on the 2-core CI machine (engine processes, HF references, the suite itself);
# measured 28 s vs 6 s for the same greedy run under load. Child processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The quantized models' tests compare with HF at 1e-4 after each activation's e4m3 or int8
# rounding, which turns a last-bit difference before it into a whole rounding step: both sides
# must reduce in the same order. Torch's, oneDNN's and MKL's kernels pick their vector width
# from the CPU, and on a host with AVX-512 and AMX the HF reference's attention and products
# summed in another order than ours (4 of those tests failed there; all pass with every
# library held to AVX2). So the suite holds every host's kernels to AVX2, which x86-64 CI hosts
# have in common.
for _name, _isa in (
    ("ATEN_CPU_CAPABILITY", "avx2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
):
    os.environ.setdefault(_name, _isa)

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from engine_core.model_dir import resolve_model_dir, tokenizer_dir_for_random  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted on first use,
    ~30 s on two cores, then cached under $TANDEM_CACHE_DIR or ~/.cache/tandem)."""
    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def default_tokenizer_dir() -> Path:
    """The default model's tokenizer: $TANDEM_TOKENIZER_DIR's folder where it is set (the GPU
    machine, which lacks the default model's 94 MB package), else the converted default model,
    for the tests whose models are random and only borrow its vocabulary."""
    return tokenizer_dir_for_random()


@pytest.fixture(scope="session")
def tiny_model_dir(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with the default model's 49,152-token vocabulary and tokenizer: a
    server on it starts in seconds and steps in milliseconds, for tests of the serving machinery
    (faults, overload, bad input) rather than of the model."""
    from tests.factories import copy_tokenizer, write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=49152)
    return copy_tokenizer(default_tokenizer_dir, path)


@pytest.fixture(scope="session")
def default_grammar_vocabulary(default_model_dir: Path) -> tuple[Any, Any]:
    """(the HF tokenizer, llguidance's view of it) for the default model, as it is: both
    tool-parser files check grammars against it, and a worker that runs both builds it once.
    Read only: a test that adds tokens loads a tokenizer of its own."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
