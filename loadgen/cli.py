"""The load generator's command line (``tandem bench`` and ``python -m loadgen``).

    tandem bench --backend openai-completions --url http://127.0.0.1:8000 \
        --num-requests 64 --input-len 128 --output-len 256 --ignore-eos --warmup-runs 1
    tandem bench --backend zmq --url http://127.0.0.1:8000 ...    # the engine behind a server
    tandem bench --backend zmq --address ipc:///tmp/tandem-x/engine ...
    tandem bench ... --sweep rate=1,2,4,inf --result-json sweep.json   # also writes sweep.png

The exit status is 0 when every request of every reported run completed, 1 when any failed,
2 for bad flags or a target that cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common import event_loop
from common.arg_types import non_negative_float, positive_float, readable_file
from loadgen.arrival import Arrival
from loadgen.backends import (
    BACKENDS,
    CONNECT_TIMEOUT_S,
    Backend,
    BackendError,
    Clock,
    open_backend,
)
from loadgen.metrics import RequestRecord, Slo, format_summary, summarize
from loadgen.runner import RunInterrupted, RunPlan, run_conversations, run_once
from loadgen.sweep import Sweep, format_sweep_table, mean_summary_figures, plot_sweep
from loadgen.workers import ClientPool
from loadgen.workload import (
    DatasetError,
    LenRange,
    WorkloadConfig,
    build_conversations,
    build_workload,
)


def argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type whose ValueError message reaches the user (argparse
    otherwise says only "invalid parse value")."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) or f"invalid value {text!r}") from None

    checked.__name__ = parse.__name__
    return checked


def add_args(parser: argparse.ArgumentParser) -> None:
    """The load generator's flags, for its own script and for `tandem bench`."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--backend", choices=BACKENDS, default="openai-completions",
        help="what to drive: an OpenAI server's completions or chat completions, or an engine "
        "core over raw ZMQ (default: %(default)s)",
    )  # fmt: skip
    target.add_argument(
        "--url", default="http://127.0.0.1:8000", help="OpenAI server (default: %(default)s)"
    )
    target.add_argument(
        "--address",
        action="append",
        default=None,
        help="zmq: an engine core's address; repeat it for several (a data-parallel server's), "
        "each request going to the one with the fewest in flight (default: every engine of "
        "GET --url's /v1/engine)",
    )
    target.add_argument("--api-key", default=None, help="HTTP: sent as 'Authorization: Bearer'")
    target.add_argument(
        "--model",
        default=None,
        help="HTTP: model name in requests (default: the server's); NAME,NAME,... names each "
        "in turn (LoRA adapters served beside their base model)",
    )
    target.add_argument(
        "--tokenizer",
        default=None,
        help="model whose tokenizer builds prompts: 'default', a folder or a .gguf "
        "(default: the served model's folder when it is on this machine, else 'default')",
    )

    work = parser.add_argument_group("workload")
    work.add_argument(
        "-n", "--num-requests", type=int, default=None,
        help="per run (default: 64; with --conversations, conversations x turns)",
    )  # fmt: skip
    work.add_argument(
        "--input-len", type=argument(LenRange.parse), default=LenRange(128, 128),
        help="random prompt tokens: N or LOW:HIGH (default: 128)",
    )  # fmt: skip
    work.add_argument(
        "--output-len", type=argument(LenRange.parse), default=None,
        help="output tokens asked for: N or LOW:HIGH (default: 128, or the dataset's)",
    )  # fmt: skip
    work.add_argument("--prompt", default=None, help="one fixed prompt text for every request")
    work.add_argument(
        "--dataset",
        type=readable_file,
        default=None,
        help="a .jsonl or ShareGPT .json file",
    )
    work.add_argument(
        "--dataset-format", choices=("auto", "jsonl", "sharegpt"), default="auto",
        help="auto: .jsonl is JSONL, anything else ShareGPT (default: auto)",
    )  # fmt: skip
    work.add_argument(
        "--unique-prompts", action="store_true",
        help="give each --prompt/--dataset request a distinct head (no shared prefix cache)",
    )  # fmt: skip
    work.add_argument("--ignore-eos", action="store_true", help="force every output length")
    work.add_argument(
        "--pretok", action="store_true", help="openai-completions: send token ids, not text"
    )
    work.add_argument(
        "--output-interval", type=int, default=1,
        help="zmq: ask the engine to send each request's tokens once this many have gathered "
        "(its first token and its end at once), as the API process does for a stream with "
        "--stream-interval N (default: 1, every step)",
    )  # fmt: skip
    work.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    work.add_argument(
        "--seed", type=int, default=None,
        help="seeds the random prompts and arrival times; give it to repeat a run's prompts "
        "(default: a fresh seed each invocation, printed, so that back-to-back runs against one "
        "server never hit its prefix cache with the same prompts)",
    )  # fmt: skip

    chat = parser.add_argument_group(
        "multi-turn chat",
        "each conversation sends its turns one after another; turn k's prompt is the system "
        "prompt, every earlier user message with the server's reply to it, and a new random "
        "user message of --input-len tokens (openai-chat: as messages; openai-completions: the "
        "same texts joined by newlines). The arrival flags start conversations, not turns; "
        "--max-concurrency caps the conversations under way.",
    )
    chat.add_argument(
        "--conversations", type=int, default=None, metavar="C",
        help="run C conversations per run instead of -n single requests",
    )  # fmt: skip
    chat.add_argument(
        "--turns", type=int, default=None, metavar="T",
        help="turns per conversation (default: 1; needs --conversations)",
    )  # fmt: skip
    chat.add_argument(
        "--shared-prefix-len", type=int, default=0, metavar="N",
        help="a system prompt of N random tokens that every conversation of a run starts with "
        "(drawn afresh per run, so only that run's conversations share it; default: none; "
        "needs --conversations)",
    )  # fmt: skip

    load = parser.add_argument_group("arrival")
    load.add_argument(
        "--request-rate", type=positive_float, default=math.inf,
        help="Poisson arrivals per second (default: inf, all at once)",
    )  # fmt: skip
    load.add_argument(
        "--burstiness", type=positive_float, default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 smoother (default: 1)",
    )  # fmt: skip
    load.add_argument(
        "--interval", type=non_negative_float, default=None,
        help="fixed gap in seconds instead",
    )  # fmt: skip
    load.add_argument(
        "--interval-mode", choices=("absolute", "relative"), default="absolute",
        help="--interval counted from the start (request i at i x S) or from the previous "
        "request's send (default: absolute)",
    )  # fmt: skip
    load.add_argument(
        "--max-concurrency", type=int, default=None,
        help="cap on requests in flight (default: none)",
    )  # fmt: skip

    rep = parser.add_argument_group("runs and report")
    rep.add_argument(
        "--warmup-runs", type=int, default=0, help="whole runs not reported (default: 0)"
    )
    rep.add_argument(
        "--repeat-runs", type=int, default=1, help="runs reported, each on its own (default: 1)"
    )
    rep.add_argument(
        "--slo",
        type=argument(Slo.parse),
        default=None,
        help="goodput SLO: any of ttft=MS,tpot=MS,e2e=MS",
    )
    rep.add_argument(
        "--sweep",
        type=argument(Sweep.parse),
        default=None,
        help="rate=R1,R2,... or concurrency=C1,C2,...",
    )
    rep.add_argument("--result-json", type=Path, default=None, help="config, summaries, records")
    rep.add_argument("--plot", type=Path, default=None, help="sweep PNG (default: JSON's .png)")
    rep.add_argument(
        "--request-timeout", type=positive_float, default=600.0,
        help="seconds per request (default: 600)",
    )  # fmt: skip
    rep.add_argument(
        "--connect-timeout", type=positive_float, default=None,
        help=f"zmq: seconds to wait for the engine's handshake (default: {CONNECT_TIMEOUT_S:g})",
    )  # fmt: skip
    rep.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    rep.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="HTTP: send from this many processes (request i from process i mod K), so that "
        "at hundreds of streams the client's own Python is not what sets the pace; all-at-once "
        "runs only (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; 0 when every reported request completed."""
    try:
        settle_args(args)
    except ValueError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    try:
        return event_loop.run(bench(args))
    except DatasetError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a run, or a second Ctrl-C
        print("loadgen: interrupted", file=sys.stderr)
        return 130
    except (httpx.HTTPError, OSError, TimeoutError, BackendError) as exc:
        where = ", ".join(args.address or [args.url])  # not reached, or answered wrong
        print(f"loadgen: cannot run against {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def settle_args(args: argparse.Namespace) -> None:
    """Check the flags (ValueError) and fix the seed of this invocation: the one given, else a
    fresh one from the OS, so that two invocations never send the same random prompts."""
    check_args(args)
    if args.conversations is not None:
        args.turns = args.turns or 1
        args.num_requests = args.conversations * args.turns  # the records a run holds
    elif args.num_requests is None:
        args.num_requests = 64
    if args.seed is None:
        args.seed = secrets.randbits(31)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        prompt=args.prompt,
        dataset=None if args.dataset is None else Path(args.dataset),
        dataset_format=args.dataset_format,
        unique_prompts=args.unique_prompts,
        seed=args.seed,
        conversations=args.conversations,
        turns=args.turns or 1,
        shared_prefix_len=args.shared_prefix_len,
    )


