"""`attention`: the paged prefill and decode attention kernels at a preset's heads, alone.

    python -m benchmarks attention --model llama-8b [--sweep]

Prefill cases are NEW[@CONTEXT][xCOUNT] (2 prompts of 3,600 fresh tokens: 3600x2; 512 new
tokens after 3,584 cached: 512@3584x2); decode cases are CONTEXTxBATCH[:SHARED], SHARED tokens
at the start of every row's context in the same pages (a system prompt the prefix cache shares:
2600x32:2000), CONTEXT either one length or LOW-HIGH, the rows' lengths spread evenly over that
range (a served batch's: 64-2560x64); each decode case runs as the engine launches it without
and with those pages attended once for all rows (the shared-prefix kernel; with none shared,
its launch's cost), then, with ``--splits``, at the context splits asked for, and with
``--longest-first`` each of those with the sequences launched longest first, and with
``--mixed-slots`` as a mixed step's launch (the rows beside a prompt, among a prefill graph's
sequence slots). The cache is bf16 in pages of --page-size tokens scattered at random. Each row:
microseconds a call (median of CUDA-event timings; with ``--graph`` a decode call's share of
one CUDA graph of many calls, gemm.py's graph_us: no launch gaps, as in the engine's decode
steps), TFLOP/s for prefill (causal: each new token over its context and the new tokens up to
it), GB/s of K/V the rows read for decode (a shared page counted once per row: above the
memory's bandwidth where pages come from L2).
The engine's launch shape first, then, with ``--sweep``, every shape of the grid below (the way
the shapes in triton_kernels.py were chosen); a shape that cannot launch prints its error
instead of figures. Fresh prompts also run through torch's flash attention for scale: SDPA a
prompt at a time (cuDNN's kernel on Hopper) and the varlen FlashAttention 2 forward over the
step, Q, K and V read in place from a projection-shaped buffer. With ``--page-size 32`` (or a
multiple) the engine's launch loads each key tile from a page through a tensor (TMA) descriptor,
and the pointer-load kernel the engine takes for smaller pages runs beside it on the same cache.

With ``--replay STEPS`` (a ``.steps.jsonl`` that a profiled engine wrote beside its trace,
engine_core/profiler.py) the decode steps of a served run run again at their own lengths, as
the engine launched them (rows padded to its decode graph's size, ``--max-num-seqs``), at
``--splits`` and ``--longest-first`` as the cases above, and with ``--peer`` through
FlashAttention 3 too, each launch's time summed over the steps: the served calls' time in the
trace against the same work alone, and the two kernels on the served batches rather than an
even spread.

With ``--peer`` (vLLM importable, e.g. its bundle first on PYTHONPATH: ``PYTHONPATH=/tmp/vsite:.``)
each decode case also runs through vLLM's FlashAttention 3 as vLLM 0.26's decode step calls it
under a CUDA graph: one query a sequence as a varlen batch over the same paged cache and block
tables, causal, at most 32 splits (its ``flash_attn_max_num_splits_for_cuda_graph``), with the
scheduler metadata vLLM computes once a step from the lengths (``get_scheduler_metadata``: each
sequence's split count and the batch's order, longest first) outside the timed call, as a step
amortizes it over the layers.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gemm import CALLS_PER_GRAPH, graph_us, median_us
from benchmarks.report import Provenance, write_json

PAGE = 16
PREFILL_SWEEP = {"block_m": (64, 128), "block_n": (32, 64, 128), "warps": (4, 8), "stages": (2, 3)}
TMA_PAGE_KEYS = 32  # triton_kernels.TMA_PAGE_KEYS, not imported: this module imports no triton
DECODE_SWEEP = {"block_n": (32, 64, 128), "warps": (4, 8), "stages": (2, 3, 4), "kv": (1, 2)}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset (default: llama-8b)")
    parser.add_argument(
        "--prefill",
        default="3600x2,8192,2048x4,2048@2048,512@3584x2,128x16",
        help="prefill cases NEW[@CONTEXT][xCOUNT], comma-separated; '' for none",
    )
    parser.add_argument(
        "--decode",
        default="3700x32,16384x8,2048x64,1024x128",
        help="decode cases CONTEXTxBATCH[:SHARED] (CONTEXT: one length, or LOW-HIGH spread "
        "evenly over the rows; SHARED: tokens every row's context starts with, in the same "
        "pages), comma-separated; '' for none",
    )
    parser.add_argument(
        "--graph", action="store_true",
        help=f"time each decode call as its share of a CUDA graph of {CALLS_PER_GRAPH} calls "
        "(the median of 5 replays; no launch gaps, "
        "as in the engine's decode steps; prefill stays eager, as the engine runs long prompts)",
    )  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="also time every launch shape")
    parser.add_argument(
        "--page-size", type=int,
        help=f"tokens a page of the cache (the engine's --block-size; default: {PAGE}); at "
        f"{TMA_PAGE_KEYS} tokens or a multiple, prefill cases also run through the pointer-load "
        "kernel the engine takes below that",
    )  # fmt: skip
    parser.add_argument(
        "--splits",
        default="",
        help="decode: also time the engine's launch (and with --mixed-slots, the mixed step's) "
        "with these context splits, comma-separated (its own choice comes from the batch size "
        "and the block table's width)",
    )
    parser.add_argument(
        "--longest-first", action="store_true",
        help="decode: also time the engine's launch with the sequences' programs launched "
        "longest first (row_order)",
    )  # fmt: skip
    parser.add_argument(
        "--max-model-len", type=int,
        help="decode: block tables this many tokens wide, as the engine's (default: the "
        "longest row's)",
    )  # fmt: skip
    parser.add_argument(
        "--mixed-slots", type=int, default=0,
        help="decode: also time each case as a mixed step's decode launch: its rows and one "
        f"{MIXED_PROMPT}-token prompt among this many sequence slots, the rest empty (a prefill "
        "graph's, padded to --max-num-seqs)",
    )  # fmt: skip
    parser.add_argument(
        "--min-split", type=int,
        help="decode: with --splits, the shortest split in tokens (default: the engine's)",
    )  # fmt: skip
    parser.add_argument(
        "--iters", type=int, default=20, help="timed eager calls each (default: 20)"
    )
    parser.add_argument(
        "--peer", action="store_true",
        help="decode: also time vLLM's FlashAttention 3 on the same cases (vllm importable)",
    )  # fmt: skip
    parser.add_argument(
        "--replay", type=Path,
        help="decode steps to run again: a profiled engine's STEPS file "
        "(tandem-engine-*.steps.jsonl); those whose rows each computed one token, with the "
        "engine's heads, pages and table width from the file (so not with --page-size or "
        "--max-model-len), each call timed in a CUDA graph as the engine's decode steps run; "
        "give --prefill '' --decode '' to run only them",
    )  # fmt: skip
    parser.add_argument(
        "--replay-steps", type=int, default=64,
        help="with --replay, this many of its decode steps, evenly spaced (0: all; default: "
        "%(default)s)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the figures here")


def parse_prefill(case: str) -> tuple[list[int], list[int]]:
    """'512@3584x2' -> ([512, 512], [3584, 3584]): new tokens and context per sequence."""
    body, _, count = case.partition("x")
    new, _, context = body.partition("@")
    n = int(count or 1)
    return [int(new)] * n, [int(context or 0)] * n


def parse_decode(case: str) -> tuple[list[int], int]:
    """'2600x32:2000' -> ([2600] * 32, 2000): each row's context tokens (the query's included)
    and the tokens every row's context starts with in shared pages (0 without ':');
    '64-2560x4' -> [64, 896, 1728, 2560]: lengths spread evenly from LOW to HIGH."""
    body, _, shared = case.partition(":")
    context, _, count = body.partition("x")
    low, _, high = context.partition("-")
    batch = int(count or 1)
    first, last = int(low), int(high or low)
    step = (last - first) / max(batch - 1, 1)
    lens = [round(first + row * step) for row in range(batch)]
    if int(shared or 0) > min(lens):
        raise SystemExit(f"decode case {case}: more shared tokens than a row's context")
    return lens, int(shared or 0)


def parse_splits(text: str) -> list[int]:
    """--splits: '2,4' -> [2, 4]."""
    return [int(n) for n in text.split(",") if n]


def prefill_flops(new: list[int], context: list[int], heads: int, head_dim: int) -> float:
    """QK and PV products of causal attention: token j of n new ones sees context + j + 1 keys."""
    keys = sum(n * c + n * (n + 1) / 2 for n, c in zip(new, context, strict=True))
    return 4 * keys * heads * head_dim


def paged_cache(
    seq_lens: list[int],
    kv_heads: int,
    head_dim: int,
    shared: int = 0,
    table_tokens: int = 0,
    in_order: bool = False,
    page: int = PAGE,
) -> dict[str, Any]:
    """K/V caches with every sequence's pages at random places, and their block tables (as
    wide as the longest row, or ``table_tokens``: the engine's are max-model-len wide, and the
    decode kernel's splits follow that width); the first ``shared`` tokens' whole pages are the
    first row's in every row. ``in_order``: each sequence's pages one after another instead."""
    import torch

    pages = [-(-s // page) for s in seq_lens]
    k = torch.randn(sum(pages) + 1, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    shuffle = torch.arange if in_order else torch.randperm
    order = (shuffle(sum(pages), device="cuda") + 1).to(torch.int32)
    width = max(*pages, -(-table_tokens // page))
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
    for row, start in enumerate(itertools.accumulate([0, *pages[:-1]])):
        tables[row, : pages[row]] = order[start : start + pages[row]]
    tables[:, : shared // page] = tables[0, : shared // page].clone()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return {"k": k, "v": torch.randn_like(k), "tables": tables, "lens": lens}


def prefill_rows(args: argparse.Namespace, shape: dict[str, int]) -> list[dict[str, Any]]:
    import torch

    from engine_core.attention.triton_kernels import (
        PrefillLaunch,
        paged_prefill_attention,
        prefill_launch,
    )

    # Pages of whole key tiles take descriptor loads in the engine's launch; the pointer-load
    # kernel at its own engine shape beside them, for scale.
    pointer_launch = prefill_launch(shape["d"], kv_fp8=False)
    launches: list[PrefillLaunch | None] = [None]
    if args.page_size % TMA_PAGE_KEYS == 0:
        launches.append(pointer_launch)
    if args.sweep:
        grid = itertools.product(*PREFILL_SWEEP.values())
        launches += [PrefillLaunch(bn, w, st, bm) for bm, bn, w, st in grid]
    rows = []
    for case in filter(None, args.prefill.split(",")):
        new, context = parse_prefill(case)
        seq_lens = [n + c for n, c in zip(new, context, strict=True)]
        cache = paged_cache(seq_lens, shape["kv"], shape["d"], page=args.page_size)
        q = torch.randn(sum(new), shape["heads"], shape["d"], device="cuda", dtype=torch.bfloat16)
        starts = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device="cuda")
        flops = prefill_flops(new, context, shape["heads"], shape["d"])
        args_ = (q, cache["k"], cache["v"], cache["tables"], cache["lens"], starts, max(new))
        for launch in launches:
            label = "engine's" if launch is None else launch_label(launch)
            if launch is not None and launch == pointer_launch:
                label = "pointer loads, the engine's shape"
            call = functools.partial(
                paged_prefill_attention,
                *args_,
                shape["d"] ** -0.5,
                launch=launch,
                tiles=step_tiles(starts, launch and launch.block_m),
            )
            rows.append({"case": case, "kernel": label} | timed(call, args, flops))
        if not any(context):
            rows += torch_flash_rows(case, starts, shape, args, flops)
    return rows


def step_tiles(starts: Any, block_m: int | None = None) -> Any:
    """The step's work list, built once as the engine builds it once a step (a kernel called
    without one works it out on the host each call, which the timings must not include)."""
    from engine_core.attention.prefill_tiles import device_tiles

    return device_tiles(starts.tolist(), starts.device, block_m)


def launch_label(launch: Any) -> str:
    return f"bm {launch.block_m} bn {launch.block_n} w {launch.num_warps} st {launch.num_stages}"


def torch_flash_rows(
    case: str, starts: Any, shape: dict[str, int], args: argparse.Namespace, flops: float
) -> list[dict[str, Any]]:
    """A fresh case through torch's flash attention, Q, K and V read in place from one
    projection-shaped buffer [tokens, (heads + 2 kv heads) x dim]: SDPA a prompt at a time, and
    the varlen forward (FlashAttention 2) over the whole step in one call, its output checked
    against SDPA's."""
    import torch
    import torch.nn.functional as F

    tokens, d = int(starts[-1]), shape["d"]
    widths = [shape["heads"] * d, shape["kv"] * d, shape["kv"] * d]
    qkv = torch.randn(tokens, sum(widths), device="cuda", dtype=torch.bfloat16)
    q, k, v = (part.view(tokens, -1, d) for part in qkv.split(widths, dim=1))
    bounds = list(itertools.pairwise(starts.tolist()))
    longest = max(b - a for a, b in bounds)

    def sdpa() -> Any:
        outs = []
        for a, b in bounds:
            heads = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*heads, is_causal=True, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def varlen() -> Any:
        return torch.ops.aten._flash_attention_forward(
            q, k, v, starts, starts, longest, longest, 0.0, True, False, scale=d**-0.5
        )[0]

    rows = [{"case": case, "kernel": "torch sdpa"} | timed(sdpa, args, flops)]
    row = {"case": case, "kernel": "torch flash varlen, K/V in place"} | timed(varlen, args, flops)
    if "error" not in row:
        row["max_diff"] = (varlen() - sdpa()).abs().max().item()
    return [*rows, row]


