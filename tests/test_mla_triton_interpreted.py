"""The Triton MLA kernels (engine_core/attention/triton_mla.py) on the CPU, through Triton's
interpreter, in float32: the latent write, the absorbed decode against a hand computation of
softmax(q_lat . c + q_pe . k_pe) @ c over sequences of different lengths on shuffled blocks (one
and several context splits, a padding row), the expanded prefill against the torch path's
causal attention for prompt chunks after cached context, LatentAttention's Triton path against
its torch path on a mixed batch, and a tiny DeepSeek-V3 greedy-decoding through the kernels
against HF transformers (on a GPU: tests/test_mla_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable; it is not in the main venv):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/vllm-cpu-venv/lib/python3.11/site-packages \\
        .venv/bin/python -m pytest tests/test_mla_triton_interpreted.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.attention import mla  # noqa: E402
from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.attention.mla import LatentAttention, causal_attention  # noqa: E402
from engine_core.attention.triton_mla import (  # noqa: E402
    MlaDecodeTile,
    expanded_batch,
    mla_decode_attention,
    mla_prefill_attention,
    step_plan,
    write_latents,
)
from engine_core.forward_context import forward_context  # noqa: E402
from tests import test_models_deepseek  # noqa: E402
from tests.mla_cases import (  # noqa: E402
    SMALL,
    V2_LITE,
    Dims,
    absorbed_by_hand,
    as_fp8,
    expanded_by_torch,
    paged_latents,
    relative_error,
)
from tests.paged_harness import (  # noqa: E402
    assert_matches,
    generate_greedy,
    hf_greedy,
    load_float32,
)
from tests.test_models_deepseek import ATOL  # noqa: E402
from tests.test_models_moe import generate_after_cached_prefix  # noqa: E402
from tests.test_triton_kernels import patch_interpreter_index  # noqa: E402

patch_interpreter_index()

TOLERANCE = 1e-4  # ‖out - ref‖ / ‖ref‖, float32 through the interpreter's exact dots


def test_write_latents_fills_the_slots_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 4, 80)
    latent, k_pe = torch.randn(5, 64, generator=gen), torch.randn(5, 16, generator=gen)
    slots = torch.tensor([3, -1, 9, 0, 15])
    write_latents(cache, latent, k_pe, slots)
    flat = cache.view(-1, 80)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], torch.cat((latent[t], k_pe[t])))
    written = {s for s in slots.tolist() if s >= 0}
    assert all(not flat[s].any() for s in range(16) if s not in written)


@pytest.mark.parametrize(
    ("dims", "seq_lens", "page"),
    [
        (SMALL, [1, 7, 16, 17, 40, 0], 16),  # across block boundaries; 0: a padding row
        (SMALL, [5, 33, 64], 8),
        (V2_LITE, [3, 18], 16),  # DeepSeek-V2-Lite's head dims, few tokens
    ],
    ids=["small-page16", "small-page8", "v2-lite"],
)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_the_hand_computation(
    dims: Dims, seq_lens: list[int], page: int, num_splits: int | None
) -> None:
    gen = torch.Generator().manual_seed(2)
    paged = paged_latents(seq_lens, dims.rank + dims.rope, page)
    batch = len(seq_lens)
    q_lat = torch.randn(batch, dims.heads, dims.rank, generator=gen)
    q_pe = torch.randn(batch, dims.heads, dims.rope, generator=gen)
    scale = 0.1 * 1.3  # a softmax scale with an mscale factor in it
    out = mla_decode_attention(
        q_lat, q_pe, paged.cache, paged.tables, torch.tensor(seq_lens, dtype=torch.int32),
        scale, num_splits=num_splits, min_split_tokens=8, tile=MlaDecodeTile(block_n=8),
    )  # fmt: skip
    ref = absorbed_by_hand(q_lat, q_pe, paged, scale)
    assert relative_error(out, ref) < TOLERANCE
    assert not out[[i for i, n in enumerate(seq_lens) if n == 0]].any()


def test_decode_splits_by_each_sequence_length() -> None:
    """With the default split choice (one launch constant from the table's width), a long
    sequence spreads over several splits and a short one fits one; both equal the hand sums."""
    seq_lens = [2, 300]
    paged = paged_latents(seq_lens, SMALL.rank + SMALL.rope, 16)
    gen = torch.Generator().manual_seed(3)
    q_lat = torch.randn(2, SMALL.heads, SMALL.rank, generator=gen)
    q_pe = torch.randn(2, SMALL.heads, SMALL.rope, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = mla_decode_attention(q_lat, q_pe, paged.cache, paged.tables, lens, 0.2)
    assert relative_error(out, absorbed_by_hand(q_lat, q_pe, paged, 0.2)) < TOLERANCE


@pytest.mark.parametrize("dims", [SMALL, V2_LITE], ids=["small", "v2-lite"])
def test_prefill_chunks_after_cached_context_match_the_torch_path(dims: Dims) -> None:
    """Whole prompts, chunks after earlier chunks or prefix-cache hits, and a one-token query,
    over shuffled blocks of 8."""
    seq_lens, query_lens = ([13, 40, 9, 21], [13, 17, 1, 5]) if dims is SMALL else ([6, 20], [6, 3])
    paged = paged_latents(seq_lens, dims.rank + dims.rope, 8)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(dims.heads * (dims.nope + dims.v_dim), dims.rank, generator=gen) * 0.1
    q = torch.randn(sum(query_lens), dims.heads, dims.nope + dims.rope, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    batch = expanded_batch(starts, seq_lens, list(range(len(seq_lens))), 8, q.device)
    out = mla_prefill_attention(q, paged.cache, paged.tables, batch, weight, dims.v_dim, 0.15)
    assert out.shape == (sum(query_lens), dims.heads, dims.v_dim)
    assert relative_error(out, expanded_by_torch(q, paged, query_lens, weight, dims)) < TOLERANCE


FP8_SCALE = 0.5  # not 1.0: a scale left out of a read or a write shows


def test_fp8_write_stores_what_the_torch_path_stores() -> None:
    """rows / scale, clamped to e4m3's range (some rows are far past it), byte for byte as
    LatentAttention's torch path writes them; padding skipped. The values are e4m3's own
    (times the scale) or beyond its range: Triton 3.7's interpreter rounds a value that
    rounds up into the next power of two down instead (127.2 to 64), so rounding itself is
    left to the GPU test's hardware conversion."""
    gen = torch.Generator().manual_seed(6)
    exact = torch.randn(5, 80, generator=gen).mul(100).to(torch.float8_e4m3fn).float()
    exact[:, ::7] = 1e4  # past e4m3's 448 after the scale: clamped
    latent, k_pe = (exact * FP8_SCALE).split([64, 16], dim=-1)
    slots = torch.tensor([3, -1, 9, 0, 15])
    got = torch.zeros(4, 4, 80, dtype=torch.float8_e4m3fn)
    write_latents(got, latent, k_pe, slots, FP8_SCALE)
    want = torch.zeros(4, 4, 80, dtype=torch.float8_e4m3fn)
    mla.write_latents(want, torch.cat((latent, k_pe), dim=-1), slots, FP8_SCALE)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert want.float().abs().max() == 448.0  # the clamp was reached


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_matches_the_hand_computation_on_its_values(num_splits: int) -> None:
    seq_lens = [1, 7, 16, 40]
    fp8, values = as_fp8(paged_latents(seq_lens, SMALL.rank + SMALL.rope, 16), FP8_SCALE)
    gen = torch.Generator().manual_seed(7)
    q_lat = torch.randn(len(seq_lens), SMALL.heads, SMALL.rank, generator=gen)
    q_pe = torch.randn(len(seq_lens), SMALL.heads, SMALL.rope, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = mla_decode_attention(
        q_lat, q_pe, fp8.cache, fp8.tables, lens, 0.13, num_splits=num_splits,
        min_split_tokens=8, tile=MlaDecodeTile(block_n=8), cache_scale=FP8_SCALE,
    )  # fmt: skip
    assert relative_error(out, absorbed_by_hand(q_lat, q_pe, values, 0.13)) < TOLERANCE


def test_fp8_prefill_matches_the_torch_path_on_its_values() -> None:
    seq_lens, query_lens = [13, 40, 9], [13, 17, 1]
    fp8, values = as_fp8(paged_latents(seq_lens, SMALL.rank + SMALL.rope, 8), FP8_SCALE)
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(SMALL.heads * (SMALL.nope + SMALL.v_dim), SMALL.rank, generator=gen)
    q = torch.randn(sum(query_lens), SMALL.heads, SMALL.nope + SMALL.rope, generator=gen)
    starts = [0, 13, 30, 31]
    batch = expanded_batch(starts, seq_lens, [0, 1, 2], 8, q.device)
    out = mla_prefill_attention(
        q, fp8.cache, fp8.tables, batch, weight * 0.1, SMALL.v_dim, 0.15, FP8_SCALE
    )
    want = expanded_by_torch(q, values, query_lens, weight * 0.1, SMALL)
    assert relative_error(out, want) < TOLERANCE


def test_causal_attention_reference_is_what_the_prefill_test_trusts() -> None:
    """causal_attention (the torch path's) against a hand loop, so the prefill test's oracle is
    itself checked: query i of the last Q sees keys 0 .. L - Q + i."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(7, 2, 8, generator=gen), None
    v = torch.randn(7, 2, 5, generator=gen)
    out = causal_attention(q, k, v, 0.3)
    for i in range(3):
        seen = 7 - 3 + i + 1
        probs = (torch.einsum("hd,lhd->hl", q[i], k[:seen]) * 0.3).softmax(-1)
        torch.testing.assert_close(out[i], torch.einsum("hl,lhv->hv", probs, v[:seen]))


def mixed_step(dims: Dims, page: int) -> tuple[AttentionMetadata, list[int]]:
    """A step of two decodes, a prompt chunk after 9 cached tokens and a whole prompt, as the
    model runner lays it out (its new tokens' slots in fresh blocks of each table)."""
    seq_lens, query_lens = [12, 30, 14, 5], [1, 1, 5, 5]
    tables = torch.tensor([[3, 7, 0, 0], [1, 4, 5, 6], [2, 8, 0, 0], [9, 0, 0, 0]])
    slots, starts = [], [0]
    for seq, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        slots += [int(tables[seq, p // page]) * page + p % page for p in range(n - q, n)]
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return meta, query_lens


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed-decodes", "all-expanded"])
def test_layer_triton_path_equals_torch_path(absorb: bool) -> None:
    dims, page = SMALL, 8
    meta, query_lens = mixed_step(dims, page)
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(10, page, dims.rank + dims.rope, generator=gen)
    weight = torch.randn(dims.heads * (dims.nope + dims.v_dim), dims.rank, generator=gen) * 0.1
    tokens = sum(query_lens)
    inputs = (
        torch.randn(tokens, dims.heads, dims.nope, generator=gen),
        torch.randn(tokens, dims.heads, dims.rope, generator=gen),
        torch.randn(tokens, dims.rank, generator=gen),
        torch.randn(tokens, dims.rope, generator=gen),
        weight,
    )
    outs, caches = [], []
    for use_triton in (True, False):
        layer = LatentAttention(dims.heads, dims.rank, dims.nope, dims.rope, dims.v_dim, 0.15)
        layer.use_triton, layer.absorb_decode = use_triton, absorb
        layer.bind_cache([cache.clone()])
        with forward_context(meta, None):
            outs.append(layer(*inputs))
        caches.append(layer.cache)
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[0], outs[1]) < TOLERANCE


def test_decode_only_step_reads_no_host_lengths() -> None:
    """A decode-only step through the Triton path takes its lengths from the device tensors:
    host copies that disagree (as a CUDA graph's captured ones would) change nothing."""
    dims, page = SMALL, 8
    meta, _ = mixed_step(dims, page)
    decode = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:2],
        query_start_loc=meta.query_start_loc[:3],
        seq_lens=meta.seq_lens[:2],
        block_tables=meta.block_tables[:2],
        max_query_len=1,
        max_seq_len=30,
        query_start_loc_cpu=[0, 1, 2],
        seq_lens_cpu=[1, 1],  # stale on purpose
    )
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(10, page, dims.rank + dims.rope, generator=gen)
    weight = torch.randn(dims.heads * (dims.nope + dims.v_dim), dims.rank, generator=gen) * 0.1
    inputs = (
        torch.randn(2, dims.heads, dims.nope, generator=gen),
        torch.randn(2, dims.heads, dims.rope, generator=gen),
        torch.randn(2, dims.rank, generator=gen),
        torch.randn(2, dims.rope, generator=gen),
        weight,
    )
    outs = []
    for use_triton, host_lens in ((True, [1, 1]), (False, [12, 30])):
        layer = LatentAttention(dims.heads, dims.rank, dims.nope, dims.rope, dims.v_dim, 0.15)
        layer.use_triton = use_triton
        layer.bind_cache([cache.clone()])
        decode.seq_lens_cpu = host_lens
        with forward_context(decode, None):
            outs.append(layer(*inputs))
    assert relative_error(outs[0], outs[1]) < TOLERANCE


@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_tiny_deepseek_through_the_kernels_matches_hf(name: str, tmp_path: Path) -> None:
    """The whole model with every latent layer on the Triton path: HF's greedy tokens and
    logits, batched with chunked prompts beside other sequences' decodes on shuffled blocks,
    and after another sequence's cached blocks (the tiny model's rope 8 and heads 4 run through
    the kernels' masked 16-wide tiles)."""
    hf_model = test_models_deepseek.make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    prompts, new_tokens = test_models_deepseek.PROMPTS, 6
    model = on_triton(load_float32(tmp_path))
    got = generate_greedy(
        model, prompts, new_tokens, prefill_chunk=5, stagger=3, shuffle_blocks=True
    )
    assert_matches(got, [hf_greedy(hf_model, p, new_tokens) for p in prompts], ATOL)
    prompt = prompts[2][:20] + [7, 8, 9]
    got = generate_after_cached_prefix(on_triton(load_float32(tmp_path)), prompts[2], prompt, 4)
    assert_matches(got, [hf_greedy(hf_model, prompt, 4)], ATOL)


def on_triton(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.attention_layers():
        assert isinstance(layer, LatentAttention)
        layer.use_triton = True
    return model


@pytest.mark.parametrize("absorb", [True, False])
def test_step_plan_splits_a_step_by_hand(absorb: bool) -> None:
    """Two decodes, a chunk of 5 after 9 cached tokens, a sequence with no new token this step
    and a fresh prompt of 5, over pages of 4: which rows go where, and which table entries
    hold each expanded sequence's context."""
    plan = step_plan((0, 1, 2, 7, 7, 12), (12, 30, 14, 6, 5), absorb, 4, torch.device("cpu"))
    expanded = plan.expanded
    assert expanded is not None
    if absorb:
        assert plan.decode_rows.tolist() == [0, 1] and plan.decode_seqs.tolist() == [0, 1]
        assert expanded.rows.tolist() == list(range(2, 12))  # seq 3 has no row
        assert expanded.block_seqs.tolist() == [2, 2, 2, 2, 4, 4]
        assert expanded.block_cols.tolist() == [0, 1, 2, 3, 0, 1]
        assert expanded.table.tolist() == [[0, 1, 2, 3], [4, 5, 0, 0]]
        assert expanded.seq_lens.tolist() == [14, 5]
        assert expanded.query_start_loc.tolist() == [0, 5, 10]
    else:
        assert plan.decode_rows is None and plan.decode_seqs is None
        assert expanded.rows.tolist() == list(range(12))
        assert expanded.seq_lens.tolist() == [12, 30, 14, 5]
        assert expanded.block_seqs.tolist().count(1) == 8  # 30 tokens: 8 pages of 4
