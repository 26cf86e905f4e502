"""The launch shapes of the skinny GEMM's plain products (engine_core/models/skinny_gemm.py
``dense_tiles``, ``dense_row_tile``) against the alternatives, on the GPU machine (issue 17):

    python scripts/device/dense_tiles_probe.py --down-splits [--models llama-1b,llama-8b]
    python scripts/device/dense_tiles_probe.py --row-tiles [--models ...] [--m 128,256]
    python scripts/device/dense_tiles_probe.py --wide-tiles [--models ...] [--m 256]
    python scripts/device/dense_tiles_probe.py --engine-chain [--models ...] [--m 256]

--down-splits: a decode layer's launches at 64 rows (RMSNorm with the residual, qkv, rotary, o,
RMSNorm, gate/up with the SiLU-and-mul epilogue, down) over all the model's layers in one CUDA
graph, the engine's tiles except the down projection's K splits (1, 2, 4), two rounds.

--row-tiles: at each row count, every projection alone (one call per layer's distinct weights in
a CUDA graph) against cuBLAS, over row tiles (block_m 16 to 128), K tiles and (down) two K splits;
then the layer's launches with cuBLAS (and the SiLU-and-mul that reads the interleaved columns),
with the skinny GEMM at the engine's shapes and at each projection's best, two rounds.

--wide-tiles: as --row-tiles, over larger tiles for batches past 128 rows: weight tiles of 64,
128 and 256 rows, row tiles of 64 to 256, one to four K splits for every projection, 4 or 8
warps (where the float32 accumulator fits the registers); each projection's best checked
against cuBLAS's output.

--engine-chain: the layer's launches with cuBLAS against the engine's path (``decode_linear``,
``decode_glu``, else cuBLAS), three rounds alternating, outputs compared.

Prints microseconds per call and per layer.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_chain_probe import layer_chain, model_weights, time_graph  # noqa: E402

from engine_core.models import skinny_gemm, triton_ops  # noqa: E402

Gemm = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def cublas(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if name == "gate_up":
        return triton_ops.silu_and_mul(F.linear(x, w), skinny_gemm.GLU_HALF)
    return F.linear(x, w)


def skinny(cfg: dict[str, Any]) -> Gemm:
    def gemm(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return skinny_gemm.skinny_gemm(x, w, x.dtype, glu=name == "gate_up", **cfg)

    return gemm


def by_name(gemms: dict[str, Gemm]) -> Gemm:
    """One projection function over the named ones (layer_chain's ``project``)."""

    def project(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return gemms[name](name, x, w)

    return project


def interleaved_weights(model: str) -> tuple[dict[str, tuple[int, int]], dict, list[dict]]:
    proj, dims, layers = model_weights(model)
    for w in layers:
        w["gate_up"] = skinny_gemm.interleave_gate_up(w["gate_up"])
    return proj, dims, layers


def down_splits(model: str) -> None:
    proj, dims, layers = interleaved_weights(model)
    dev = torch.device("cuda")
    tiles = {p: skinny_gemm.dense_tiles(*proj[p], dev) for p in proj}
    tiles["gate_up"] = dict(block_n=2 * skinny_gemm.GLU_HALF, block_k=tiles["gate_up"]["block_k"])
    for rnd in range(2):
        for split in (1, 2, 4):
            cfgs = dict(tiles, down=dict(tiles["down"], split_k=split))
            torch.manual_seed(0)
            step, _ = layer_chain(
                64, layers, dims, by_name({p: skinny(c) for p, c in cfgs.items()})
            )
            us = time_graph(step, dims["layers"])
            print(
                f"chain {model:13} M=64 round {rnd} down in {split} K splits: {us:7.2f} us a layer"
            )


def row_tile_configs(name: str, k: int, m: int) -> list[dict[str, Any]]:
    """Row tiles from 16 to 128 rows (at most the rows' power of two), K tiles of 64 and 128,
    8 warps for 128-row tiles too, two K splits for the down projection."""
    tiles = [t for t in (16, 32, 64, 128) if t <= max(16, 1 << (m - 1).bit_length())]
    out = []
    for bm, bk, nw in itertools.product(tiles, (64, 128), (4, 8)):
        if bm < 128 and nw == 8:
            continue
        for split in (1, 2) if name == "down" else (1,):
            if k % (bk * split) == 0:
                out.append(dict(block_m=bm, block_n=64, block_k=bk, split_k=split, num_warps=nw))
    return out


def wide_tile_configs(name: str, k: int, m: int) -> list[dict[str, Any]]:
    """Weight tiles of 64-256 rows (64 for the gate/up epilogue), row tiles of 64-256, K tiles
    of 64, one to four K splits (one for the epilogue), 4 or 8 warps, where the float32
    accumulator takes at most 128 registers a thread."""
    out = []
    block_ns = (2 * skinny_gemm.GLU_HALF,) if name == "gate_up" else (64, 128, 256)
    splits = (1,) if name == "gate_up" else (1, 2, 4)
    for bn, bm, nw, split in itertools.product(block_ns, (64, 128, 256), (4, 8), splits):
        if bm > max(64, 1 << (m - 1).bit_length()) or bn * bm > 128 * 32 * nw:
            continue
        if k % (64 * split) == 0:
            out.append(dict(block_m=bm, block_n=bn, block_k=64, split_k=split, num_warps=nw))
    return out


def sweep(
    name: str, n: int, k: int, m: int, weights: list[torch.Tensor], wide: bool = False
) -> dict[str, Any]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    base = time_graph(lambda: [cublas(name, x, w) for w in weights], len(weights))
    rows = []
    configs = wide_tile_configs(name, k, m) if wide else row_tile_configs(name, k, m)
    for cfg in configs:
        gemm = skinny(cfg)
        try:
            us = time_graph(lambda g=gemm: [g(name, x, w) for w in weights], len(weights))
        except Exception as exc:  # a tile the shared memory or the compiler refuses
            print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        rows.append((us, cfg))
    rows.sort(key=lambda r: r[0])
    top = "; ".join(
        f"n{c['block_n']}m{c['block_m']}k{c['block_k']}s{c['split_k']}w{c['num_warps']} {us:.1f}"
        for us, c in rows[:4]
    )
    want = cublas(name, x, weights[0]).float()
    got = skinny(rows[0][1])(name, x, weights[0]).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(
        f"{name:8} N={n:<6} K={k:<6} M={m}: cuBLAS {base:6.2f} us "
        f"({n * k * 2 / base / 1e6:4.2f} TB/s) | skinny {top} | best's max diff {err:.2g} "
        "of cuBLAS's largest",
        flush=True,
    )
    return rows[0][1]


def row_tiles(model: str, m: int, wide: bool = False) -> None:
    proj, dims, layers = interleaved_weights(model)
    best = {p: sweep(p, *proj[p], m, [w[p] for w in layers], wide) for p in proj}
    dev = torch.device("cuda")
    engine = {p: dict(skinny_gemm.dense_tiles(*proj[p], dev)) for p in proj}
    engine["gate_up"] = dict(block_n=2 * skinny_gemm.GLU_HALF, block_k=engine["gate_up"]["block_k"])
    for name, cfg in engine.items():
        cfg["block_m"] = skinny_gemm.dense_row_tile(m, *proj[name], dev)
    variants = (
        ("cuBLAS", dict.fromkeys(proj, cublas)),
        ("skinny, engine shapes", {p: skinny(engine[p]) for p in proj}),
        ("skinny, best shapes", {p: skinny(best[p]) for p in proj}),
    )
    for rnd in range(2):
        for label, gemms in variants:
            torch.manual_seed(0)
            step, _ = layer_chain(m, layers, dims, by_name(gemms))
            us = time_graph(step, dims["layers"])
            print(f"chain {model:13} M={m} round {rnd} {label:21} {us:7.2f} us a layer", flush=True)


def engine_path(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the model's layers run in a CUDA graph: the skinny GEMM where it takes the product."""
    if name == "gate_up":
        out = skinny_gemm.decode_glu(x, w)
    else:
        out = skinny_gemm.decode_linear(x, w, None)
    return cublas(name, x, w) if out is None else out


def engine_chain(model: str, m: int) -> None:
    proj, dims, layers = interleaved_weights(model)
    outs = {}
    for rnd in range(3):
        for label, gemm in (("cuBLAS", cublas), ("engine path", engine_path)):
            torch.manual_seed(0)
            step, out = layer_chain(m, layers, dims, by_name(dict.fromkeys(proj, gemm)))
            us = time_graph(step, dims["layers"])
            outs[label] = out.float()
            print(f"chain {model:13} M={m} round {rnd} {label:12} {us:7.2f} us a layer", flush=True)
    diff = (outs["engine path"] - outs["cuBLAS"]).norm() / outs["cuBLAS"].norm()
    print(f"chain {model:13} M={m}: engine path against cuBLAS, relative difference {diff:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-1b,llama-8b")
    parser.add_argument("--m", default="128,256", help="row counts for --row-tiles")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--down-splits", action="store_true")
    mode.add_argument("--row-tiles", action="store_true")
    mode.add_argument("--wide-tiles", action="store_true")
    mode.add_argument("--engine-chain", action="store_true")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    with skinny_gemm.for_graphs():
        for model in args.models.split(","):
            if args.down_splits:
                down_splits(model)
            elif args.engine_chain:
                for m in (int(v) for v in args.m.split(",")):
                    engine_chain(model, m)
            else:
                for m in (int(v) for v in args.m.split(",")):
                    row_tiles(model, m, wide=args.wide_tiles)


if __name__ == "__main__":
    main()
