"""`w4a16-compile`: what Triton makes of the W4A16 tensor-core kernels for sm_90, without a GPU.

    pip install --no-deps --target /tmp/tritonsite triton==3.6.0
    PYTHONPATH=.:/tmp/tritonsite python -m benchmarks w4a16-compile

``_w4a16_kernel`` and ``_w4a16_joined_kernel`` (w4a16_kernels.py) at each tensor-core tile the
sweep (``python -m benchmarks w4a16 --sweep``) times at 16 and 64 rows of llama-8b's gate/up
(N 28,672, K 4,096) and down (N 4,096, K 14,336), at the K split the rule picks, groups of 128
with zero points, compiled for a Hopper target (``triton.compile``, no device) as a bf16 launch
specializes them, then read back from the TTGIR and the SASS (``benchmarks/sm90_compile.py``
says what each column counts). ``to smem``: every register tensor stored to shared memory, with
its type; the weights' tile ([BLOCK_N, 16] bf16 a slice) there is the round trip that the joined
kernel avoids. ``/weight``: the main loop (one 128-column block of K) over the BLOCK_N x 128
weights it dequantizes, a thread's share.

Nothing is timed: ``python -m benchmarks w4a16 --sweep`` does that on a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, format_table, write_json
from benchmarks.sm90_compile import census, compile_sm90

SHAPES = {"gate/up": (28672, 4096), "down": (4096, 14336)}  # llama-8b's (N, K)
ROWS = (16, 64)
GROUP = 128
MULTIPROCESSORS = 132  # Hopper's (sm_90) count, for the rule's K split
# A bf16 launch at these shapes passes these as multiples of 16 (Triton marks them so).
_DIVISIBLE = {
    "A", "QWeight", "Scales", "Zeros", "C", "Part", "N", "K", "GROUPS", "stride_am", "stride_cm",
    "TILES",
}  # fmt: skip
_SIGNATURE = {
    "A": "*bf16", "QWeight": "*i32", "Scales": "*fp32", "Zeros": "*u8", "C": "*bf16",
    "Part": "*fp32", "M": "i32", "N": "i32", "K": "i32", "GROUPS": "i32", "stride_am": "i32",
    "stride_cm": "i32", "TILES": "i32", "TILES_PER_SPLIT": "i32",
}  # fmt: skip


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the rows here")


def candidates(m: int, n: int, k: int) -> list[Any]:
    """The sweep's tensor-core tiles at M rows, at the rule's K split (the split changes only
    whether partials are written, not the loop)."""
    from benchmarks.w4a16 import grid
    from engine_core.models.w4a16_kernels import Tiles, rule_tiles

    split = rule_tiles(m, n, k, MULTIPROCESSORS).split_k
    tiles = grid(m, n, k, MULTIPROCESSORS)
    return [t for t in tiles if isinstance(t, Tiles) and t.split_k == split]


def compile_tiles(tiles: Any) -> Any:
    """The kernel ``run_w4a16`` launches for these tiles, compiled for sm_90."""
    from engine_core.models import w4a16_kernels as wk

    constants = {
        "GROUP": GROUP, "PLANES_PER_GROUP": wk.planes_per_group(GROUP), "HAS_ZEROS": True,
        "PRECISION": "tf32", "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
        "SPLIT": tiles.split_k > 1,
    }  # fmt: skip
    if tiles.joined:
        kernel = wk._w4a16_joined_kernel
    else:
        kernel, constants["SWAP"] = wk._w4a16_kernel, tiles.swap
    return compile_sm90(kernel, _SIGNATURE, constants, tiles.warps, tiles.stages, _DIVISIBLE)


def rows() -> list[dict[str, Any]]:
    """Every candidate at each row count and projection (one compile per distinct kernel)."""
    from benchmarks.w4a16 import describe

    compiled: dict[Any, dict[str, Any]] = {}
    out = []
    for m in ROWS:
        for name, (n, k) in SHAPES.items():
            for tiles in candidates(m, n, k):
                if tiles not in compiled:
                    compiled[tiles] = census(compile_tiles(tiles), tiles.block_n * 128, r"\w+")
                out.append({"rows": m, "projection": name, "tiles": describe(tiles)}
                           | compiled[tiles])  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv, device="cpu")
    print(header.format())
    results = rows()
    headers = ["M", "projection", "tiles", "mma", "to smem", "regs", "stack", "loop", "/weight"]
    table = [
        [str(r["rows"]), r["projection"], r["tiles"], r["mma"], _stored(r["to_smem"]),
         str(r["regs"]), str(r["stack"]), str(r["loop"]), f"{r['per_weight']:.1f}"]
        for r in results
    ]  # fmt: skip
    print(format_table(headers, table))
    if args.json:
        write_json(args.json, header, {"results": results})
    return 0


def _stored(tiles: str) -> str:
    """The stored tiles, repeats counted: '8 x 64x16xbf16'."""
    names = [t for t in tiles.split(", ") if t]
    return ", ".join(f"{names.count(t)} x {t}" for t in dict.fromkeys(names)) or "-"
