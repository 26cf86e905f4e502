"""Structured outputs on the GPU machine: what a JSON-schema constraint costs a decode batch.

    python scripts/bench_structured.py [--model llama-1b] [--requests 64] [--json OUT]

In one run, on a random-weight preset (engine_core/presets.py) in this process (the offline
path), the same "decode" workload (N requests at once, random prompts, a fixed number of output
tokens, greedy) twice after a warm-up:

- ``free``: no constraint (EOS ignored);
- ``json``: every request constrained by a JSON schema whose shortest valid output is longer
  than the output budget, so every request still runs to max_tokens and the two runs decode the
  same number of tokens: ``--schema records`` (the default: an array of at least 1,000 small
  records, each a bounded string, a bounded integer and an enum: what structured output mostly
  looks like) or ``long-string`` (one string of at least 20,000 characters: a worst case for
  the grammar engine, whose lexer then meets a new state at every token);

then prints tok/s of both and their ratio (the target: >= 0.9), the host ms per step spent filling
bitmasks (the engine's step stats, a third constrained run), the compile time p50/p99 of the
JSON schemas the tests use (tests/structured_cases.py), each compiled afresh (no cache), and
whether every one of those schemas' outputs, 5 samples each at temperature 1 on this device,
validates (the jsonschema package).

Random presets use the default model's 49,152-token tokenizer; where its GGUF is absent set
$TANDEM_TOKENIZER_DIR to a folder with its tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import RunResult, Workload, engine_config, summarize  # noqa: E402

from engine_core.core import EngineCore  # noqa: E402
from engine_core.grammar import compile_matcher, token_table  # noqa: E402
from engine_core.request import Request  # noqa: E402
from protocol.messages import Constraint, ConstraintKind, SamplingParams  # noqa: E402
from tests.structured_cases import SCHEMAS  # noqa: E402

# Schemas whose shortest output outruns the token budget: every request runs to max_tokens.
RECORD = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "maxLength": 12},
        "qty": {"type": "integer", "minimum": 1, "maximum": 999},
        "tag": {"enum": ["new", "used", "refurbished"]},
    },
    "required": ["sku", "qty", "tag"],
    "additionalProperties": False,
}
LONG_SCHEMAS = {
    "records": {
        "type": "object",
        "properties": {"rows": {"type": "array", "items": RECORD, "minItems": 1000}},
        "required": ["rows"],
        "additionalProperties": False,
    },
    "long-string": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999999},
            "body": {"type": "string", "minLength": 20000, "maxLength": 30000},
        },
        "required": ["id", "body"],
        "additionalProperties": False,
    },
}


def params(work: Workload, schema: dict[str, Any] | None) -> SamplingParams:
    if schema is None:
        return work.params
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    return SamplingParams(max_tokens=work.output_len, temperature=0.0, constraint=constraint)


def run(core: EngineCore, work: Workload, schema: dict[str, Any] | None, tag: str) -> RunResult:
    """Every request at once; step until all finish, timing each token's arrival."""
    vocab = core.model_config.vocab_size
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(work.prompts(vocab)):
        rid = f"{tag}-{i}"
        times[rid] = []
        core.add_request(Request(rid, prompt, params(work, schema)))
    while core.has_unfinished():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request.request_id].extend([now] * len(out.new_token_ids))
    return summarize("free" if schema is None else "json", start, list(times.values()))


def bitmask_host_ms(core: EngineCore, work: Workload, schema: dict[str, Any]) -> dict[str, float]:
    """A constrained run with the engine's step stats on: host ms per step, by phase."""
    stats = core.step_stats
    stats.enabled = True
    stats.reset()
    run(core, work, schema, "stats")
    summary = stats.summary()
    stats.enabled = False
    return {k: round(v, 4) for k, v in summary.items()}


