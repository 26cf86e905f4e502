"""Gemma 3 and Phi-3 on the GPU path (Triton layers and Triton attention) against HF, float32.

The per-layer sliding windows (Gemma 3: window 8 on every other layer, none on the others;
Phi-3: window 8 on all) go through the Triton decode and varlen prefill kernels, in chunked
prefills mixed with decodes and in a prefill whose first blocks are a prefix-cache hit; partial
rotary goes through the in-place rotary kernel on a slice of each head. Without a GPU it is
skipped, unless ``TRITON_INTERPRET=1`` is set (then on the CPU, through Triton's interpreter)::

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_models_gemma_phi_gpu.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.gpu
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.loader import load_model  # noqa: E402
from engine_core.models import layers  # noqa: E402
from tests.paged_harness import assert_matches, generate_greedy, hf_greedy  # noqa: E402
from tests.test_models_gemma_phi import (  # noqa: E402
    greedy_with_cached_prefix,
    make_hf_model,
    prompts_for,
)

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
NEW_TOKENS = 6 if INTERPRET else 32
# GPU GEMMs sum in another order than the CPU's (see test_triton_kernels.py).
ATOL = 1e-4 if INTERPRET else 1e-3
MODELS = ["gemma3", "phi3_longrope", "phi3_partial_window"]


@pytest.fixture
def fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the layers take the Triton kernels by themselves; under the interpreter the
    tensors are on the CPU, so the dispatch is told to."""
    if INTERPRET:
        monkeypatch.setattr(layers, "use_triton", lambda x: True)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.usefixtures("fused_path")
def test_fused_path_matches_hf(name: str, tmp_path: Path) -> None:
    """Chunked prefills (5 tokens) mixed with decodes, then a prefix-cached prefill."""
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), DEVICE, torch.float32).module
    prompts = prompts_for(name)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    got = generate_greedy(
        model,
        prompts,
        NEW_TOKENS,
        block_size=4,
        prefill_chunk=5,
        stagger=1,
        shuffle_blocks=True,
        backend=TritonBackend(),
    )
    assert_matches(got, reference, ATOL)
    prompt = prompts[-1]
    cached_blocks = len(prompt) // 2 // 4
    donor = prompt[: cached_blocks * 4] + [7] * 9
    cached = greedy_with_cached_prefix(
        model, donor, prompt, cached_blocks, NEW_TOKENS, backend=TritonBackend()
    )
    assert_matches(cached, reference[-1:], ATOL)
