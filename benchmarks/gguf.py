"""A GGUF model's weights on a device, its blocks kept (CUDA's default) and dequantized to bf16
(the CPU's way, at CUDA's dtype): bytes each, their ratio, and the bound that the file's own
tensor bytes give against bf16's. On CUDA the bytes are the allocator's (what loading the model
took); elsewhere the parameters' and buffers'.

    python -m benchmarks gguf-memory --device cuda --json gguf-memory.json
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.report import Provenance, write_json
from engine_core.loader import load_model
from engine_core.memory_plan import module_bytes
from engine_core.model_dir import default_gguf_path


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' or a .gguf file")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=device, help=f"where to load it (default {device})")
    parser.add_argument("--json", type=Path, help="write the figures here")


@dataclass(frozen=True)
class WeightBytes:
    kept: int  # the model loaded with its blocks kept
    floats: int  # the model loaded dequantized to bf16
    file: int  # the GGUF file's tensor bytes
    file_bf16: int  # its tensors' bytes in bf16

    @property
    def ratio(self) -> float:
        return self.kept / self.floats

    @property
    def bound(self) -> float:
        """The ratio that keeping the file's own bytes gives."""
        return self.file / self.file_bf16


def run(args: argparse.Namespace) -> int:
    provenance = Provenance.here(args.argv)
    print(provenance.format(), flush=True)
    got = weight_bytes(args.model, args.device)
    print(f"{args.model} on {args.device}: blocks kept {got.kept / 2**20:.1f} MiB, dequantized "
          f"to bf16 {got.floats / 2**20:.1f} MiB: {got.ratio:.4f}x; the file's tensor bytes "
          f"give {got.bound:.4f}x")  # fmt: skip
    if args.json is not None:
        write_json(args.json, provenance, got)
    return 0


def weight_bytes(model: str, device: str) -> WeightBytes:
    """The model's bytes loaded both ways, and its file's."""
    kept = loaded_bytes(model, device, keep=True)
    floats = loaded_bytes(model, device, keep=False)
    gguf = default_gguf_path() if model == "default" else Path(model)
    return WeightBytes(kept, floats, *file_bytes(gguf))


def loaded_bytes(model: str, device: str, keep: bool) -> int:
    on_cuda = torch.device(device).type == "cuda"
    before = torch.cuda.memory_allocated() if on_cuda else 0
    loaded = load_model(model, device, torch.bfloat16, keep_gguf_blocks=keep).module
    used = torch.cuda.memory_allocated() - before if on_cuda else module_bytes(loaded)
    del loaded
    gc.collect()
    return used


def file_bytes(gguf: Path) -> tuple[int, int]:
    """(the file's tensor bytes, those of its tensors in bf16)."""
    import numpy as np
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    return sum(int(t.n_bytes) for t in tensors), sum(2 * int(np.prod(t.shape)) for t in tensors)
