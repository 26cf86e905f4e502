"""`speculative`: time per output token at batch 1, with speculative decoding and without.

    python -m benchmarks speculative                       # the default model, on the CPU
    python -m benchmarks speculative --device cuda --model random:llama-1b --runs 5

One request at a time through the engine core in this process (``EngineCore``, greedy), on
prompts whose answers repeat their input (editing code, summarising a given text: what prompt
lookup drafts from), each run once without and once with ``--speculative-config`` (alternating,
so both meet the machine in the same state), after one warm-up run of each. TPOT is the time
from the first token to the last over the tokens after the first. The outputs of the two must
be the same tokens (greedy): the table says so for each prompt, and the exit status is 1 if
one differs. Also: drafts per step, drafts kept, mean tokens a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, fmt, format_table, write_json
from benchmarks.servers import context_bound

CODE = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
"""
TEXT = (
    "The museum opens at nine in the morning and closes at five in the evening. Tickets cost "
    "twelve euros for adults and six euros for children. The museum is closed on Mondays."
)
PROMPTS = {
    "code edit": f"Rename the function add to plus and print the whole code:\n{CODE}",
    "text edit": f"Rewrite this text with 'museum' replaced by 'gallery':\n{TEXT}",
    "summary": f"Summarise this text in one sentence: {TEXT}",
}


@dataclass
class Timing:
    tokens: list[int]
    ttft: float
    tpot: float  # seconds


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default: %(default)s")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--runs", type=int, default=3, help="timed runs each (default: 3)")
    parser.add_argument(
        "--speculative-config",
        default=json.dumps({"method": "ngram", "num_speculative_tokens": 5}),
        help="the speculative run's config (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


def engine(args: argparse.Namespace, speculative: str | None) -> Any:
    from engine_core.config import EngineConfig
    from engine_core.core import EngineCore

    config = EngineConfig(
        model=args.model, device=args.device, max_model_len=context_bound(args.model, 2048),
        speculative_config=speculative,
    )  # fmt: skip
    return EngineCore(config)


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def timed(core: Any, prompt: list[int], max_tokens: int, tag: str) -> Timing:
    """One greedy request alone: its tokens and their timing."""
    from engine_core.request import Request
    from protocol.messages import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    core.add_request(Request(tag, prompt, params))
    start, arrivals, tokens = time.perf_counter(), [], []
    while core.has_unfinished():
        for out in core.step():
            now = time.perf_counter()
            arrivals += [now] * len(out.new_token_ids)
            tokens += out.new_token_ids
    tpot = (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1)
    return Timing(tokens, arrivals[0] - start, tpot)


def tokenizer_of(core: Any) -> Any:
    """The served model's tokenizer (a random preset borrows the default model's)."""
    from transformers import AutoTokenizer

    from engine_core.model_dir import tokenizer_dir_for_random

    return AutoTokenizer.from_pretrained(str(core.runner.model_dir or tokenizer_dir_for_random()))


def run(args: argparse.Namespace) -> int:
    header = Provenance.here(args.argv)
    plain, spec = engine(args, None), engine(args, args.speculative_config)
    tokenizer = tokenizer_of(plain)
    prompts = {name: chat_prompt(tokenizer, text) for name, text in PROMPTS.items()}
    rows, results, same_all = [], [], True
    for name, prompt in prompts.items():
        timed(plain, prompt, args.max_tokens, f"{name}-w0")  # warm-up
        timed(spec, prompt, args.max_tokens, f"{name}-w1")
        before = spec.scheduler.counts()
        plain_runs, spec_runs = [], []
        for i in range(args.runs):
            plain_runs.append(timed(plain, prompt, args.max_tokens, f"{name}-p{i}"))
            spec_runs.append(timed(spec, prompt, args.max_tokens, f"{name}-s{i}"))
        after = spec.scheduler.counts()
        same = all(s.tokens == p.tokens for s, p in zip(spec_runs, plain_runs, strict=True))
        same_all = same_all and same
        result = summarize(name, plain_runs, spec_runs, after, before, same)
        results.append(result)
        rows.append(table_row(result))
    print(header.format())
    print(f"speculative config: {args.speculative_config}; batch 1, greedy, median of runs")
    headers = ["prompt", "tokens", "TPOT ms", "spec TPOT ms", "speed-up", "drafts/step",
               "kept", "tokens/step", "same tokens"]  # fmt: skip
    print(format_table(headers, rows))
    if args.json:
        write_json(args.json, header, results)
    return 0 if same_all else 1


def summarize(
    name: str,
    plain: list[Timing],
    spec: list[Timing],
    after: Any,
    before: Any,
    same: bool,
) -> dict[str, Any]:
    drafts = after.spec_drafts - before.spec_drafts
    draft_tokens = after.spec_draft_tokens - before.spec_draft_tokens
    kept = after.spec_accepted_tokens - before.spec_accepted_tokens
    tpot = statistics.median(t.tpot for t in plain)
    spec_tpot = statistics.median(t.tpot for t in spec)
    return {
        "prompt": name,
        "tokens": len(plain[0].tokens),
        "tpot_ms": 1e3 * tpot,
        "spec_tpot_ms": 1e3 * spec_tpot,
        "speedup": tpot / spec_tpot,
        "drafts_per_step": draft_tokens / drafts if drafts else 0.0,
        "kept": kept / draft_tokens if draft_tokens else 0.0,
        "tokens_per_step": 1 + kept / drafts if drafts else 1.0,
        "same_tokens": same,
    }


def table_row(r: dict[str, Any]) -> list[str]:
    return [
        r["prompt"], str(r["tokens"]), fmt(r["tpot_ms"], ".1f"), fmt(r["spec_tpot_ms"], ".1f"),
        f"{r['speedup']:.2f}x", fmt(r["drafts_per_step"], ".1f"), f"{100 * r['kept']:.0f}%",
        fmt(r["tokens_per_step"], ".2f"), "yes" if r["same_tokens"] else "NO",
    ]  # fmt: skip