def decode_rows(args: argparse.Namespace, shape: dict[str, int]) -> list[dict[str, Any]]:
    import torch

    from engine_core.attention.triton_kernels import DecodeTile, paged_decode_attention

    tiles: list[DecodeTile | None] = [None]
    if args.sweep:
        tiles += [DecodeTile(*point) for point in itertools.product(*DECODE_SWEEP.values())]
    rows = []
    splits = parse_splits(args.splits)
    for case in filter(None, args.decode.split(",")):
        lens, shared = parse_decode(case)
        cache = paged_cache(
            lens, shape["kv"], shape["d"], shared, args.max_model_len, page=args.page_size
        )
        q = torch.randn(len(lens), shape["heads"], shape["d"], device="cuda", dtype=torch.bfloat16)
        kv_bytes = 4 * sum(lens) * shape["kv"] * shape["d"]  # K and V, two bytes each
        page = args.page_size
        pages = torch.tensor([shared // page * page, 0], dtype=torch.int32, device="cuda")
        # The engine's launch as it stands, then with the shared pages attended once for all
        # rows (the engine's choice where a step has them; with none shared, the cost of the
        # extra launch a decode graph captures), then at the splits asked for, then launched
        # longest first.
        launches = [(tile, None, None, None) for tile in tiles] + [(None, pages, None, None)]
        launches += [(None, None, n, None) for n in splits]
        if args.longest_first:
            longest_first = torch.argsort(cache["lens"], descending=True).to(torch.int32)
            launches += [(None, None, None, longest_first)]
            launches += [(None, None, n, longest_first) for n in splits]
        for tile, shared_prefix, num_splits, order in launches:
            label = "engine's" if tile is None else str(tile)
            if shared_prefix is not None:
                label = f"engine's, {int(pages[0])} shared tokens once"
            if num_splits is not None:
                label = f"engine's, {num_splits} splits"
            if order is not None:
                label += ", longest first"
            call = functools.partial(
                paged_decode_attention, q, cache["k"], cache["v"], cache["tables"],
                cache["lens"], shape["d"] ** -0.5, tile=tile, shared_prefix=shared_prefix,
                num_splits=num_splits, row_order=order,
                min_split_tokens=args.min_split if num_splits is not None else None,
            )  # fmt: skip
            figures = timed(call, args, bytes_=kv_bytes, graph=args.graph)
            rows.append({"case": case, "kernel": label} | figures)
        for num_splits in [None, *splits] if args.mixed_slots else []:
            mixed = mixed_step_call(
                lens, args.mixed_slots, shape, args.max_model_len, args.page_size, num_splits,
                args.min_split if num_splits is not None else None,
            )  # fmt: skip
            figures = timed(mixed, args, bytes_=kv_bytes, graph=args.graph)
            label = f"engine's, in a mixed step of {args.mixed_slots} slots"
            label += "" if num_splits is None else f", {num_splits} splits"
            rows.append({"case": case, "kernel": label} | figures)
        if args.peer:
            rows.append(peer_row(case, q, cache, shape, kv_bytes, args, args.graph))
    return rows


def peer_row(
    case: str, q: Any, cache: dict[str, Any], shape: dict[str, int], kv_bytes: float,
    args: argparse.Namespace, graph: bool,
) -> dict[str, Any]:  # fmt: skip
    """FlashAttention 3's row for a decode case: a wrong call could be fast, so its output must
    equal ours first (peer_decode)."""
    from engine_core.attention.triton_kernels import paged_decode_attention

    ours = paged_decode_attention(
        q, cache["k"], cache["v"], cache["tables"], cache["lens"], shape["d"] ** -0.5
    )
    figures = timed(peer_decode(q, cache, shape, ours), args, bytes_=kv_bytes, graph=graph)
    return {"case": case, "kernel": "vLLM FlashAttention 3"} | figures


@dataclass(frozen=True)
class Replayed:
    """A profiled engine's decode step (engine_core/profiler.py StepShape): its line in the
    steps file, its rows' lengths, the rows of the graph it replayed (0: eager), and the
    shared-prefix tokens its rows attended once."""

    line: int
    lens: list[int]
    graph_rows: int
    shared: int

    @property
    def padded(self) -> list[int]:
        """Its rows and the graph's empty padding rows."""
        return self.lens + [0] * max(0, self.graph_rows - len(self.lens))


def read_steps(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A steps file's engine (its first line) and its steps."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0]) if lines else {}
    if not isinstance(header, dict) or "engine" not in header:
        raise SystemExit(f"--replay {path}: not a profiler's steps file (no engine line first)")
    return header["engine"], [json.loads(line) for line in lines[1:]]


def replay_steps(steps: list[dict[str, Any]], count: int) -> list[Replayed]:
    """Of a steps file's steps, those whose rows each computed one token (decode steps),
    ``count`` of them evenly spaced (0: all)."""
    decodes = [
        Replayed(line, step["lens"], step["graph_rows"], step["shared"])
        for line, step in enumerate(steps, start=1)
        if step["new"] and all(n == 1 for n in step["new"])
    ]
    if 0 < count < len(decodes):
        stride = len(decodes) / count
        decodes = [decodes[int(k * stride)] for k in range(count)]
    return decodes


def replay_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """The decode steps of ``--replay`` at their lengths (replay_step), and a line on what
    they are of the file's steps."""
    engine, steps = read_steps(args.replay)
    if not engine["plain_attention"] or engine["kv_cache_dtype"] not in ("bfloat16", "float16"):
        raise SystemExit(
            f"--replay: {engine['model']}'s attention is not plain causal attention over a "
            f"16-bit cache (its cache: {engine['kv_cache_dtype']}; windows, chunks, latent "
            "attention and sinks are not plain), the kind the replay runs"
        )
    chosen = replay_steps(steps, args.replay_steps)
    rows = [row for step in chosen for row in replay_step(args, engine, step)]
    about = (
        f"replayed {len(chosen)} of the {len(replay_steps(steps, 0))} decode steps of "
        f"{len(steps)} steps in {args.replay} ({engine['model']}: {engine['heads']} heads, "
        f"{engine['kv_heads']} kv heads, pages of {engine['block_size']}, tables "
        f"{engine['max_model_len']} tokens wide); the mixed steps' decode rows and any "
        "drafter's calls are not replayed"
    )
    return rows, about


def replay_step(
    args: argparse.Namespace, engine: dict[str, Any], step: Replayed
) -> list[dict[str, Any]]:
    """One replayed step: the engine's launch as it ran (its graph's padding rows, its
    shared-prefix pass), then unpadded, at ``--splits``, launched ``--longest-first``, and
    with ``--peer`` FlashAttention 3 over the step's own rows (as vLLM's decode call, without
    its cascade attention for shared prefixes)."""
    import torch

    from engine_core.attention.triton_kernels import paged_decode_attention

    shape = {"heads": engine["heads"], "kv": engine["kv_heads"], "d": engine["head_dim"]}
    padded, n = step.padded, len(step.lens)
    cache = paged_cache(
        padded, shape["kv"], shape["d"], step.shared, engine["max_model_len"],
        page=engine["block_size"],
    )  # fmt: skip
    q = torch.randn(len(padded), shape["heads"], shape["d"], device="cuda", dtype=torch.bfloat16)
    shared = torch.tensor([step.shared, 0], dtype=torch.int32, device="cuda")
    kv_bytes = 4 * sum(step.lens) * shape["kv"] * shape["d"]
    case = f"step {step.line}: {n} rows ({len(padded)} launched), mean {sum(step.lens) / n:,.0f}"
    case += f", {step.shared} shared" if step.shared else ""
    orders = [None]
    if args.longest_first:
        orders.append(torch.argsort(cache["lens"], descending=True).to(torch.int32))
    splits: list[int | None] = [None, *parse_splits(args.splits)]
    launches = [("engine's", len(padded), None, None), ("engine's, unpadded", n, None, None)]
    for order, num_splits in itertools.product(orders, splits):
        if order is not None or num_splits is not None:  # (None, None): the engine's, above
            label = "engine's" if num_splits is None else f"engine's, {num_splits} splits"
            label += "" if order is None else ", longest first"
            launches.append((label, len(padded), num_splits, order))
    rows = []
    for label, m, num_splits, order in launches:
        call = functools.partial(
            paged_decode_attention, q[:m], cache["k"], cache["v"], cache["tables"][:m],
            cache["lens"][:m], shape["d"] ** -0.5, num_splits=num_splits, row_order=order,
            min_split_tokens=args.min_split if num_splits is not None else None,
            shared_prefix=shared if step.shared else None,
        )  # fmt: skip
        rows.append(
            {"case": case, "kernel": label} | timed(call, args, bytes_=kv_bytes, graph=True)
        )
    if args.peer:  # the step's own rows: the graph's padding is the engine's
        own = cache | {"tables": cache["tables"][:n], "lens": cache["lens"][:n]}
        rows.append(peer_row(case, q[:n], own, shape, kv_bytes, args, graph=True))
    return rows


def replay_totals(rows: list[dict[str, Any]]) -> str:
    """Each launch's time over the replayed steps, summed, and over the engine's own launch;
    a launch that failed on some step says on how many instead."""
    totals: dict[str, float] = {}
    failed: dict[str, int] = {}
    for row in rows:
        kernel = row["kernel"]
        totals[kernel] = totals.get(kernel, 0.0) + row.get("us", 0.0)
        failed[kernel] = failed.get(kernel, 0) + ("us" not in row)
    steps = len({row["case"] for row in rows})
    lines = [f"{steps} steps, a layer's call each, summed:"]
    ours = totals["engine's"]
    for kernel, us in totals.items():
        if failed[kernel]:
            lines.append(f"  {kernel:<40} failed on {failed[kernel]} of {steps} steps")
        else:
            lines.append(f"  {kernel:<40} {us:12,.1f} us  {us / ours:6.3f}")
    return "\n".join(lines)


MIXED_PROMPT = 512  # --mixed-slots: the prompt beside the decode rows, in tokens


def mixed_step_call(
    lens: list[int],
    slots: int,
    shape: dict[str, int],
    table_tokens: int,
    page: int,
    num_splits: int | None = None,
    min_split: int | None = None,
) -> Any:
    """The decode kernel's launch in a mixed step as a prefill graph replays it: the case's
    rows (one new token each) and a MIXED_PROMPT-token prompt, then empty sequences up to
    ``slots``; only the one-token rows are attended (at ``num_splits`` context splits: None,
    the engine's choice for that many slots)."""
    import torch

    from engine_core.attention.triton_kernels import paged_decode_attention

    if slots < len(lens) + 1:
        raise SystemExit(f"--mixed-slots {slots}: fewer than the case's rows and its prompt")
    padding = slots - len(lens) - 1
    cache = paged_cache(
        [*lens, MIXED_PROMPT] + [0] * padding, shape["kv"], shape["d"], 0, table_tokens, page=page
    )
    new = [1] * len(lens) + [MIXED_PROMPT] + [0] * padding
    starts = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device="cuda")
    q = torch.randn(
        int(starts[-1]), shape["heads"], shape["d"], device="cuda", dtype=torch.bfloat16
    )
    out = torch.zeros_like(q)
    return functools.partial(
        paged_decode_attention, q, cache["k"], cache["v"], cache["tables"], cache["lens"],
        shape["d"] ** -0.5, out=out, mixed_starts=starts, num_splits=num_splits,
        min_split_tokens=min_split,
    )  # fmt: skip


PEER_MAX_SPLITS = 32  # vLLM 0.26's flash_attn_max_num_splits_for_cuda_graph
PEER_TOLERANCE = 0.02  # two bf16 outputs of the same attention (random values of order 0.1)


def peer_decode(q: Any, cache: dict[str, Any], shape: dict[str, int], ours: Any) -> Any:
    """vLLM's FlashAttention 3 over one decode step's rows, as its backend calls it, once its
    output was checked against ``ours``; where it cannot be set up or differs, a call that
    raises why (timed() prints it as the row's error)."""
    try:
        call = _peer_decode_call(q, cache, shape)
        differs = (call().float() - ours.float()).abs().max().item()
        if differs > PEER_TOLERANCE:
            raise ValueError(f"its output differs from the engine's by up to {differs:.3g}")
        return call
    except Exception as error:  # the peer failing must not end our measurement
        message = f"{type(error).__name__}: {error}"

        def unavailable() -> None:
            raise RuntimeError(message)

        return unavailable


def _peer_decode_call(q: Any, cache: dict[str, Any], shape: dict[str, int]) -> Any:
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    batch = q.shape[0]
    starts = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    lens, tables = cache["lens"], cache["tables"]
    longest = int(lens.max())
    metadata = get_scheduler_metadata(
        batch_size=batch, max_seqlen_q=1, max_seqlen_k=longest, num_heads_q=shape["heads"],
        num_heads_kv=shape["kv"], headdim=shape["d"], cache_seqlens=lens,
        qkv_dtype=q.dtype, cu_seqlens_q=starts, page_size=cache["k"].shape[1],
        causal=True,
        num_splits=PEER_MAX_SPLITS,
    )  # fmt: skip
    out = torch.empty_like(q)  # the call returns it
    return functools.partial(
        flash_attn_varlen_func, q=q, k=cache["k"], v=cache["v"], out=out, cu_seqlens_q=starts,
        max_seqlen_q=1, seqused_k=lens, max_seqlen_k=longest, softmax_scale=shape["d"] ** -0.5,
        causal=True, block_table=tables, scheduler_metadata=metadata, fa_version=3,
        num_splits=PEER_MAX_SPLITS,
    )  # fmt: skip


def timed(
    call: Any,
    args: argparse.Namespace,
    flops: float = 0.0,
    bytes_: float = 0.0,
    graph: bool = False,
) -> dict[str, Any]:
    """The call's median µs and rate, or its error (a shape that does not fit the GPU)."""
    try:
        if graph:
            us = graph_us(lambda _: call(), 1, "cuda")
        else:
            us = median_us(lambda _: call(), 1, args.iters)
    except Exception as error:  # a launch shape over the shared memory: say so, go on
        return {"error": f"{type(error).__name__}: {str(error)[:80]}"}
    return {"us": us, "tflops": flops / us / 1e6, "gb_s": bytes_ / us / 1e3}


def attention_shape(model: str) -> dict[str, int]:
    from engine_core.presets import hf_config

    config = hf_config(model)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {"heads": heads, "kv": config["num_key_value_heads"], "d": head_dim}


def print_rows(rows: list[dict[str, Any]], rate: str) -> None:
    for row in rows:
        figures = row.get("error") or (
            f"{row['us']:9.1f} us  {row['tflops']:6.0f} TFLOP/s"
            if rate == "tflops"
            else f"{row['us']:9.1f} us  {row['gb_s']:6.0f} GB/s"
        )
        checked = f"  max |diff| {row['max_diff']:.1e}" if "max_diff" in row else ""
        print(f"{row['case']:>14}  {row['kernel']:<55} {figures}{checked}", flush=True)


def run(args: argparse.Namespace) -> int:
    if args.replay and (args.page_size is not None or args.max_model_len is not None):
        raise SystemExit("--replay takes the engine's page size and table width from its file")
    args.page_size = PAGE if args.page_size is None else args.page_size
    args.max_model_len = args.max_model_len or 0
    header = Provenance.here(args.argv)
    print(header.format())
    shape = attention_shape(args.model)
    heads = f"heads {shape['heads']}, kv heads {shape['kv']}, head dim {shape['d']}"
    print(f"{heads}, pages of {args.page_size}")
    prefill = prefill_rows(args, shape)
    print_rows(prefill, "tflops")
    decode = decode_rows(args, shape)
    print_rows(decode, "gb_s")
    replay: list[dict[str, Any]] = []
    if args.replay:
        replay, about = replay_rows(args)
        print(about)
        print_rows(replay, "gb_s")
        print(replay_totals(replay))
    if args.json:
        write_json(args.json, header, {"prefill": prefill, "decode": decode, "replay": replay})
    return 0
