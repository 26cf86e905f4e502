"""GGUF weights kept in their blocks: the layout a GGUF layer holds, its torch reference and the
CUDA kernels' entry (engine_core/models/gguf_kernels.py, imported only on CUDA: it imports
triton).

A GGUF converted folder (engine_core/model_dir.py) holds, beside the float32 weights the CPU
serves, the raw block rows of every tensor whose type has a kernel here (Q8_0, Q4_0, Q4_1: 32
values a block) under its HF name. On CUDA the loader builds such layers in that form: a
``Linear`` (layers.py ``make_gguf``) or the token embedding (``GgufEmbedding``, which a tied LM
head multiplies by too) holds one uint8 tensor ``gguf_blocks`` of the file's bytes, re-laid as
planes (``GgufLayout``):

- the layer's parts (q, k, v of a merged qkv; gate, up) are grouped into runs of consecutive
  parts of one type; parts of different types stay apart (a Q4_K_M file's v is Q6_K);
- per run, ``codes`` [N, K] (Q8_0: the int8 bits) or [N, K / 2] (Q4: byte j of a block holds
  value j in its low nibble, value j + 16 in its high one, as in the file), ``d`` fp16
  [N, K / 32] and, for Q4_1, ``m`` fp16 [N, K / 32]. A value is d * q (Q8_0), d * (q - 8)
  (Q4_0), d * q + m (Q4_1).

The codes of all runs come first, each a multiple of 16 bytes, so a kernel reads them as int32
words; the scales follow. Bytes in = bytes held: nothing is padded or widened.

The reference (any device) puts a run's planes back into blocks and dequantizes them with
gguf_blocks.py, which reads blocks as gguf-py does; on CUDA the kernels multiply the planes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models import gguf_blocks

VALUES = 32  # values in one block of each type with a kernel
# Type -> (bytes of fp16 fields before a block's codes, bytes of its codes).
KERNEL_TYPES = {"Q8_0": (2, 32), "Q4_0": (2, 16), "Q4_1": (4, 16)}


def gguf_kernels() -> ModuleType:
    """The CUDA kernels' module, imported on first use: importing it imports triton."""
    from engine_core.models import gguf_kernels as kernels

    return kernels


@dataclass(frozen=True)
class Planes:
    """One run's rows [N, K] as planes (views into a layer's ``gguf_blocks``)."""

    type_name: str
    codes: torch.Tensor  # uint8 [N, K] (Q8_0) or [N, K / 2] (Q4_0, Q4_1)
    d: torch.Tensor  # fp16 [N, K / 32]
    m: torch.Tensor | None  # fp16 [N, K / 32]: Q4_1's mins


@dataclass(frozen=True)
class Run:
    """Consecutive parts of one type: their first output row and their rows."""

    type_name: str
    start: int
    rows: int


@dataclass(frozen=True)
class GgufLayout:
    """A layer's parts (their types and rows) over ``cols`` input columns, and where each run's
    planes lie in its one uint8 tensor."""

    types: tuple[str, ...]
    rows: tuple[int, ...]
    cols: int

    def __post_init__(self) -> None:
        unknown = set(self.types) - set(KERNEL_TYPES)
        if unknown or self.cols % VALUES:
            raise ValueError(f"GGUF blocks {self.types} over {self.cols} columns have no kernel")

    @property
    def runs(self) -> list[Run]:
        runs: list[Run] = []
        start = 0
        for type_name, rows in zip(self.types, self.rows, strict=True):
            if runs and runs[-1].type_name == type_name:
                runs[-1] = Run(type_name, runs[-1].start, runs[-1].rows + rows)
            else:
                runs.append(Run(type_name, start, rows))
            start += rows
        return runs

    def code_bytes(self, run: Run) -> int:
        return run.rows * self.cols // VALUES * KERNEL_TYPES[run.type_name][1]

    def scale_bytes(self, run: Run) -> int:
        """Bytes of one fp16 plane of ``run`` (d, and m where it has one)."""
        return run.rows * self.cols // VALUES * 2

    @property
    def nbytes(self) -> int:
        return sum(self.code_bytes(run) + self.scale_bytes(run) * planes_of_scales(run)
                   for run in self.runs)  # fmt: skip

    def planes(self, blocks: torch.Tensor) -> list[tuple[int, Planes]]:
        """(first output row, planes) of each run, as views into ``blocks``."""
        runs = self.runs
        offset, codes = 0, []
        for run in runs:
            size = self.code_bytes(run)
            codes.append(blocks[offset : offset + size].view(run.rows, -1))
            offset += size
        out = []
        for run, run_codes in zip(runs, codes, strict=True):
            size = self.scale_bytes(run)
            scales = [blocks[offset + i * size : offset + (i + 1) * size].view(torch.float16)
                      .view(run.rows, -1) for i in range(planes_of_scales(run))]  # fmt: skip
            offset += size * len(scales)
            m = scales[1] if len(scales) > 1 else None
            out.append((run.start, Planes(run.type_name, run_codes, scales[0], m)))
        return out

    def part_place(self, part: int) -> tuple[int, slice]:
        """(the run, the rows within it) of part ``part``."""
        start = sum(self.rows[:part])
        for index, run in enumerate(self.runs):
            if run.start <= start < run.start + run.rows:
                first = start - run.start
                return index, slice(first, first + self.rows[part])
        raise IndexError(f"part {part} of {len(self.rows)}")


