"""GGUF weights kept in their blocks: the layout a GGUF layer holds, its torch reference and the
CUDA kernels' entry (engine_core/models/gguf_kernels.py, imported only on CUDA: it imports
triton).

A GGUF converted folder (engine_core/model_dir.py) holds, beside the float32 weights the CPU
serves, the raw block rows of every tensor whose type has a kernel here (Q8_0, Q4_0, Q4_1: 32
values a block; Q4_K, Q6_K: 256) under its HF name. On CUDA the loader builds such layers in
that form: a ``Linear`` (layers.py ``make_gguf``) or the token embedding (``GgufEmbedding``,
which a tied LM head multiplies by too) holds one uint8 tensor ``gguf_blocks`` of the file's
bytes, re-laid as planes (``GgufLayout``):

- the layer's parts (q, k, v of a merged qkv; gate, up) are grouped into runs of consecutive
  parts of one type; parts of different types stay apart (a Q4_K_M file's v is Q6_K);
- per run, each of a block's segments as a plane of its own, its bytes as in the file:
  ``codes`` [N, K] (Q8_0: the int8 bits) or [N, K / 2] (4 bits: in a Q4_0/Q4_1 block byte j
  holds value j in its low nibble and j + 16 in its high one; in a Q4_K block byte t of 32-byte
  chunk c holds value t of sub-block 2c low and of sub-block 2c + 1 high; Q6_K's low 4 bits as
  gguf_blocks.py describes), ``high`` [N, K / 4] (Q6_K's high 2 bits), ``d`` fp16
  [N, K / block], ``m`` fp16 (Q4_1's min, Q4_K's dmin), ``scales`` (Q4_K's eight 6-bit scales
  and mins packed in 12 bytes, Q6_K's sixteen int8). A value is d * q (Q8_0), d * (q - 8)
  (Q4_0), d * q + m (Q4_1), d * sc_s * q - m * mn_s (Q4_K, sub-block s of 32),
  d * sc_s * (q - 32) (Q6_K, sub-block s of 16).

The codes (and Q6_K's high bits) of all runs come first, each a multiple of 16 bytes, so a
kernel reads them as int32 words; the other planes follow (all of even size, so the fp16 planes
are aligned). Bytes in = bytes held: nothing is padded or widened.

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


@dataclass(frozen=True)
class BlockType:
    """A block's values and its bytes in order, as (plane, bytes) segments: ``codes`` (and
    Q6_K's ``high``) the quantized values, ``d`` and ``m`` fp16, ``scales`` raw bytes."""

    values: int
    segments: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        return sum(size for _, size in self.segments)


# Planes read as int32 words: they come first in a layer's tensor, each a multiple of 16 bytes.
WORD_PLANES = ("codes", "high")
FP16_PLANES = ("d", "m")
KERNEL_TYPES = {
    "Q8_0": BlockType(32, (("d", 2), ("codes", 32))),
    "Q4_0": BlockType(32, (("d", 2), ("codes", 16))),
    "Q4_1": BlockType(32, (("d", 2), ("m", 2), ("codes", 16))),
    "Q4_K": BlockType(256, (("d", 2), ("m", 2), ("scales", 12), ("codes", 128))),
    "Q6_K": BlockType(256, (("codes", 128), ("high", 64), ("scales", 16), ("d", 2))),
}


def gguf_kernels() -> ModuleType:
    """The CUDA kernels' module, imported on first use: importing it imports triton."""
    from engine_core.models import gguf_kernels as kernels

    return kernels


