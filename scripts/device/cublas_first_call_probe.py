"""What cuBLAS's first call at a new row count costs the host, on the GPU machine (issue 17: the
first long prompt after start-up still took 8 ms more than the second on llama-1b, with the
warm-up steps in place):

    python scripts/device/cublas_first_call_probe.py [--model llama-1b] [--ladder]

In a fresh process, each of the preset's four decoder products (qkv, o, gate_up, down: one
weight each) is called by ``F.linear`` at 16 and 8,192 rows (what a start-up warm-up reaches),
then at a list of eager prefill sizes, some twice in a row. Each call is timed twice: on the
host until ``F.linear`` returns (the launch, with whatever cuBLAS does first), and until the GPU
has finished it. A cost that comes back at every new row count, also right beside sizes already
called, is per row count (cuBLAS's choice of kernel for that shape); one that a size nearby
already paid is per kernel. ``--ladder`` first calls every multiple of 64 rows between 2,048 and
8,192, as a warm-up over a ladder of sizes would.

Prints, per call: host microseconds / microseconds until done, for each product.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_chain_probe import shapes  # noqa: E402

MOST_ROWS = 8192
SIZES = (3000, 3000, 3001, 3064, 3128, 3900, 3900, 2500, 5000, 6000, 7000, 2100, 2200, 4097, 4097)
LADDER = range(2048 + 64, MOST_ROWS, 64)


def call_all(
    weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], rows: int
) -> list[tuple[str, float, float]]:
    """(product, host us, us until done) for one F.linear of each product at ``rows`` rows."""
    times = []
    for name, weight in weights.items():
        x = inputs[name][:rows]
        torch.cuda.synchronize()
        start = time.perf_counter()
        F.linear(x, weight)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        times.append((name, 1e6 * (returned - start), 1e6 * (done - start)))
    return times


def print_call(label: str, rows: int, times: list[tuple[str, float, float]]) -> None:
    parts = "  ".join(f"{name} {host:6.0f}/{done:6.0f}" for name, host, done in times)
    print(f"{label:7} M={rows:5}  host/done us: {parts}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", help="preset whose product shapes to use")
    parser.add_argument("--ladder", action="store_true", help="call a ladder of sizes first")
    args = parser.parse_args(argv)
    print("# python " + " ".join([sys.argv[0], *argv]))
    proj, _ = shapes(args.model)
    weights = {
        name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for name, (n, k) in proj.items()
    }
    inputs = {
        name: torch.randn(MOST_ROWS, k, device="cuda", dtype=torch.bfloat16)
        for name, (_, k) in proj.items()
    }
    for rows in (16, MOST_ROWS):
        print_call("warm-up", rows, call_all(weights, inputs, rows))
    if args.ladder:
        start = time.perf_counter()
        for rows in LADDER:
            call_all(weights, inputs, rows)
        print(f"ladder of {len(LADDER)} sizes: {time.perf_counter() - start:.2f} s")
    label = "ladder" if args.ladder else "fresh"
    for rows in SIZES:
        print_call(label, rows, call_all(weights, inputs, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
