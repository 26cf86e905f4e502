"""The FP8 KV-cache contract of the attention side, on the CPU (torch reference backend and the
Attention layer); tests/test_kv_cache_fp8.py holds the first checks and the engine run.

Here: every written element is exactly the cast of clamp(x / scale) and padding slots keep their
bytes; float32 and bf16 caches ignore the scales bit for bit; the layer hands its k_scale and
v_scale to the backend; and a mixed batch (decode, whole prompt, chunk after a cached context,
GQA, shuffled blocks, with and without a sliding window) over an FP8 cache equals the same
batch over a float32 cache of the dequantized values, and the original values within the bound
derived in ``rounding_bound``.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.attention.base import FP8_MAX, AttentionMetadata
from engine_core.attention.layer import Attention
from engine_core.attention.torch_ref import TorchReferenceBackend
from engine_core.forward_context import forward_context

E4M3 = torch.float8_e4m3fn
BLOCK, HEADS, KV_HEADS, DIM = 4, 8, 2, 16
NUM_BLOCKS = 40  # 4 sequences x 8-block tables, plus spare blocks that stay empty
SCALE = DIM**-0.5
# (cached context, new tokens): a decode, a whole prompt, a chunk after 7 cached tokens, and a
# decode whose context spans many blocks.
SPECS = [(12, 1), (0, 9), (7, 6), (30, 1)]
BACKEND = TorchReferenceBackend()


def mixed_metadata(gen: torch.Generator) -> AttentionMetadata:
    """SPECS on shuffled blocks: sequence i's new tokens sit after its cached context."""
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-(c + n) // BLOCK) for c, n in SPECS)
    tables = torch.tensor(order[: len(SPECS) * width], dtype=torch.int32).view(len(SPECS), width)
    slots = [
        int(tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
        for i, (context, new) in enumerate(SPECS)
        for pos in range(context, context + new)
    ]
    starts = [0]
    for _, new in SPECS:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in SPECS]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(n for _, n in SPECS),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def context_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """The same sequences with every context token new: one write fills the whole context."""
    table, lens = meta.block_tables, meta.seq_lens_cpu
    slots = [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for i, n in enumerate(lens)
             for p in range(n)]  # fmt: skip
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=meta.seq_lens,
        block_tables=table,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


def empty_caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def random_fp8(gen: torch.Generator) -> torch.Tensor:
    """A cache of arbitrary old e4m3 contents (no NaN), to see what a write leaves alone."""
    return (torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen) * 50).to(E4M3)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


# ---- write ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_stores_the_cast_of_each_value_over_its_scale(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = random_fp8(gen), random_fp8(gen)
    old_k, old_v = k_cache.clone(), v_cache.clone()
    num_tokens = 20
    k = (torch.randn(num_tokens, KV_HEADS, DIM, generator=gen) * 4).to(dtype)
    v = (torch.randn(num_tokens, KV_HEADS, DIM, generator=gen) / 8).to(dtype)
    k[3] *= 1e4  # past 448 * k_scale: clamps
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:num_tokens]
    slots[::4] = -1
    scales = (0.0371, 0.0029)  # a checkpoint's kind: amax / 448, not powers of two
    BACKEND.write_kv(k_cache, v_cache, k, v, slots, *scales)

    written = slots >= 0
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[slots[written]] = False
    for cache, old, x, scale in ((k_cache, old_k, k, scales[0]), (v_cache, old_v, v, scales[1])):
        flat, flat_old = cache.view(-1, KV_HEADS, DIM), old.view(-1, KV_HEADS, DIM)
        want = (x[written].float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
        assert torch.equal(as_bytes(flat[slots[written]]), as_bytes(want))
        assert torch.equal(as_bytes(flat[untouched]), as_bytes(flat_old[untouched]))
    assert k_cache.view(-1, KV_HEADS, DIM)[slots[3]].float().abs().max() == FP8_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_caches_ignore_the_scales(dtype: torch.dtype) -> None:
    """The runner sets scales on every layer; a float cache must give the same bits as without."""
    gen = torch.Generator().manual_seed(4)
    meta = mixed_metadata(gen)
    whole = context_metadata(meta)
    total = whole.query_start_loc_cpu[-1]
    k = torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype)
    q = torch.randn(meta.query_start_loc_cpu[-1], HEADS, DIM, generator=gen).to(dtype)
    results = []
    for scales in ((1.0, 1.0), (3.0, 0.25)):
        k_cache, v_cache = empty_caches(dtype)
        BACKEND.write_kv(k_cache, v_cache, k, v, whole.slot_mapping, *scales)
        out = BACKEND.forward(q, k_cache, v_cache, meta, SCALE, 5, *scales)
        results.append((k_cache, v_cache, out))
    for plain, scaled in zip(*results, strict=True):
        assert torch.equal(plain, scaled)


