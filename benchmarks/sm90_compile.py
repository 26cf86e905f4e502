"""Triton kernels compiled for sm_90 without a GPU, and their machine code read back: the
helpers `mxfp4-compile` and `w4a16-compile` share.

``compile_sm90`` runs ``triton.compile`` on a kernel's ``ASTSource`` for a Hopper target (no
device needed), the launch's divisibility hints given; ``census`` reads the TTGIR, the PTX and
the SASS (the wheel's nvdisasm and cuobjdump) for the columns both reports print:

- ``mma``: the tensor-core instruction: wgmma (its A operand from registers or a shared-memory
  descriptor) or mma.sync;
- ``to smem``: the tiles the kernel stores to shared memory from registers (``local_alloc`` of a
  register tensor) in the dtypes asked for: an operand's tile there is a round trip through
  shared memory;
- ``regs``, ``stack``: registers a thread and stack bytes (a spill where not 0);
- ``loop``, ``/weight``: the main loop's SASS instructions (the longest backward branch), and
  those over the weights a thread widens a step.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any


def compile_sm90(fn: Any, signature: dict[str, str], constants: dict[str, Any], warps: int,
                 stages: int, divisible: Collection[str]) -> Any:  # fmt: skip
    """``fn`` compiled for sm_90 with these constexprs, the ``divisible`` arguments marked as
    multiples of 16 (as Triton marks a launch's pointers and integers that are)."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = fn.arg_names  # the kernel's order, which the attributes' indices follow
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in signature if n in divisible}
    full = {n: signature.get(n, "constexpr") for n in names}
    source = triton.compiler.ASTSource(fn=fn, signature=full, constexprs=constants, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _on_cubin(compiled: Any, *command: str) -> str:
    """A CUDA binary tool's output on the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([*command, cubin.name], capture_output=True, text=True).stdout


def sass(compiled: Any) -> str:
    """The kernel's SASS, as nvdisasm prints it."""
    return _on_cubin(compiled, _tool("nvdisasm"), "-c")


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a branch back to an earlier label) in nvdisasm's
    output."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    code: list[tuple[int, str]] = []
    for line in sass.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(label.group(1))
        if op := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            offset = int(op.group(1), 16)
            labels.update(dict.fromkeys(pending, offset))
            pending = []
            code.append((offset, op.group(2).strip()))
    loops = [[]]
    for offset, text in code:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), offset) < offset:
            start = labels[target.group(1)]
            loops.append([t for o, t in code if start <= o <= offset])
    return max(loops, key=len)


def _mma_name(kind: str, shape: str, a_operand: str) -> str:
    """The instruction and shape; for wgmma whether A is a register list (``{``) or a
    shared-memory descriptor."""
    if kind != "wgmma":
        return f"{kind} {shape}"
    return f"wgmma {shape} A " + ("regs" if a_operand == "{" else "smem")


def stored_tiles(ttgir: str, dtypes: str) -> list[str]:
    """The register tensors the kernel stores to shared memory (``local_alloc`` with an
    operand) whose element type matches the regex ``dtypes``: shapes, with the type where
    ``dtypes`` admits more than one."""
    found = re.findall(rf"ttg\.local_alloc %\S+ : \(tensor<([\dx]+)x({dtypes})\b", ttgir)
    typed = not re.fullmatch(r"\w+", dtypes)
    return [f"{shape}x{dtype}" if typed else shape for shape, dtype in found]


def census(compiled: Any, weights_a_step: int, dtypes: str = "bf16") -> dict[str, Any]:
    """The module docstring's columns for one compiled kernel; ``to_smem`` lists the stored
    tiles whose type matches the regex ``dtypes``."""
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    usage = _on_cubin(compiled, _tool("cuobjdump"), "-res-usage")
    loop = main_loop(sass(compiled))
    threads = 32 * compiled.metadata.num_warps
    # (kind, shape, the first character of wgmma's A operand, after the accumulators)
    pattern = r"(wgmma|mma\.sync)\S*?\.(m\d+n\d+k\d+)\S*\s+(?:\{[^}]*\},\s*(.))?"
    kinds = sorted(set(re.findall(pattern, ptx)))
    return {
        "mma": ", ".join(_mma_name(*kind) for kind in kinds),
        "to_smem": ", ".join(stored_tiles(ttgir, dtypes)),
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "loop": len(loop),
        "per_weight": len(loop) * threads / weights_a_step,
    }
