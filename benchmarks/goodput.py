"""`goodput`: a mixed Poisson workload swept over request rates, Tandem beside vLLM.

    python -m benchmarks goodput --model llama-8b --rates 2,4,8,16,32 \\
        --vllm-python python3 --vllm-pythonpath /tmp/vsite --json OUT.json

One server at a time (side_by_side.py, as `serving`); on each, for every rate R, one run of
`python -m loadgen --backend openai-completions --ignore-eos` with R x --duration requests,
prompts of --input-len random tokens (drawn per request, default 64:2048), --output-len
tokens asked for (default 32:512), arriving as a Poisson process at R per second, each judged
against --slo (default TTFT <= 500 ms and TPOT <= 50 ms). Goodput is vLLM's
benchmark_serving.py `--goodput` figure: the requests meeting every SLO over the run's
duration (from the first arrival to the last request's end; docs/loadgen.md).

One warm-up per server, as it starts (--warmup-requests of the same lengths, all at once),
not one per rate: the defaults offer 20 s of arrivals at each of 5 rates, 100 s per server
plus each run's tail (longer once a server saturates), and both servers with their starts
(vLLM's takes about 85 s) must fit one 10-minute call on the GPU machine. Sweep the rates up
until either server saturates (its goodput stops growing while its TTFT climbs).

The table: each server's goodput, completed requests per second, output tok/s, TTFT p50 and
p99, TPOT p50 and its preemptions for KV room (its /metrics counter over the rate's run: a
request preempted twice counts twice) per rate, and Tandem's goodput over vLLM's per rate.
"""

from __future__ import annotations

import argparse
import math
import shlex

from benchmarks import serving
from benchmarks.report import Provenance, write_json
from benchmarks.servers import PoissonWorkload
from benchmarks.side_by_side import Metric, print_comparison, run_sequential
from loadgen.metrics import Slo
from loadgen.workload import LenRange

GOODPUT = Metric("goodput req/s", "goodput", ".2f", True)
GOODPUT_METRICS = (
    GOODPUT,
    Metric("req/s", "request_rate", ".2f", True),
    Metric("tok/s", "output_tok_s", ",.0f", True),
    Metric("TTFT p50 ms", "ttft_p50_ms", ",.1f", False),
    Metric("TTFT p99 ms", "ttft_p99_ms", ",.1f", False),
    Metric("TPOT p50 ms", "tpot_p50_ms", ".2f", False),
    Metric("preempted", "preemptions", ",d", False, ratio_column=False),
)


def parse_rates(text: str) -> list[float]:
    """``"2,4,8"`` -> [2.0, 4.0, 8.0]: finite rates above 0 (a rate sets a run's request count)."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: finite numbers > 0, e.g. 2,4,8")
    return rates


def add_args(parser: argparse.ArgumentParser) -> None:
    serving.add_model_arg(parser)
    serving.add_checkpoint_args(parser)
    parser.add_argument(
        "--rates", type=parse_rates, default=parse_rates("2,4,8,16,32"),
        help="Poisson arrival rates (requests/s) swept, comma-separated (default: 2,4,8,16,32)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=0,
        help="the prompts' and arrivals' seed: rate i's run is seeded SEED + i on every server, "
        "so servers (and two commits) meet the same requests (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--duration", type=float, default=20.0,
        help="seconds of arrivals per rate: each rate's run sends round(rate x duration) "
        "requests, at least one (default: %(default)s; a saturated server takes longer to "
        "finish them)",
    )  # fmt: skip
    parser.add_argument(
        "--input-len", type=LenRange.parse, default=LenRange(64, 2048),
        help="prompt tokens, LOW:HIGH drawn per request (default: 64:2048)",
    )  # fmt: skip
    parser.add_argument(
        "--output-len", type=LenRange.parse, default=LenRange(32, 512),
        help="output tokens asked for, LOW:HIGH drawn per request, EOS ignored (default: 32:512)",
    )  # fmt: skip
    parser.add_argument(
        "--slo", type=Slo.parse, default=Slo(ttft=0.5, tpot=0.05),
        help="the goodput's objectives in ms, ttft=MS,tpot=MS[,e2e=MS] (default: ttft=500,tpot=50)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-requests", type=int, default=32,
        help="the one warm-up run as each server starts: this many requests of the same lengths, "
        "all at once (default: %(default)s; 0: none)",
    )  # fmt: skip
    serving.add_server_args(parser)
    serving.add_output_args(parser)


def rate_workloads(args: argparse.Namespace) -> list[PoissonWorkload]:
    """One workload per rate: round(rate x duration) requests at that rate, seeded with
    ``--seed`` plus the rate's index, so every server gets the same prompts and arrival times
    at a rate and no rate repeats another's prompts (which a server's prefix cache would hit)."""
    return [
        PoissonWorkload(
            max(1, round(rate * args.duration)), args.input_len, args.output_len, rate, args.slo,
            args.seed + i,
        )
        for i, rate in enumerate(args.rates)
    ]  # fmt: skip


def warm_up_workload(args: argparse.Namespace) -> PoissonWorkload | None:
    """The warm-up as each server starts, seeded past every rate's seed (its prompts are
    none of the measured ones)."""
    if not args.warmup_requests:
        return None
    seed = args.seed + len(args.rates)
    return PoissonWorkload(
        args.warmup_requests, args.input_len, args.output_len, math.inf, seed=seed
    )


def check(args: argparse.Namespace) -> None:
    """Refuse what the servers would refuse request by request, before starting them."""
    if args.duration <= 0 or args.warmup_requests < 0:
        raise SystemExit("--duration must be > 0 and --warmup-requests >= 0")
    longest = args.input_len.high + args.output_len.high
    if longest > args.max_model_len:
        raise SystemExit(
            f"--input-len {args.input_len} and --output-len {args.output_len} reach {longest} "
            f"tokens, more than --max-model-len {args.max_model_len}"
        )


def run(args: argparse.Namespace) -> int:
    check(args)
    out_dir = serving.output_dir(args, "tandem-goodput-")
    model_dir, tokenizer = serving.served_model(args, out_dir)
    servers = serving.build_servers(args, model_dir, out_dir)
    warm_up = warm_up_workload(args)
    loadgen_args = shlex.split(args.loadgen_args)
    workloads = rate_workloads(args)
    results = run_sequential(servers, workloads, tokenizer, out_dir, 1, loadgen_args, warm_up)
    provenance = Provenance.here(args.argv)
    print_comparison(provenance, servers, results, GOODPUT_METRICS, out_dir, (GOODPUT,))
    if args.json:
        write_json(args.json, provenance, results)
    return 0
