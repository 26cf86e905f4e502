"""The CPU attention backend (engine_core/attention/cpu_backend.py) against the torch reference.

The reference attends one sequence at a time in float32 (the oracle of every backend); the CPU
backend batches the decoding sequences and gathers their blocks in chunks. They must agree on any
batch: decode-only, mixed with whole prompts and chunks after a cached context, shuffled blocks,
GQA and MHA, sliding windows, chunks of one sequence and of many, and bf16.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.attention import cpu_backend
from engine_core.attention.base import AttentionMetadata
from engine_core.attention.cpu_backend import CpuBackend, plan_step
from engine_core.attention.torch_ref import TorchReferenceBackend, Visibility

BLOCK, DIM = 4, 16
SCALE = DIM**-0.5
REFERENCE = TorchReferenceBackend()


def metadata(
    specs: list[tuple[int, int]], num_blocks: int, gen: torch.Generator, shuffled: bool = True
) -> AttentionMetadata:
    """Sequences of (cached context, new tokens) on shuffled blocks (or on consecutive ones,
    from block 1), for forward only (the cache is filled with random values directly, so no
    slot mapping is needed)."""
    width = max(-(-(c + n) // BLOCK) for c, n in specs)
    order = torch.randperm(num_blocks, generator=gen) if shuffled else torch.arange(1, num_blocks)
    order = order[: len(specs) * width]
    tables = order.to(torch.int32).view(len(specs), width)
    starts = [0]
    for _, new in specs:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in specs]
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def poison_unwritten(cache: torch.Tensor, meta: AttentionMetadata, value: float) -> None:
    """Set every slot that no sequence's context holds (block tails, unused blocks) to value."""
    used = torch.zeros(cache.shape[0] * BLOCK, dtype=torch.bool)
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        for pos in range(seq_len):
            used[int(meta.block_tables[seq, pos // BLOCK]) * BLOCK + pos % BLOCK] = True
    cache.view(-1, *cache.shape[2:])[~used] = value


def compare(
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    window: int | None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    unwritten: float | None = None,
    shuffled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(specs) * max(-(-(c + n) // BLOCK) for c, n in specs) + 3
    meta = metadata(specs, num_blocks, gen, shuffled)
    shape = (num_blocks, BLOCK, kv_heads, DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    if unwritten is not None:
        poison_unwritten(k_cache, meta, unwritten)
        poison_unwritten(v_cache, meta, unwritten)
    q = torch.randn(meta.query_start_loc_cpu[-1], heads, DIM, generator=gen).to(dtype)
    got = CpuBackend().forward(q, k_cache, v_cache, meta, SCALE, window)
    want = REFERENCE.forward(q, k_cache, v_cache, meta, SCALE, window)
    assert got.shape == want.shape and got.dtype == want.dtype
    return got.float(), want.float()


DECODES = [(5, 1), (0, 1), (30, 1), (11, 1), (16, 1), (3, 1)]
MIXED = [(12, 1), (0, 9), (7, 6), (30, 1), (0, 1), (21, 4)]


@pytest.mark.parametrize("specs", [DECODES, MIXED], ids=["decode-only", "mixed"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 6), (9, 3)])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_reference(
    specs: list[tuple[int, int]], heads: int, kv_heads: int, window: int | None
) -> None:
    got, want = compare(specs, heads, kv_heads, window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 2 * 8 * BLOCK * 2 * DIM * 4, 2**30])
def test_chunking_changes_nothing(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    """One sequence per gather, a few, or all at once: the same result."""
    monkeypatch.setattr(cpu_backend, "CHUNK_BYTES", chunk_bytes)
    got, want = compare(DECODES * 3, 8, 2, None, seed=3)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_past_the_context_are_never_read(value: float, dtype: torch.dtype) -> None:
    """What an earlier owner of a block left past a sequence's end (here NaN or inf) cannot
    reach the output: the gathered blocks' tails and the padding blocks are masked and zeroed."""
    got, want = compare(MIXED + DECODES, 8, 2, None, dtype=dtype, seed=2, unwritten=value)
    assert torch.isfinite(got).all()
    tolerance = (
        {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("context", [0, 3, 4, 13, 30])
@pytest.mark.parametrize("shuffled", [True, False], ids=["gathered", "viewed"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_decoding_sequence(
    context: int, shuffled: bool, window: int | None, dtype: torch.dtype
) -> None:
    """A step of one decode reads its exact context (a view of consecutive blocks, else a
    gather): NaN past its end or in other blocks never reaches the output."""
    got, want = compare(
        [(context, 1)], 9, 3, window, dtype, seed=context, unwritten=float("nan"), shuffled=shuffled
    )
    assert torch.isfinite(got).all()
    tolerance = (
        {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(got, want, **tolerance)


def test_one_decoding_sequence_is_planned_as_such() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.empty(20, BLOCK, 2, DIM)
    viewed = plan_step(metadata([(13, 1)], 20, gen, shuffled=False), cache).single
    assert viewed is not None and viewed.first_block == 1 and viewed.seq_len == 14
    gathered = plan_step(metadata([(13, 1)], 20, gen), cache).single
    assert gathered is not None and gathered.first_block is None
    assert plan_step(metadata([(13, 1), (2, 1)], 20, gen), cache).single is None
    assert plan_step(metadata([(13, 3)], 20, gen), cache).single is None


def test_bf16_within_rounding() -> None:
    got, want = compare(MIXED, 8, 2, 5, dtype=torch.bfloat16, seed=1)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_plan_is_made_once_per_forward() -> None:
    """Every layer of a forward reads the same plan; the next forward's metadata gets a new one."""
    gen = torch.Generator().manual_seed(0)
    backend = CpuBackend()
    meta = metadata(MIXED, 60, gen)
    k_cache = torch.randn(60, BLOCK, 2, DIM, generator=gen)
    q = torch.randn(meta.query_start_loc_cpu[-1], 8, DIM, generator=gen)
    backend.forward(q, k_cache, k_cache, meta, SCALE)
    first = backend._plans[(id(meta), Visibility())]
    backend.forward(q, k_cache, k_cache, meta, SCALE)
    assert backend._plans[(id(meta), Visibility())] is first
    other = metadata(MIXED, 60, gen)
    backend.forward(q, k_cache, k_cache, other, SCALE)
    assert backend._plans[(id(other), Visibility())] is not first
    backend.forward(q, k_cache, k_cache, other, SCALE, sliding_window=5)
    assert backend._plans[(id(other), Visibility(5))].see == Visibility(5)  # its own plan


WINDOWED = [(12, 1), (0, 9), (7, 6), (30, 1), (21, 4), (17, 1), (40, 1), (33, 7)]


@pytest.mark.parametrize("window", [1, 5, 8, 13])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("specs", [WINDOWED, [(29, 1)], [(26, 5)]], ids=["batch", "one", "chunk"])
def test_blocks_behind_the_window_are_never_read(
    window: int, backend: str, specs: list[tuple[int, int]]
) -> None:
    """A window KV group gives back the blocks wholly behind the window of a sequence's first
    new token and holds the null block in their place (engine_core/block_manager.py): point
    those entries at a block of NaN and the output is what the intact tables give, for decodes,
    batched or alone, and for prompt chunks whose first query needs the window behind it."""
    gen = torch.Generator().manual_seed(window)
    num_blocks = len(specs) * 11 + 1
    meta = metadata(specs, num_blocks, gen)
    shape = (num_blocks + 1, BLOCK, 2, DIM)  # the last block: the stand-in for the null block
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_cache[-1], v_cache[-1] = float("nan"), float("nan")
    q = torch.randn(meta.query_start_loc_cpu[-1], 8, DIM, generator=gen)
    want = REFERENCE.forward(q, k_cache, v_cache, meta, SCALE, window)
    nulled = meta.block_tables.clone()
    starts, behind = meta.query_start_loc_cpu, 0
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        first_query = seq_len - (starts[seq + 1] - starts[seq])
        first = max(0, first_query - window + 1) // BLOCK
        nulled[seq, :first] = num_blocks
        behind += first
    assert behind > 0  # the case holds blocks behind the window
    meta.block_tables = nulled
    run = CpuBackend() if backend == "cpu" else REFERENCE
    got = run.forward(q, k_cache, v_cache, meta, SCALE, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_plan_splits_decodes_from_prompts() -> None:
    meta = metadata(MIXED, 60, torch.Generator().manual_seed(0))
    plan = plan_step(meta, torch.empty(60, BLOCK, 2, DIM))
    assert plan.prompts == [1, 2, 5]
    assert plan.decode is not None
    starts = meta.query_start_loc_cpu
    assert plan.decode.rows is not None
    assert plan.decode.rows.tolist() == [starts[0], starts[3], starts[4]]
    assert plan.decode.seq_lens.tolist() == [13, 31, 1]
    assert plan.decode.slots == -(-31 // BLOCK) * BLOCK


@pytest.mark.parametrize("padded", [False, True])
def test_write_kv_matches_reference(padded: bool) -> None:
    """Every written slot holds its token's K and V, padding (-1) writes nothing, the rest of
    the cache keeps its values: the same cache as the reference's write."""
    gen = torch.Generator().manual_seed(5)
    shape = (10, BLOCK, 2, DIM)
    before = torch.randn(shape, generator=gen)
    slots = torch.randperm(10 * BLOCK, generator=gen)[:7]
    if padded:
        slots[[1, 4]] = -1
    k, v = torch.randn(7, 2, DIM, generator=gen), torch.randn(7, 2, DIM, generator=gen)
    got_k, got_v, want_k, want_v = (before.clone() for _ in range(4))
    CpuBackend().write_kv(got_k, got_v, k, v, slots)
    REFERENCE.write_kv(want_k, want_v, k, v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    written = slots[slots >= 0]
    assert torch.equal(got_k.view(-1, 2, DIM)[written], k[slots >= 0])
    assert not torch.equal(got_k, before)


def chunked_by_hand(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    chunk: int,
) -> torch.Tensor:
    """Chunked local attention query by query: the query at position p attends to the keys at
    positions p // chunk * chunk .. p, read through the intact block tables."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        slots = [
            int(meta.block_tables[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in range(seq_len)
        ]
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [L, KVH, D]
        values = v_cache.view(-1, *v_cache.shape[2:])[slots]
        group = q.shape[1] // keys.shape[1]
        for row in range(starts[seq], starts[seq + 1]):
            p = seq_len - (starts[seq + 1] - row)
            lo = p // chunk * chunk
            k = keys[lo : p + 1].repeat_interleave(group, dim=1)  # [n, H, D]
            v = values[lo : p + 1].repeat_interleave(group, dim=1)
            weights = torch.einsum("hd,nhd->hn", q[row], k).mul(SCALE).softmax(dim=-1)
            out[row] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.mark.parametrize("chunk", [1, 4, 6, 16])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("specs", [WINDOWED, [(29, 1)], [(26, 5)]], ids=["batch", "one", "chunk"])
def test_chunked_attention_reads_only_its_chunk(
    chunk: int, backend: str, specs: list[tuple[int, int]]
) -> None:
    """Llama 4's chunked local attention: each query sees only its own chunk of positions. A
    chunked KV group gives back the blocks wholly before the chunk of a sequence's first new
    token (the null block in their place): with those entries on a block of NaN, the output is
    the attention computed query by query over the intact tables."""
    gen = torch.Generator().manual_seed(chunk)
    num_blocks = len(specs) * 11 + 1
    meta = metadata(specs, num_blocks, gen)
    shape = (num_blocks + 1, BLOCK, 2, DIM)  # the last block: the stand-in for the null block
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_cache[-1], v_cache[-1] = float("nan"), float("nan")
    q = torch.randn(meta.query_start_loc_cpu[-1], 8, DIM, generator=gen)
    want = chunked_by_hand(q, k_cache, v_cache, meta, chunk)
    nulled = meta.block_tables.clone()
    starts, behind = meta.query_start_loc_cpu, 0
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        first_query = seq_len - (starts[seq + 1] - starts[seq])
        first = first_query // chunk * chunk // BLOCK
        nulled[seq, :first] = num_blocks
        behind += first
    assert behind > 0  # the case holds blocks before the chunk
    meta.block_tables = nulled
    run = CpuBackend() if backend == "cpu" else REFERENCE
    got = run.forward(q, k_cache, v_cache, meta, SCALE, attention_chunk=chunk)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("queries", "length", "heads", "kv_heads", "dtype", "tol"),
    [
        (1, 5, 4, 2, torch.float32, 1e-5),
        (7, 100, 9, 3, torch.float32, 1e-5),
        (64, 65, 8, 8, torch.float32, 1e-5),
        (33, 300, 4, 1, torch.bfloat16, 2e-2),
    ],
)
def test_a_chunk_over_its_prefix_is_two_flash_calls_merged(
    queries: int, length: int, heads: int, kv_heads: int, dtype: torch.dtype, tol: float
) -> None:
    """A chunk's (or a prefix hit's) queries over their whole context, unmasked over the prefix
    and causal over the chunk, merged by log-sum-exp: SDPA's masked attention's numbers, in
    float32 from the same inputs."""
    from engine_core.attention.cpu_backend import prefix_and_chunk_attention, visible_keys

    torch.manual_seed(queries)
    q = torch.randn(queries, heads, 32, dtype=dtype)
    k = torch.randn(length, kv_heads, 32, dtype=dtype)
    v = torch.randn(length, kv_heads, 32, dtype=dtype)
    keep = visible_keys(queries, length, None)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None].float() for t in (q, k, v)),
        attn_mask=keep, enable_gqa=True, scale=0.2,
    )[0].transpose(0, 1)  # fmt: skip
    got = prefix_and_chunk_attention(q, k, v, 0.2)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize(("kv_heads", "dtype"), [(3, torch.float32), (1, torch.bfloat16)])
def test_rotating_q_and_k_together_equals_each_alone(
    tokens: int, rotary_dim: int, kv_heads: int, dtype: torch.dtype
) -> None:
    """Off CUDA, q's and k's heads cut from one qkv projection rotate as one tensor; each must
    come out exactly as rotated alone (the rotate-half formula, a partial rotary's pass-through
    dims), and q and k from separate tensors still rotate each alone."""
    from engine_core.models.layers import adjacent_heads, apply_rotary, rotate_qk

    torch.manual_seed(tokens)
    heads, head_dim = 9, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    cos, sin = (torch.randn(tokens, rotary_dim, dtype=dtype) for _ in range(2))
    assert adjacent_heads(q, k) is not None
    got_q, got_k = rotate_qk(q, k, cos, sin)
    assert torch.equal(got_q, apply_rotary(q.clone(), cos, sin))
    assert torch.equal(got_k, apply_rotary(k.clone(), cos, sin))
    # k before q, or from another tensor: no shared view, each rotated alone.
    assert adjacent_heads(k, q) is None and adjacent_heads(q, k.clone()) is None
    apart_q, apart_k = rotate_qk(q.clone(), k.clone(), cos, sin)
    assert torch.equal(apart_q, got_q) and torch.equal(apart_k, got_k)
