"""--kv-cache-dtype fp8 on the GPU: the Triton KV write, decode and prefill over e4m3 caches
against the torch reference over the same caches (random inputs, head dims 64 and 128, GQA,
contexts past 4000 tokens, block size 16, sliding windows, non-1 scales); the scales ignored by
bf16 caches; and a CUDA-graph replay of an FP8 decode step equal to eager.

Both sides read the same e4m3 values, so they differ only as the bf16 kernels do from the
reference (bf16 query and softmax weights into the matrix units): the same relative tolerance.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (e4m3 tiles)", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.attention.base import FP8_MAX  # noqa: E402
from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)
from tests.test_triton_kernels import (  # noqa: E402
    DECODE_CONTEXTS,
    PREFILL_SPECS,
    REFERENCE,
    PagedBatch,
    assert_close,
    make_batch,
    poisoned,
)

E4M3 = torch.float8_e4m3fn
BLOCK_SIZE = 16
# (heads, kv_heads, head_dim): MHA and GQA groups of 3 and 4 at both head dims.
FP8_HEAD_SHAPES = [(4, 4, 64), (9, 3, 64), (8, 2, 128), (32, 8, 128)]
# Power-of-two scales (exact reciprocals) and a checkpoint's kind: amax / 448 of the cache.
SCALES = ["pow2", "calibrated"]
DECODE_SPECS = [(c - 1, 1) for c in DECODE_CONTEXTS]


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def pick_scales(batch: PagedBatch, kind: str) -> tuple[float, float]:
    if kind == "pow2":
        return 0.5, 2.0
    k_max, v_max = batch.k_cache.abs().max().item(), batch.v_cache.abs().max().item()
    return k_max / FP8_MAX, v_max / FP8_MAX


def fp8_caches(batch: PagedBatch, scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's random bf16 context as e4m3 caches holding K / k_scale and V / v_scale."""
    return quantize(batch.k_cache, scales[0]), quantize(batch.v_cache, scales[1])


def reference(
    batch: PagedBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[float, float],
    window: int | None = None,
) -> torch.Tensor:  # [T, heads, head_dim]
    scale = batch.q.shape[2] ** -0.5
    return REFERENCE.forward(batch.q, k_cache, v_cache, batch.meta, scale, window, *scales)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


# ---- KV write -------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128)])
def test_fp8_write_rounds_like_the_reference_and_skips_padding(
    scale_kind: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    """stored = e4m3(clamp(k / k_scale, +-448)); some rows far past the clamp; padding slots
    (-1) keep their old bytes. The kernel multiplies by 1 / scale where the reference divides,
    so a non-power-of-two scale may round a rare tie the other way: one e4m3 step, no more."""
    batch = make_batch(PREFILL_SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=head_dim)
    scales = pick_scales(batch, scale_kind)
    k_cache, v_cache = fp8_caches(batch, scales)
    k, v = batch.k.clone(), batch.v.clone()
    k[::5] *= 1000.0  # far past 448 * k_scale: must clamp, not overflow to NaN
    slots = batch.meta.slot_mapping.clone()
    slots[1::3] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    REFERENCE.write_kv(ref_k, ref_v, k, v, slots, *scales)
    old_k, old_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots, *scales)

    skipped = batch.meta.slot_mapping[1::3]
    for got, old in ((k_cache, old_k), (v_cache, old_v)):
        flat_got, flat_old = got.view(-1, kv_heads, head_dim), old.view(-1, kv_heads, head_dim)
        assert torch.equal(as_bytes(flat_got[skipped]), as_bytes(flat_old[skipped]))
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        assert not got.float().isnan().any()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-3, atol=2**-9)
        differing = (as_bytes(got) != as_bytes(want)).float().mean().item()
        assert differing < (1e-3 if scale_kind == "calibrated" else 1e-9), differing


# ---- decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), FP8_HEAD_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_fp8_decode_matches_reference(
    scale_kind: str, heads: int, kv_heads: int, head_dim: int, num_splits: int | None
) -> None:
    batch = make_batch(DECODE_SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=heads)
    scales = pick_scales(batch, scale_kind)
    k_cache, v_cache = fp8_caches(batch, scales)
    out = paged_decode_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        head_dim**-0.5,
        num_splits=num_splits,
        min_split_tokens=16,
        out=poisoned(batch.q),
        k_scale=scales[0],
        v_scale=scales[1],
    )
    assert_close(out, reference(batch, k_cache, v_cache, scales))