@dataclass(frozen=True)
class Planes:
    """One run's rows [N, K] as planes (views into a layer's ``gguf_blocks``)."""

    type_name: str
    codes: torch.Tensor  # uint8 [N, K] (Q8_0) or [N, K / 2] (4-bit types; Q6_K's low 4 bits)
    d: torch.Tensor  # fp16 [N, K / block values]
    m: torch.Tensor | None = None  # fp16 [N, K / block values]: Q4_1's mins, Q4_K's dmin
    # uint8: Q4_K's packed 6-bit scales and mins [N, K / 256 * 12]; Q6_K's int8 scales [N, K / 16]
    scales: torch.Tensor | None = None
    high: torch.Tensor | None = None  # uint8 [N, K / 4]: Q6_K's high 2 bits

    @property
    def by_name(self) -> dict[str, torch.Tensor]:
        """The planes by name, in the order of a block's bytes."""
        kind = KERNEL_TYPES[self.type_name]
        return {name: getattr(self, name) for name, _ in kind.segments}


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
        if unknown or any(self.cols % KERNEL_TYPES[t].values for t in self.types):
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

    def blocks(self, run: Run) -> int:
        """``run``'s blocks in all."""
        return run.rows * self.cols // KERNEL_TYPES[run.type_name].values

    @property
    def nbytes(self) -> int:
        return sum(self.blocks(run) * KERNEL_TYPES[run.type_name].size for run in self.runs)

    def planes(self, blocks: torch.Tensor) -> list[tuple[int, Planes]]:
        """(first output row, planes) of each run, as views into ``blocks``."""
        runs = self.runs
        offset = 0
        planes: list[dict[str, torch.Tensor]] = [{} for _ in runs]
        for words in (True, False):  # the word planes of every run first
            for run, run_planes in zip(runs, planes, strict=True):
                for name, size in KERNEL_TYPES[run.type_name].segments:
                    if (name in WORD_PLANES) != words:
                        continue
                    plane = blocks[offset : offset + self.blocks(run) * size]
                    offset += plane.numel()
                    plane = plane.view(torch.float16) if name in FP16_PLANES else plane
                    run_planes[name] = plane.view(run.rows, -1)
        return [
            (run.start, Planes(run.type_name, **run_planes))
            for run, run_planes in zip(runs, planes, strict=True)
        ]

    def part_place(self, part: int) -> tuple[int, slice]:
        """(the run, the rows within it) of part ``part``."""
        start = sum(self.rows[:part])
        for index, run in enumerate(self.runs):
            if run.start <= start < run.start + run.rows:
                first = start - run.start
                return index, slice(first, first + self.rows[part])
        raise IndexError(f"part {part} of {len(self.rows)}")


def split_blocks(raw: torch.Tensor, type_name: str) -> dict[str, torch.Tensor]:
    """Raw rows [n, K / values * size] -> each plane's rows by name (``codes``, ``d``, ...)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, KERNEL_TYPES[type_name].size)
    planes, start = {}, 0
    for name, size in KERNEL_TYPES[type_name].segments:
        segment = blocks[:, :, start : start + size].contiguous()
        start += size
        fp16 = name in FP16_PLANES
        planes[name] = segment.view(torch.float16)[..., 0] if fp16 else segment.view(rows, -1)
    return planes


def join_blocks(planes: Planes) -> torch.Tensor:
    """``split_blocks``' inverse: the run's rows as the file's raw blocks."""
    rows, count = planes.d.shape
    segments = [p.contiguous().view(torch.uint8).reshape(rows, count, -1)
                for p in planes.by_name.values()]  # fmt: skip
    return torch.cat(segments, dim=2).reshape(rows, -1)


def dequantize(planes: Planes) -> torch.Tensor:
    """A run's planes -> float32 W [N, K], exactly as gguf-py reads the blocks."""
    return gguf_blocks.dequantize(join_blocks(planes), planes.type_name)


def load_part(layout: GgufLayout, blocks: torch.Tensor, part: int, raw: torch.Tensor,
              hf_name: str) -> None:  # fmt: skip
    """Copy part ``part``'s raw block rows (the checkpoint's ``hf_name``) into its planes."""
    kind = KERNEL_TYPES[layout.types[part]]
    expected = (layout.rows[part], layout.cols // kind.values * kind.size)
    if raw.dtype != torch.uint8 or tuple(raw.shape) != expected:
        raise ValueError(f"checkpoint tensor {hf_name!r} is {raw.dtype} {tuple(raw.shape)}, "
                         f"expected {layout.types[part]} rows uint8 {expected}")  # fmt: skip
    run, rows = layout.part_place(part)
    planes = layout.planes(blocks)[run][1]
    targets = planes.by_name
    with torch.no_grad():
        for name, value in split_blocks(raw, layout.types[part]).items():
            targets[name][rows].copy_(value)


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
    return Planes(planes.type_name, **{name: p[ids] for name, p in planes.by_name.items()})


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
