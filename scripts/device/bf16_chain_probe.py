"""Small models' bf16 decode GEMMs: cuBLAS against the skinny Triton GEMM with programmatic
dependent launch, alone and inside a decode layer's launch chain (issue 17), on the GPU machine:

    python scripts/device/bf16_chain_probe.py [--models smollm2-135m,llama-1b] [--m 64]
        [--quick | --prefetch-sweep]

1. Each projection (qkv, o, gate_up, down) alone: a CUDA graph of one call per layer over every
   layer's distinct weights, cuBLAS (``F.linear``) against ``skinny_gemm`` on the bf16 operands
   over tile shapes and K splits.
2. The chain: the model's layers in one CUDA graph, each RMSNorm (with the residual), qkv, the
   rotary (a PDL chain kernel standing in for rotary, KV write and attention), o on q, the
   residual RMSNorm, gate_up, SiLU-and-mul, down; with cuBLAS, and with the skinny GEMM (with
   PDL, as the engine launches it) at each projection's best shape from 1 and at what a plain
   Linear runs (``decode_linear``'s tiles). Outputs are compared with cuBLAS's.

Prints microseconds per call (1) and per layer (2).
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

from fp8_skinny_bench import time_graph_calls  # noqa: E402

from engine_core.models import skinny_gemm, triton_ops  # noqa: E402
from engine_core.presets import hf_config  # noqa: E402

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shapes(name: str) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(projection -> (N, K), dims) from the preset's HF config."""
    cfg = hf_config(name)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    proj = {
        "qkv": ((heads + 2 * kv) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    dims = dict(
        hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, layers=cfg["num_hidden_layers"]
    )
    return proj, dims


def time_graph(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of a CUDA graph of fn() that makes ``calls`` calls."""
    return time_graph_calls(fn, calls, replays=50, warmup=5, rounds=7)


def skinny(cfg: dict[str, Any]) -> Gemm:
    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return skinny_gemm.skinny_gemm(x, w, x.dtype, **cfg)

    return gemm


def engine_path(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a plain Linear runs in a CUDA graph: decode_linear's choice of tiles, else cuBLAS."""
    out = skinny_gemm.decode_linear(x, w, None)
    return F.linear(x, w) if out is None else out


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


QUICK = False  # --quick: the few shapes that won at 64 and 128 rows (K tiles of 64 for smollm2)


def configs(k: int, m: int) -> list[dict[str, Any]]:
    warps = (4,) if m <= 64 else (4, 8)
    tiles, ks, splits = (
        ((64, 128), (64, 128), (1, 2)) if QUICK else ((32, 64, 128), (64, 128, 256), (1, 2, 4, 8))
    )
    out = []
    for bn, bk, split, nw in itertools.product(tiles, ks, splits, warps):
        if k % (bk * split) == 0 and k // split >= bk:
            out.append(dict(block_n=bn, block_k=bk, split_k=split, num_warps=nw))
    return out


def sweep_projection(
    name: str, n: int, k: int, m: int, weights: list[torch.Tensor]
) -> tuple[float, dict[str, Any], float]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gbytes = n * k * 2 / 1e3  # KB -> bytes per us gives GB/s... kept simple: MB per call
    base = time_graph(lambda: [cublas(x, w) for w in weights], len(weights))
    want = cublas(x, weights[0]).float()
    results = []
    for cfg in configs(k, m):
        try:
            got = skinny(cfg)(x, weights[0]).float()
            err = (got - want).abs().max().item()
            us = time_graph(lambda cfg=cfg: [skinny(cfg)(x, w) for w in weights], len(weights))
        except Exception as exc:  # a shape the kernel refuses or shared memory cannot hold
            print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        results.append((us, cfg, err))
    results.sort(key=lambda r: r[0])
    best = results[0]
    top = "; ".join(
        f"n{c['block_n']}k{c['block_k']}s{c['split_k']}w{c['num_warps']} {us:.1f}us"
        for us, c, _ in results[:4]
    )
    print(
        f"{name:8} N={n:<6} K={k:<6} {gbytes / 1e3:6.2f} MB | cuBLAS {base:6.2f} us "
        f"({n * k * 2 / base / 1e6:5.2f} TB/s) | skinny best {best[0]:6.2f} us "
        f"({n * k * 2 / best[0] / 1e6:5.2f} TB/s, max err {best[2]:.3g}) | top: {top}",
        flush=True,
    )
    return base, best[1], best[0]


def layer_chain(
    m: int,
    layers: list[dict[str, torch.Tensor]],
    dims: dict,
    project: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[Callable[[], None], torch.Tensor]:
    """A decode layer's launches over every layer, and its output. ``project(name, x, w)`` runs
    projection ``name`` of x; for "gate_up" it returns the activation, silu(gate) * up."""
    hidden, heads, kv, hd = dims["hidden"], dims["heads"], dims["kv"], dims["head_dim"]
    x0 = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    res0 = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(m, device="cuda", dtype=torch.float32)[:, None]
    freqs = pos * torch.linspace(0, 1, hd // 2, device="cuda")[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([freqs.sin(), freqs.sin()], -1).to(torch.bfloat16)
    out = torch.empty_like(x0)

    def step() -> None:
        x, res = x0, res0
        for w in layers:
            h, res = triton_ops.rms_norm(x, w["norm"], 1e-5, res)
            qkv = project("qkv", h, w["qkv"])
            q = qkv[:, : heads * hd].view(m, heads, hd)
            k = qkv[:, heads * hd : (heads + kv) * hd].view(m, kv, hd)
            triton_ops.rotary_inplace(q, k, cos, sin)
            o = project("o", q.reshape(m, heads * hd), w["o"])
            h, res = triton_ops.rms_norm(o, w["norm"], 1e-5, res)
            act = project("gate_up", h, w["gate_up"])
            x = project("down", act, w["down"])
        out.copy_(x)

    return step, out


def chain(
    model: str, m: int, gemms: dict[str, Gemm], layers: list[dict[str, torch.Tensor]], dims: dict
) -> tuple[Callable[[], None], torch.Tensor]:
    """layer_chain with these products; gate_up's followed by SiLU-and-mul."""

    def project(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = gemms[name](x, w)
        return triton_ops.silu_and_mul(y) if name == "gate_up" else y

    return layer_chain(m, layers, dims, project)


def model_weights(model: str) -> tuple[dict[str, tuple[int, int]], dict, list[dict]]:
    """(projection shapes, dims, every layer's random weights)."""
    proj, dims = shapes(model)
    layers = []
    for _ in range(dims["layers"]):
        w = {"norm": torch.ones(dims["hidden"], device="cuda", dtype=torch.bfloat16)}
        for name, (n, k) in proj.items():
            w[name] = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        layers.append(w)
    return proj, dims, layers


def prefetch_sweep(model: str, m: int) -> None:
    """The engine's path (decode_linear) in the chain, over SKINNY_PREFETCH_BYTES."""
    proj, dims, layers = model_weights(model)
    gemms = dict.fromkeys(proj, engine_path)
    for prefetch in (0, 256, 512, 1024, 2048, 512):
        skinny_gemm.SKINNY_PREFETCH_BYTES = prefetch
        torch.manual_seed(0)
        step, _ = chain(model, m, gemms, layers, dims)
        us = time_graph(step, dims["layers"])
        print(f"prefetch {model:13} M={m} {prefetch:5} bytes a weight row: {us:7.2f} us a layer")
    skinny_gemm.SKINNY_PREFETCH_BYTES = 512


def probe(model: str, m: int) -> None:
    proj, dims, layers = model_weights(model)
    n_layers = dims["layers"]
    print(f"== {model}, M={m}, {n_layers} layers", flush=True)
    best: dict[str, dict[str, Any]] = {}
    for name, (n, k) in proj.items():
        _, cfg, _ = sweep_projection(name, n, k, m, [w[name] for w in layers])
        best[name] = cfg
    tuned = {p: skinny(best[p]) for p in proj}
    variants: list[tuple[str, dict[str, Gemm]]] = [
        ("cuBLAS", dict.fromkeys(proj, cublas)),
        ("skinny best", tuned),
        ("engine (decode_linear)", dict.fromkeys(proj, engine_path)),
    ]
    want = None
    for label, gemms in variants:
        torch.manual_seed(0)
        step, out = chain(model, m, gemms, layers, dims)
        step()
        torch.cuda.synchronize()
        us = time_graph(step, n_layers)
        if want is None:
            want = out.float().clone()
        rel = ((out.float() - want).norm() / want.norm()).item()
        print(
            f"chain {model:13} {label:24} {us:7.2f} us a layer (rel. diff to cuBLAS {rel:.2e})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,llama-1b,llama-8b")
    parser.add_argument("--m", default="64", help="comma-separated row counts")
    parser.add_argument("--quick", action="store_true", help="sweep only a few tile shapes")
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--prefetch-sweep", action="store_true", help="only the engine's chain over prefetch depths"
    )
    args = parser.parse_args()
    global QUICK
    QUICK = args.quick
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    run = probe
    if args.prefetch_sweep:
        run = prefetch_sweep
    for m in (int(v) for v in args.m.split(",")):
        for model in args.models.split(","):
            run(model, m)


if __name__ == "__main__":
    main()