def check_args(args: argparse.Namespace) -> None:
    check_conversation_args(args)
    check_unused_flags(args)
    if args.client_processes < 1:
        raise ValueError("--client-processes must be >= 1")
    if args.client_processes > 1 and (
        args.backend == "zmq"
        or not math.isinf(args.request_rate)
        or args.interval is not None
        or args.max_concurrency is not None
        or args.sweep is not None
    ):
        raise ValueError(
            "--client-processes applies to HTTP backends with all requests at once (no "
            "--request-rate, --interval, --max-concurrency or --sweep)"
        )
    if not 1 <= args.output_interval <= 2**31 - 1:
        raise ValueError("--output-interval must be in [1, 2^31 - 1]")
    if args.prompt is not None and args.dataset is not None:
        raise ValueError("give --prompt or --dataset, not both")
    if args.interval is not None and not math.isinf(args.request_rate):
        raise ValueError("give --interval or --request-rate, not both")
    if args.interval is not None and math.isinf(args.interval):
        raise ValueError("--interval must be a finite number of seconds")
    if not 0 <= args.temperature < math.inf:  # NaN too
        raise ValueError(f"--temperature must be a number >= 0, got {args.temperature}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2^63), got {args.seed}")
    check_writable(args.result_json, "--result-json")
    check_writable(args.plot, "--plot")
    too_few = args.num_requests is not None and args.num_requests < 1
    if too_few or args.repeat_runs < 1 or args.warmup_runs < 0:
        raise ValueError("--num-requests and --repeat-runs must be >= 1, --warmup-runs >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.sweep is not None and args.interval is not None and args.sweep.param == "rate":
        raise ValueError("a rate sweep sets the arrival rate: drop --interval")


def check_writable(path: Path | None, flag: str) -> None:
    """ValueError now, before the run, where ``path`` could not be written after it (its
    missing folders are made then, as the result writer makes them)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path} is not writable")
        return
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def check_unused_flags(args: argparse.Namespace) -> None:
    """Refuse a flag given where this run would not use it, naming what it needs."""
    zmq = args.backend == "zmq"
    sweep = args.sweep.param if args.sweep is not None else None
    text_prompts = args.prompt is not None or args.dataset is not None
    unused = {
        "--pretok applies to openai-completions only": (
            args.pretok and args.backend != "openai-completions"
        ),
        "--address is the engine's, for --backend zmq (HTTP backends use --url)": (
            args.address is not None and not zmq
        ),
        "--output-interval applies to --backend zmq only (over HTTP the server's "
        "--stream-interval sets it)": args.output_interval != 1 and not zmq,
        "--connect-timeout is for --backend zmq": args.connect_timeout is not None and not zmq,
        # zmq asks --url's /v1/engine for the address, with the key, unless --address gives it
        "--api-key: --backend zmq with --address asks no server": (
            args.api_key is not None and args.address is not None
        ),
        "--model is for the HTTP backends": args.model is not None and zmq,
        "--burstiness shapes Poisson arrivals: it needs --request-rate or --sweep rate=...": (
            args.burstiness != 1.0 and math.isinf(args.request_rate) and sweep != "rate"
        ),
        "--interval-mode needs --interval": (
            args.interval_mode != "absolute" and args.interval is None
        ),
        "--plot draws a sweep: it needs --sweep": args.plot is not None and sweep is None,
        "--request-rate: --sweep rate=... sets the rate of each run": (
            not math.isinf(args.request_rate) and sweep == "rate"
        ),
        "--max-concurrency: --sweep concurrency=... sets the cap of each run": (
            args.max_concurrency is not None and sweep == "concurrency"
        ),
        "--unique-prompts applies to --prompt or --dataset (random prompts are distinct "
        "already)": args.unique_prompts and not text_prompts,
        "--dataset-format needs --dataset": (
            args.dataset_format != "auto" and args.dataset is None
        ),
    }
    given = [what for what, on in unused.items() if on]
    if given:
        raise ValueError("; ".join(given))


def check_conversation_args(args: argparse.Namespace) -> None:
    """Refuse what multi-turn runs cannot honour: their prompts are made of random texts and
    the server's replies, so they need an HTTP text route and one client process."""
    if args.conversations is None:
        if args.turns is not None or args.shared_prefix_len:
            raise ValueError("--turns and --shared-prefix-len need --conversations")
        return
    if args.conversations < 1 or (args.turns is not None and args.turns < 1):
        raise ValueError("--conversations and --turns must be >= 1")
    if args.shared_prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    refused = {
        "-n/--num-requests (a run sends conversations x turns)": args.num_requests is not None,
        "--backend zmq (turns need the reply's text)": args.backend == "zmq",
        "--pretok": args.pretok,
        "--prompt": args.prompt is not None,
        "--dataset": args.dataset is not None,
        "--unique-prompts": args.unique_prompts,
        "--sweep": args.sweep is not None,
        "--client-processes > 1": args.client_processes != 1,
    }
    given = [flag for flag, on in refused.items() if on]
    if given:
        raise ValueError(f"--conversations does not take {', '.join(given)}")


def base_arrival(args: argparse.Namespace) -> Arrival:
    if args.interval is not None:
        return Arrival("interval", interval=args.interval, interval_mode=args.interval_mode)
    return Arrival.from_rate(args.request_rate, args.burstiness, args.seed)


def load_tokenizer(args: argparse.Namespace, backend: Backend) -> Any | None:
    """The tokenizer prompts need, or None when random ids straight to the engine will do."""
    if backend.kind == "zmq" and args.prompt is None and args.dataset is None:
        return None
    from common.hf_tokenizer import load_pretrained_tokenizer
    from engine_core.model_dir import resolve_model_dir

    source = args.tokenizer or getattr(backend, "model_root", None) or backend.model or "default"
    if args.tokenizer is None and not Path(source).is_dir() and source != "default":
        source = "default"  # a served name, or a folder on another machine
    return load_pretrained_tokenizer(resolve_model_dir(source))


async def bench(args: argparse.Namespace) -> int:
    clock = Clock()
    backend = await open_backend(args, clock)
    pool = ClientPool(args, args.client_processes) if args.client_processes > 1 else None
    try:
        if pool is not None:
            await pool.start()
        tokenizer = await asyncio.to_thread(load_tokenizer, args, backend)
        bench_run = BenchRun(args, backend, tokenizer, pool)
        print(bench_run.describe(), flush=True)
        interrupted = False
        try:
            await bench_run.warm_up()
            if args.sweep is None:
                runs = await bench_run.measure(base_arrival(args), args.max_concurrency)
            else:
                runs = await bench_run.sweep(args.sweep)
        except BenchInterrupted as stop:
            runs, interrupted = stop.runs, True
    finally:
        await backend.close()
        if pool is not None:
            await pool.close()
    if args.result_json is not None and runs:
        write_json(args.result_json, result_document(args, backend, runs))
        print(f"results: {args.result_json}")
    if interrupted:
        where = "; the runs up to it are reported above" if runs else " before a reported run"
        print(f"loadgen: interrupted{where}", file=sys.stderr)
        return 130
    return 0 if all(r["summary"].failed == 0 for r in runs) else 1


class BenchInterrupted(Exception):
    """Ctrl-C during a run: the reported runs up to it, the cut one last (its entry's
    ``interrupted`` is true, its records those of the requests that had ended)."""

    def __init__(self, runs: list[dict[str, Any]]) -> None:
        super().__init__(f"interrupted after {len(runs)} reported run(s)")
        self.runs = runs


class BenchRun:
    """Runs the workload against one backend: warm-ups, reported runs, sweep points."""

    def __init__(
        self,
        args: argparse.Namespace,
        backend: Backend,
        tokenizer: Any | None,
        pool: ClientPool | None = None,
    ) -> None:
        self.args = args
        self.backend = backend  # the parent's: model name, vocabulary; sends unless a pool does
        self.tokenizer = tokenizer
        self.pool = pool
        self.next_index = 0  # every run, warm-ups included, gets fresh random prompts
        self.workload = workload_config(args)

    def describe(self) -> str:
        a = self.args
        where = getattr(self.backend, "address", None) or a.url
        source = a.dataset or (f"prompt {a.prompt!r:.40}" if a.prompt else f"random {a.input_len}")
        if a.conversations is not None:
            source = f"{a.conversations} conversations x {a.turns} turns, user messages: {source}"
            source += f", shared system prompt: {a.shared_prefix_len} tokens"
        return (
            f"loadgen: {a.backend} at {where}, model {model_name(self.backend)}; {a.num_requests} "
            f"requests x {a.repeat_runs} run(s) (+{a.warmup_runs} warm-up), prompts: {source}, "
            f"output {a.output_len or 'default'} tokens{' (EOS ignored)' if a.ignore_eos else ''}"
            f"; --seed {a.seed}"
        )

    async def one_run(self, plan: RunPlan) -> list[RequestRecord]:
        index, self.next_index = self.next_index, self.next_index + 1
        if self.workload.conversations is not None:
            assert self.tokenizer is not None  # HTTP text routes always load one
            conversations = build_conversations(self.workload, index, self.tokenizer)
            return await run_conversations(self.backend, conversations, plan, index)
        vocab = getattr(self.backend, "vocab", None) if self.tokenizer is None else None
        specs = build_workload(self.workload, index, self.backend.wants_ids, self.tokenizer, vocab)
        if self.pool is not None:
            return await self.pool.run(specs, index)
        return await run_once(self.backend, specs, plan, index)

    def plan(self, arrival: Arrival, concurrency: int | None, label: str) -> RunPlan:
        return RunPlan(
            arrival, concurrency, self.args.request_timeout, not self.args.no_progress, label
        )

    async def warm_up(self) -> None:
        for i in range(self.args.warmup_runs):
            label = f"warm-up {i + 1}/{self.args.warmup_runs}"
            plan = self.plan(base_arrival(self.args), self.args.max_concurrency, label)
            try:
                s = summarize(await self.one_run(plan))
            except RunInterrupted:
                raise BenchInterrupted([]) from None
            print(f"{label}: {s.completed} completed, {s.failed} failed in {s.duration_s:.2f} s")

    async def measure(
        self, arrival: Arrival, concurrency: int | None, point: str = ""
    ) -> list[dict[str, Any]]:
        """The reported runs at one load point, each printed and kept with its records."""
        runs = []
        for i in range(self.args.repeat_runs):
            label = f"{point + ', ' if point else ''}run {i + 1}/{self.args.repeat_runs}"
            cpu, wall = time.process_time(), time.perf_counter()
            cut: RunInterrupted | None = None
            try:
                records = await self.one_run(self.plan(arrival, concurrency, label))
            except RunInterrupted as stop:
                records, cut = stop.finished, stop
            client_cpu = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
            summary = summarize(records, self.args.slo)
            title = f"{self.args.backend}: {label}; {arrival.describe()}"
            if concurrency:
                title += f", concurrency <= {concurrency}"
            if cut is not None:
                title += f"; INTERRUPTED: the {len(records)} of {cut.total} requests that had ended"
            print(format_summary(summary, title), flush=True)
            # Near 100% the load generator, not the server, may be what sets the pace.
            if self.pool is not None:
                busiest = self.pool.busiest_cpu_share
                print(
                    f"load generator CPU: {100 * busiest:.0f}% of one core "
                    f"(the busiest of {self.pool.count} client processes)",
                    flush=True,
                )
            else:
                print(f"load generator CPU: {100 * client_cpu:.0f}% of one core", flush=True)
            runs.append(
                {
                    "label": label,
                    "arrival": arrival.describe(),
                    "max_concurrency": concurrency,
                    "interrupted": cut is not None,
                    "summary": summary,
                    "records": records,
                }
            )
            if cut is not None:
                raise BenchInterrupted(runs)
        return runs

    async def sweep(self, sweep: Sweep) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        figures = []
        for value in sweep.values:
            arrival, concurrency = base_arrival(self.args), self.args.max_concurrency
            if sweep.param == "rate":
                arrival = Arrival.from_rate(value, self.args.burstiness, self.args.seed)
            else:
                concurrency = int(value)
            try:
                point = await self.measure(arrival, concurrency, sweep.label(value))
            except BenchInterrupted as stop:  # no table or plot of a cut sweep
                for r in stop.runs:
                    r["sweep_value"] = value
                raise BenchInterrupted(runs + stop.runs) from None
            for r in point:
                r["sweep_value"] = value
            runs += point
            figures.append(mean_summary_figures([r["summary"] for r in point]))
        print(format_sweep_table(sweep, figures))
        path = self.args.plot or (self.args.result_json or Path("loadgen-sweep.json")).with_suffix(
            ".png"
        )
        title = f"{self.args.backend}, {model_name(self.backend)}: sweep over {sweep.param}"
        plot_sweep(sweep, figures, path, title)
        print(f"plot: {path}")
        return runs


def model_name(backend: Backend) -> str:
    """The served name, or the folder's last part when the engine reports a path."""
    name = str(getattr(backend, "model", None) or "?")
    return Path(name).name if "/" in name else name


def result_document(
    args: argparse.Namespace, backend: Backend, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """What --result-json holds: the configuration, then each reported run's summary and
    per-request records."""
    config = {k: _jsonable(v) for k, v in vars(args).items() if not k.startswith("_")}
    config["served_model"] = backend.model
    if config.get("api_key"):
        config["api_key"] = "<set>"  # a result file gets shared: never the key itself
    if args.sweep is not None:
        config["sweep"] = {"param": args.sweep.param, "values": [_jsonable(v) for v in
                                                                  args.sweep.values]}  # fmt: skip
    return {
        "config": config,
        "runs": [
            {
                **{k: v for k, v in r.items() if k not in ("summary", "records")},
                "sweep_value": _jsonable(r.get("sweep_value")),
                "summary": r["summary"].as_json(),
                "requests": [rec.as_json() for rec in r["records"]],
            }
            for r in runs
        ],
    }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return "inf" if math.isinf(value) else value
    if isinstance(value, Slo):
        return value.as_ms()
    return str(value)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