def validate_outputs(core: EngineCore, samples: int = 5) -> dict[str, Any]:
    """Every test schema, sampled at temperature 1: does each output parse and validate?"""
    import jsonschema

    hf = core._load_tokenizer()
    prompt = hf.encode("Answer with JSON:")
    failures, total = [], 0
    for name, schema in SCHEMAS.items():
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        texts: dict[str, list[int]] = {}
        for seed in range(samples):
            rid = f"check-{name}-{seed}"
            texts[rid] = []
            params = SamplingParams(
                max_tokens=512, temperature=1.0, seed=seed, constraint=constraint
            )
            core.add_request(Request(rid, prompt, params))
        while core.has_unfinished():
            for out in core.step():
                texts[out.request.request_id] += out.new_token_ids
        for rid, ids in texts.items():
            total += 1
            text = hf.decode(ids, skip_special_tokens=True)
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append(f"{rid}: {exc!s:.80} in {text[:80]!r}")
    return {"outputs": total, "valid": total - len(failures), "failures": failures[:5]}


def compile_times(core: EngineCore, repeats: int = 5) -> dict[str, float]:
    """Seconds to compile each test schema afresh (as a new constraint reaching the engine)."""
    hf = core._load_tokenizer()
    start = time.perf_counter()
    table = token_table(hf, core.model_config.vocab_size)
    table_s = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        for schema in SCHEMAS.values():
            constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
            start = time.perf_counter()
            compile_matcher(constraint, table)
            samples.append(time.perf_counter() - start)
    ordered = sorted(samples)
    return {
        "token_table_s": round(table_s, 3),
        "compile_ms_p50": round(statistics.median(ordered) * 1e3, 3),
        "compile_ms_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
        "compiles": len(samples),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--schema", choices=sorted(LONG_SCHEMAS), default="records")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    schema = LONG_SCHEMAS[args.schema]
    work = Workload(args.requests, args.prompt_len, args.output_len, seed=1)
    config = engine_config(args.model, work, args.device, enforce_eager=args.device == "cpu")
    core = EngineCore(config)
    core.grammar_compiler()  # the token table builds while the warm-up runs
    warm = work.shorter(16, seed=2)
    run(core, warm, None, "warm-free")
    run(core, warm, schema, "warm-json")
    results: dict[str, Any] = {"model": args.model, "workload": vars(args) | {"json": None}}
    free = run(core, work.shorter(args.output_len, seed=3), None, "free")
    constrained = run(core, work.shorter(args.output_len, seed=4), schema, "json")
    results["free"] = vars(free)
    results["json"] = vars(constrained)
    results["ratio"] = round(constrained.tok_s / free.tok_s, 4)
    stats_work = work.shorter(args.output_len, seed=5)
    results["step_stats_json"] = bitmask_host_ms(core, stats_work, schema)
    results["compile"] = compile_times(core)
    results["validity"] = validate_outputs(core)
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def print_table(results: dict[str, Any]) -> None:
    free, constrained = results["free"], results["json"]
    stats, comp = results["step_stats_json"], results["compile"]
    workload = results["workload"]
    print(f"model {results['model']}, {workload['requests']} requests, schema {workload['schema']}")
    for name, r in (("free", free), ("json", constrained)):
        print(f"  {name:5s} {r['tok_s']:9.0f} tok/s  TPOT p50 {r['tpot_p50_ms']:.2f} ms  "
              f"({r['output_tokens']} tokens in {r['duration_s']:.2f} s)")  # fmt: skip
    print(f"  ratio json/free: {results['ratio']:.3f}")
    print(f"  host ms per step (json, step stats): bitmask {stats.get('host_bitmask_ms', 0):.3f}, "
          f"wait {stats.get('host_wait_ms', 0):.3f}, update {stats.get('host_update_ms', 0):.3f}, "
          f"step wall {stats.get('step_wall_ms', 0):.3f}")  # fmt: skip
    validity = results["validity"]
    print(f"  test schemas at temperature 1: {validity['valid']} of {validity['outputs']} "
          f"outputs valid {validity['failures'] or ''}")  # fmt: skip
    print(f"  compile: token table {comp['token_table_s']} s; schema p50 "
          f"{comp['compile_ms_p50']} ms, p99 {comp['compile_ms_p99']} ms over "
          f"{comp['compiles']} compiles")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
