"""Triton kernels against the torch reference backend, on fresh random paged caches; the fused
elementwise kernels against the torch code of models/layers.py; and the models on the fused path
(Triton layers and attention, float32) against HF transformers.

On a GPU this covers bf16 caches over block sizes 16 and 32, head dims 64 and 128, GQA ratios 1,
3 and 4, contexts from 1 to several thousand tokens, mixed prefill/decode batches and
prefix-cached prefills. Without a GPU it is skipped, unless ``TRITON_INTERPRET=1`` is set: then
the same tests run a few small float32 shapes through Triton's CPU interpreter (whose bf16 dot
is unreliable, hence float32 there)::

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_kernels.py -q
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.gpu
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with int(),
    which NumPy >= 2.4 refuses for arrays that are not 0-d; take the element instead."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if INTERPRET:
    patch_interpreter_index()

from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    NewTokens,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_decode_attention,
    rotary_write_kv_cache,
    write_kv_cache,
)
from engine_core.loader import load_model  # noqa: E402
from engine_core.models import layers  # noqa: E402
from engine_core.models.triton_ops import (  # noqa: E402
    gelu_new,
    layer_norm,
    qk_norm_rotary_inplace,
    rms_norm,
    rotary_cos_sin,
    rotary_inplace,
    row_argmax,
    silu_and_mul,
    stage_decode_inputs,
)
from tests.paged_harness import generate_greedy, hf_greedy  # noqa: E402
from tests.test_models_hf import PROMPTS, make_hf_model  # noqa: E402
from tests.triton_variants import compiled_variants  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16
# ‖out - ref‖ / ‖ref‖: bf16 operands land between 1e-3 and 1e-2; exact float32 far below.
TOLERANCE = 1e-4 if INTERPRET else 1.5e-2
REFERENCE = TorchReferenceBackend()

if INTERPRET:
    BLOCK_SIZES = [16]
    HEAD_SHAPES = [(2, 2, 64), (3, 1, 32), (8, 2, 128)]  # (heads, kv_heads, head_dim)
    DECODE_CONTEXTS = [1, 5, 16, 47, 130]
    PREFILL_SPECS = [(0, 1), (0, 37), (20, 3), (70, 1), (33, 40)]  # (cached context, new tokens)
else:
    BLOCK_SIZES = [16, 32]
    HEAD_SHAPES = [(h * r, h, d) for d in (64, 128) for h, r in ((4, 1), (3, 3), (8, 4), (2, 4))]
    DECODE_CONTEXTS = [1, 2, 15, 16, 17, 100, 255, 257, 1000, 2049, 3000, 4500]
    PREFILL_SPECS = [
        (0, 1),
        (0, 7),
        (0, 128),
        (0, 700),
        (16, 1),
        (31, 1),
        (1000, 1),
        (48, 5),
        (2048, 64),
        (513, 200),
        (3000, 1),
        (0, 2000),
    ]


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim]: the new tokens' K
    v: torch.Tensor  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
    extra_table_width: int = 2,
) -> PagedBatch:
    """Sequences of (cached context, new tokens), each on shuffled blocks of a random cache."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + extra_table_width
    tables = torch.zeros(len(specs), width, dtype=torch.int32)
    slots, starts, seq_lens = [], [0], []
    for i, ((context, new), count) in enumerate(zip(specs, needed, strict=True)):
        blocks, order = order[:count], order[count:]
        tables[i, :count] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(context, context + new):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + new)
        seq_lens.append(context + new)
    num_tokens = starts[-1]
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(
        q=randn(gen, num_tokens, heads, head_dim),
        k=randn(gen, num_tokens, kv_heads, head_dim),
        v=randn(gen, num_tokens, kv_heads, head_dim),
        k_cache=randn(gen, *cache_shape),
        v_cache=randn(gen, *cache_shape),
        meta=meta,
    )


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel fails to write fails the check."""
    return torch.full_like(like, float("nan"))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), "some output elements were never written (or are NaN)"
    err = relative_error(out, ref)
    assert err < TOLERANCE, f"relative error {err:.2e} >= {TOLERANCE:.0e}"


def reference_attention(batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    return REFERENCE.forward(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)


def qkv_views_and_angles(batch: PagedBatch, partial: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """The batch's q, k, v as strided views of one qkv projection (as the Llama attention hands
    them over) and rotary cos/sin at random positions, over the whole head or its first half
    (Phi-3's partial rotary)."""
    num_tokens, heads, head_dim = batch.q.shape
    kv_heads = batch.k.shape[1]
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(widths, dim=1))
    rot = head_dim // 2 if partial else head_dim
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = layers.RotaryEmbedding(rot, 10000.0).to(DEVICE)(positions, DTYPE)
    return q, k, v, cos, sin


# ---- KV-cache write -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_write_kv_matches_reference_and_skips_padding(
    block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    specs = [(c, n) for c, n in PREFILL_SPECS]
    batch = make_batch(specs, heads, kv_heads, head_dim, block_size, seed=block_size + head_dim)
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1  # padding rows: their slots must keep the old contents
    # K as a strided view of a wider projection, as the models hand it over.
    wide = torch.cat([batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    k = wide[:, : kv_heads * head_dim].view_as(batch.k)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    REFERENCE.write_kv(ref_k, ref_v, batch.k, batch.v, slots)
    write_kv_cache(k, batch.v, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, ref_k)
    assert torch.equal(batch.v_cache, ref_v)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("partial", [False, True], ids=["whole-heads", "partial-rotary"])
@pytest.mark.parametrize("kv", ["cache-dtype", "fp8"])
def test_rotary_in_the_kv_write_equals_rotary_then_write(
    block_size: int, heads: int, kv_heads: int, head_dim: int, partial: bool, kv: str
) -> None:
    """One launch (rotary_write_kv_cache) against the two it replaces (rotary_inplace over the
    rotary dims, then write_kv_cache), on q, k, v viewed from one qkv projection as the Llama
    attention hands them over: the same rotated q, bit for bit, and the same cache, padding
    slots (-1) untouched; k and v are read, not written. Half-head rotary as Phi-3's; an e4m3
    cache with scales on the GPU."""
    if kv == "fp8" and INTERPRET:
        pytest.skip("e4m3 caches need the GPU")
    specs = [(c, n) for c, n in PREFILL_SPECS]
    batch = make_batch(specs, heads, kv_heads, head_dim, block_size, seed=block_size + heads)
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1
    q, k, v, cos, sin = qkv_views_and_angles(batch, partial, seed=heads)
    rot = cos.shape[1]
    scales = (0.5, 2.0) if kv == "fp8" else (1.0, 1.0)
    k_cache, v_cache = batch.k_cache, batch.v_cache
    if kv == "fp8":
        k_cache = (k_cache.float() / scales[0]).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / scales[1]).to(torch.float8_e4m3fn)
    ref_q, ref_k = q.clone(), k.clone()
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    rotary_inplace(ref_q[..., :rot], ref_k[..., :rot], cos, sin)
    write_kv_cache(ref_k, v, ref_k_cache, ref_v_cache, slots, *scales)
    k_before, v_before = k.clone(), v.clone()
    rotary_write_kv_cache(q, k, v, cos, sin, k_cache, v_cache, slots, *scales)
    assert torch.equal(q, ref_q)
    assert torch.equal(k_cache.float(), ref_k_cache.float())
    assert torch.equal(v_cache.float(), ref_v_cache.float())
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


# ---- decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_decode_matches_reference(
    block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS]
    batch = make_batch(specs, heads, kv_heads, head_dim, block_size, seed=heads * head_dim)
    scale = head_dim**-0.5
    ref = reference_attention(batch, scale)
    out = paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        scale,
        out=poisoned(batch.q),
    )
    assert_close(out, ref)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
