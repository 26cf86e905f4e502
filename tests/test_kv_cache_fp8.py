"""The FP8 KV cache on the CPU (the torch reference backend, which the GPU kernels are tested
against, and the engine around it).

An e4m3 value keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself. So
attention over an FP8 cache must equal attention over a float32 cache holding the dequantized
values exactly (same math after the read), and attention over the original K/V within the bound
those roundings give (derived in the test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.attention.base import AttentionMetadata
from engine_core.attention.torch_ref import TorchReferenceBackend
from engine_core.llm import LLM
from protocol.messages import SamplingParams
from tests.factories import write_tiny_llama

E4M3 = torch.float8_e4m3fn
BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 16


def metadata(query_lens: list[int], seq_lens: list[int], blocks_per_seq: int) -> AttentionMetadata:
    """Sequence i owns blocks i * blocks_per_seq ...; its new tokens are its last query_lens[i]."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [
        i * blocks_per_seq * BLOCK + pos
        for i, (q, total) in enumerate(zip(query_lens, seq_lens, strict=True))
        for pos in range(total - q, total)
    ]
    tables = torch.arange(len(seq_lens) * blocks_per_seq, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.view(len(seq_lens), blocks_per_seq),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def caches(dtype: torch.dtype, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM, dtype=dtype),
        torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM, dtype=dtype),
    )


def fill(meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, seed: int,
         k_scale: float = 1.0, v_scale: float = 1.0) -> None:  # fmt: skip
    """Write every sequence's whole context (random K/V) through the backend."""
    total = int(meta.seq_lens.sum())
    whole = metadata(meta.seq_lens_cpu, meta.seq_lens_cpu, meta.block_tables.shape[1])
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen) * 3
    v = torch.randn(total, KV_HEADS, DIM, generator=gen)
    TorchReferenceBackend().write_kv(k_cache, v_cache, k, v, whole.slot_mapping, k_scale, v_scale)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "window"),
    [([1, 1], [9, 14], None), ([9, 5], [9, 14], None), ([3, 1], [11, 6], 4)],
    ids=["decode", "prefill-and-chunk", "sliding-window"],
)
def test_fp8_cache_reads_back_its_dequantized_values(
    query_lens: list[int], seq_lens: list[int], window: int | None
) -> None:
    backend, scales = TorchReferenceBackend(), (0.5, 2.0)
    meta = metadata(query_lens, seq_lens, blocks_per_seq=4)
    fp8_k, fp8_v = caches(E4M3, 8)
    fill(meta, fp8_k, fp8_v, seed=1, k_scale=scales[0], v_scale=scales[1])
    exact_k, exact_v = caches(torch.float32, 8)
    fill(meta, exact_k, exact_v, seed=1)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=torch.Generator().manual_seed(2))

    got = backend.forward(q, fp8_k, fp8_v, meta, 0.25, window, *scales)
    dequantized = backend.forward(
        q, fp8_k.float() * scales[0], fp8_v.float() * scales[1], meta, 0.25, window
    )
    original = backend.forward(q, exact_k, exact_v, meta, 0.25, window)
    torch.testing.assert_close(got, dequantized, atol=1e-6, rtol=0)
    # Each V moves by <= 2^-4 |V|, each score by <= d = scale * max(|q| . |k|) * 2^-4, so each
    # softmax weight by a factor within exp(+-2d): |out error| <= max|V| (2^-4 + exp(2d) - 1).
    d = 0.25 * (q.abs().flatten(0, 1) @ exact_k.abs().flatten(0, 2).T).max() * 2**-4
    bound = exact_v.abs().max() * (2**-4 + torch.exp(2 * d) - 1)
    error = (got - original).abs().max()
    assert 0 < error <= bound, f"error {error:.4f}, bound {bound:.4f}"


def test_write_stores_rounded_values_over_the_scale() -> None:
    k_cache, v_cache = caches(E4M3, 2)
    k = torch.tensor([[[1000.0] + [3.0] * (DIM - 1)] * KV_HEADS])  # 1000 / 2 clamps to 448
    slots = torch.tensor([5])
    TorchReferenceBackend().write_kv(k_cache, v_cache, k, -k, slots, 2.0, 4.0)
    stored_k, stored_v = k_cache.view(-1, KV_HEADS, DIM)[5], v_cache.view(-1, KV_HEADS, DIM)[5]
    assert stored_k[0, 0].item() == 448.0 and stored_k[0, 1].item() == 1.5
    assert stored_v[0, 1].item() == -0.75
    assert k_cache.float().abs().sum() == stored_k.float().abs().sum()  # nothing else written


def test_padding_slots_are_not_written() -> None:
    k_cache, v_cache = caches(E4M3, 2)
    kv = torch.ones(3, KV_HEADS, DIM)
    TorchReferenceBackend().write_kv(k_cache, v_cache, kv, kv, torch.tensor([-1, 2, -1]))
    assert k_cache.float().sum() == KV_HEADS * DIM  # only slot 2


def test_engine_with_an_fp8_cache_stays_close_to_float32(tmp_path: Path) -> None:
    """The tiny Llama (well-separated greedy choices) through the engine with --kv-cache-dtype
    fp8: the same greedy tokens as the float32 cache, each chosen token's logprob within 0.1 nats
    (measured: up to 0.07 on this model)."""
    write_tiny_llama(tmp_path, vocab_size=384)
    prompts = [[5, 9, 33, 2 + i, 100] * (3 + i) for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)

    def run(kv_cache_dtype: str) -> tuple[list[list[int]], torch.Tensor]:
        llm = LLM(str(tmp_path), kv_cache_dtype=kv_cache_dtype, max_model_len=128,
                  num_kv_blocks=32, block_size=4)  # fmt: skip
        try:
            outs = llm.generate(prompts, params, detokenize=False)
        finally:
            llm.engine.shutdown()
        logprobs = torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs])
        assert llm.engine.runner.kv_cache.dtype == (E4M3 if kv_cache_dtype == "fp8" else
                                                    torch.float32)  # fmt: skip
        return [o.token_ids for o in outs], logprobs

    tokens, logprobs = run("fp8")
    ref_tokens, ref_logprobs = run("auto")
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max() < 0.1
    assert (logprobs - ref_logprobs).abs().max() > 0
