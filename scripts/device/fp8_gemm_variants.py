"""FP8 GEMM experiments on llama-8b's shapes (issue 18), on the GPU machine:

    python scripts/device/fp8_gemm_variants.py [--json OUT] [--ms 64,16,1] [--prefill-m 16384]

1. Decode sizes (``--ms``): ``fp8_skinny_gemm`` with its tiles loaded by TMA (the engine's
   default on Hopper) against per-thread pointer loads (the kernel before), over pipeline depths,
   each timed as a CUDA graph of LAYERS calls over distinct weights (as fp8_skinny_bench.py).
2. Prefill sizes (``--prefill-m``): cuBLAS bf16; cuBLASLt FP8 with row-wise scales (what the
   engine dispatches above SKINNY_MAX_ROWS) and with one scale per tensor (the same GEMM with no
   row scaling: what row-wise costs); a persistent Triton FP8 GEMM with TMA loads and the
   row-wise scales in its epilogue, over tile shapes; and SiLU-and-mul followed by the per-token
   quantizer against ``silu_and_mul_quant`` (one launch).
3. A decode layer's launch chain (``--chain``, 64 rows): RMSNorm with its fused quantizer, qkv,
   the o_proj input's quantizer, o, the residual RMSNorm, gate_up, SiLU-and-mul, the quantizer,
   down, over LAYERS layers in one CUDA graph (attention left out): the skinny GEMM launched as
   the engine launches it (a programmatic dependent that releases the kernel after it), over
   prefetch depths (SKINNY_PREFETCH_BYTES).

Prints microseconds and TB/s (decode) or TFLOP/s (prefill) per variant, and the layer sums.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_skinny_bench import LAYERS, SHAPES, time_graph  # noqa: E402

from engine_core.models import fp8_kernels, skinny_gemm, triton_ops  # noqa: E402
from engine_core.models.fp8_kernels import (  # noqa: E402
    fp8_skinny_gemm,
    quantize_per_token,
    silu_and_mul_quant,
)

# ---- decode sizes --------------------------------------------------------------------------------


DECODE_SWEEP: list[dict[str, Any]] = [{"tma": False, "num_stages": st} for st in (3, 5)] + [
    {"tma": True, "num_stages": st} for st in (3, 4, 5, 6)
]


def bench_decode(name: str, n: int, k: int, m: int) -> list[dict[str, Any]]:
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    ws = [w.float().abs().amax(1) / 448 for w in w16]
    w8 = [(w.float() / s[:, None]).to(torch.float8_e4m3fn) for w, s in zip(w16, ws, strict=True)]
    del w16
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_per_token(x)
    ref = (xq.float() * xs) @ (w8[0].float() * ws[0][:, None]).T
    rows = [{"variant": "engine default", "kw": {}}] + [
        {"variant": f"{'tma' if c['tma'] else 'ptr'} st{c['num_stages']}", "kw": c}
        for c in DECODE_SWEEP
    ]
    for row in rows:
        kw = row.pop("kw")
        got = fp8_skinny_gemm(xq, xs, w8[0], ws[0], torch.bfloat16, **kw).float()
        row["err"] = (got - ref).abs().max().item() / ref.abs().max().item()
        row["us"] = time_graph(
            lambda i, kw=kw: fp8_skinny_gemm(xq, xs, w8[i], ws[i], x.dtype, **kw)
        )
        row.update(shape=name, m=m, tb_s=n * k / row["us"] / 1e6)
    return rows


def decode_report(m: int) -> list[dict[str, Any]]:
    results = []
    for name, (n, k) in SHAPES.items():
        rows = bench_decode(name, n, k, m)
        torch.cuda.empty_cache()
        results += rows
        for r in sorted(rows, key=lambda r: r["us"]):
            print(f"{name:8} M={m:<4} {r['variant']:16} {r['us']:7.1f} us {r['tb_s']:5.2f} TB/s "
                  f"err {r['err']:.1e}", flush=True)  # fmt: skip
    sums: dict[str, float] = {}
    for r in results:
        sums[r["variant"]] = sums.get(r["variant"], 0.0) + r["us"]
    print(f"M={m} layer sums: " + ", ".join(f"{v} {t:.1f} us" for v, t in sums.items()))
    return results


# ---- prefill sizes -------------------------------------------------------------------------------


@triton.jit
def _persistent_rowwise_kernel(
    a_desc, w_desc, C, AScale, WScale, M, N, K, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """C = (A @ W.T) * a_scale[:, None] * w_scale[None, :], programs walking the output tiles
    (grouped along M so that neighbours share W tiles in L2); the FP8 products promoted to the
    float32 accumulator every BLOCK_K, as cuBLASLt's accurate mode does."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_size
        pid_n = (tile % per_group) // group_size
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([off_m, kt * BLOCK_K])
            w = w_desc.load([off_n, kt * BLOCK_K])
            acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=BLOCK_K)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        a_s = tl.load(AScale + rm, mask=rm < M, other=0.0)
        w_s = tl.load(WScale + rn, mask=rn < N, other=0.0)
        acc = acc * a_s[:, None] * w_s[None, :]
        c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def persistent_rowwise(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    m, k = a.shape
    n = w.shape[0]
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    programs = min(tiles, sms) if cfg["persistent"] else tiles
    _persistent_rowwise_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        out, a_scale.reshape(-1), w_scale, m, n, k, out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=programs,
        WARP_SPECIALIZE=cfg["ws"], num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    return out


PREFILL_SWEEP = [
    {"bm": bm, "bn": bn, "bk": 128, "stages": st, "warps": w, "ws": ws, "persistent": p}
    for bm, bn, st, w in ((128, 256, 3, 8), (128, 128, 4, 8), (128, 128, 5, 4), (256, 128, 3, 8))
    for ws in (False, True)
    for p in (True, False)
]


def time_eager(fn: Callable[[], object], reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def bench_prefill_shape(name: str, n: int, k: int, m: int) -> list[dict[str, Any]]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ws = w16.float().abs().amax(1) / 448
    w8 = (w16.float() / ws[:, None]).to(torch.float8_e4m3fn)
    xq, xs = quantize_per_token(x)
    one = torch.ones((), device="cuda")
    ref = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws.reshape(1, -1),
                           out_dtype=torch.bfloat16).float()  # fmt: skip
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "bf16 mm": lambda: x @ w16.T,
        "scaled_mm rowwise": lambda: torch._scaled_mm(
            xq, w8.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16),
        "scaled_mm tensorwise": lambda: torch._scaled_mm(
            xq, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    }  # fmt: skip
    for cfg in PREFILL_SWEEP:
        label = f"triton {cfg['bm']}x{cfg['bn']} st{cfg['stages']} w{cfg['warps']}"
        label += (" ws" if cfg["ws"] else "") + (" persistent" if cfg["persistent"] else "")
        variants[label] = lambda cfg=cfg: persistent_rowwise(xq, xs, w8, ws, cfg)
    rows = []
    for variant, fn in variants.items():
        try:
            err = None
            if variant.startswith("triton"):
                err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            us = time_eager(fn)
        except Exception as exc:
            print(f"  skip {variant}: {type(exc).__name__}: {str(exc)[:90]}", flush=True)
            continue
        rows.append({"shape": name, "m": m, "variant": variant, "us": us, "err": err,
                     "tflops": 2 * m * n * k / us / 1e6})  # fmt: skip
    for r in sorted(rows, key=lambda r: r["us"])[:8]:
        err = "" if r["err"] is None else f" err {r['err']:.1e}"
        print(f"{name:8} M={m:<6} {r['variant']:36} {r['us']:8.1f} us {r['tflops']:7.1f} TFLOP/s"
              f"{err}", flush=True)  # fmt: skip
    return rows


def bench_act_quant(m: int, inter: int = 14336) -> list[dict[str, Any]]:
    gate_up = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    plain_act = triton_ops.silu_and_mul(gate_up)
    plain_q, plain_s = quantize_per_token(plain_act)
    act, q, s = silu_and_mul_quant(gate_up)
    same = (torch.equal(act, plain_act) and torch.equal(s, plain_s)
            and torch.equal(q.view(torch.uint8), plain_q.view(torch.uint8)))  # fmt: skip
    rows = []
    for variant, fn in {
        "silu_and_mul + quantize_per_token": lambda: quantize_per_token(
            triton_ops.silu_and_mul(gate_up)),
        "silu_and_mul_quant": lambda: silu_and_mul_quant(gate_up),
    }.items():  # fmt: skip
        us = time_eager(fn, reps=20)
        rows.append({"shape": "act", "m": m, "variant": variant, "us": us, "bit_exact": same})
        print(f"act      M={m:<6} {variant:36} {us:8.1f} us (bit-exact: {same})", flush=True)
    return rows


def chain_layer(x: torch.Tensor, res: torch.Tensor, w: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """One decode layer's FP8 launches without attention; returns (hidden, residual)."""
    gemm = fp8_kernels.fp8_rowwise_gemm
    rows = triton_ops.fp8_rows(*x.shape, x.device)
    h, res = triton_ops.rms_norm(x, w["norm"], 1e-5, res, rows)
    qkv = gemm(*rows, w["qkv"], w["qkv_s"], x.dtype)
    attn = qkv[:, :4096]  # stands in for the attention output, which comes from qkv
    o = gemm(*quantize_per_token(attn), w["o"], w["o_s"], x.dtype)
    rows = triton_ops.fp8_rows(*o.shape, o.device)
    h, res = triton_ops.rms_norm(o, w["norm"], 1e-5, res, rows)
    gate_up = gemm(*rows, w["gate_up"], w["gate_up_s"], x.dtype)
    act = triton_ops.silu_and_mul(gate_up)
    return gemm(*quantize_per_token(act), w["down"], w["down_s"], x.dtype), res


def bench_chain(m: int = 64) -> list[dict[str, Any]]:
    layers = []
    for _ in range(LAYERS):
        w: dict[str, Any] = {"norm": torch.ones(4096, device="cuda", dtype=torch.bfloat16)}
        for name, (n, k) in SHAPES.items():
            w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            w[f"{name}_s"] = w16.float().abs().amax(1) / 448
            w[name] = (w16.float() / w[f"{name}_s"][:, None]).to(torch.float8_e4m3fn)
        layers.append(w)
    x0 = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    res0 = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)

    def step(i: int) -> None:  # all layers in one call: time_graph's LAYERS calls repeat it
        x, res = x0, res0
        for w in layers:
            x, res = chain_layer(x, res, w)
        out.copy_(x)

    out = torch.empty_like(x0)
    rows = []
    want = None
    for prefetch in (0, 512, 1024, 2048):
        # FP8 weights: one byte a column, so the prefetch's bytes are its columns.
        skinny_gemm.SKINNY_PREFETCH_BYTES = prefetch
        step(0)
        want = out.clone() if want is None else want
        same = torch.equal(out, want)
        us = time_graph(step, replays=10)  # per step of all the layers
        variant = f"prefetch={prefetch}"
        rows.append({"shape": "chain", "m": m, "variant": variant,
                     "us_per_layer": us / len(layers), "same_output": same})  # fmt: skip
        print(f"chain    M={m:<4} {variant:34} {us / len(layers):7.1f} us "
              f"a layer (output equal to no prefetch: {same})", flush=True)  # fmt: skip
    skinny_gemm.SKINNY_PREFETCH_BYTES = 512
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--ms", default="64,16,1")
    parser.add_argument("--prefill-m", type=int, default=16384)
    parser.add_argument("--chain", action="store_true", help="only the decode-layer chain")
    args = parser.parse_args()
    if args.chain:
        print(torch.cuda.get_device_name(), flush=True)
        results = bench_chain()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    print(torch.cuda.get_device_name(), flush=True)
    results: list[dict[str, Any]] = []
    for m in (int(v) for v in args.ms.split(",") if v):
        results += decode_report(m)
    if args.prefill_m:
        m = args.prefill_m
        for name, (n, k) in SHAPES.items():
            results += bench_prefill_shape(name, n, k, m)
            torch.cuda.empty_cache()
        sums: dict[str, float] = {}
        for r in results:
            if r["m"] == m:
                sums[r["variant"]] = sums.get(r["variant"], 0.0) + r["us"]
        best = sorted((t, v) for v, t in sums.items() if v.startswith("triton"))[:3]
        base = {
            v: sums.get(v, 0.0) for v in ("bf16 mm", "scaled_mm rowwise", "scaled_mm tensorwise")
        }
        print(f"M={m} layer sums: " + ", ".join(f"{v} {t:.0f} us" for v, t in base.items())
              + "; best Triton: " + ", ".join(f"{v} {t:.0f} us" for t, v in best))  # fmt: skip
        results += bench_act_quant(m)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
