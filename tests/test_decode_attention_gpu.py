"""The decode kernel's launch shapes and split policy on the GPU, against the torch reference:
every tuned tile and the sweep's extremes (16-128 tokens per iteration, 1, 2 and 4 kv heads per
program, 2-8 warps, 2-3 stages), MHA and GQA groups of 3 and 4, head dims 64 and 128, bf16 and
FP8 caches, contexts up to 8,192 tokens with sequences that fit one split (written directly)
beside ones merged from many, sliding windows that start inside, at and past split boundaries,
and a CUDA graph captured on short contexts and replayed on long ones (and back) equal to eager.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.attention import triton_kernels  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    MAX_SPLITS,
    DecodeTile,
    choose_num_splits,
    default_min_split,
    paged_decode_attention,
)
from tests.test_fp8_kv_gpu import fp8_caches, pick_scales, reference  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402
    PagedBatch,
    assert_close,
    make_batch,
    poisoned,
)

BLOCK_SIZE = 16
# Short ones that one split covers beside long ones split many ways, in one batch.
CONTEXTS = [1, 16, 17, 200, 255, 1000, 2049, 4097, 8192]
SPECS = [(c - 1, 1) for c in CONTEXTS]
TUNED_TILES = sorted(
    {
        *triton_kernels._DECODE_TILES.values(),
        *triton_kernels._WIDE_DECODE_TILES.values(),
        *triton_kernels._SPARSE_DECODE_TILES.values(),
    },
    key=repr,
)
TILES = [
    *TUNED_TILES,
    DecodeTile(16, 4, 2, kv_per_program=4),
    DecodeTile(32, 2, 3),
    DecodeTile(64, 4, 3, kv_per_program=2),
    DecodeTile(128, 8, 2),
]
# (heads, kv_heads, head_dim): 4 kv heads take 1, 2 or 4 per program; 3 take one.
HEAD_SHAPES = [(16, 4, 64), (9, 3, 64), (4, 4, 64), (16, 4, 128), (32, 8, 128)]


def caches(batch: PagedBatch, kv: str) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float]]:
    """The batch's cache as bf16, or as e4m3 with calibrated scales."""
    if kv == "bf16":
        return batch.k_cache, batch.v_cache, (1.0, 1.0)
    scales = pick_scales(batch, "calibrated")
    return *fp8_caches(batch, scales), scales


def decode(
    batch: PagedBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[float, float],
    **kwargs: object,
) -> torch.Tensor:  # [B, heads, head_dim]
    return paged_decode_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        batch.q.shape[2] ** -0.5,
        k_scale=scales[0],
        v_scale=scales[1],
        **kwargs,
    )


@pytest.mark.parametrize("tile", TILES, ids=repr)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_tiles_match_reference(
    tile: DecodeTile, heads: int, kv_heads: int, head_dim: int, kv: str
) -> None:
    check_decode(tile, heads, kv_heads, head_dim, kv, None)


@pytest.mark.parametrize("tile", TUNED_TILES, ids=repr)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [HEAD_SHAPES[0], HEAD_SHAPES[-1]])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("num_splits", [5, 64])
def test_decode_forced_splits_match_reference(
    tile: DecodeTile, heads: int, kv_heads: int, head_dim: int, kv: str, num_splits: int
) -> None:
    check_decode(tile, heads, kv_heads, head_dim, kv, num_splits)


def check_decode(
    tile: DecodeTile, heads: int, kv_heads: int, head_dim: int, kv: str, num_splits: int | None
) -> None:
    batch = make_batch(SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=head_dim + heads)
    k_cache, v_cache, scales = caches(batch, kv)
    out = decode(
        batch,
        k_cache,
        v_cache,
        scales,
        tile=tile,
        num_splits=num_splits,
        min_split_tokens=16 if num_splits else triton_kernels.MIN_SPLIT_TOKENS,
        out=poisoned(batch.q),
    )
    assert_close(out, reference(batch, k_cache, v_cache, scales))


@pytest.mark.parametrize("window", [1, 15, 16, 17, 300, 1024, 5000, 10000])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("tile", [None, DecodeTile(32, 4, 2, kv_per_program=4)], ids=repr)
def test_decode_windows_across_split_boundaries(
    window: int, kv: str, tile: DecodeTile | None
) -> None:
    """Splits of 512 tokens (8 over the longest row): windows inside one split (written
    directly), across a boundary, and longer than the sequence."""
    heads, kv_heads, head_dim = HEAD_SHAPES[0]
    batch = make_batch(SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=window)
    k_cache, v_cache, scales = caches(batch, kv)
    out = decode(
        batch,
        k_cache,
        v_cache,
        scales,
        sliding_window=window,
        tile=tile,
        num_splits=16,
        min_split_tokens=512,
        out=poisoned(batch.q),
    )
    assert_close(out, reference(batch, k_cache, v_cache, scales, window))


def test_split_policy_bounds() -> None:
    device = torch.device("cuda")
    assert choose_num_splits(64, 8, 256, device) == 1  # one split's worth of table
    for batch in (1, 2, 8, 32, 64, 256, 1024):
        for max_context in (512, 4096, 32768, 131072):
            splits = choose_num_splits(batch, 8, max_context, device)
            assert 1 <= splits <= MAX_SPLITS
            assert splits <= -(-max_context // triton_kernels.MIN_SPLIT_TOKENS)
    assert choose_num_splits(1, 8, 131072, device) > choose_num_splits(256, 8, 131072, device)
    # From PROGRAMS_PER_SM to SPARSE_SPLIT_PROGRAMS_PER_SM programs a multiprocessor unsplit:
    # SPARSE_SPLITS (no split under the shortest); past it one.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    band = range(-(-2 * sms // 8), -(-3 * sms // 8))
    assert [choose_num_splits(b, 8, 4096, device) for b in band] == [4] * len(band)
    assert choose_num_splits(band[0], 8, 512, device) == 2
    assert choose_num_splits(band[-1] + 1, 8, 4096, device) == 1
    # The shortest split shrinks as the unsplit grid thins: many programs a multiprocessor,
    # fewer than PROGRAMS_PER_SM, at most one.
    minimums = [default_min_split(b, 1, device) for b in (4 * sms, sms + 1, sms)]
    assert minimums == [
        triton_kernels.MIN_SPLIT_TOKENS,
        triton_kernels.THIN_MIN_SPLIT_TOKENS,
        triton_kernels.STARVED_MIN_SPLIT_TOKENS,
    ]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_graph_replays_across_context_lengths(kv: str) -> None:
    """Captured with every row one token long (each written directly by one split), replayed
    with long rows (merged from many splits) and back, and with a padding row: the same bits
    as eager each time, since the split count comes from the table's width alone."""
    heads, kv_heads, head_dim = 32, 8, 128
    batch = make_batch(SPECS, heads, kv_heads, head_dim, BLOCK_SIZE, seed=3)
    k_cache, v_cache, scales = caches(batch, kv)
    full = batch.meta.seq_lens.clone()
    seq_lens = batch.meta.seq_lens
    seq_lens.fill_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode(batch, k_cache, v_cache, scales)  # compile off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode(batch, k_cache, v_cache, scales)

    padded = full.clone()
    padded[-1] = 0
    for lens in (full, torch.ones_like(full), padded, (full + 1) // 2):
        seq_lens.copy_(lens)
        graph.replay()
        eager = decode(batch, k_cache, v_cache, scales)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        if lens is full:
            assert_close(captured, reference(batch, k_cache, v_cache, scales))
        if lens is padded:
            assert torch.equal(captured[-1], torch.zeros_like(captured[-1]))
