"""A decode step's CUDA graph with its rotary and KV write in the attention's launch, against
the same graph with them in their own launch, side by side in one process.

    python scripts/device/decode_graph_ab.py --model smollm2-135m --batch 64 [--context 256]
        [--rounds 6] [--replays 200]

It builds two in-process engines on a preset's random weights (launch_host_probe.py's
``decoding_engine``: CUDA graphs and overlap on), one with ``TritonBackend.rotary_in_decode``
on (the engine's default) and one with it off, as ``TANDEM_DECODE_ROPE=0`` would set it. The
engine takes that path for head dims up to ``ROPE_IN_DECODE_MAX_HEAD_DIM`` (64);
``--max-head-dim`` moves that limit for both engines (128: llama-8b's heads too). Each
decodes its batch to about ``--context`` tokens. Then each engine's decode graph is replayed
``--replays`` times back to back and timed by CUDA events, the two engines taking turns for
``--rounds`` rounds, so both see the same clocks and neighbours. It prints each round's
microseconds per replay and the medians: the GPU time of a decode step's graph, without the
host (bench_decode.py's "graph replay" column measures the same thing, one engine a run).

On the GPU machine from the repository root.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch_host_probe import decoding_engine  # noqa: E402  (scripts/device, this folder)

from engine_core.attention import triton_backend  # noqa: E402
from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.core import EngineCore  # noqa: E402

PROMPT_TOKENS = 128  # decoding_engine's prompts


def engine_at_context(model: str, batch: int, context: int, fused: bool) -> EngineCore:
    """An engine whose graphs were captured with the rotary in the attention's launch (or not),
    stepped until its requests hold about ``context`` tokens."""
    TritonBackend.rotary_in_decode = fused
    core = decoding_engine(model, batch, context)
    for _ in range(context - PROMPT_TOKENS + 1):  # the prefill, then one token a step
        core.step()
    torch.cuda.synchronize()
    return core


def replay_us(core: EngineCore, batch: int, replays: int) -> float:
    """Microseconds per replay of the engine's decode graph for ``batch`` rows, on the inputs
    its last step staged (each replay rewrites the same cache slots with the same values)."""
    runner = core.runner.graph_runner
    assert runner is not None, "no CUDA graphs: run on the GPU"
    graph = runner.graphs[runner._bucket[batch]]
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
        "--max-head-dim",
        type=int,
        default=triton_backend.ROPE_IN_DECODE_MAX_HEAD_DIM,
        help="the largest head dim whose rotary rides in the attention's launch",
    )
    args = parser.parse_args(argv)
    triton_backend.ROPE_IN_DECODE_MAX_HEAD_DIM = args.max_head_dim
    print("# python " + " ".join([sys.argv[0], *argv]))
    engines = {
        "in-attention": engine_at_context(args.model, args.batch, args.context, fused=True),
        "own-launch": engine_at_context(args.model, args.batch, args.context, fused=False),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, core in engines.items():
            times[name].append(replay_us(core, args.batch, args.replays))
    for name, values in times.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{args.model} batch {args.batch} context ~{args.context}, rotary {name}: "
              f"median {statistics.median(values):.1f} us a replay ({rounds})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
