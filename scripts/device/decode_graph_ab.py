"""Decode CUDA graphs of differently built engines, replayed side by side in one process: the
GPU time of a decode step, without the host, precise to about a microsecond.

    python scripts/device/decode_graph_ab.py --model smollm2-135m --batch 64 [--context 256]
        [--rounds 6] [--replays 200] [--variant LABEL:KEY=VALUE,... ...]

Each variant is an in-process engine on the preset's random weights (launch_host_probe.py's
``decoding_engine``: CUDA graphs and overlap on) built with some launch settings, which its
graphs capture. KEY=VALUE settings:

- ``max_head_dim=N``: the largest head dim whose decode step's rotary and KV write ride in the
  attention's launch (``ROPE_IN_DECODE_MAX_HEAD_DIM``; 0: none do);
- ``tile=nNwWsS[kK]``: the decode kernel's launch shape for the model's head size with a bf16
  cache (tokens per iteration N, W warps, S pipeline stages, K kv heads per program), and
  ``wide_tile=...`` the one for grids that fill the GPU many times over (``_WIDE_DECODE_TILES``),
  ``sparse_tile=...`` the one for grids of 1-1.5 programs a multiprocessor
  (``_SPARSE_DECODE_TILES``);
- ``min_split=N``: the shortest context split (``MIN_SPLIT_TOKENS``), and ``thin_split=N``
  the one for grids of 1-2 programs a multiprocessor (``THIN_MIN_SPLIT_TOKENS``);
- ``norm_between_max_k=N``: the longest o product whose launch and the gate/up product's
  share the post-attention RMSNorm (``skinny_gemm.NORM_BETWEEN_MAX_K``; 0: none).

Without ``--variant``: ``in-attention`` (the defaults) against ``own-launch:max_head_dim=0``.
Each engine decodes
its batch to about ``--context`` tokens; then each one's decode graph is replayed ``--replays``
times back to back and timed by CUDA events, the engines taking turns for ``--rounds`` rounds
(the same clocks and neighbours for all). It prints each round's microseconds per replay and
the medians (bench_decode.py's "graph replay" column measures the same, one engine a run).

On the GPU machine from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch_host_probe import decoding_engine  # noqa: E402  (scripts/device, this folder)

from engine_core.attention import triton_backend, triton_kernels  # noqa: E402
from engine_core.attention.triton_kernels import DecodeTile  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402
from engine_core.models import skinny_gemm  # noqa: E402
from engine_core.presets import PRESETS  # noqa: E402

PROMPT_TOKENS = 128  # decoding_engine's prompts


def parse_tile(text: str) -> DecodeTile:
    """``n64w4s3`` or ``n64w4s3k2`` as a DecodeTile."""
    match = re.fullmatch(r"n(\d+)w(\d+)s(\d+)(?:k(\d+))?", text)
    if match is None:
        raise ValueError(f"a tile is nNwWsS[kK], not {text!r}")
    block_n, warps, stages, kpp = match.groups()
    return DecodeTile(int(block_n), int(warps), int(stages), int(kpp or 1))


@contextlib.contextmanager
def launch_settings(settings: dict[str, str], head_dim: int, kv_heads: int) -> Iterator[None]:
    """The variant's settings applied while its engine is built (its graphs captured), then
    the defaults back."""
    tile_key = (head_dim, False)
    saved = (
        triton_backend.ROPE_IN_DECODE_MAX_HEAD_DIM,
        triton_kernels.MIN_SPLIT_TOKENS,
        triton_kernels.THIN_MIN_SPLIT_TOKENS,
        dict(triton_kernels._DECODE_TILES),
        dict(triton_kernels._WIDE_DECODE_TILES),
        dict(triton_kernels._SPARSE_DECODE_TILES),
        skinny_gemm.NORM_BETWEEN_MAX_K,
    )
    for key, value in settings.items():
        if key == "norm_between_max_k":
            skinny_gemm.NORM_BETWEEN_MAX_K = int(value)
        elif key == "max_head_dim":
            triton_backend.ROPE_IN_DECODE_MAX_HEAD_DIM = int(value)
        elif key == "min_split":
            triton_kernels.MIN_SPLIT_TOKENS = int(value)
        elif key == "thin_split":
            triton_kernels.THIN_MIN_SPLIT_TOKENS = int(value)
        elif key == "tile":
            triton_kernels._DECODE_TILES[tile_key] = parse_tile(value)
        elif key == "wide_tile":
            triton_kernels._WIDE_DECODE_TILES[tile_key] = parse_tile(value)
        elif key == "sparse_tile":  # for the model's kv head count
            triton_kernels._SPARSE_DECODE_TILES[(*tile_key, kv_heads)] = parse_tile(value)
        else:
            raise ValueError(f"unknown setting {key!r}")
    try:
        yield
    finally:
        (
            triton_backend.ROPE_IN_DECODE_MAX_HEAD_DIM,
            triton_kernels.MIN_SPLIT_TOKENS,
            triton_kernels.THIN_MIN_SPLIT_TOKENS,
            tiles,
            wide,
            sparse,
            skinny_gemm.NORM_BETWEEN_MAX_K,
        ) = saved
        triton_kernels._DECODE_TILES.clear()
        triton_kernels._DECODE_TILES.update(tiles)
        triton_kernels._WIDE_DECODE_TILES.clear()
        triton_kernels._WIDE_DECODE_TILES.update(wide)
        triton_kernels._SPARSE_DECODE_TILES.clear()
        triton_kernels._SPARSE_DECODE_TILES.update(sparse)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``label:key=value,key=value`` as (label, settings)."""
    label, _, spec = text.partition(":")
    settings = dict(item.split("=", 1) for item in spec.split(",") if item)
    return label, settings


