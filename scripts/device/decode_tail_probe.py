"""The decode graphs' tail (engine_core/cuda_graph.py ``DecodeTail``): the LM head's product at
64 rows and its argmax, each way, on the GPU machine (issue 17):

    python scripts/device/decode_tail_probe.py [--models smollm2-135m,llama-1b,llama-8b]

Four tails, each with its own random weight (so no weight is read from L2), in one CUDA graph:
cuBLAS or the skinny GEMM (``decode_linear``, as the tail runs it) for the product, torch.argmax or
``row_argmax`` for the argmax, two rounds. For a short K (smollm2's) also the product alone in
one row tile, in 16-row tiles and by cuBLAS. Checks that row_argmax gives torch.argmax's answer on
the logits the tail wrote. Prints microseconds per tail.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_skinny_bench import time_graph_calls  # noqa: E402

from engine_core.models import skinny_gemm, triton_ops  # noqa: E402
from engine_core.presets import hf_config  # noqa: E402

ROWS = 64
TAILS = 4


def tail(
    x: torch.Tensor,
    w: torch.Tensor,
    logits: torch.Tensor,
    argmax: torch.Tensor,
    vocab: int,
    skinny: bool,
    ours: bool,
) -> None:
    """One tail: logits = x @ w.T, argmax over the first ``vocab`` columns."""
    if not (skinny and skinny_gemm.decode_linear(x, w, None, out=logits) is not None):
        torch.mm(x, w.t(), out=logits)
    if ours:
        triton_ops.row_argmax(logits, vocab, argmax)
    else:
        torch.argmax(logits[:, :vocab], dim=-1, out=argmax)


def time_us(fn: Callable[[], object]) -> float:
    return time_graph_calls(fn, TAILS, replays=50, warmup=5, rounds=7)


def probe(model: str) -> None:
    cfg = hf_config(model)
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    weights = [
        torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        for _ in range(TAILS)
    ]
    logits = [torch.empty(ROWS, vocab, device="cuda", dtype=torch.bfloat16) for _ in weights]
    argmax = [torch.empty(ROWS, device="cuda", dtype=torch.int64) for _ in weights]
    x = torch.randn(ROWS, hidden, device="cuda", dtype=torch.bfloat16)
    runs = list(zip(weights, logits, argmax, strict=True))
    for rnd in range(2):
        for skinny, ours in ((False, False), (False, True), (True, False), (True, True)):
            with skinny_gemm.for_graphs():
                us = time_us(lambda s=skinny, o=ours: [tail(x, *r, vocab, s, o) for r in runs])
            label = f"{'skinny' if skinny else 'cuBLAS'} + {'row_argmax' if ours else 'argmax'}"
            print(f"{model:13} round {rnd} {label:22} {us:7.2f} us a tail", flush=True)
    want = logits[0].argmax(dim=-1)
    print(f"{model:13} row_argmax equals torch.argmax: {torch.equal(argmax[0], want)}")
    if hidden > skinny_gemm.SHORT_K:
        return
    tiles = skinny_gemm.dense_tiles(vocab, hidden, x.device)

    def products(block_m: int | None) -> None:
        for w, o, _ in runs:
            skinny_gemm.skinny_gemm(x, w, x.dtype, out=o, block_m=block_m, **tiles)

    for rnd in range(2):
        one, sixteen = time_us(lambda: products(None)), time_us(lambda: products(16))
        cublas = time_us(lambda: [torch.mm(x, w.t(), out=o) for w, o, _ in runs])
        print(f"{model:13} round {rnd} LM head alone: skinny in one tile {one:6.2f}, in 16-row "
              f"tiles {sixteen:6.2f}, cuBLAS {cublas:6.2f} us", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,llama-1b,llama-8b")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for model in args.models.split(","):
        probe(model)


if __name__ == "__main__":
    main()