def test_decode_splits_give_the_same_attention(num_splits: int) -> None:
    """Forced split counts, down to splits shorter than most sequences, merge to the same result."""
    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS]
    batch = make_batch(specs, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=num_splits)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        scale,
        num_splits=num_splits,
        min_split_tokens=16,
        out=poisoned(batch.q),
    )
    assert_close(out, reference_attention(batch, scale))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_in_a_row_order_gives_each_row_its_own_attention(num_splits: int) -> None:
    """Sequences launched longest first (``row_order``, a permutation) attend exactly as in
    the batch's order, each into its own output row, split or not; an order of the wrong
    length is refused."""
    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS]
    batch = make_batch(specs, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=5 + num_splits)
    lens = batch.meta.seq_lens
    longest_first = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    in_batch_order = torch.arange(len(lens), device=lens.device)
    assert not torch.equal(longest_first.long(), in_batch_order)  # a real permutation
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables, lens, head_dim**-0.5)
    common = dict(num_splits=num_splits, min_split_tokens=16)
    ordered = paged_decode_attention(
        *args, row_order=longest_first, out=poisoned(batch.q), **common
    )
    assert torch.equal(ordered, paged_decode_attention(*args, **common))
    assert_close(ordered, reference_attention(batch, head_dim**-0.5))
    with pytest.raises(ValueError, match="permutation"):
        paged_decode_attention(*args, row_order=longest_first[1:], **common)


def test_decode_reads_block_tables_through_their_row_stride() -> None:
    """The input batch hands the kernels a narrowed view of block tables that have room past
    the widest (rows strided by the room): the same attention as from contiguous tables, and
    nothing read past a row's width (the room holds block ids far out of the cache)."""
    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS]
    batch = make_batch(specs, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=11)
    tables = batch.meta.block_tables
    rows, width = tables.shape
    room = torch.full((rows, width + 5), 1 << 30, dtype=tables.dtype, device=tables.device)
    room[:, :width] = tables
    narrowed = room[:, :width]
    assert narrowed.stride(0) == width + 5
    common = dict(num_splits=3, min_split_tokens=16)
    args = (batch.q, batch.k_cache, batch.v_cache)
    want = paged_decode_attention(*args, tables, batch.meta.seq_lens, head_dim**-0.5, **common)
    got = paged_decode_attention(*args, narrowed, batch.meta.seq_lens, head_dim**-0.5, **common)
    assert torch.equal(got, want)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_rows_give_zeros(num_splits: int) -> None:
    """Rows with seq_len 0 (CUDA-graph padding) read nothing and write zeros, not NaN."""
    heads, kv_heads, head_dim = HEAD_SHAPES[0]
    batch = make_batch([(9, 1), (40, 1), (3, 1)], heads, kv_heads, head_dim, BLOCK_SIZES[0], 7)
    seq_lens = batch.meta.seq_lens.clone()
    seq_lens[1] = 0
    out = paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.block_tables,
        seq_lens,
        head_dim**-0.5,
        num_splits=num_splits,
        min_split_tokens=16,
        out=poisoned(batch.q),
    )
    ref = reference_attention(batch, head_dim**-0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], ref[[0, 2]])