def engine_at_context(model: str, batch: int, context: int) -> EngineCore:
    """An engine stepped until its requests hold about ``context`` tokens."""
    core = decoding_engine(model, batch, context)
    for _ in range(context - PROMPT_TOKENS + 1):  # the prefill, then one token a step
        core.step()
    torch.cuda.synchronize()
    return core


def decode_graph(core: EngineCore, batch: int) -> torch.cuda.CUDAGraph:
    """The engine's decode graph for ``batch`` rows (also power_cap_probe.py's and
    graph_launch_probe.py's)."""
    runner = core.runner.graph_runner
    assert runner is not None, "no CUDA graphs: run on the GPU"
    return runner.graphs[runner._bucket[batch]]


def replay_us(core: EngineCore, batch: int, replays: int) -> float:
    """Microseconds per replay of the engine's decode graph for ``batch`` rows, on the inputs
    its last step staged (each replay rewrites the same cache slots with the same values)."""
    graph = decode_graph(core, batch)
    graph.replay()  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset (random weights)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="tokens per request, about")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replays", type=int, default=200, help="replays timed per round")
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help="LABEL:KEY=VALUE,... (see the docstring); default: rotary in the attention or not",
    )
    args = parser.parse_args(argv)
    print("# python " + " ".join([sys.argv[0], *argv]))
    variants = dict(
        parse_variant(v) for v in args.variant or ["in-attention", "own-launch:max_head_dim=0"]
    )
    head_dim = PRESETS[args.model].head_dim
    tuned = min((d for d, _ in triton_kernels._DECODE_TILES if head_dim <= d), default=head_dim)
    engines = {}
    for label, settings in variants.items():
        with launch_settings(settings, tuned, PRESETS[args.model].num_kv_heads):
            engines[label] = engine_at_context(args.model, args.batch, args.context)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, core in engines.items():
            times[name].append(replay_us(core, args.batch, args.replays))
    for name, values in times.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{args.model} batch {args.batch} context ~{args.context}, {name}: "
              f"median {statistics.median(values):.1f} us a replay ({rounds})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
