"""All-reduce latency on the GPUs of one host: NCCL against the one-shot peer all-reduce.

    python scripts/device/all_reduce_bench.py [--gpus 2] [--dtype bfloat16]

Two (or --gpus) processes, one a GPU. For each size from 1 KiB to 64 MiB, and for the two
decode shapes of llama-8b ([64, 4096] and [256, 4096]), each way captures 32 all-reduces back to
back in one CUDA graph (as a decode step's layers run them) and times 20 replays: microseconds
per all-reduce. "ours" is engine_core/peer_all_reduce.py (up to its 4 MiB); "torch 1-shot" is
PyTorch's own one-shot kernel on symmetric memory (copy in, barrier, sum, barrier) and "torch
2-shot" its two-shot one (reduce-scatter then all-gather over peer memory), for comparison.
Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_core.parallel import connect_store, create_store, join_tp_group  # noqa: E402
from engine_core.peer_all_reduce import PeerAllReduce  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

REPEATS_IN_GRAPH = 32
REPLAYS = 20
MAX_BYTES = 64 * 2**20


def time_in_graph(step: Callable[[], None]) -> float:
    """Microseconds per call of ``step`` captured REPEATS_IN_GRAPH times in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS_IN_GRAPH):
            step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * REPEATS_IN_GRAPH)


def torch_symmetric_buffer(group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(MAX_BYTES, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group)
    return buffer


def bench_rank(rank: int, port: int, world: int, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", rank)
    tp = join_tp_group(connect_store(port, world), rank, world, device, "nccl")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ours = PeerAllReduce(tp.device_group, device, sms)
    symm = torch_symmetric_buffer(tp.device_group, device)
    group_name = tp.device_group.group_name
    shapes = [(n // dtype.itemsize,) for n in (2**k for k in range(10, 27))]
    shapes += [(64, 4096), (256, 4096)]
    rows = []
    for shape in shapes:
        x = torch.randn(shape, device=device).to(dtype) * 1e-3
        nbytes = x.numel() * x.element_size()
        staging = symm[:nbytes].view(dtype).view(shape)

        def one_shot(x: torch.Tensor = x, staging: torch.Tensor = staging) -> None:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", group_name, out=x)

        def two_shot(x: torch.Tensor = x, staging: torch.Tensor = staging) -> None:
            staging.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", group_name, x)

        nccl_us = time_in_graph(lambda x=x: dist.all_reduce(x, group=tp.device_group))
        ours_us = time_in_graph(lambda x=x: ours.all_reduce(x)) if ours.fits(x) else float("nan")
        rows.append(
            (shape, nbytes, nccl_us, ours_us, time_in_graph(one_shot), time_in_graph(two_shot))
        )
    if rank == 0:
        print(f"{torch.cuda.get_device_name(0)} x {world}, {dtype_name}, us per all-reduce "
              f"({REPEATS_IN_GRAPH} in one CUDA graph, {REPLAYS} replays)")  # fmt: skip
        print(f"{'shape':>14} {'bytes':>10} {'NCCL':>9} {'ours':>9} {'torch 1-shot':>13} "
              f"{'torch 2-shot':>13}")  # fmt: skip
        for shape, nbytes, *times in rows:
            label = "x".join(map(str, shape))
            nccl_us, ours_us, one_us, two_us = times
            print(f"{label:>14} {nbytes:>10} {nccl_us:>9.1f} {ours_us:>9.1f} {one_us:>13.1f} "
                  f"{two_us:>13.1f}")  # fmt: skip
    dist.barrier()
    os._exit(0)  # skip the teardown of NCCL and symmetric memory: nothing is left to do


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    store = create_store(args.gpus)
    mp.spawn(bench_rank, args=(store.port, args.gpus, args.dtype), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