# ---- attention over an FP8 cache ------------------------------------------------------------


def rounding_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[float, float]
) -> float:
    """The largest |out_fp8 - out_original| the e4m3 roundings allow, q [T, H, D], k and v the
    original [L, KVH, D] of all sequences.

    e4m3 rounds to nearest with 3 mantissa bits: a stored x / s moves by at most 2^-4 of itself
    (normal range) or half the subnormal step 2^-9, so |dx| <= 2^-4 |x| + 2^-10 s. A score moves
    by at most d = SCALE * max sum_d |q_d| (2^-4 |k_d| + 2^-10 k_s); each softmax weight then by
    a factor within exp(+-2d), so |dp_j| <= p_j (exp(2d) - 1); and
    |sum p'v' - sum p v| <= (exp(2d) - 1) max|v'| + max|dv|, with max|v'| <= max|v| + max|dv|.
    """
    k_step = 2**-4 * k.abs() + 2**-10 * scales[0]  # [L, KVH, D]
    group = HEADS // KV_HEADS
    moves = torch.einsum("thd,lhd->thl", q.abs(), k_step.repeat_interleave(group, dim=1))
    d = SCALE * moves.max().item()
    dv = 2**-4 * v.abs().max().item() + 2**-10 * scales[1]
    return (torch.tensor(2 * d).exp().item() - 1) * (v.abs().max().item() + dv) + dv


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0), (0.0371, 0.0029)])
def test_mixed_batch_over_fp8_reads_the_dequantized_values(
    window: int | None, scales: tuple[float, float]
) -> None:
    gen = torch.Generator().manual_seed(5)
    meta = mixed_metadata(gen)
    whole = context_metadata(meta)
    total = whole.query_start_loc_cpu[-1]
    k = torch.randn(total, KV_HEADS, DIM, generator=gen) * 2
    v = torch.randn(total, KV_HEADS, DIM, generator=gen) / 4
    q = torch.randn(meta.query_start_loc_cpu[-1], HEADS, DIM, generator=gen)
    fp8_k, fp8_v = empty_caches(E4M3)
    BACKEND.write_kv(fp8_k, fp8_v, k, v, whole.slot_mapping, *scales)
    exact_k, exact_v = empty_caches(torch.float32)
    BACKEND.write_kv(exact_k, exact_v, k, v, whole.slot_mapping)

    got = BACKEND.forward(q, fp8_k, fp8_v, meta, SCALE, window, *scales)
    dequantized = BACKEND.forward(
        q, fp8_k.float() * scales[0], fp8_v.float() * scales[1], meta, SCALE, window
    )
    original = BACKEND.forward(q, exact_k, exact_v, meta, SCALE, window)
    torch.testing.assert_close(got, dequantized, atol=1e-6, rtol=0)
    error = (got - original).abs().max().item()
    bound = rounding_bound(q, k, v, scales)
    assert 0 < error <= bound, f"error {error:.2e}, bound {bound:.2e}"
    # The worst case above is loose (~3.6 against ~0.05 here); typically the output moves by
    # about what V's rounding does: measured 0.033-0.044 in norm over seeds, below 2^-3.
    relative = ((got - original).norm() / original.norm()).item()
    assert relative < 2**-3, relative


def test_layer_passes_its_scales_to_the_backend() -> None:
    """Attention.k_scale / v_scale (set by the runner) reach both write_kv and forward."""
    gen = torch.Generator().manual_seed(6)
    meta = mixed_metadata(gen)
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, HEADS * DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS * DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS * DIM, generator=gen)
    layer = Attention(HEADS, KV_HEADS, DIM, SCALE)
    layer.k_cache, layer.v_cache = empty_caches(E4M3)
    layer.k_scale, layer.v_scale = 0.25, 0.0625
    with forward_context(meta, BACKEND):
        out = layer(q, k, v)

    k_cache, v_cache = empty_caches(E4M3)
    shaped = k.view(num_tokens, KV_HEADS, DIM), v.view(num_tokens, KV_HEADS, DIM)
    BACKEND.write_kv(k_cache, v_cache, *shaped, meta.slot_mapping, 0.25, 0.0625)
    want = BACKEND.forward(q.view(num_tokens, HEADS, DIM), k_cache, v_cache, meta, SCALE, None,
                           0.25, 0.0625)  # fmt: skip
    assert torch.equal(as_bytes(layer.k_cache), as_bytes(k_cache))
    assert torch.equal(as_bytes(layer.v_cache), as_bytes(v_cache))
    assert torch.equal(out, want.view(num_tokens, HEADS * DIM))
