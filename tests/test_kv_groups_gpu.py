"""KV layer groups on the GPU: the Triton decode and prefill kernels never read a block behind a
query's window or before its attention chunk (a window or chunked group's table holds the null
block there), and Gemma 3 and Llama 4 on layer groups through the engine on CUDA give HF's
greedy tokens.

The kernels' claim is tested as the CPU backend's is (tests/test_cpu_backend.py): the table
entries wholly behind the window of each sequence's first new token point at a block of NaN,
and the output must be the torch reference's over the intact tables, for decodes (split or not)
and for prompt chunks whose first queries need the window behind them. The kernel test also runs
on the CPU through Triton's interpreter::

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kv_groups_gpu.py -q
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
from engine_core.llm import LLM  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests import test_kv_groups_engine, test_models_llama4  # noqa: E402
from tests.paged_harness import hf_greedy, random_prompts  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402
    REFERENCE,
    assert_close,
    make_batch,
)

BLOCK, VOCAB = test_kv_groups_engine.BLOCK, test_kv_groups_engine.VOCAB
gemma = test_kv_groups_engine.gemma  # the fixture: the random Gemma 3 saved for HF and us
llama4 = test_models_llama4.llama4  # and the random Llama 4 (chunks of 16, a NoPE layer)

# Under Triton's interpreter (on the CPU) the contexts are kept short.
DECODES = [(c - 1, 1) for c in ((1, 17, 70, 130) if INTERPRET else (1, 17, 200, 1000, 4097))]
CHUNKS = [(0, 37), (40, 33), (100, 20), (17, 1), (64, 30)]


@pytest.mark.parametrize("window", [1, 16, 17, 50])
@pytest.mark.parametrize("specs", [DECODES, CHUNKS], ids=["decode", "chunks"])
def test_blocks_behind_the_window_are_never_read(window: int, specs: list[tuple[int, int]]) -> None:
    heads, kv_heads, head_dim = 8, 2, 64
    batch = make_batch(specs, heads, kv_heads, head_dim, 16, seed=window)
    meta = batch.meta
    want = REFERENCE.forward(batch.q, batch.k_cache, batch.v_cache, meta, head_dim**-0.5, window)
    nan_block = torch.full_like(batch.k_cache[:1], float("nan"))
    k_cache = torch.cat([batch.k_cache, nan_block])
    v_cache = torch.cat([batch.v_cache, nan_block])
    null = k_cache.shape[0] - 1
    tables, starts, behind = meta.block_tables.clone(), meta.query_start_loc_cpu, 0
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        first = max(0, seq_len - (starts[seq + 1] - starts[seq]) - window + 1) // 16
        tables[seq, :first] = null
        behind += first
    assert behind > 0
    meta.block_tables = tables
    out = TritonBackend().forward(batch.q, k_cache, v_cache, meta, head_dim**-0.5, window)
    assert_close(out, want)


@pytest.mark.parametrize("chunk", [1, 16, 24, 64])
@pytest.mark.parametrize("specs", [DECODES, CHUNKS], ids=["decode", "chunks"])
def test_blocks_before_the_attention_chunk_are_never_read(
    chunk: int, specs: list[tuple[int, int]]
) -> None:
    """Llama 4's chunked local attention: the entries wholly before the chunk of each
    sequence's first new token point at a block of NaN (a chunked group's null block), and the
    output is the torch reference's over the intact tables (itself checked query by query in
    tests/test_cpu_backend.py), decodes split or not, prompt chunks crossing chunk edges."""
    heads, kv_heads, head_dim = 8, 2, 64
    batch = make_batch(specs, heads, kv_heads, head_dim, 16, seed=chunk)
    meta, scale = batch.meta, head_dim**-0.5
    want = REFERENCE.forward(
        batch.q, batch.k_cache, batch.v_cache, meta, scale, attention_chunk=chunk
    )
    nan_block = torch.full_like(batch.k_cache[:1], float("nan"))
    k_cache = torch.cat([batch.k_cache, nan_block])
    v_cache = torch.cat([batch.v_cache, nan_block])
    null = k_cache.shape[0] - 1
    tables, starts, behind = meta.block_tables.clone(), meta.query_start_loc_cpu, 0
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        first_query = seq_len - (starts[seq + 1] - starts[seq])
        first = first_query // chunk * chunk // 16
        tables[seq, :first] = null
        behind += first
    assert behind > 0
    meta.block_tables = tables
    out = TritonBackend().forward(batch.q, k_cache, v_cache, meta, scale, attention_chunk=chunk)
    assert_close(out, want)


@pytest.mark.skipif(INTERPRET, reason="the engine on CUDA")
def test_gemma3_engine_on_cuda_matches_hf(gemma: tuple[Path, torch.nn.Module]) -> None:
    """Three prompts past the window of 64 in chunks of 48 beside decodes, a pool small enough
    to preempt, float32 on the Triton backend, eagerly (with graphs: test_graph_groups_gpu.py)."""
    folder, hf_model = gemma
    prompts = random_prompts(VOCAB, (150, 210, 97))
    expected = [hf_greedy(hf_model, p, 12).tokens[0] for p in prompts]
    llm = LLM(
        str(folder), device="cuda", dtype="float32", block_size=BLOCK, num_kv_blocks=100,
        max_model_len=512, max_num_batched_tokens=48, max_num_seqs=3, enforce_eager=True,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, detokenize=False)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.counts().preemptions > 0
        llm.engine.scheduler.block_manager.check_integrity()
    finally:
        llm.engine.shutdown()


@pytest.mark.skipif(INTERPRET, reason="the engine on CUDA")
def test_llama4_engine_on_cuda_matches_hf(llama4: tuple[Path, torch.nn.Module]) -> None:
    """Three prompts past two chunks in steps of 20 tokens beside decodes, a pool small enough
    to preempt, float32 on the Triton backend, eagerly (with graphs: test_graph_groups_gpu.py)."""
    folder, hf_model = llama4
    prompts = random_prompts(test_models_llama4.VOCAB, (61, 83, 50))
    expected = [hf_greedy(hf_model, p, 12).tokens[0] for p in prompts]
    llm = LLM(
        str(folder), device="cuda", dtype="float32", block_size=4, num_kv_blocks=60,
        max_model_len=112, max_num_batched_tokens=20, max_num_seqs=4, enforce_eager=True,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, detokenize=False)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.counts().preemptions > 0
        llm.engine.scheduler.block_manager.check_integrity()
    finally:
        llm.engine.shutdown()