def planes_of_scales(run: Run) -> int:
    return 2 if run.type_name == "Q4_1" else 1


def split_blocks(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, ...]:
    """Raw rows [n, K / 32 * size] -> codes [n, K / 32 * code bytes], d [n, K / 32] fp16 and,
    for Q4_1, m."""
    head, code = KERNEL_TYPES[type_name]
    blocks = raw.reshape(raw.shape[0], -1, head + code)
    scales = [blocks[:, :, i : i + 2].contiguous().view(torch.float16)[..., 0]
              for i in range(0, head, 2)]  # fmt: skip
    return blocks[:, :, head:].reshape(raw.shape[0], -1), *scales


def join_blocks(planes: Planes) -> torch.Tensor:
    """``split_blocks``' inverse: the run's rows as the file's raw blocks."""
    rows = planes.codes.shape[0]
    fields = [planes.d] if planes.m is None else [planes.d, planes.m]
    heads = [f.contiguous().view(torch.uint8).view(rows, -1, 2) for f in fields]
    codes = planes.codes.reshape(rows, heads[0].shape[1], -1)
    return torch.cat([*heads, codes], dim=2).reshape(rows, -1)


def dequantize(planes: Planes) -> torch.Tensor:
    """A run's planes -> float32 W [N, K], exactly as gguf-py reads the blocks."""
    return gguf_blocks.dequantize(join_blocks(planes), planes.type_name)


def load_part(layout: GgufLayout, blocks: torch.Tensor, part: int, raw: torch.Tensor,
              hf_name: str) -> None:  # fmt: skip
    """Copy part ``part``'s raw block rows (the checkpoint's ``hf_name``) into its planes."""
    head, code = KERNEL_TYPES[layout.types[part]]
    expected = (layout.rows[part], layout.cols // VALUES * (head + code))
    if raw.dtype != torch.uint8 or tuple(raw.shape) != expected:
        raise ValueError(f"checkpoint tensor {hf_name!r} is {raw.dtype} {tuple(raw.shape)}, "
                         f"expected {layout.types[part]} rows uint8 {expected}")  # fmt: skip
    run, rows = layout.part_place(part)
    planes = layout.planes(blocks)[run][1]
    targets = (planes.codes, planes.d) if planes.m is None else (planes.codes, planes.d, planes.m)
    with torch.no_grad():
        for target, value in zip(targets, split_blocks(raw, layout.types[part]), strict=True):
            target[rows].copy_(value)


def gguf_linear(x: torch.Tensor, runs: list[tuple[int, Planes]], n: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (no bias): on CUDA the Triton kernels, elsewhere
    each run dequantized and multiplied in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        out = gguf_kernels().gguf_matmul(rows, runs, n)
    else:
        products = [F.linear(rows, dequantize(planes).to(x.dtype)) for _, planes in runs]
        out = products[0] if len(products) == 1 else torch.cat(products, dim=1)
    return out.view(*x.shape[:-1], n)


def gather_rows(planes: Planes, ids: torch.Tensor) -> Planes:
    """The planes of rows ``ids`` (an embedding lookup before dequantizing)."""
    m = None if planes.m is None else planes.m[ids]
    return Planes(planes.type_name, planes.codes[ids], planes.d[ids], m)


class HoldsGgufBlocks:
    """A module whose weight is ``gguf_blocks`` laid out by ``gguf`` (None: not GGUF); its planes
    are views made once per storage (loading or moving the tensor makes new ones)."""

    gguf: GgufLayout | None
    gguf_blocks: nn.Parameter
    _gguf_views: tuple[int, list[tuple[int, Planes]]] | None = None

    def gguf_planes(self) -> list[tuple[int, Planes]]:
        assert self.gguf is not None
        pointer = self.gguf_blocks.data_ptr()
        if self._gguf_views is None or self._gguf_views[0] != pointer:
            self._gguf_views = (pointer, self.gguf.planes(self.gguf_blocks.data))
        return self._gguf_views[1]

    def load_gguf_part(self, raw: torch.Tensor, part: int | None, hf_name: str) -> None:
        assert self.gguf is not None
        load_part(self.gguf, self.gguf_blocks.data, part or 0, raw, hf_name)
