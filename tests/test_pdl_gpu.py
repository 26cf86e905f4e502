"""Programmatic dependent launch (engine_core/triton_pdl.py) changes when the decode chain's
kernels start, never what they compute: a decode layer's chain (norm with residual, the qkv
projection, rotary in place, the KV write, split decode attention and its merge, the gate/up
projection with SiLU-and-mul in its epilogue, the down projection over two K splits and their
reduction; the projections by the skinny GEMM, which takes plain decode-sized products on Hopper
and launches as a programmatic dependent too) captured in a CUDA graph and replayed on fresh
inputs gives the same bits with PDL as without, and as the chain run eagerly. A kernel that read
before waiting what the kernel before it writes would see half-written outputs (the unrotated
K, last replay's cache row, the activations or partial sums of the last replay) and differ."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core import triton_pdl  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    paged_decode_attention,
    write_kv_cache,
)
from engine_core.models import skinny_gemm  # noqa: E402
from engine_core.models.gate_up_layout import interleave_gate_up  # noqa: E402
from engine_core.models.triton_ops import rms_norm, rotary_inplace  # noqa: E402

if not triton_pdl.hopper_or_later(torch.device("cuda")):
    pytest.skip("programmatic dependent launch needs sm_90+", allow_module_level=True)

# An MLP width of 8,192 over 16 N tiles of the hidden size takes two K splits in the down
# projection (skinny_gemm.dense_tiles), as llama-1b's does.
BATCH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP = 8, 16, 4, 64, 1024, 8192
PAGE, CONTEXT = 16, 300  # 300 tokens: 19 pages; num_splits=4 below makes the merge run
DTYPE = torch.bfloat16


class Chain:
    """The chain's weights, its paged cache and its static inputs; with ``shared`` tokens, the
    decode attention's shared-prefix pass first (every row's table opens with row 0's pages;
    0: the pass launched with nothing to do)."""

    def __init__(self, shared: int | None = None) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(DTYPE)

        self.randn = randn
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.norm_w = randn(HIDDEN) + 1
        self.w_qkv = randn(width, HIDDEN, scale=HIDDEN**-0.5)
        w_up = randn(2 * MLP, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5)
        self.w_up = interleave_gate_up(w_up)
        self.w_down = randn(HIDDEN, MLP, scale=MLP**-0.5)
        pages = -(-CONTEXT // PAGE)
        self.k_cache = randn(BATCH * pages, PAGE, KV_HEADS, HEAD_DIM)
        self.v_cache = randn(BATCH * pages, PAGE, KV_HEADS, HEAD_DIM)
        order = torch.randperm(BATCH * pages, generator=gen, device="cuda")
        self.block_tables = order.view(BATCH, pages).to(torch.int32)
        self.shared = None
        if shared is not None:
            self.block_tables[:, : shared // PAGE] = self.block_tables[0, : shared // PAGE]
            self.shared = torch.tensor([shared, 0], dtype=torch.int32, device="cuda")
        last = CONTEXT - 1  # each sequence's new token, written by the chain
        self.slots = (self.block_tables[:, last // PAGE].long() * PAGE + last % PAGE).contiguous()
        self.seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device="cuda")
        angles = torch.rand(BATCH, HEAD_DIM // 2, generator=gen, device="cuda") * 6.28
        self.cos = torch.cat([angles.cos(), angles.cos()], 1).to(DTYPE)
        self.sin = torch.cat([angles.sin(), angles.sin()], 1).to(DTYPE)
        self.x = randn(BATCH, HIDDEN)
        self.residual = randn(BATCH, HIDDEN)

    def refill(self) -> None:
        self.x.copy_(self.randn(BATCH, HIDDEN))
        self.residual.copy_(self.randn(BATCH, HIDDEN))

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        h, summed = rms_norm(self.x, self.norm_w, 1e-6, residual=self.residual)
        q, k, v = self.project(h, self.w_qkv).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1
        )
        q = q.view(BATCH, HEADS, HEAD_DIM)
        k = k.view(BATCH, KV_HEADS, HEAD_DIM)
        rotary_inplace(q, k, self.cos, self.sin)
        write_kv_cache(k, v.view(BATCH, KV_HEADS, HEAD_DIM), self.k_cache, self.v_cache, self.slots)
        attn = paged_decode_attention(
            q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, HEAD_DIM**-0.5,
            num_splits=4, shared_prefix=self.shared,
        )  # fmt: skip
        # The MLP as the engine runs it on Hopper: SiLU-and-mul in the gate/up product's epilogue
        # over the interleaved weight, then the down projection.
        act = skinny_gemm.decode_glu(attn.flatten(1), self.w_up)
        assert act is not None, "the skinny GEMM should take a decode-sized bf16 product"
        assert skinny_gemm.dense_tiles(HIDDEN, MLP, act.device)["split_k"] == 2
        return self.project(act, self.w_down), summed

    @staticmethod
    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = skinny_gemm.decode_linear(x, w, None)  # the engine's plain-weight path
        assert out is not None, "the skinny GEMM should take a decode-sized bf16 product"
        return out


def replays(
    monkeypatch: pytest.MonkeyPatch, pdl: bool, rounds: int, shared: int | None
) -> list[torch.Tensor]:
    """The chain captured with PDL on or off, replayed on ``rounds`` fresh inputs (the same
    ones for both: the generator restarts). Off, every chain kernel launches as it does on a
    GPU before Hopper (chain_pdl asks launches_dependents)."""
    if not pdl:
        monkeypatch.setattr(triton_pdl, "launches_dependents", lambda x: False)
    chain = Chain(shared)
    chain.run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = chain.run()
    results = []
    for _ in range(rounds):
        chain.refill()
        graph.replay()
        results.append(torch.cat([out, summed], 1).clone())
    eager_out, eager_summed = chain.run()  # the last round's inputs again, no graph
    results.append(torch.cat([eager_out, eager_summed], 1))
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("shared", [None, 0, 8 * PAGE], ids=["no-pass", "pass-idle", "pass"])
def test_pdl_chain_in_a_graph_equals_the_chain_without(
    monkeypatch: pytest.MonkeyPatch, shared: int | None
) -> None:
    """The shared-prefix pass releases its successor before its own wait: the decode kernel
    that folds its partials must still see them whole, and the KV write before it done."""
    with_pdl = replays(monkeypatch, True, rounds=50, shared=shared)
    without = replays(monkeypatch, False, rounds=50, shared=shared)
    assert torch.equal(with_pdl[-1], with_pdl[-2])  # the graph with PDL equals eager
    for got, expected in zip(with_pdl, without, strict=True):
        assert torch.equal(got, expected)
    assert not torch.equal(with_pdl[0], with_pdl[1])  # fresh inputs gave fresh outputs
