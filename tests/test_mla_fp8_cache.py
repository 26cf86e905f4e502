"""`--kv-cache-dtype fp8` with multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), on the CPU:
the latent cache holds e4m3 rows (row / scale, clamped, rounded) and every reader widens them.

The engine with the FP8 cache gives the same tokens and logprobs as the engine with a float32
cache whose writes are rounded through e4m3 first (the values the FP8 cache stands for), so
nothing is lost or misread between the write, the absorbed decode and the expanded prompt path.
How close that stays to the model depends on the model: on these random tiny ones, whose greedy
choices lie close together, e4m3's steps move a chosen token's logprob by up to 0.13 nats and
flip some tokens (an exact test of that would be a test of e4m3). A block takes half bf16's bytes.
The Triton kernels' FP8 reads and writes: tests/test_mla_triton_interpreted.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.attention import mla
from engine_core.attention.base import cached_values
from engine_core.llm import LLM
from engine_core.loader import load_model_config
from engine_core.memory_plan import kv_block_bytes
from protocol.messages import SamplingParams
from tests.test_models_deepseek import PROMPTS, make_hf_model

E4M3 = torch.float8_e4m3fn
NEW_TOKENS = 12
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=["v3", "v2_lite"])
def deepseek(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_model(request.param)
    hf_model.save_pretrained(folder)
    return folder, hf_model


def generate(folder: Path, kv_cache_dtype: str) -> tuple[list[list[int]], torch.Tensor, Any]:
    """Greedy tokens and their logprobs, prompts in chunks of 8 beside decodes; the caches."""
    llm = LLM(
        str(folder), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
        max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
    )  # fmt: skip
    try:
        outs = llm.generate(PROMPTS, PARAMS, detokenize=False)
    finally:
        llm.engine.shutdown()
    logprobs = torch.tensor([[lp.logprob for lp in out.logprobs] for out in outs])
    return [out.token_ids for out in outs], logprobs, llm.engine.runner.kv_cache


def rounding_writes(
    cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float = 1.0
) -> None:
    """A float cache written with the values an FP8 cache would hold."""
    rounded = (rows.float() / scale).clamp(-448.0, 448.0).to(E4M3).float() * scale
    write_plain(cache, rounded, slots, scale)


write_plain = mla.write_latents


def test_the_fp8_cache_reads_back_what_it_wrote(
    deepseek: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = deepseek
    tokens, logprobs, caches = generate(folder, "fp8")
    assert all(cache.dtype == E4M3 for cache in caches)
    monkeypatch.setattr(mla, "write_latents", rounding_writes)
    want_tokens, want_logprobs, plain = generate(folder, "auto")
    assert all(cache.dtype == torch.float32 for cache in plain)
    assert tokens == want_tokens
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=0)


def test_rows_are_stored_divided_by_the_scale_and_clamped() -> None:
    """e4m3 tops out at 448: a row past 448 x scale is stored at the limit; padding (slot -1)
    writes nothing; a read gives the stored values times the scale."""
    cache = torch.zeros(2, 4, 3, dtype=E4M3)
    rows = torch.tensor([[1.0, -3.0, 1000.0], [5.0, 5.0, 5.0], [0.5, -600.0, 0.25]])
    mla.write_latents(cache, rows, torch.tensor([6, -1, 1]), scale=0.5)
    flat = cached_values(cache.view(-1, 3), torch.float32, scale=0.5)
    assert flat[6].tolist() == [1.0, -3.0, 224.0] and flat[1].tolist() == [0.5, -224.0, 0.25]
    assert not flat[[0, 2, 3, 4, 5, 7]].any()


def test_a_latent_block_takes_half_the_bytes_of_bf16(deepseek: tuple[Path, Any]) -> None:
    folder, _ = deepseek
    config = load_model_config(folder)
    bf16 = kv_block_bytes(config, config.num_kv_heads, 16, torch.bfloat16)
    assert kv_block_bytes(config, config.num_kv_heads, 16, E4M3) * 2 == bf16
