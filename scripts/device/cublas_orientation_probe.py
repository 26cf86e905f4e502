"""cuBLAS's products at batch sizes past the skinny GEMM (256 rows) in both orientations, on the
GPU machine (issue 17, llama-8b 256):

    python scripts/device/cublas_orientation_probe.py [--models llama-8b,llama-1b] [--m 256]

cuBLAS picks its kernel by the problem's layout. ``F.linear(x, w)`` asks for C [M, N] row-major
(in cuBLAS's column-major terms, C.T = W @ X.T); the swapped problem ``torch.mm(w, x.T)`` asks
for C.T [N, M] row-major, another layout with its own heuristics and tiles. Each projection
(qkv, o, gate_up, down) alone, one call per layer over every layer's distinct weights in one
CUDA graph (so L2 holds no weights between calls):

- ``linear``: F.linear(x, w), what the engine runs;
- ``swapped``: torch.mm(w, x.T), the transposed output left as it is (a bound: the layer
  after it would need to read it transposed);
- ``swapped+copy``: the same, then made row-major again (.T.contiguous()).

Each variant's output is checked against ``linear``'s. Prints microseconds per call.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_chain_probe import model_weights, time_graph  # noqa: E402

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

VARIANTS: dict[str, Gemm] = {
    "linear": lambda x, w: F.linear(x, w),
    "swapped": lambda x, w: torch.mm(w, x.t()),
    "swapped+copy": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
}


def probe(model: str, m: int) -> None:
    """Each projection in each orientation, two rounds, with the outputs compared."""
    torch.manual_seed(0)
    proj, dims, layers = model_weights(model)
    x = torch.randn(m, dims["hidden"], device="cuda", dtype=torch.bfloat16)
    for name, (n, k) in proj.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) if k != x.shape[1] else x
        ref = F.linear(a, layers[0][name]).float()
        for label, gemm in VARIANTS.items():
            got = gemm(a, layers[0][name]).float()
            got = got.t() if label == "swapped" else got
            err = (got - ref).abs().max().item()
            times = []
            for _ in range(2):

                def calls(gemm: Gemm = gemm, a: torch.Tensor = a, name: str = name) -> None:
                    for layer in layers:
                        gemm(a, layer[name])

                times.append(time_graph(calls, len(layers)))
            shown = " ".join(f"{t:7.2f}" for t in times)
            print(f"{model:9} M={m} {name:8} N={n:6} K={k:6} {label:13} {shown} us a call "
                  f"(max |diff| vs linear {err:.3g})")  # fmt: skip
        del ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-8b,llama-1b")
    parser.add_argument("--m", default="256", help="comma-separated row counts")
    args = parser.parse_args()
    for model in args.models.split(","):
        for m in (int(v) for v in args.m.split(",")):
            probe(model, m)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
