"""The one-shot peer all-reduce on two GPUs (engine_core/peer_all_reduce.py) against NCCL's.

Two processes, one a GPU, join a group through the engine's own set-up (``join_tp_group``) and sum
random tensors of 1 KiB to 64 MiB, bfloat16, float16 and float32, both ways (the engine's dispatch
sends the large ones to NCCL). With two ranks each element is one addition of the same two
numbers, rounded once, so the results must be identical bit for bit. Then odd shapes, 200 calls
of mixed sizes queued back to back (a rank must not overwrite a buffer half while the other still
reads it), and several all-reduces in one CUDA graph, replayed on fresh data. Then tensor
parallelism end to end: a tiny random Llama at TP=2 on the two GPUs, with CUDA graphs, gives HF's
greedy tokens with either all-reduce.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from engine_core.llm import LLM  # noqa: E402
from engine_core.parallel import (  # noqa: E402
    TPGroup,
    connect_store,
    create_store,
    join_tp_group,
    leave_tp_group,
)
from protocol.messages import SamplingParams  # noqa: E402
from tests.paged_harness import hf_greedy  # noqa: E402
from tests.test_tensor_parallel import PROMPTS, write_model  # noqa: E402

# The GPU machines forbid NVLink multicast; children inherit these.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HANG_TIMEOUT_S = 120


def random_like_rank(numel: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def nccl_sum(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref, group=tp.device_group)
    return ref


def check_sizes(tp: TPGroup) -> None:
    """Every size both ways; the engine's dispatch takes the kernel up to its buffer's size."""
    assert tp.peer is not None
    assert tp.peer.max_bytes >= 2 * 2**20  # a decode step of 256 x 4096 in bfloat16
    for dtype in DTYPES:
        for seed, nbytes in enumerate(SIZES):
            x = random_like_rank(nbytes // dtype.itemsize, dtype, tp.rank, seed)
            want = nccl_sum(x, tp)
            assert tp.peer.fits(x) == (nbytes <= tp.peer.max_bytes)
            if tp.peer.fits(x):
                got = tp.peer.all_reduce(x.clone())
                assert torch.equal(got, want), f"one-shot {dtype} {nbytes} bytes differs"
            assert torch.equal(tp.all_reduce(x.clone()), want), f"{dtype} {nbytes} bytes"


def check_odd_shapes(tp: TPGroup) -> None:
    """Sizes that are no whole chunk, a view that starts mid-storage, float16: the kernel; a
    dtype it lacks: NCCL. The same sums either way."""
    assert tp.peer is not None
    fitting = {
        "6 bytes": random_like_rank(3, torch.bfloat16, tp.rank, 1),
        "a chunk and a bit": random_like_rank(4097, torch.bfloat16, tp.rank, 2),
        "float16": random_like_rank(5000, torch.float16, tp.rank, 3),
        "offset view": random_like_rank(4097, torch.float32, tp.rank, 4)[1:],
    }
    unfit = {"float64": random_like_rank(1000, torch.float64, tp.rank, 5)}
    for name, x in [*fitting.items(), *unfit.items()]:  # the same order on every rank
        assert tp.peer.fits(x) == (name in fitting), name
        want = nccl_sum(x, tp)
        assert torch.equal(tp.all_reduce(x.clone()), want), name


def check_back_to_back(tp: TPGroup) -> None:
    """Many calls of mixed sizes and dtypes queued with no wait in between, as a step's layers
    queue them: a rank must never overwrite a buffer half that a peer still reads."""
    assert tp.peer is not None
    inputs = []
    for i in range(200):
        dtype = DTYPES[i % len(DTYPES)]
        numel = [64 * 4096, 3, 256 * 4096 // 2, 8192, 4096 * 7 + 5][i % 5]
        inputs.append(random_like_rank(numel, dtype, tp.rank, 100 + i))
    outs = [tp.peer.all_reduce(x.clone()) for x in inputs]
    torch.cuda.synchronize()
    for i, (x, got) in enumerate(zip(inputs, outs, strict=True)):
        assert torch.equal(got, nccl_sum(x, tp)), f"call {i} differs from NCCL"


def check_norm(tp: TPGroup) -> None:
    """The RMSNorm kernel that sums its rows over the ranks itself gives what the all-reduce
    followed by the norm gives, bit for bit: decode batches, odd widths, 60 calls queued back
    to back. Too many rows or too wide a row: no peer arguments (the norm all-reduces first)."""
    from engine_core.models import triton_ops as ops

    assert tp.peer is not None
    cases = [(64, 4096, torch.bfloat16), (128, 4096, torch.bfloat16), (3, 576, torch.float32)]
    cases += [(1, 8192, torch.bfloat16), (17, 2048, torch.float16)]
    queued = []
    for i in range(60):
        rows, n, dtype = cases[i % len(cases)]
        partial = random_like_rank(rows * n, dtype, tp.rank, 200 + i).view(rows, n)
        residual = random_like_rank(rows * n, dtype, 0, 300 + i).view(rows, n)  # the same
        weight = random_like_rank(n, dtype, 0, 400 + i)
        args = tp.peer.norm_args(partial)
        assert args is not None
        queued.append(
            (partial, residual, weight, ops.rms_norm(partial, weight, 1e-5, residual, None, args))
        )
    torch.cuda.synchronize()
    for i, (partial, residual, weight, got) in enumerate(queued):
        want = ops.rms_norm(nccl_sum(partial, tp), weight, 1e-5, residual)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"call {i}"
    too_many = torch.zeros(tp.peer.max_norm_rows + 1, 64, dtype=torch.bfloat16, device="cuda")
    too_wide = torch.zeros(2, 8192, dtype=torch.float32, device="cuda")
    assert tp.peer.norm_args(too_many) is None and tp.peer.norm_args(too_wide) is None


def check_graph(tp: TPGroup) -> None:
    """Four all-reduces of a decode step's shape in one CUDA graph, each feeding the next (as
    layers do), replayed on fresh inputs."""
    static = torch.empty(64, 4096, dtype=torch.bfloat16, device="cuda")

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = tp.all_reduce(x * 0.5)
        return x

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    for seed in range(3):
        fresh = random_like_rank(static.numel(), static.dtype, tp.rank, 50 + seed)
        static.copy_(fresh.view(static.shape))
        want = static.clone()
        for _ in range(4):
            want = nccl_sum(want * 0.5, tp)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"graph replay {seed} differs from NCCL"


def run_rank(rank: int, port: int) -> None:
    # A rank stuck in a barrier would hang the test: print where it waits and fail instead.
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True)
    tp = join_tp_group(connect_store(port, 2), rank, 2, torch.device("cuda", rank), "auto")
    try:
        assert tp.peer is not None, "two GPUs of one host without peer access"
        check_sizes(tp)
        check_odd_shapes(tp)
        check_back_to_back(tp)
        check_norm(tp)
        check_graph(tp)
        torch.cuda.synchronize()
    finally:
        leave_tp_group()


def test_one_shot_all_reduce_matches_nccl_bit_for_bit() -> None:
    store = create_store(2)  # the ranks are the two children; this process only hosts the store
    mp.spawn(run_rank, args=(store.port,), nprocs=2, join=True)


def tp2_llm(folder: Path, all_reduce: str) -> LLM:
    return LLM(
        str(folder),
        device="cuda",
        dtype="float32",
        tensor_parallel_size=2,
        tp_all_reduce=all_reduce,
        max_model_len=128,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        max_num_seqs=16,
    )


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params, detokenize=False)]


@pytest.mark.parametrize("all_reduce", ["auto", "nccl"])
def test_tp2_on_two_gpus_gives_hf_greedy_tokens(all_reduce: str, tmp_path: Path) -> None:
    """The first tensor-parallel engine of this process (the test runs first in its module)."""
    hf_model = write_model("llama", tmp_path)
    want = [hf_greedy(hf_model, prompt, 16).tokens[0] for prompt in PROMPTS]
    llm = tp2_llm(tmp_path, all_reduce)
    try:
        deferred = [
            m.defer_sum for m in llm.engine.runner.model.modules() if hasattr(m, "defer_sum")
        ]
        got = greedy_tokens(llm)
    finally:
        llm.engine.shutdown()
    # With the peer all-reduce, every o_proj and down_proj leaves its sum to the next norm.
    assert deferred == [all_reduce == "auto"] * 4
    assert got == want


def test_a_second_tp_engine_in_one_process_falls_back_to_nccl(tmp_path: Path) -> None:
    """torch's symmetric memory cannot set up a second group of the same name in one process
    (it would wait on the first one's store for ever): the ranks vote, and a later engine in
    this process takes NCCL, with the same tokens and no hang."""
    hf_model = write_model("llama", tmp_path)
    want = [hf_greedy(hf_model, prompt, 16).tokens[0] for prompt in PROMPTS]
    for _ in range(2):  # the first may already be a later one, after the test above
        llm = tp2_llm(tmp_path, "auto")
        try:
            peer = llm.engine.runner.tp.peer
            got = greedy_tokens(llm)
        finally:
            llm.engine.shutdown()
        assert got == want
    assert peer is None