@pytest.mark.parametrize("window", [1, 8, 100])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_fp8_decode_sliding_window(window: int, heads: int, kv_heads: int, head_dim: int) -> None:
    batch = make_batch(DECODE_SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=window)
    scales = pick_scales(batch, "calibrated")
    k_cache, v_cache = fp8_caches(batch, scales)
    out = paged_decode_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        head_dim**-0.5,
        sliding_window=window,
        num_splits=3,
        min_split_tokens=16,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    assert_close(out, reference(batch, k_cache, v_cache, scales, window))


# ---- prefill --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), FP8_HEAD_SHAPES)
@pytest.mark.parametrize("window", [None, 64])
def test_fp8_prefill_matches_reference(
    scale_kind: str, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """Whole prompts, chunks after a cached context, and decodes mixed in (PREFILL_SPECS)."""
    batch = make_batch(PREFILL_SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=kv_heads)
    scales = pick_scales(batch, scale_kind)
    k_cache, v_cache = fp8_caches(batch, scales)
    out = paged_prefill_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        batch.meta.query_start_loc,
        batch.meta.max_query_len,
        head_dim**-0.5,
        sliding_window=window,
        out=poisoned(batch.q),
        k_scale=scales[0],
        v_scale=scales[1],
    )
    assert_close(out, reference(batch, k_cache, v_cache, scales, window))


# ---- the backend: scales ignored by bf16 caches ---------------------------------------------


@pytest.mark.parametrize("decode_only", [True, False])
def test_bf16_cache_ignores_the_scales(decode_only: bool) -> None:
    """The model runner sets a layer's scales whatever the cache dtype: a bf16 cache must give
    the same bits with any scales as with none."""
    specs = DECODE_SPECS if decode_only else PREFILL_SPECS
    batch = make_batch(specs, 8, 2, 128, BLOCK_SIZE, seed=31)
    backend, scale, slots = TritonBackend(), 128**-0.5, batch.meta.slot_mapping
    outs, caches = [], []
    for scales in ((1.0, 1.0), (3.0, 0.25)):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        backend.write_kv(k_cache, v_cache, batch.k, batch.v, slots, *scales)
        outs.append(backend.forward(batch.q, k_cache, v_cache, batch.meta, scale, None, *scales))
        caches.append((k_cache, v_cache))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


# ---- CUDA graphs ----------------------------------------------------------------------------


def next_decode_inputs(batch: PagedBatch, seed: int) -> None:
    """A different decode step, in place (as the runner fills its static buffers): new q, k, v;
    every other sequence one token shorter (its slot moved back); the last row padding."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for x in (batch.q, batch.k, batch.v):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
    meta, page = batch.meta, batch.k_cache.shape[1]
    seq_lens = meta.seq_lens.clone()
    seq_lens[::2] = (seq_lens[::2] - 1).clamp(min=1)
    pos = (seq_lens - 1).long()
    rows = torch.arange(len(pos), device="cuda")
    slots = meta.block_tables[rows, pos // page].long() * page + pos % page
    seq_lens[-1], slots[-1] = 0, -1
    meta.seq_lens.copy_(seq_lens)
    meta.slot_mapping.copy_(slots)


def test_fp8_decode_replays_in_a_cuda_graph_as_eager() -> None:
    """write_kv + decode over an FP8 cache captured once (scales baked in as kernel arguments)
    and replayed on new inputs: the same bits as running them eagerly on those inputs."""
    batch = make_batch(DECODE_SPECS, 32, 8, 128, BLOCK_SIZE, seed=41)
    scales = pick_scales(batch, "calibrated")
    k0, v0 = fp8_caches(batch, scales)
    backend, meta, scale = TritonBackend(), batch.meta, 128**-0.5

    def step(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        backend.write_kv(k_cache, v_cache, batch.k, batch.v, meta.slot_mapping, *scales)
        return backend.forward(batch.q, k_cache, v_cache, meta, scale, None, *scales)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(k0.clone(), v0.clone())  # compile and warm up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph_k, graph_v = k0.clone(), v0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(graph_k, graph_v)

    for seed in (1, 2):
        next_decode_inputs(batch, seed)
        graph_k.copy_(k0)
        graph_v.copy_(v0)
        graph.replay()
        eager_k, eager_v = k0.clone(), v0.clone()
        eager = step(eager_k, eager_v)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert torch.equal(captured[-1], torch.zeros_like(captured[-1]))  # the padding row
        assert torch.equal(as_bytes(graph_k), as_bytes(eager_k))
        assert torch.equal(as_bytes(graph_v), as_bytes(eager_v))
