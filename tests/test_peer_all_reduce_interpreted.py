"""The one-shot peer all-reduce kernel's protocol on the CPU, through Triton's interpreter.

Skipped unless ``TRITON_INTERPRET=1`` (and triton installed); then two processes stand in for
two GPUs: their buffers are shared memory, each process's kernel writes its flags into the other's
buffer and spins on its own, exactly as over NVLink. Fifteen calls of mixed sizes and dtypes run
back to back, so the buffer halves alternate and programs of different launches meet; each
rank's results must be the exact sum, the same on both ranks. Then the RMSNorm kernel that sums
its rows over the ranks first (with the residual add) must give what the all-reduce followed by
the plain norm kernel gives. float32 and float16 only: the
interpreter rounds float32 to bfloat16 by truncation, where GPUs round to nearest.

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_peer_all_reduce_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

WORLD = 2
MAX_BYTES = 1 << 16
NORM_ROWS = 8


def make_calls() -> list[list[torch.Tensor]]:
    """Each call's input on each rank: sizes under, at and over a chunk, three dtypes' worth."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for i in range(15):
        dtype = (torch.float32, torch.float16)[i % 2]
        numel = (3, 2048, 4097, 9000, 16384)[i % 5]
        calls.append([torch.randn(numel, generator=gen).to(dtype) for _ in range(WORLD)])
    return calls


def make_norm_calls() -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Each norm call's rows on each rank, the residual and the weight (float32)."""
    gen = torch.Generator().manual_seed(1)
    calls = []
    for rows, n in [(4, 64), (3, 100), (8, 1024)] * 2:
        partials = [torch.randn(rows, n, generator=gen) for _ in range(WORLD)]
        calls.append((partials, torch.randn(rows, n, generator=gen), torch.randn(n, generator=gen)))
    return calls


def run_rank(rank: int, buffers: list[torch.Tensor], results: mp.Queue) -> None:
    """The plain calls, then the norm calls, each family in its own part of the buffers."""
    from engine_core import peer_all_reduce_kernel as kernel
    from engine_core.models import triton_ops as ops
    from engine_core.peer_all_reduce import PeerSumArgs

    layout = kernel.BufferLayout.of(MAX_BYTES, WORLD, NORM_ROWS)
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)  # this process's
    counters = torch.zeros(layout.programs, dtype=torch.int64)
    outs = []
    for call in make_calls():
        x = call[rank].clone()
        half = MAX_BYTES // x.element_size()
        kernel.one_shot_all_reduce(x, peers, counters, half, layout.signal_offset, rank, WORLD)
        outs.append(x)
    slot = kernel.ROW_BYTES // 4
    args = PeerSumArgs(
        peers, torch.zeros(NORM_ROWS, dtype=torch.int64), NORM_ROWS * slot,
        layout.norm_data_offset, layout.norm_signal_offset, slot, rank, WORLD,
    )  # fmt: skip
    for partials, residual, weight in make_norm_calls():
        outs.extend(ops.rms_norm(partials[rank], weight, 1e-5, residual, None, args))
    results.put((rank, [x.tolist() for x in outs]))  # plain values: the process ends next


def test_two_interpreted_ranks_sum_exactly() -> None:
    from engine_core import peer_all_reduce_kernel as kernel
    from engine_core.models import triton_ops as ops

    total = kernel.BufferLayout.of(MAX_BYTES, WORLD, NORM_ROWS).total
    buffers = [torch.zeros(total, dtype=torch.uint8).share_memory_() for _ in range(WORLD)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, buffers, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in range(WORLD))
    for p in procs:
        p.join(60)
    wants = [call[0] + call[1] for call in make_calls()]  # one rounding of the exact sum
    for partials, residual, weight in make_norm_calls():
        # The all-reduce, then the separate norm: what the fused launch must give.
        wants.extend(ops.rms_norm(partials[0] + partials[1], weight, 1e-5, residual))
    for rank in range(WORLD):
        assert len(got[rank]) == len(wants)
        for i, want in enumerate(wants):
            sums = torch.tensor(got[rank][i], dtype=want.dtype)
            assert torch.equal(sums, want), f"output {i} on rank {rank}"