# (heads, kv heads, head dim, shared tokens, decode splits, shared tile, sequences)
SHARED_PAGES_CASES = [
    (*HEAD_SHAPES[-1], 48, 1, 64, 6),  # one shared partial a row, one decode split
    (*HEAD_SHAPES[-1], 48, 3, 16, 6),  # three shared partials folded, three decode splits
    (*HEAD_SHAPES[1], 32, 2, 16, 6),  # a group of 3: row tiles that cut through a sequence
    (*HEAD_SHAPES[-1], 48, 2, 16, 20),  # 80 query rows a kv head: two row tiles
    (*HEAD_SHAPES[-1], 0, 2, 16, 6),  # the kernel launched, no pages shared this step
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "shared", "num_splits", "shared_tile", "sequences"),
    SHARED_PAGES_CASES,
)
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_over_shared_pages_matches_reference(
    monkeypatch: pytest.MonkeyPatch,
    heads: int,
    kv_heads: int,
    head_dim: int,
    shared: int,
    num_splits: int,
    shared_tile: int,
    sequences: int,
    sinks: bool,
) -> None:
    """Sequences whose tables open with the same pages (a shared system prompt), attended once
    for all of them by the shared-prefix kernel and folded into each sequence's own decode:
    the reference's attention over each whole table, a padding row's zeros, every output
    written. Shared tiles and splits of 16 tokens give a row several partials to fold."""
    from engine_core.attention import triton_kernels

    monkeypatch.setattr(triton_kernels, "SHARED_BLOCK_N", shared_tile)
    monkeypatch.setattr(triton_kernels, "SHARED_MIN_SPLIT_TOKENS", shared_tile)
    contexts = [(49, 64, 90, 130, 200, 51)[i % 6] + i // 6 for i in range(sequences)]
    block = BLOCK_SIZES[0]
    batch = make_batch([(c - 1, 1) for c in contexts], heads, kv_heads, head_dim, block, seed=5)
    tables = batch.meta.block_tables
    tables[:, : shared // block] = tables[0, : shared // block].clone()
    seq_lens = batch.meta.seq_lens.clone()
    seq_lens[4] = 0  # a graph's padding row
    scale = head_dim**-0.5
    gen = torch.Generator().manual_seed(3)
    sink_logits = torch.randn(heads, generator=gen).to(DEVICE) if sinks else None
    folded: list[int] = []
    launch = triton_kernels._shared_prefix_partials

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        result = launch(*args)
        folded.append(result[2])
        return result

    monkeypatch.setattr(triton_kernels, "_shared_prefix_partials", counted)
    out = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, tables, seq_lens, scale,
        num_splits=num_splits, min_split_tokens=16, out=poisoned(batch.q), sinks=sink_logits,
        shared_prefix=torch.tensor([shared, 0], dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    ref = REFERENCE.forward(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, sinks=sink_logits
    )
    # The partials a row folds: the splits that hold shared tokens (the kernel's split length).
    per_split = -(-shared // folded[0])
    split_len = -(-per_split // shared_tile) * shared_tile
    partials = -(-shared // split_len) if shared else 0
    assert partials >= (0 if shared == 0 else 1 if shared_tile == 64 else 2)
    real = [i for i in range(sequences) if i != 4]
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert_close(out[real], ref[real])


def test_decode_over_shared_pages_refuses_what_it_does_not_serve() -> None:
    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    batch = make_batch([(40, 1), (50, 1)], heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=2)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens)
    shared = torch.tensor([16, 0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="plain decode"):
        paged_decode_attention(*args, 0.1, sliding_window=8, shared_prefix=shared)
    with pytest.raises(ValueError, match=r"\[tokens, row\]"):  # the kernel reads both
        paged_decode_attention(*args, 0.1, shared_prefix=shared[:1])
    wide = make_batch([(40, 1), (50, 1)], 2, 1, 256, BLOCK_SIZES[0], seed=2)
    wide_args = (wide.q, wide.k_cache, wide.v_cache, wide.meta.block_tables, wide.meta.seq_lens)
    with pytest.raises(ValueError, match="head dim of 16 to 128"):
        paged_decode_attention(*wide_args, 0.1, shared_prefix=shared)
    # The backend does not ask for it there (nor for windows), whatever the step found.
    meta = dataclasses.replace(wide.meta, shared_prefix=shared)
    rows = wide.q.repeat(4, 1, 1)  # 8 query rows: SHARED_PREFIX_MIN_ROWS
    backend = TritonBackend()
    assert backend.shared_prefix(meta, rows, wide.k_cache, None, None) is None
    narrow = rows[..., :128]
    assert backend.shared_prefix(meta, narrow, wide.k_cache, 64, None) is None
    assert backend.shared_prefix(meta, narrow, wide.k_cache, None, None) is shared
    assert backend.shared_prefix_passes == 1  # what the graph runner counts


@pytest.mark.parametrize("window", [1, 8, 100])
def test_decode_sliding_window(window: int) -> None:
    heads, kv_heads, head_dim = HEAD_SHAPES[1]
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS]
    batch = make_batch(specs, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=window)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        scale,
        sliding_window=window,
        num_splits=3,
        min_split_tokens=16,
    )
    assert_close(out, reference_attention(batch, scale, window))


# Every head shape and block size with the engine's split count; forced splits and a window on
# one shape (each variant compiles its own kernel: the GPU run's time goes there).
ROTARY_DECODE_CASES = [(b, *shape, None, None) for b in BLOCK_SIZES for shape in HEAD_SHAPES]
ROTARY_DECODE_CASES += [(BLOCK_SIZES[0], *HEAD_SHAPES[1], 1, None)]
ROTARY_DECODE_CASES += [(BLOCK_SIZES[0], *HEAD_SHAPES[1], 3, 20)]


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim", "num_splits", "window"), ROTARY_DECODE_CASES
)
@pytest.mark.parametrize("partial", [False, True], ids=["whole-heads", "partial-rotary"])
@pytest.mark.parametrize("kv", ["cache-dtype", "fp8"])
def test_rotary_decode_equals_rotary_write_then_decode(
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    partial: bool,
    kv: str,
    num_splits: int | None,
    window: int | None,
) -> None:
    """A decode step's rotary, KV write and attention in one launch (rotary_decode_attention)
    against the two launches it replaces (rotary_write_kv_cache, paged_decode_attention) and
    the torch reference over what they wrote: the same caches bit for bit, a padding row's
    (seq_len 0, slot -1) zeros and untouched slot, q and k not written, the attention within
    rounding (the new token opens the softmax before the cache's tiles, not inside the last)."""
    if kv == "fp8" and INTERPRET:
        pytest.skip("e4m3 caches need the GPU")
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS]
    batch = make_batch(specs, heads, kv_heads, head_dim, block_size, seed=heads + head_dim)
    num_tokens = batch.q.shape[0]
    q, k, v, cos, sin = qkv_views_and_angles(batch, partial, seed=head_dim)
    slots, seq_lens = batch.meta.slot_mapping.clone(), batch.meta.seq_lens.clone()
    slots[1], seq_lens[1] = -1, 0  # a CUDA-graph padding row
    scales = (0.5, 2.0) if kv == "fp8" else (1.0, 1.0)
    k_cache, v_cache = batch.k_cache, batch.v_cache
    if kv == "fp8":
        k_cache = (k_cache.float() / scales[0]).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / scales[1]).to(torch.float8_e4m3fn)
    ref_q, ref_k_cache, ref_v_cache = q.clone(), k_cache.clone(), v_cache.clone()
    rotary_write_kv_cache(ref_q, k, v, cos, sin, ref_k_cache, ref_v_cache, slots, *scales)
    launch = {"sliding_window": window, "num_splits": num_splits, "k_scale": scales[0]}
    launch |= {"v_scale": scales[1], "min_split_tokens": 16 if num_splits else None}
    tables, scale = batch.meta.block_tables, head_dim**-0.5
    two_launches = paged_decode_attention(
        ref_q, ref_k_cache, ref_v_cache, tables, seq_lens, scale, **launch
    )
    q_before, k_before = q.clone(), k.clone()
    out = rotary_decode_attention(
        q, NewTokens(k, v, cos, sin, slots), k_cache, v_cache, tables, seq_lens, scale,
        out=poisoned(q), **launch,
    )  # fmt: skip
    assert torch.equal(k_cache.float(), ref_k_cache.float())
    assert torch.equal(v_cache.float(), ref_v_cache.float())
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    real = [i for i in range(num_tokens) if i != 1]
    meta = dataclasses.replace(batch.meta, seq_lens=seq_lens)
    ref = REFERENCE.forward(ref_q, ref_k_cache, ref_v_cache, meta, scale, window, *scales)
    assert_close(out[real], ref[real])
    assert_close(out[real], two_launches[real])


def test_a_rotated_decode_over_shared_pages_writes_first_then_takes_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heads that rotate in the decode launch (the backend's decode_rotated) take the
    shared-prefix pass in a step with a shared prefix: q and the new k rotated and written
    first (as rotary_write_kv_cache writes them), then the plain decode with the pass. The
    caches and the attention as the reference's over what that write left; without a shared
    prefix, the fused launch and no pass, with the same result."""
    from engine_core.attention import triton_kernels

    heads, kv_heads, head_dim = HEAD_SHAPES[0]
    block, shared = BLOCK_SIZES[0], 48
    contexts = [(49, 64, 90, 130, 200, 51)[i % 6] + i for i in range(10)]
    batch = make_batch([(c - 1, 1) for c in contexts], heads, kv_heads, head_dim, block, seed=9)
    batch.meta.block_tables[:, : shared // block] = batch.meta.block_tables[0, : shared // block]
    q, k, v, cos, sin = qkv_views_and_angles(batch, partial=False, seed=4)
    scale = head_dim**-0.5
    ref_q, ref_k_cache, ref_v_cache = q.clone(), batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping
    rotary_write_kv_cache(ref_q, k, v, cos, sin, ref_k_cache, ref_v_cache, slots)
    ref = REFERENCE.forward(ref_q, ref_k_cache, ref_v_cache, batch.meta, scale)
    passes: list[int] = []
    launch = triton_kernels._shared_prefix_partials

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        passes.append(1)
        return launch(*args)

    monkeypatch.setattr(triton_kernels, "_shared_prefix_partials", counted)
    backend = TritonBackend()
    assert backend.rotates_in_decode(head_dim)
    for shared_prefix in (torch.tensor([shared, 0], dtype=torch.int32, device=DEVICE), None):
        q, k, v, cos, sin = qkv_views_and_angles(batch, partial=False, seed=4)  # q unrotated
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        meta = dataclasses.replace(batch.meta, shared_prefix=shared_prefix)
        out = backend.decode_rotated(q, k, v, cos, sin, k_cache, v_cache, meta, scale)
        assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)
        assert_close(out, ref)
        assert len(passes) == 1  # the shared step's
    assert backend.shared_prefix_passes == 1


# ---- prefill (varlen, paged, prefix-cached, mixed with decodes) -----------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_prefill_matches_reference(
    block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    batch = make_batch(PREFILL_SPECS, heads, kv_heads, head_dim, block_size, seed=block_size)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        batch.meta.query_start_loc,
        batch.meta.max_query_len,
        scale,
        out=poisoned(batch.q),
    )
    assert_close(out, reference_attention(batch, scale))


TMA_SHAPES = [(8, 2, 64), (8, 2, 128)] if INTERPRET else [(32, 8, 128), (32, 8, 64), (8, 8, 128)]


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), TMA_SHAPES)
@pytest.mark.parametrize("graph_rows", [0, 5])
def test_descriptor_load_prefill_matches_reference(
    block_size: int, heads: int, kv_heads: int, head_dim: int, graph_rows: int
) -> None:
    """The descriptor-load prefill kernel over pages of whole key tiles: prompts fresh and
    after cached context, shorter than a tile and spanning pages, Q a strided view of the qkv
    projection; with a prefill graph's padding (query rows and sequences no program visits, a
    work list padded with rows that name none: the padding rows stay zeros)."""
    from engine_core.attention.prefill_tiles import capacity, prefill_block_m, query_lens, tile_list
    from engine_core.attention.triton_kernels import tma_page_prefill_attention

    specs = PREFILL_SPECS if INTERPRET else [*PREFILL_SPECS, (37, 300), (64, 64)]
    batch = make_batch(specs, heads, kv_heads, head_dim, block_size, seed=head_dim + block_size)
    meta = batch.meta
    q = qkv_views_and_angles(batch, partial=False, seed=1)[0]
    scale = head_dim**-0.5
    ref = reference_attention(batch, scale)
    out, tiles = poisoned(q), None
    if graph_rows:
        meta, q = padded_like_a_graph(meta, q, graph_rows, sequences=2)
        out = torch.zeros_like(q)
        block_m = prefill_block_m(q.shape[0])
        rows = capacity(q.shape[0], meta.num_seqs, block_m) + 7
        tiles = torch.from_numpy(tile_list(query_lens(meta.query_start_loc_cpu), block_m, rows))
        tiles = tiles.to(DEVICE)
        assert (tiles[:, 0] < 0).any()  # rows that name no sequence
    out = tma_page_prefill_attention(
        q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, scale, out, tiles,
    )  # fmt: skip
    tokens = ref.shape[0]
    assert_close(out[:tokens], ref)
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


def test_descriptor_load_prefill_leaves_one_token_sequences_alone() -> None:
    """skip_decodes: the rows of one-token sequences keep what the decode kernel wrote there
    (here: poison); the prompt rows equal the reference's."""
    from engine_core.attention.triton_kernels import tma_page_prefill_attention

    heads, kv_heads, head_dim = TMA_SHAPES[0]
    batch = make_batch(MIXED_SPECS, heads, kv_heads, head_dim, 32, seed=51)
    meta, scale = batch.meta, head_dim**-0.5
    ref = reference_attention(batch, scale)
    out = tma_page_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, scale, poisoned(batch.q), skip_decodes=True,
    )  # fmt: skip
    lens = torch.tensor(meta.query_start_loc_cpu).diff()
    prompt_rows = torch.repeat_interleave(lens > 1, lens).to(DEVICE)
    assert_close(out[prompt_rows], ref[prompt_rows])
    assert out[~prompt_rows].isnan().all()


