"""`speculative-serving`: time per output token with speculative decoding, Tandem beside vLLM.

    python -m benchmarks speculative-serving --model llama-8b --method ngram \\
        --vllm-python python3 --vllm-pythonpath /tmp/vsite --json OUT.json
    python -m benchmarks speculative-serving --model llama-8b --method draft --k 3 ...

One server at a time, each started with the same speculative config in the peers' spelling
(``--speculative-config``): ``ngram`` (prompt lookup: K, ``prompt_lookup_max`` and
``prompt_lookup_min`` given to both), ``draft`` (the target as its own draft: Tandem's
``random:PRESET`` drafts with the same seeded weights, vLLM's dummy weights are the same for
both models, so nearly every draft is kept and a step costs what verifying K drafts costs) or
``none`` (the baseline); ``--vllm-ngram ngram_gpu`` names vLLM's prompt lookup on the GPU,
for a vLLM without numba. At each batch size B of ``--batches``, B streamed chat requests at once,
``--rounds`` times, each one of the prompts whose answers repeat their input
(benchmarks/speculative.py: editing code and text, summarising a given text) in turn, greedy,
``--max-tokens`` tokens (EOS ignored), after one warm-up request. TPOT of a request: from its
first token to its last over the tokens after the first (usage's count: a stream's chunk may
carry several). Acceptance from each server's /metrics (the same counters under vLLM's names and
ours: drafts, draft tokens, kept tokens) before and after each batch size.

Random weights (a preset) write text unlike a trained model's, so n-gram acceptance is whatever
each model's random output repeats: read the acceptance column beside the TPOT. ``--device cpu``
runs vLLM's CPU build (both in float32), for the default model or a folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.first_token import carries_token, sse_events
from benchmarks.report import Provenance, fmt, format_table, parse_ints, ratio, write_json
from benchmarks.servers import (
    METRICS_SETTLE_S,
    SERVED_NAME,
    Server,
    VllmInstall,
    counter_totals,
    imports,
    peer_model_dir,
    running,
    tandem_serve_command,
    vllm_server,
)
from benchmarks.serving import add_model_arg, add_output_args, add_vllm_args, output_dir
from benchmarks.speculative import PROMPTS

METHODS = ("ngram", "draft", "none")
# The counters both servers export (frontend/metrics.py names ours after vLLM's).
SPEC_COUNTERS = {
    "drafts": ("tandem_spec_decode_num_drafts", "vllm:spec_decode_num_drafts"),
    "draft_tokens": ("tandem_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "accepted": ("tandem_spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
}


@dataclass(frozen=True)
class SpecRow:
    """One server's figures at one batch size."""

    server: str
    batch: int
    requests: int
    tpot_p50_ms: float
    tpot_mean_ms: float
    output_tok_s: float  # every request's tokens over the batch size's wall time
    acceptance: float | None  # kept / draft tokens; None without drafts counted
    tokens_per_step: float | None  # 1 + kept / drafts: a request's tokens per target step


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument("--method", choices=METHODS, default="ngram", help="default: ngram")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram's (default: 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram's (default: 2)")
    parser.add_argument(
        "--vllm-ngram", choices=("ngram", "ngram_gpu"), default="ngram",
        help="vLLM's name for prompt lookup: its ngram proposer needs numba, ngram_gpu does not "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--batches", default="1,8,32", help="requests at once, per level")
    parser.add_argument("--rounds", type=int, default=2, help="batches of requests per level")
    parser.add_argument("--max-tokens", type=int, default=256, help="each request's output")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    add_vllm_args(parser)
    add_output_args(parser)


def speculative_config(args: argparse.Namespace, draft: str, ngram: str = "ngram") -> str | None:
    """The --speculative-config a server gets: ``draft`` the model and ``ngram`` prompt lookup,
    as that server names them."""
    if args.method == "none":
        return None
    config: dict[str, Any] = {"num_speculative_tokens": args.k}
    if args.method == "ngram":
        config |= {"method": ngram, "prompt_lookup_max": args.prompt_lookup_max}
        config["prompt_lookup_min"] = args.prompt_lookup_min
    else:
        config["model"] = draft  # the peers read a bare model as a draft model
    return json.dumps(config)


def build_servers(args: argparse.Namespace, out_dir: Path) -> list[Server]:
    """Tandem (unless --no-tandem) and vLLM (given --vllm-python), the same config each."""
    from engine_core.model_dir import resolve_model_dir, tokenizer_dir_for_random
    from engine_core.presets import PRESETS

    if args.vllm_ngram != "ngram" and args.method != "ngram":
        raise SystemExit(f"--vllm-ngram {args.vllm_ngram} is for --method ngram only")
    preset = args.model in PRESETS
    cpu = args.device == "cpu"
    servers = []
    if not args.no_tandem:
        model = f"random:{args.model}" if preset else args.model
        extra = ["--device", args.device, "--served-model-name", SERVED_NAME]
        extra += ["--dtype", "float32"] if cpu else []
        extra += spec_flags(speculative_config(args, model))
        extra += shlex.split(args.tandem_args)
        command = tandem_serve_command(model, args.port, args.max_model_len, extra)
        servers.append(Server("tandem", command, args.port))
    if args.vllm_python:
        install = VllmInstall(args.vllm_python, args.vllm_pythonpath, cpu=cpu)
        if preset:
            model_dir = peer_model_dir(args.model, tokenizer_dir_for_random(), out_dir / "model")
        else:
            model_dir = resolve_model_dir(args.model)  # the default model: its converted folder
        config = speculative_config(args, str(model_dir), args.vllm_ngram)
        extra = spec_flags(config) + shlex.split(args.vllm_args)
        servers.append(
            vllm_server(install, model_dir, args.port + 1, args.max_model_len, preset, extra)
        )
    if not servers:
        raise SystemExit("nothing to run: --no-tandem and no --vllm-python")
    return servers


def spec_flags(config: str | None) -> list[str]:
    return [] if config is None else ["--speculative-config", config]


# ---- requests -----------------------------------------------------------------------------------


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed greedy chat request of ``max_tokens`` tokens, EOS ignored."""
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_tpot(client: Any, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """(seconds from the stream's first token to its last over the tokens after the first,
    the tokens usage counted)."""
    first = last = tokens = None
    for event in sse_events(client, url, body, timeout_s=600):
        if carries_token(event):
            last = time.perf_counter()
            first = last if first is None else first
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    if first is None or last is None or not tokens:
        raise RuntimeError(f"no tokens or no usage came back from {url}")
    return (last - first) / max(1, tokens - 1), tokens


def metric_totals(text: str) -> dict[str, float]:
    """SPEC_COUNTERS' totals in a Prometheus exposition (zero where a server has none)."""
    return {key: total or 0.0 for key, total in counter_totals(text, SPEC_COUNTERS).items()}


def spec_rates(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, ...]:
    """(acceptance, tokens per step) between two metric_totals; None where nothing drafted."""
    drafts = after["drafts"] - before["drafts"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    if not drafts or not draft_tokens:
        return None, None
    return accepted / draft_tokens, 1 + accepted / drafts


def measure_batch(server: Server, batch: int, args: argparse.Namespace) -> SpecRow:
    """``args.rounds`` rounds of ``batch`` requests at once on a running server."""
    import httpx

    prompts = list(PROMPTS.values())
    bodies = [chat_body(prompts[i % len(prompts)], args.max_tokens) for i in range(batch)]
    url = f"{server.url}/v1/chat/completions"
    tpots, tokens = [], 0
    with httpx.Client() as client, ThreadPoolExecutor(batch) as pool:
        time.sleep(METRICS_SETTLE_S)
        before = metric_totals(client.get(f"{server.url}/metrics").text)
        started = time.perf_counter()
        for _ in range(args.rounds):
            for tpot, count in pool.map(lambda b: stream_tpot(client, url, b), bodies):
                tpots.append(tpot)
                tokens += count
        wall = time.perf_counter() - started
        time.sleep(METRICS_SETTLE_S)
        after = metric_totals(client.get(f"{server.url}/metrics").text)
    acceptance, per_step = spec_rates(before, after)
    return SpecRow(
        server.name, batch, len(tpots), 1e3 * statistics.median(tpots),
        1e3 * statistics.fmean(tpots), tokens / wall, acceptance, per_step,
    )  # fmt: skip


def measure_server(server: Server, args: argparse.Namespace, out_dir: Path) -> list[SpecRow]:
    """Start ``server``, warm it with one request, measure each batch size, stop it."""
    import httpx

    with running(server, out_dir), httpx.Client() as client:
        warm = chat_body(next(iter(PROMPTS.values())), args.max_tokens)
        stream_tpot(client, f"{server.url}/v1/chat/completions", warm)
        rows = []
        for batch in parse_ints(args.batches):
            rows.append(measure_batch(server, batch, args))
            print(f"  {progress(rows[-1])}", flush=True)
    return rows


def peer_can_run(server: Server, args: argparse.Namespace) -> bool:
    """False (and a line saying why) for a vLLM asked for its n-gram proposer without numba,
    which that proposer imports as the server starts."""
    if server.name != "vllm" or args.method != "ngram" or args.vllm_ngram != "ngram":
        return True
    if imports(server, "numba"):
        return True
    print("  vllm skipped: its Python has no numba; --vllm-ngram ngram_gpu needs none", flush=True)
    return False


def progress(row: SpecRow) -> str:
    kept = "-" if row.acceptance is None else f"{100 * row.acceptance:.0f}%"
    return f"{row.server} batch {row.batch}: TPOT p50 {row.tpot_p50_ms:.2f} ms, kept {kept}"


# ---- the report ---------------------------------------------------------------------------------


def format_rows(rows: list[SpecRow]) -> str:
    """One row per batch size: each server's TPOT, acceptance and tokens a step, then vLLM's
    TPOT over Tandem's (above 1: Tandem's tokens come faster)."""
    servers = list(dict.fromkeys(r.server for r in rows))
    by = {(r.server, r.batch): r for r in rows}
    headers = ["batch"]
    for s in servers:
        headers += [f"{s} TPOT p50 ms", f"{s} tok/s", f"{s} kept %", f"{s} tokens/step"]
    pair = {"tandem", "vllm"} <= set(servers)
    headers += ["TPOT x"] if pair else []
    table = []
    for batch in dict.fromkeys(r.batch for r in rows):
        line = [str(batch)]
        for s in servers:
            r = by.get((s, batch))
            line += [
                fmt(r.tpot_p50_ms if r else None, ".2f"),
                fmt(r.output_tok_s if r else None, ",.0f"),
                fmt(100 * r.acceptance if r and r.acceptance is not None else None, ".0f"),
                fmt(r.tokens_per_step if r else None, ".2f"),
            ]
        if pair:
            ours, theirs = by.get(("tandem", batch)), by.get(("vllm", batch))
            x = ratio(theirs.tpot_p50_ms, ours.tpot_p50_ms) if ours and theirs else None
            line.append(fmt(x, ".2f"))
        table.append(line)
    return format_table(headers, table)


def run(args: argparse.Namespace) -> int:
    import httpx

    out_dir = output_dir(args, "tandem-spec-serving-")
    servers = build_servers(args, out_dir)
    rows: list[SpecRow] = []
    for server in servers:
        if not peer_can_run(server, args):
            continue
        try:
            rows += measure_server(server, args, out_dir)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            print(f"  {server.name} failed: {exc}", flush=True)
    provenance = Provenance.here(args.argv)
    print(f"\n{provenance.format()}")
    for server in servers:
        print(f"{server.name}: {server.shown()}")
    print(f"logs: {out_dir}")
    config = speculative_config(args, "<the model>")
    print(f"speculative config: {config}; greedy, {args.max_tokens} tokens, EOS ignored\n")
    print(format_rows(rows) if rows else "no figures: every server failed")
    if args.json:
        commands = {server.name: server.shown() for server in servers}
        write_json(args.json, provenance, {"rows": [asdict(r) for r in rows], "servers": commands})
    return 0 if rows else 1
