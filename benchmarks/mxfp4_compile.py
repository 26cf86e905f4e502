"""`mxfp4-compile`: what Triton makes of the MXFP4 expert kernels for sm_90, without a GPU.

    pip install --no-deps --target /tmp/tritonsite triton==3.6.0
    PYTHONPATH=.:/tmp/tritonsite python -m benchmarks mxfp4-compile

The tiled kernels (mxfp4_kernels.py) at each of their CANDIDATES and the swapped ones
(mxfp4_swapped.py) at each of SWAPPED_CANDIDATES, gate/up and down, compiled for a Hopper
target (``triton.compile``, no device) as a bf16 launch at gpt-oss-20b's shape specializes them
(pointers, strides and widths divisible by 16 marked so; the scales' rows, 90 bytes apart, not),
then read back from the TTGIR and the SASS (``benchmarks/sm90_compile.py``, which says what each
column counts). ``bf16 to smem``: the activations' tile is expected there; a weight tile there is
the round trip the swapped kernels avoid.

Nothing is timed: ``python -m benchmarks mxfp4 --sweep`` does that on a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import sm90_compile
from benchmarks.report import Provenance, format_table, write_json
from benchmarks.sm90_compile import census

# Arguments a launch at gpt-oss-20b's shape passes as multiples of 16 (Triton marks them so).
_DIVISIBLE = {
    "X", "Act", "Codes", "Scales", "Bias", "Out", "SlotWeights", "SortedSlots", "BlockExperts",
    "stride_xt", "stride_ce", "stride_cn", "stride_se", "stride_be", "stride_as", "stride_os",
    "hidden", "inter",
}  # fmt: skip
_GATE_UP = {
    "X": "*bf16", "Codes": "*u8", "Scales": "*u8", "Bias": "*bf16", "Act": "*bf16",
    "SortedSlots": "*i32", "BlockExperts": "*i32", "stride_xt": "i32", "stride_ce": "i32",
    "stride_cn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_be": "i32",
    "stride_as": "i32", "num_slots": "i32", "hidden": "i32", "inter": "i32", "limit": "fp32",
    "alpha": "fp32",
}  # fmt: skip
_DOWN = {
    "Act": "*bf16", "Codes": "*u8", "Scales": "*u8", "Bias": "*bf16", "Out": "*fp32",
    "SlotWeights": "*fp32", "SortedSlots": "*i32", "BlockExperts": "*i32", "stride_as": "i32",
    "stride_ce": "i32", "stride_cn": "i32", "stride_se": "i32", "stride_sn": "i32",
    "stride_be": "i32", "stride_os": "i32", "num_slots": "i32", "hidden": "i32", "inter": "i32",
}  # fmt: skip
TOP_K = 4  # gpt-oss's


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the rows here")


def compile_sm90(fn: Any, signature: dict[str, str], constants: dict[str, Any], warps: int,
                 stages: int) -> Any:  # fmt: skip
    """``fn`` compiled for sm_90 as a launch at gpt-oss-20b's shape specializes it."""
    return sm90_compile.compile_sm90(fn, signature, constants, warps, stages, _DIVISIBLE)


def rows() -> list[dict[str, Any]]:
    """Every candidate of both kernels, gate/up and down."""
    from engine_core.models import mxfp4_kernels, mxfp4_swapped

    out = []
    for b in mxfp4_kernels.CANDIDATES:
        tiles = {"BLOCK_M": b.m, "BLOCK_N": b.n, "BLOCK_K": b.k, "ONE_SLOT_PER_BLOCK": False}
        kernels = (mxfp4_kernels._gate_up_kernel, mxfp4_kernels._down_kernel)
        name = f"tiled {b.m}x{b.n}x{b.k} w{b.warps}"
        out += _both(kernels, name, tiles, b.n * b.k, b.warps, b.stages)
    for t in mxfp4_swapped.SWAPPED_CANDIDATES:
        tiles = {"ROWS": t.rows, "SLOTS": t.slots, "BLOCK_K": t.k, "SCALED": t.scaled}
        kernels = (mxfp4_swapped._gate_up_swapped_kernel, mxfp4_swapped._down_swapped_kernel)
        name = f"swapped {t.rows}x{t.slots}x{t.k} w{t.warps} s{t.stages}"
        name += "" if t.scaled else " bits"
        out += _both(kernels, name, tiles, t.rows * t.k, t.warps, t.stages)
    return out


def _both(kernels: tuple[Any, Any], name: str, tiles: dict[str, Any], weights: int, warps: int,
          stages: int) -> list[dict[str, Any]]:  # fmt: skip
    """Gate/up (gate's and up's tiles: twice ``weights`` a step) and down at one tile."""
    gate_up = compile_sm90(kernels[0], _GATE_UP, tiles | {"TOP_K": TOP_K, "PRECISION": "tf32"},
                           warps, stages)  # fmt: skip
    down = compile_sm90(kernels[1], _DOWN, tiles | {"PRECISION": "tf32"}, warps, stages)
    return [
        {"kernel": f"{name} gate/up"} | census(gate_up, 2 * weights),
        {"kernel": f"{name} down"} | census(down, weights),
    ]


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv, device="cpu")
    print(header.format())
    results = rows()
    headers = ["kernel", "mma", "bf16 to smem", "regs", "stack", "loop", "/weight"]
    table = [
        [r["kernel"], r["mma"], r["to_smem"], str(r["regs"]), str(r["stack"]),
         str(r["loop"]), f"{r['per_weight']:.1f}"]
        for r in results
    ]  # fmt: skip
    print(format_table(headers, table))
    if args.json:
        write_json(args.json, header, {"results": results})
    return 0
