"""`mla`: the MLA kernels (engine_core/attention/triton_mla.py) alone: decode against HBM.

    python -m benchmarks mla [--models v2-lite,v3] [--batches 1,32,64] [--contexts 1024,4096]
                             [--sweep] [--vllm] [--prefill 2048,512@3584]

At DeepSeek-V2-Lite's heads (16) and DeepSeek-V3's (128), kv_lora_rank 512 and rope 64, over a
bf16 latent cache in 16-token pages scattered at random: microseconds a call (CUDA events
around a CUDA graph of 20 calls, as the decode graphs run it), and the latent bytes it must
read (batch x context x 576 x 2) over that time, as GB/s and as a share of HBM (--hbm-tb-s,
default 4.8 TB/s). Each call reads a different copy of the cache, enough copies to exceed L2,
so the figures are from memory. The engine's launch shape first; --sweep times every shape of
the grid below; --vllm times vLLM's Triton MLA decode (decode_attention_fwd, with its own split
count) on the same cache when vLLM is importable.

The expanded prefill (one prompt of NEW tokens after CONTEXT cached ones: the gather, kv_b_proj
into per-head K and V, and the prefill kernel) is timed too, as TFLOP/s of its attention
products (each new token over the keys up to it, Q/K 192 wide, V 128).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from benchmarks.attention import timed
from benchmarks.report import Provenance, write_json

PAGE = 16
RANK, ROPE = 512, 64
HEADS = {"v2-lite": 16, "v3": 128}
L2_BYTES = 256 << 20  # more cache copies than this: every call reads from HBM
SWEEP = {"block_h": (16, 32, 64), "block_n": (16, 32, 64), "warps": (4, 8), "stages": (1, 2, 3)}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="v2-lite,v3", help="v2-lite (16 heads), v3 (128)")
    parser.add_argument("--batches", default="1,32,64", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths")
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth, TB/s")
    parser.add_argument("--sweep", action="store_true", help="also time every launch shape")
    parser.add_argument("--vllm", action="store_true", help="also time vLLM's Triton MLA decode")
    parser.add_argument("--iters", type=int, default=30, help="timed calls each (default: 30)")
    parser.add_argument(
        "--prefill", default="2048,512@3584", help="prefill cases NEW[@CONTEXT], comma-separated"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")


def latent_caches(batch: int, context: int, at_least: int = L2_BYTES) -> list[dict[str, Any]]:
    """Copies of a bf16 latent cache holding ``batch`` sequences of ``context`` tokens, each
    with its pages at random places, enough of them to fill ``at_least`` bytes (default:
    more than L2)."""
    import torch

    pages = -(-context // PAGE)
    one = batch * pages * PAGE * (RANK + ROPE) * 2
    copies = max(1, -(-at_least // one))
    caches = []
    for _ in range(copies):
        cache = torch.randn(batch * pages + 1, PAGE, RANK + ROPE, device="cuda").bfloat16()
        order = (torch.randperm(batch * pages, device="cuda") + 1).to(torch.int32)
        caches.append({"cache": cache, "tables": order.view(batch, pages)})
    return caches


def our_calls(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from engine_core.attention.triton_mla import MlaDecodeTile

    tiles: list[tuple[str, MlaDecodeTile | None]] = [("engine's", None)]
    if args.sweep:
        for h, n, w, s in itertools.product(*SWEEP.values()):
            tiles.append((f"h {h} n {n} w {w} st {s}", MlaDecodeTile(h, n, w, s)))
    return tiles


def decode_rows(args: argparse.Namespace, model: str, batch: int, context: int) -> list[dict]:
    import torch

    from engine_core.attention.triton_mla import mla_decode_attention

    heads = HEADS[model]
    caches = latent_caches(batch, context)
    q_lat = torch.randn(batch, heads, RANK, device="cuda").bfloat16()
    q_pe = torch.randn(batch, heads, ROPE, device="cuda").bfloat16()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    latent_bytes = batch * context * (RANK + ROPE) * 2
    case = {"model": model, "batch": batch, "context": context}
    rows = []
    for label, tile in our_calls(args):

        def call(c: dict[str, Any], tile: Any = tile) -> None:
            mla_decode_attention(q_lat, q_pe, c["cache"], c["tables"], lens, 0.1, tile=tile)

        rows.append(case | {"kernel": label} | graph_timed(call, caches, args, latent_bytes))
    if args.vllm:
        rows.append(
            case
            | {"kernel": "vLLM triton_mla"}
            | vllm_row(args, q_lat, q_pe, lens, caches, latent_bytes)
        )
    return rows


def graph_timed(
    call: Any, caches: list[dict[str, Any]], args: argparse.Namespace, latent_bytes: int
) -> dict[str, Any]:
    """The call's µs inside a CUDA graph of back-to-back calls over the cache copies, as the
    engine's decode graphs run it: timing single launches measures the host's launch cost
    (about 180 µs a call here), not the kernel."""
    from benchmarks.w4a16 import graph_us

    try:
        us = graph_us(lambda i: call(caches[i % len(caches)]), len(caches), "cuda")
    except Exception as error:  # a launch shape over the shared memory: say so, go on
        return {"error": f"{type(error).__name__}: {str(error)[:80]}"}
    return {"us": us, "tflops": 0.0, "gb_s": latent_bytes / us / 1e3}


def vllm_row(
    args: argparse.Namespace, q_lat: Any, q_pe: Any, lens: Any, caches: list, latent_bytes: int
) -> dict[str, Any]:
    """vLLM's grouped Triton decode as its TritonMLA backend calls it, on the same caches."""
    import torch

    try:
        import triton
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except ImportError as error:
        return {"error": f"vLLM not importable: {error}"}
    batch, heads, _ = q_lat.shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = min(triton.next_power_of_2(max(1, int(lens[0]) // 512)), 2 * sms)
    q = torch.cat((q_lat, q_pe), dim=-1)
    out = torch.empty_like(q_lat)
    lse = torch.empty(batch, heads, dtype=q.dtype, device="cuda")
    logits = torch.empty(batch, heads, splits, RANK + 1, dtype=torch.float32, device="cuda")

    def call(c: dict[str, Any]) -> None:
        kv = c["cache"].unsqueeze(2)
        decode_attention_fwd(
            q, kv, kv[..., :RANK], out, lse, c["tables"], lens, logits, splits, 0.1, PAGE,
            is_mla=True,
        )  # fmt: skip

    return graph_timed(call, caches, args, latent_bytes)


def prefill_row(args: argparse.Namespace, model: str, case: str) -> dict[str, Any]:
    import torch

    from engine_core.attention.triton_mla import expanded_batch, mla_prefill_attention

    new_s, _, context_s = case.partition("@")
    new, context = int(new_s), int(context_s or 0)
    heads, nope, v_dim = HEADS[model], 128, 128
    (cache,) = latent_caches(1, new + context, at_least=0)
    batch = expanded_batch([0, new], [new + context], [0], PAGE, torch.device("cuda"))
    q = torch.randn(new, heads, nope + ROPE, device="cuda").bfloat16()
    weight = (torch.randn(heads * (nope + v_dim), RANK, device="cuda") / RANK**0.5).bfloat16()
    keys = new * context + new * (new + 1) / 2
    flops = 2 * keys * heads * (nope + ROPE + v_dim)

    def call() -> None:
        mla_prefill_attention(q, cache["cache"], cache["tables"], batch, weight, v_dim, 0.1)

    row = {"model": model, "batch": 1, "context": case, "kernel": "expanded prefill"}
    return row | timed(call, args, flops=flops)


def print_row(row: dict[str, Any], hbm_gb_s: float) -> None:
    head = f"{row['model']:>8} b{row['batch']:<3} ctx {row['context']:<6} {row['kernel']:<24}"
    if "error" in row:
        print(f"{head} {row['error']}", flush=True)
        return
    if row["tflops"]:
        print(f"{head} {row['us']:8.1f} us  {row['tflops']:6.1f} TFLOP/s", flush=True)
        return
    share = 100 * row["gb_s"] / hbm_gb_s
    print(f"{head} {row['us']:8.1f} us  {row['gb_s']:6.0f} GB/s  {share:5.1f}% of HBM", flush=True)


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv)
    print(header.format())
    print(f"kv_lora_rank {RANK}, rope {ROPE}, bf16 latents in pages of {PAGE}")
    rows = []
    for model, batch, context in itertools.product(
        args.models.split(","),
        map(int, args.batches.split(",")),
        map(int, args.contexts.split(",")),
    ):
        for row in decode_rows(args, model, batch, context):
            print_row(row, args.hbm_tb_s * 1000)
            rows.append(row)
    prefill = []
    for model, case in itertools.product(args.models.split(","), args.prefill.split(",")):
        prefill.append(prefill_row(args, model, case))
        print_row(prefill[-1], args.hbm_tb_s * 1000)
    if args.json:
        write_json(args.json, header, {"decode": rows, "prefill": prefill})
    return 0
