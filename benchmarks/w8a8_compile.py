"""`w8a8-compile`: what Triton makes of the W8A8 int8 GEMM for sm_90, without a GPU.

    pip install --no-deps --target /tmp/tritonsite triton==3.6.0
    PYTHONPATH=.:/tmp/tritonsite python -m benchmarks w8a8-compile

The prefill tiles (w8a8_kernels.py) compiled for a Hopper target (``triton.compile``, no device)
as a bf16 launch with TMA descriptors specializes them: the one-tile-a-program kernel
(``_int8_gemm_kernel``, TMA) beside the persistent one (``_int8_gemm_persistent_kernel``),
without and with ``ws`` (the K loop's ``warp_specialize``). Read back from the TTGIR, the PTX
and the SASS (``benchmarks/sm90_compile.py`` says what the shared columns count), with what
says whether the compiler warp-specialized the loop: ``ws ops``, the TTGIR's
``ttg.warp_specialize`` and nvws ops; ``setmaxnreg``, the SASS's register reallocations between
warp groups (``USETMAXREG``: the counts warp groups give theirs down to / raise theirs to, a
producer giving registers to consumers; ``regs`` is then the launch's count a thread);
``smem``, the shared memory a program takes (KiB); ``threads``. A configuration that does not
compile shows its error.

Nothing is timed: ``python -m benchmarks gemm --rows 2048 --sweep`` does that on a GPU.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, format_table, write_json
from benchmarks.sm90_compile import census, compile_sm90, sass

# A launch at llama-8b's shapes passes these as multiples of 16 (Triton marks them so).
_DIVISIBLE = {"C", "AScale", "WScale", "Bias", "Part", "N", "K", "K_PER_SPLIT", "stride_am",
              "stride_wn", "stride_cm"}  # fmt: skip
MULTIPROCESSORS = 132  # Hopper's (sm_90) count, as w4a16_compile's
# A USETMAXREG's register count: "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8" (hexadecimal).
_COUNT = r"\S*\s+(?:UP\d, )?(0x[0-9a-f]+)"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the rows here")


def candidates() -> list[Any]:
    """The prefill tiles the sweep offers in the persistent forms, and the one-tile-a-program
    TMA kernel at the same shapes for comparison."""
    from benchmarks.gemm import sweep_grid

    grid = [t for t in sweep_grid(2048, 4096, 4096, MULTIPROCESSORS) if t.tma]
    return [t for t in grid if t.persistent] + [t for t in grid if not t.persistent][:4]


def _descriptor(rows: int, cols: int) -> str:
    return f"tensordesc<i8[{rows}, {cols}]>"


def compile_tiles(tiles: Any) -> Any:
    """The kernel ``int8_gemm`` launches for these tiles (TMA, bf16 out, no bias), for sm_90."""
    from engine_core.models import w8a8_kernels as wk

    a, w = _descriptor(tiles.block_m, tiles.block_k), _descriptor(tiles.block_n, tiles.block_k)
    signature = {
        "a_desc": a, "w_desc": w, "C": "*bf16", "AScale": "*fp32", "WScale": "*fp32",
        "Bias": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
    }  # fmt: skip
    constants: dict[str, Any] = {
        "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        "GROUP_M": tiles.group_m, "HAS_BIAS": False,
    }  # fmt: skip
    if tiles.persistent:  # its descriptors are made in the kernel
        kernel = wk._int8_gemm_persistent_kernel
        signature |= {"A": "*i8", "W": "*i8", "stride_am": "i32", "stride_wn": "i32"}
        del signature["a_desc"], signature["w_desc"]
        constants |= {"NUM_SMS": MULTIPROCESSORS, "WS": tiles.ws,
                      "LOG2_M": tiles.block_m.bit_length() - 1,
                      "LOG2_N": tiles.block_n.bit_length() - 1}  # fmt: skip
    else:
        kernel = wk._int8_gemm_kernel
        signature |= {"A": a, "W": w, "Part": "*i32", "K_PER_SPLIT": "i32", "stride_am": "i32",
                      "stride_wn": "i32"}  # fmt: skip
        del signature["a_desc"], signature["w_desc"]
        constants |= {"EVEN_K": True, "SPLIT": False, "TMA": True}
    return compile_sm90(kernel, signature, constants, tiles.warps, tiles.stages, _DIVISIBLE)


def ws_census(compiled: Any) -> dict[str, Any]:
    """Whether the compiler split the kernel into warp groups of different roles."""
    ttgir, code = compiled.asm["ttgir"], sass(compiled)
    # (the loop's ``tt.warp_specialize`` attribute is only the request, not counted)
    ops = sorted(set(re.findall(r"\b(ttg\.warp_specialize|nvws\.\w+)", ttgir)))
    counts = {
        kind: sorted({int(n, 16) for n in re.findall(rf"USETMAXREG\.{kind}{_COUNT}", code)})
        for kind in ("DEALLOC", "TRY_ALLOC")
    }
    down, up = (",".join(map(str, counts[kind])) for kind in ("DEALLOC", "TRY_ALLOC"))
    return {
        "ws_ops": ", ".join(ops) or "-",
        "setmaxnreg": f"to {down} / {up}" if down or up else "-",
        "smem_kib": compiled.metadata.shared / 1024,
        "threads": 32 * compiled.metadata.num_warps,
    }


def rows() -> list[dict[str, Any]]:
    from benchmarks.gemm import describe

    out = []
    for tiles in candidates():
        row: dict[str, Any] = {"tiles": describe(tiles)}
        try:
            compiled = compile_tiles(tiles)
            row |= census(compiled, tiles.block_n * tiles.block_k, r"\w+") | ws_census(compiled)
        except Exception as exc:  # one configuration failing must not end the report
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        print(row, flush=True)
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv, device="cpu")
    print(header.format())
    results = rows()
    headers = ["tiles", "mma", "ws ops", "setmaxnreg", "regs", "stack", "smem KiB", "threads",
               "loop"]  # fmt: skip
    table = [
        [r["tiles"], r["mma"], r["ws_ops"], r["setmaxnreg"], str(r["regs"]),
         str(r["stack"]), f"{r['smem_kib']:.0f}", str(r["threads"]), str(r["loop"])]
        if "error" not in r else [r["tiles"], "FAILED: " + r["error"]] + [""] * 7
        for r in results
    ]  # fmt: skip
    print(format_table(headers, table))
    if args.json:
        write_json(args.json, header, {"results": results})
    return 0