@pytest.mark.skipif(INTERPRET, reason="descriptor loads need a GPU with TMA")
def test_the_engine_launch_takes_descriptor_loads_only_where_the_cache_allows() -> None:
    """Pages of 32 tokens or a multiple, bf16, heads of 128, contiguous caches:
    tma_pages_serve; pages of 16, an FP8 cache, heads of 64 or 96 or a cache whose kv heads are
    not dense in a page: not."""
    from engine_core.attention.triton_kernels import tma_pages_serve

    def cache(page: int, head_dim: int = 128, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        return torch.zeros(4, page, 2, head_dim, device=DEVICE).to(dtype)

    q = torch.zeros(8, 8, 128, device=DEVICE, dtype=DTYPE)
    assert tma_pages_serve(q, cache(32), cache(32), None)
    assert tma_pages_serve(q, cache(64), cache(64), torch.zeros_like(q))
    assert not tma_pages_serve(q, cache(16), cache(16), None)
    fp8 = cache(32, dtype=torch.float8_e4m3fn)
    assert not tma_pages_serve(q, fp8, fp8, None)
    for head_dim in (64, 96):
        q_small = torch.zeros(8, 8, head_dim, device=DEVICE, dtype=DTYPE)
        assert not tma_pages_serve(q_small, cache(32, head_dim), cache(32, head_dim), None)
    heads_outer = torch.zeros(4, 2, 32, 128, device=DEVICE, dtype=DTYPE).transpose(1, 2)
    assert not tma_pages_serve(q, heads_outer, heads_outer, None)


def test_descriptor_load_prefill_refuses_pages_it_cannot_read() -> None:
    from engine_core.attention.triton_kernels import tma_page_prefill_attention

    q = torch.zeros(4, 8, 128, device=DEVICE, dtype=DTYPE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    small = torch.zeros(2, 16, 2, 128, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="pages of 16"):
        tma_page_prefill_attention(q, small, small, tables, lens, starts, 1.0)
    strided = torch.zeros(2, 2, 32, 128, device=DEVICE, dtype=DTYPE).transpose(1, 2)
    with pytest.raises(ValueError, match="-strided pages of 32"):
        tma_page_prefill_attention(q, strided, strided, tables, lens, starts, 1.0)


@pytest.mark.skipif(INTERPRET, reason="the interpreter compiles nothing")
def test_block_table_width_compiles_no_new_attention_variant() -> None:
    """An eager step packs its block tables at its own widest width. The kernels must not be
    specialized on that width: each new width class would compile a variant in the middle of
    serving. Padded with unused columns to other widths, the tables give the same attention
    and no new compiled variant."""
    from engine_core.attention import triton_kernels

    heads, kv_heads, head_dim = HEAD_SHAPES[0]
    batch = make_batch(PREFILL_SPECS, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=5)
    scale = head_dim**-0.5
    expected = reference_attention(batch, scale)
    tables = batch.meta.block_tables
    narrow = tables.shape[1]
    aligned = -(-(narrow + 2) // 16) * 16  # a multiple of 16 wider than the tables
    counts = []
    for width in (narrow, narrow + 1, aligned, aligned + 1):
        wide = torch.zeros((tables.shape[0], width), dtype=tables.dtype, device=tables.device)
        wide[:, : tables.shape[1]] = tables
        out = paged_prefill_attention(
            batch.q, batch.k_cache, batch.v_cache, wide, batch.meta.seq_lens,
            batch.meta.query_start_loc, batch.meta.max_query_len, scale,
        )  # fmt: skip
        assert_close(out, expected)
        counts.append(compiled_variants(triton_kernels._prefill_kernel))
    assert counts == [counts[0]] * len(counts), counts


def test_prefill_padded_work_list_matches_reference() -> None:
    """A CUDA graph's work list: the step's tiles, then rows naming no sequence, which must
    do nothing (the output is poisoned beforehand)."""
    from engine_core.attention.prefill_tiles import capacity, prefill_block_m, query_lens, tile_list

    heads, kv_heads, head_dim = HEAD_SHAPES[0]
    batch = make_batch(PREFILL_SPECS, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=21)
    meta = batch.meta
    block_m = prefill_block_m(batch.q.shape[0])
    rows = capacity(batch.q.shape[0], meta.num_seqs, block_m) + 7
    tiles = tile_list(query_lens(meta.query_start_loc_cpu), block_m, rows)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        scale,
        out=poisoned(batch.q),
        tiles=torch.from_numpy(tiles).to(DEVICE),
    )
    assert_close(out, reference_attention(batch, scale))


@pytest.mark.parametrize("window", [1, 5, 64])
def test_prefill_sliding_window(window: int) -> None:
    heads, kv_heads, head_dim = HEAD_SHAPES[1]
    batch = make_batch(PREFILL_SPECS, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=window)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        batch.meta.query_start_loc,
        batch.meta.max_query_len,
        scale,
        sliding_window=window,
    )
    assert_close(out, reference_attention(batch, scale, window))


# ---- the backend: write, then attend, as an attention layer calls it ------------------------


@pytest.mark.parametrize("decode_only", [True, False])
def test_backend_write_then_attend_matches_reference(decode_only: bool) -> None:
    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS] if decode_only else PREFILL_SPECS
    batch = make_batch(specs, heads, kv_heads, head_dim, BLOCK_SIZES[-1], seed=11)
    scale = head_dim**-0.5
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    REFERENCE.write_kv(ref_k, ref_v, batch.k, batch.v, batch.meta.slot_mapping)
    ref = REFERENCE.forward(batch.q, ref_k, ref_v, batch.meta, scale)
    backend = TritonBackend()
    backend.write_kv(batch.k_cache, batch.v_cache, batch.k, batch.v, batch.meta.slot_mapping)
    out = backend.forward(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert batch.meta.is_decode_only == decode_only
    assert_close(out, ref)


def test_served_row_order_by_hand() -> None:
    """A decode step launches its rows longest first from ORDERED_DECODE_MIN_ROWS rows (a
    graph's, padding included), in the batch's order below that or without an order."""
    from engine_core.attention.triton_kernels import ORDERED_DECODE_MIN_ROWS, served_row_order

    order = torch.arange(300, dtype=torch.int32)
    assert served_row_order(None, 256) is None
    assert served_row_order(order, ORDERED_DECODE_MIN_ROWS - 1) is None
    assert served_row_order(order, ORDERED_DECODE_MIN_ROWS) is order
    assert served_row_order(order, 1024) is order


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_a_served_decode_step_longest_first_matches_reference(
    monkeypatch: pytest.MonkeyPatch, rotated: bool, shared: bool
) -> None:
    """A decode step of rows of spread lengths with its row order (the input batch's: longest
    first) through the backend as a layer calls it, plain or rotating in the decode launch,
    over a shared prefix or not, in two context splits: the launch takes the order, and each
    row gets the reference's attention in its own output row (the threshold lowered to this
    test's 12 rows)."""
    from engine_core.attention import triton_kernels

    monkeypatch.setattr(triton_kernels, "ORDERED_DECODE_MIN_ROWS", 12)
    heads, kv_heads, head_dim = HEAD_SHAPES[0] if rotated else HEAD_SHAPES[-1]
    block, shared_tokens = BLOCK_SIZES[0], 32
    contexts = [40 + (i * 131) % 560 for i in range(12)]
    batch = make_batch([(c - 1, 1) for c in contexts], heads, kv_heads, head_dim, block, seed=21)
    if shared:
        lead = shared_tokens // block
        batch.meta.block_tables[:, :lead] = batch.meta.block_tables[0, :lead]
    order = torch.argsort(batch.meta.seq_lens, descending=True, stable=True).to(torch.int32)
    shared_prefix = torch.tensor([shared_tokens, 0], dtype=torch.int32, device=DEVICE)
    meta = dataclasses.replace(
        batch.meta, row_order=order, shared_prefix=shared_prefix if shared else None
    )
    launched: list[torch.Tensor | None] = []
    real_decode = triton_kernels._decode

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        launched.append(kwargs["row_order"])
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "_decode", spy)
    monkeypatch.setattr(triton_kernels, "choose_num_splits", lambda *_: 2)
    backend, scale = TritonBackend(), head_dim**-0.5
    if rotated:
        assert backend.rotates_in_decode(head_dim)
        q, k, v, cos, sin = qkv_views_and_angles(batch, partial=False, seed=6)
        ref_q, ref_k_cache, ref_v_cache = q.clone(), batch.k_cache.clone(), batch.v_cache.clone()
        rotary_write_kv_cache(ref_q, k, v, cos, sin, ref_k_cache, ref_v_cache, meta.slot_mapping)
        ref = REFERENCE.forward(ref_q, ref_k_cache, ref_v_cache, meta, scale)
        out = backend.decode_rotated(q, k, v, cos, sin, batch.k_cache, batch.v_cache, meta, scale)
        assert torch.equal(batch.k_cache, ref_k_cache)
    else:
        backend.write_kv(batch.k_cache, batch.v_cache, batch.k, batch.v, meta.slot_mapping)
        ref = REFERENCE.forward(batch.q, batch.k_cache, batch.v_cache, meta, scale)
        out = backend.forward(batch.q, batch.k_cache, batch.v_cache, meta, scale)
    assert len(launched) == 1 and launched[0] is order
    assert backend.shared_prefix_passes == shared
    assert_close(out, ref)


# A mixed step: running decodes (some past a block or two of context, one at a window's edge)
# and prompt chunks, one of them a cached prefix's rest, and a decode after them.
MIXED_SPECS = [(c, 1) for c in (0, 3, 15, 16, 40, 63, 64, 90, 127)] + [(0, 21), (30, 9), (2, 1)]


def decode_arguments_seen(
    monkeypatch: pytest.MonkeyPatch, name: str, expected: torch.Tensor | None
) -> list[bool]:
    """Each call the backend makes to paged_decode_attention from now on: whether its
    argument ``name`` was ``expected`` (that very tensor)."""
    from engine_core.attention import triton_backend

    seen: list[bool] = []
    real_decode = triton_backend.paged_decode_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get(name) is expected)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    return seen


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("graph_rows", [0, 5])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_a_mixed_step_attends_its_decodes_through_the_decode_kernel(
    monkeypatch: pytest.MonkeyPatch,
    window: int | None,
    sinks: bool,
    graph_rows: int,
    block_size: int,
) -> None:
    """An eager step with MIXED_DECODE_ROWS or more one-token sequences, and a prefill graph's
    step (``graph_rows`` padding rows and two padding sequences, as cuda_graph.py pads them):
    the decode kernel attends the one-token sequences wherever they sit, the prefill kernel the
    rest (over pages of 32 on a GPU, through descriptor loads where neither window nor sinks
    are asked for); the output equals the reference's, and the padding rows are zeros."""
    from engine_core.attention import triton_backend

    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    batch = make_batch(MIXED_SPECS, heads, kv_heads, head_dim, block_size, seed=31)
    meta, q = batch.meta, batch.q
    assert meta.num_decode_rows == 10 >= triton_backend.MIXED_DECODE_ROWS
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    sink_logits = sink_logits if sinks else None
    scale = head_dim**-0.5
    ref = REFERENCE.forward(q, batch.k_cache, batch.v_cache, meta, scale, window, sinks=sink_logits)
    if graph_rows:
        meta, q = padded_like_a_graph(meta, q, graph_rows, sequences=2)
    mixed_calls = decode_arguments_seen(monkeypatch, "mixed_starts", meta.query_start_loc)
    out = TritonBackend().forward(
        q, batch.k_cache, batch.v_cache, meta, scale, window, sinks=sink_logits
    )
    assert mixed_calls == [True]
    tokens = ref.shape[0]
    assert_close(out[:tokens], ref)
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


@pytest.mark.parametrize("graph_rows", [0, 5])
def test_a_mixed_steps_decodes_attend_their_shared_pages_once(
    monkeypatch: pytest.MonkeyPatch, graph_rows: int
) -> None:
    """A step with prompt rows and ten one-token sequences whose tables open with the same two
    pages (the prompt rows' tables do not): the backend hands the decode kernel the shared
    prefix, and the output, prompt rows included, equals the reference's; a prefill graph's
    padding rows stay zeros."""

    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    # The prompt rows first: a one-token sequence's query row is not its sequence index.
    specs = [(0, 21), (30, 9)] + [(c, 1) for c in (40, 47, 63, 64, 90, 127, 33, 70, 51, 99)]
    block = BLOCK_SIZES[0]
    batch = make_batch(specs, heads, kv_heads, head_dim, block, seed=41)
    meta, q = batch.meta, batch.q
    meta.block_tables[2:, :2] = meta.block_tables[2, :2].clone()
    meta.shared_prefix = torch.tensor([2 * block, 2], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    ref = REFERENCE.forward(q, batch.k_cache, batch.v_cache, meta, scale)
    if graph_rows:
        meta, q = padded_like_a_graph(meta, q, graph_rows, sequences=2)
    shared_calls = decode_arguments_seen(monkeypatch, "shared_prefix", meta.shared_prefix)
    out = TritonBackend().forward(q, batch.k_cache, batch.v_cache, meta, scale)
    assert shared_calls == [True]
    tokens = ref.shape[0]
    assert_close(out[:tokens], ref)
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


def padded_like_a_graph(
    meta: AttentionMetadata, q: torch.Tensor, rows: int, sequences: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The step as a prefill graph holds it: ``rows`` more query rows (poisoned) and
    ``sequences`` more sequences of no tokens, no context and table rows of block 0."""
    starts = meta.query_start_loc_cpu + [meta.query_start_loc_cpu[-1]] * sequences
    lens = meta.seq_lens_cpu + [0] * sequences
    table = torch.cat(
        [meta.block_tables, meta.block_tables.new_zeros(sequences, meta.block_tables.shape[1])]
    )
    padded = dataclasses.replace(
        meta,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=table,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        padded=True,
        prefill_tiles=None,
    )
    return padded, torch.cat([q, poisoned(q[:rows])])


@pytest.mark.skipif(INTERPRET, reason="e4m3 tiles need the GPU")
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [HEAD_SHAPES[0], HEAD_SHAPES[-1]])
@pytest.mark.parametrize("window", [None, 100])
def test_fp8_cache_write_then_attend_matches_reference(
    decode_only: bool, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """--kv-cache-dtype fp8: an e4m3 cache with K and V scales, written and read by the Triton
    kernels, against the torch reference over the same cache."""
    specs = [(c - 1, 1) for c in DECODE_CONTEXTS] if decode_only else PREFILL_SPECS
    batch = make_batch(specs, heads, kv_heads, head_dim, BLOCK_SIZES[0], seed=12)
    scales, scale = (0.5, 2.0), head_dim**-0.5
    k_cache = (batch.k_cache.float() / scales[0]).to(torch.float8_e4m3fn)
    v_cache = (batch.v_cache.float() / scales[1]).to(torch.float8_e4m3fn)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    REFERENCE.write_kv(ref_k, ref_v, batch.k, batch.v, batch.meta.slot_mapping, *scales)
    ref = REFERENCE.forward(batch.q, ref_k, ref_v, batch.meta, scale, window, *scales)
    backend = TritonBackend()
    backend.write_kv(k_cache, v_cache, batch.k, batch.v, batch.meta.slot_mapping, *scales)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), rtol=2**-3, atol=2**-9)
    out = backend.forward(batch.q, k_cache, v_cache, batch.meta, scale, window, *scales)
    assert batch.meta.is_decode_only == decode_only
    assert_close(out, ref)


# ---- fused elementwise kernels against the torch layers they replace ------------------------

FUSED_TOKENS = [1, 5, 64] if INTERPRET else [1, 7, 64, 300]


FUSED_HIDDEN = [64, 576] if INTERPRET else [576, 768, 2048, 4096]
# Rotary also over head dims whose half is not a power of two (48, 96; Phi-2 has 80).
ROTARY_SHAPES = [*HEAD_SHAPES, (6, 2, 48)] if INTERPRET else [*HEAD_SHAPES, (32, 8, 96)]


@pytest.mark.parametrize("num_tokens", FUSED_TOKENS)
@pytest.mark.parametrize("hidden", FUSED_HIDDEN)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_layer(num_tokens: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    x, residual = randn(gen, num_tokens, hidden), randn(gen, num_tokens, hidden)
    weight = randn(gen, hidden)
    summed = x + residual if with_residual else x
    ref = layers.rms_norm_torch(summed, weight, 1e-5)
    if with_residual:
        out, res_out = rms_norm(x, weight, 1e-5, residual)
        assert torch.equal(res_out, summed)
    else:
        out = rms_norm(x, weight, 1e-5)
    assert_close(out, ref)


@pytest.mark.parametrize("num_tokens", FUSED_TOKENS)
@pytest.mark.parametrize("hidden", [*FUSED_HIDDEN, 100])  # 100: masked tail of the row
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_matches_torch(num_tokens: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    # An offset mean, so a kernel that skipped centring (or centred the padding) would fail.
    x, residual = randn(gen, num_tokens, hidden) + 3.0, randn(gen, num_tokens, hidden)
    weight, bias = randn(gen, hidden), randn(gen, hidden)
    summed = x + residual if with_residual else x
    ref = torch.nn.functional.layer_norm(summed, (hidden,), weight, bias, 1e-5)
    if with_residual:
        out, res_out = layer_norm(x, weight, bias, 1e-5, residual)
        assert torch.equal(res_out, summed)
    else:
        out = layer_norm(x, weight, bias, 1e-5)
    assert_close(out, ref)


@pytest.mark.parametrize("num_tokens", FUSED_TOKENS)
@pytest.mark.parametrize("width", [96, 3072])
def test_gelu_new_matches_torch(num_tokens: int, width: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens + width)
    x = randn(gen, num_tokens, width) * 4.0  # well into both tails
    assert_close(gelu_new(x), layers.gelu_new_torch(x))


@pytest.mark.parametrize(("rotary_dim", "attention_factor"), [(64, 1.0), (96, 1.0), (128, 1.19)])
def test_rotary_cos_sin_is_the_torch_code_bit_for_bit(
    rotary_dim: int, attention_factor: float
) -> None:
    """One launch for RotaryEmbedding's seven: on a GPU the same bits (libdevice's cosf and
    sinf, which torch's CUDA cos and sin call); the interpreter's NumPy cos and sin may differ
    from torch's in the last place. Positions up to a 128k context, a partial rotary dim (96:
    a half of 48, no power of two) and a LongRoPE attention factor."""
    gen = torch.Generator().manual_seed(rotary_dim)
    positions = torch.randint(0, 131072, (300,), generator=gen).to(DEVICE)
    positions[:3] = torch.tensor([0, 1, 131071])
    rope = layers.RotaryEmbedding(rotary_dim, 500000.0).to(DEVICE)
    for dtype in (torch.float32, DTYPE):
        ref = layers.rotary_cos_sin_torch(positions, rope.inv_freq, attention_factor, dtype)
        got = rotary_cos_sin(positions, rope.inv_freq, attention_factor, dtype)
        for g, r in zip(got, ref, strict=True):
            assert g.shape == r.shape == (300, rotary_dim) and g.dtype == r.dtype == dtype
            if INTERPRET:
                torch.testing.assert_close(g, r, atol=2e-6, rtol=0)
            else:
                assert torch.equal(g, r)


@pytest.mark.parametrize("room", [0, 5])
@pytest.mark.parametrize(("n", "rows", "width"), [(5, 8, 3), (8, 8, 130), (1, 4, 1)])
def test_stage_decode_inputs_copies_and_pads_as_the_copies_did(
    n: int, rows: int, width: int, room: int
) -> None:
    """The decode graph's inputs staged in one launch: the first n rows copied, rows n..rows
    padding (slot -1, no context), everything else of the buffers left as it was; block tables
    with ``room`` columns past their width (the input batch's narrowed view) as contiguous
    ones."""
    gen = torch.Generator().manual_seed(n * 1000 + width)

    def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(0, 10_000, shape, generator=gen, dtype=dtype).to(DEVICE)

    inputs = (ints(n), ints(n), ints(n), ints(n, dtype=torch.int32))
    tables = ints(n, width + room, dtype=torch.int32)[:, :width]
    buffers = (ints(16), ints(16), ints(16), ints(16, dtype=torch.int32))
    table_buffer = ints(16, 200, dtype=torch.int32)
    want = [b.clone() for b in buffers]
    want_tables = table_buffer.clone()
    for w, x in zip(want, inputs, strict=True):
        w[:n] = x
    want[2][n:rows] = -1
    want[3][n:rows] = 0
    want_tables[:n, :width] = tables
    stage_decode_inputs(inputs, tables, buffers, table_buffer, rows)
    for got, w in zip(buffers, want, strict=True):
        assert torch.equal(got, w)
    assert torch.equal(table_buffer, want_tables)


@pytest.mark.parametrize("step_has_order", [True, False])
def test_stage_decode_inputs_stages_a_row_order_that_stays_a_permutation(
    step_has_order: bool,
) -> None:
    """The graph's row order after a step of n rows in a graph of ``rows``: the step's order
    (or the batch's where it has none) then each padding row's own index, a permutation of
    the graph's rows even where a longer step staged its order before; rows past the graph's
    are left as they were."""
    n, rows = 5, 8
    gen = torch.Generator().manual_seed(11)

    def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(0, 10_000, shape, generator=gen, dtype=dtype).to(DEVICE)

    inputs = (ints(n), ints(n), ints(n), ints(n, dtype=torch.int32))
    step_order = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32, device=DEVICE)
    buffers = (ints(16), ints(16), ints(16), ints(16, dtype=torch.int32))
    # Left by an earlier step of 7 rows (indices below n at the padding rows' places), and
    # past the graph's rows values no staging writes.
    order_buffer = torch.tensor([6, 5, 4, 3, 2, 1, 0, 7, 99, 98, 97, 96, 95, 94, 93, 92])
    order_buffer = order_buffer.to(torch.int32).to(DEVICE)
    stage_decode_inputs(
        inputs, ints(n, 3, dtype=torch.int32), buffers, ints(16, 8, dtype=torch.int32), rows,
        (step_order if step_has_order else None, order_buffer),
    )  # fmt: skip
    head = [3, 0, 4, 1, 2] if step_has_order else [0, 1, 2, 3, 4]
    assert order_buffer.tolist() == [*head, 5, 6, 7, 99, 98, 97, 96, 95, 94, 93, 92]


def test_a_decode_graphs_buffers_take_the_steps_row_order() -> None:
    """GraphBuffers.stage_decode, as a decode graph's replay calls it: the step's order (the
    input batch's, longest first) in the buffer the graph's metadata reads, the padding rows
    in place."""
    from engine_core.cuda_graph import GraphBuffers

    buffers = GraphBuffers.allocate(16, 16, 4, 8, DTYPE, DEVICE)
    n, rows = 5, 8
    lens = [7, 30, 2, 30, 11]
    order = sorted(range(n), key=lambda i: -lens[i])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(n, 4, dtype=torch.int32, device=DEVICE),
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=lens,
        row_order=torch.tensor(order, dtype=torch.int32, device=DEVICE),
    )
    ids = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    buffers.stage_decode((ids, ids.clone()), [meta], None, rows)
    graph_meta = buffers.decode_metadata(rows, 64)
    assert graph_meta.row_order is not None
    assert graph_meta.row_order.tolist() == [1, 3, 4, 0, 2, 5, 6, 7]


@pytest.mark.parametrize("num_tokens", FUSED_TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROTARY_SHAPES)
def test_rotary_inplace_matches_layer(
    num_tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + heads)
    # q and k as views of one qkv projection, as the Llama attention hands them over.
    qkv = randn(gen, num_tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, -1)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = layers.RotaryEmbedding(head_dim, 10000.0).to(DEVICE)(positions, DTYPE)
    ref_q, ref_k = layers.apply_rotary(q, cos, sin), layers.apply_rotary(k, cos, sin)
    rotary_inplace(q, k, cos, sin)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("num_tokens", FUSED_TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROTARY_SHAPES)
def test_qk_norm_rotary_matches_the_layers(
    num_tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Qwen3's q_norm and k_norm (RMSNorm layers, each with its own weight) and the rotary, in
    torch, against the one in-place launch; v, beside q and k in the projection, untouched."""
    gen = torch.Generator().manual_seed(num_tokens + heads + 1)
    qkv = randn(gen, num_tokens, (heads + 2 * kv_heads) * head_dim) * 3.0
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, -1)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    q_before, k_before = q.clone(), k.clone()
    q_norm, k_norm = layers.RMSNorm(head_dim, 1e-6), layers.RMSNorm(head_dim, 1e-5)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    q_norm, k_norm = q_norm.to(DEVICE, DTYPE), k_norm.to(DEVICE, DTYPE)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = layers.RotaryEmbedding(head_dim, 10000.0).to(DEVICE)(positions, DTYPE)
    ref_q = layers.apply_rotary(layers.rms_norm_torch(q, q_norm.weight, 1e-6), cos, sin)
    ref_k = layers.apply_rotary(layers.rms_norm_torch(k, k_norm.weight, 1e-5), cos, sin)
    with torch.no_grad():
        qkv_layers = qkv.clone()
        q2 = qkv_layers[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        k2 = qkv_layers[:, heads * head_dim : (heads + kv_heads) * head_dim]
        got_q, got_k = layers.norm_and_rotate_qk(
            q2, k2.view(num_tokens, kv_heads, -1), q_norm, k_norm, cos, sin
        )
        qk_norm_rotary_inplace(q, k, q_norm.weight, k_norm.weight, 1e-6, 1e-5, cos, sin)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert_close(got_q, ref_q)  # the layer helper (fused on CUDA, torch under the interpreter)
    assert_close(got_k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)
    # Against the unfused kernels (rms_norm, then rotary_inplace): the same roundings, but the
    # GPU compiler contracts multiply-adds differently in the two, so in bf16 a few elements in
    # a hundred thousand land one rounding apart (observed), never more than one unit in
    # the last place of the largest output; float32 differs in its last bits more often (the
    # sum of squares is taken in two halves).
    q3 = rms_norm(q_before.flatten(0, 1), q_norm.weight, 1e-6).view(q.shape)
    k3 = rms_norm(k_before.flatten(0, 1), k_norm.weight, 1e-5).view(k.shape)
    rotary_inplace(q3, k3, cos, sin)
    for got, unfused in ((q, q3), (k, k3)):
        if DTYPE is torch.bfloat16:
            one_ulp = torch.finfo(DTYPE).eps * unfused.abs().max().item()
            torch.testing.assert_close(got, unfused, atol=one_ulp, rtol=0.0)
            assert (got != unfused).float().mean().item() < 1e-3
        else:
            torch.testing.assert_close(got, unfused, atol=1e-6, rtol=1e-6)


def test_qk_norms_with_a_unit_offset_or_a_partial_rotary_are_not_fused() -> None:
    """Gemma's (1 + w) norms and a rotary over part of each head take the unfused layers: the
    fused launch implements neither."""
    gen = torch.Generator().manual_seed(11)
    num_tokens, heads, kv_heads, head_dim = 5, 4, 2, 64
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    for unit_offset, rotary_dim in [(True, head_dim), (False, head_dim // 2)]:
        q = randn(gen, num_tokens, heads, head_dim)
        k = randn(gen, num_tokens, kv_heads, head_dim)
        norms = [layers.RMSNorm(head_dim, 1e-6, unit_offset) for _ in range(2)]
        with torch.no_grad():
            for norm in norms:
                norm.weight.copy_(torch.rand(head_dim, generator=gen) * 0.5)
        q_norm, k_norm = (norm.to(DEVICE, DTYPE) for norm in norms)
        cos, sin = layers.RotaryEmbedding(rotary_dim, 10000.0).to(DEVICE)(positions, DTYPE)
        with torch.no_grad():
            want_q, want_k = (
                layers.apply_rotary(norm_torch(x, norm), cos, sin)
                for x, norm in [(q, q_norm), (k, k_norm)]
            )
            got_q, got_k = layers.norm_and_rotate_qk(q.clone(), k.clone(), q_norm, k_norm, cos, sin)
        assert_close(got_q, want_q)
        assert_close(got_k, want_k)


def norm_torch(x: torch.Tensor, norm: layers.RMSNorm) -> torch.Tensor:
    fn = layers.gemma_rms_norm_torch if norm.unit_offset else layers.rms_norm_torch
    return fn(x, norm.weight, norm.eps)


@pytest.mark.parametrize("num_tokens", FUSED_TOKENS)
@pytest.mark.parametrize("intermediate", [96, 1536] if INTERPRET else [1536, 8192, 14336])
def test_silu_and_mul_matches_layer(num_tokens: int, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = randn(gen, num_tokens, 2 * intermediate)
    assert_close(silu_and_mul(gate_up), layers.silu_and_mul_torch(gate_up))


# The decode graphs' argmax (cuda_graph.py DecodeTail) over a vocabulary of several 2,048-column
# chunks with a partial last one (GPT-2's on the GPU), in a logits buffer wider than the
# vocabulary (padding columns).
ARGMAX_VOCAB = 5000 if INTERPRET else 50257


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_row_argmax_is_torch_argmax(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    logits = randn(gen, rows, ARGMAX_VOCAB + 64)
    logits[:, ARGMAX_VOCAB:] = 1e4  # padding past the vocabulary: never an answer
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    row_argmax(logits, ARGMAX_VOCAB, out)
    assert torch.equal(out, logits[:, :ARGMAX_VOCAB].argmax(dim=-1))


def test_row_argmax_takes_the_first_of_equal_largest_values() -> None:
    """Ties within a chunk, across chunks and over a whole row go to the first column, as
    torch.argmax's do; a row of -inf answers 0."""
    vocab = ARGMAX_VOCAB
    logits = torch.zeros(4, vocab, device=DEVICE, dtype=DTYPE)
    logits[0, [5, 6, vocab - 1]] = 3.0  # within the first chunk, and in the last
    logits[1, [vocab - 1, 2100, 4100]] = 2.0  # the second chunk's holds the first
    logits[2] = float("-inf")
    logits[3, 7] = float("nan")  # NaN counts as +inf (the first of them wins, as in torch)
    logits[3, 9] = float("inf")
    out = torch.empty(4, dtype=torch.int64, device=DEVICE)
    row_argmax(logits, vocab, out)
    assert out.tolist() == [5, 2100, 0, 7]


def test_row_argmax_refuses_what_it_cannot_answer() -> None:
    logits = torch.zeros(2, 100, device=DEVICE, dtype=DTYPE)
    out = torch.empty(2, dtype=torch.int64, device=DEVICE)
    for n_cols in (0, 101):
        with pytest.raises(ValueError, match="row_argmax"):
            row_argmax(logits, n_cols, out)
    with pytest.raises(ValueError, match="int64"):
        row_argmax(logits, 100, out.to(torch.int32))


# The decode graphs' LM head (cuda_graph.py DecodeTail): the skinny GEMM's epilogue takes each
# weight tile's argmax, argmax_of_parts each row's. N leaves a partial last tile; the columns past
# n_cols (a padded vocabulary) hold the largest values and are never an answer.
ARGMAX_N, ARGMAX_COLS, ARGMAX_K = 300, 290, 64


def skinny_logits_argmax(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The product x @ w.T as the skinny GEMM writes it, and its argmax by the epilogue."""
    from engine_core.models.skinny_gemm import TileArgmax, skinny_gemm
    from engine_core.models.triton_ops import argmax_of_parts

    rows, n, block_n = x.shape[0], w.shape[0], 64
    out = torch.empty(rows, n, dtype=DTYPE, device=DEVICE)
    parts = TileArgmax.allocate(rows, -(-n // block_n), ARGMAX_COLS, DEVICE)
    skinny_gemm(x, w, DTYPE, block_n=block_n, block_k=64, num_stages=2, tma=False, out=out,
                tile_argmax=parts)  # fmt: skip
    argmax = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    return out, argmax_of_parts(parts.best, parts.at, argmax)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_skinny_gemm_argmax_epilogue_is_the_argmax_of_its_product(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = randn(gen, rows, ARGMAX_K)
    w = randn(gen, ARGMAX_N, ARGMAX_K)
    w[ARGMAX_COLS:] = x[0] * 100  # padding columns: row 0's largest products
    out, argmax = skinny_logits_argmax(x, w)
    assert_close(out, (x.float() @ w.float().T).to(DTYPE))
    assert torch.equal(argmax, out[:, :ARGMAX_COLS].argmax(dim=-1))


def test_skinny_gemm_argmax_epilogue_takes_the_first_of_equal_largest() -> None:
    """Ties within a tile and across tiles go to the first column, as torch.argmax's do; NaN
    counts as +inf (the first of them wins), also in a row of NaN only."""
    x = torch.ones(3, ARGMAX_K, dtype=DTYPE, device=DEVICE)
    x[2] = float("-inf")
    w = torch.zeros(ARGMAX_N, ARGMAX_K, dtype=DTYPE, device=DEVICE)
    w[[70, 75, 130], 0] = 2.0  # the second tile's first and fifth rows, and in the third
    w[[20], 1] = 1.0
    _, argmax = skinny_logits_argmax(x[:1], w)
    assert argmax.tolist() == [70]
    w[[200, 250], 3] = float("nan")
    out, argmax = skinny_logits_argmax(x, w)
    assert argmax[:2].tolist() == [200, 200]
    # Row 2's products are -inf or NaN (-inf times 0): whatever they are, torch.argmax's answer
    # with NaN as +inf.
    row = out[2, :ARGMAX_COLS].float()
    assert argmax[2].item() == torch.where(row.isnan(), float("inf"), row).argmax().item()


# ---- the models on the fused path, against HF ---------------------------------------------

# GQA with the fused residual norms; q/k norms on [T, heads, D] views; GPT-2's LayerNorm, gelu_new
# and MHA decode (group 1 through the padded tl.dot tile).
FUSED_MODELS = ["llama", "qwen3_qk_norm", "gpt2"]
MODEL_TOKENS = 6 if INTERPRET else 32


@pytest.fixture
def fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the models' layers to the Triton kernels: on a GPU they go there by themselves;
    under the interpreter the tensors are on the CPU, so the dispatch is told to."""
    if INTERPRET:
        monkeypatch.setattr(layers, "use_triton", lambda x: True)


@pytest.mark.parametrize("name", FUSED_MODELS)
@pytest.mark.usefixtures("fused_path")
def test_models_on_fused_path_match_hf(name: str, tmp_path: Path) -> None:
    """Float32 end to end, Triton attention included: HF's greedy tokens, logits within 1e-4
    (1e-3 on a GPU, whose GEMMs sum in another order than the CPU's)."""
    assert layers.use_triton(torch.empty(0, device=DEVICE))
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), DEVICE, torch.float32).module
    got = generate_greedy(
        model,
        PROMPTS,
        MODEL_TOKENS,
        block_size=4,
        prefill_chunk=5,
        stagger=1,
        backend=TritonBackend(),
    )
    for i, prompt in enumerate(PROMPTS):
        ref = hf_greedy(hf_model, prompt, MODEL_TOKENS)
        assert got.tokens[i] == ref.tokens[0], f"prompt {i}"
        atol = 1e-4 if INTERPRET else 1e-3
        torch.testing.assert_close(got.logits[i].cpu(), ref.logits[0], atol=atol, rtol=0)


def test_decode_tile_follows_the_grid_density() -> None:
    """Two kv heads a program where batch x kv heads reaches WIDE_GRID_WAVES programs a
    multiprocessor (bf16 caches); the sparse grids' own tile for the shapes that have one where
    it gives each more than one and at most SPARSE_GRID_PROGRAMS_PER_SM; the geometric-mean tile
    elsewhere and for what the other tables do not hold."""
    from engine_core.attention import triton_kernels as tk

    device = torch.device(DEVICE)
    sms = tk._num_sms(device)
    wide = tk.WIDE_GRID_WAVES * sms
    assert (tk.decode_grid(wide // 8, 8, device) == "wide") == (wide % 8 == 0)
    assert tk.decode_grid(-(-wide // 8), 8, device) == "wide"
    assert tk.decode_grid(-(-wide // 8) - 1, 8, device) == "default"
    sparse = int(tk.SPARSE_GRID_PROGRAMS_PER_SM * sms)  # the most programs of a sparse grid
    assert [tk.decode_grid(p, 1, device) for p in (sms, sms + 1, sparse, sparse + 1)] == [
        "default", "sparse", "sparse", "default"
    ]  # fmt: skip
    for head_dim, tuned in ((64, 64), (96, 128), (128, 128)):
        assert tk.decode_tile(head_dim, False) == tk._DECODE_TILES[(tuned, False)]
        assert tk.decode_tile(head_dim, False, "wide") == tk._WIDE_DECODE_TILES[(tuned, False)]
        assert tk.decode_tile(head_dim, True, "wide") == tk._DECODE_TILES[(tuned, True)]
        for kv_heads in (1, 3, 8):
            for fp8 in (False, True):
                sparse_tile = tk._SPARSE_DECODE_TILES.get(
                    (tuned, fp8, kv_heads), tk._DECODE_TILES[(tuned, fp8)]
                )
                assert tk.decode_tile(head_dim, fp8, "sparse", kv_heads) == sparse_tile
    assert tk.decode_tile(256, False) == tk._DECODE_TILES[(128, False)]  # past the largest
    assert tk.decode_tile(64, False, "sparse", 3) != tk._DECODE_TILES[(64, False)]
    assert tk.decode_tile(64, False, "sparse", 8) == tk._DECODE_TILES[(64, False)]
    assert tk.decode_tile(64, False, "default", 3) == tk._DECODE_TILES[(64, False)]
    assert tk._WIDE_DECODE_TILES[(64, False)].kv_per_program == 2
