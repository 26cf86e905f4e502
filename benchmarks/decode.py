"""`decode`: decode throughput of random-weight presets against the HBM roofline.

    python -m benchmarks decode --models smollm2-135m,llama-1b,llama-8b --json OUT.json
    python -m benchmarks decode --models llama-8b --num-requests 256
    python -m benchmarks decode --models llama-8b --num-requests 32 --prompt-len 3800
    python -m benchmarks decode --models llama-8b --quantization fp8 --kv-cache-dtype fp8
    python -m benchmarks decode --models llama-8b --quantization gptq --num-requests 1
    python -m benchmarks decode --models qwen3-30b-a3b --paths inproc --routing uniform
    python -m benchmarks decode --models llama-8b --tensor-parallel-size 2
    python -m benchmarks decode --models gpt-oss-20b --paths inproc --profile-steps 16
    python -m benchmarks decode --models llama-8b --paths inproc --lora 8 --profile-steps 16

Measures the memory bandwidth (the best of 20 device-to-device copies), then for each preset
(engine_core/presets.py: random weights with the real shapes) runs N requests at once of
random prompts (greedy, EOS ignored, after a short warm-up) through

- ``inproc``: the engine core stepped in this process (the offline path), and
- ``zmq``: a `tandem engine` process driven by the raw ZMQ client.

The table: output tok/s, TPOT and TTFT p50/p99, ITL p50 (the median gap between a request's
tokens: a steady decode step), and the roofline (roofline.py) two ways: ``%roof``, the run's
tok/s over the roofline's (the prefill's time included), and ``step%``, the roofline step time
over ITL p50. With tensor parallelism the roofline is that of the GPUs used.

A mixture of experts reads the experts its batch is routed to; random routers pile onto a few
experts, unlike trained ones, so ``--routing uniform`` (in process only) replaces every
router's logits by fresh normals at every step: each token takes a uniformly random top-k,
the balance a load-balancing loss aims for and what the roofline counts.

``--lora N`` (in process only) writes N random rank-``--lora-rank`` adapters of every projection
(benchmarks/lora_adapters.py, peft's layout) and spreads the requests over them in turn, the
serving benchmark's ``--lora`` without the HTTP path, so ``--profile-steps`` shows what the
adapters add to the prompt and decode steps; the roofline stays the base model's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.report import Provenance, fmt, format_table, percentile, write_json
from benchmarks.roofline import ModelBytes, measure_bandwidth, model_bytes, step_bytes
from benchmarks.servers import server_env, tandem_command

if TYPE_CHECKING:
    from protocol.messages import LoraRef

PATHS = ("inproc", "zmq")
DEFAULT_LORA_RANK = 16


@dataclass(frozen=True)
class Workload:
    """``num_requests`` prompts of ``prompt_len`` random token ids, ``output_len`` tokens each."""

    num_requests: int
    prompt_len: int
    output_len: int
    seed: int = 0
    loras: tuple[LoraRef, ...] = ()  # request i takes loras[i % len]; none: the base model

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(3, vocab) for _ in range(self.prompt_len)]
            for _ in range(self.num_requests)
        ]

    def params(self) -> Any:
        from protocol.messages import SamplingParams

        return SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True)

    def warmup(self) -> Workload:
        """The same batch and prompt length, a few output tokens, other prompts."""
        return replace(self, output_len=min(16, self.output_len), seed=self.seed + 1)

    def lora(self, index: int) -> LoraRef | None:
        """Request ``index``'s adapter (a LoraRef), or None for the base model."""
        return self.loras[index % len(self.loras)] if self.loras else None

    @property
    def mean_context(self) -> float:
        return self.prompt_len + self.output_len / 2


@dataclass
class Run:
    """What a client saw of one workload run."""

    path: str
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float
    duration_s: float
    output_tokens: int
    profile: list[Any] = field(default_factory=list)  # step_profile.PhaseProfile, --profile-steps


@dataclass
class ModelResult:
    model: str
    weight_bytes: int
    bytes_per_step: int
    roofline_tok_s: float
    roofline_step_ms: float
    runs: list[Run] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def summarize(path: str, start: float, token_times: list[list[float]]) -> Run:
    """A run's figures from each request's token arrival times (perf_counter seconds)."""
    ttft = [(times[0] - start) * 1e3 for times in token_times]
    tpot = [(t[-1] - t[0]) * 1e3 / (len(t) - 1) for t in token_times if len(t) > 1]
    itl = [gap * 1e3 for times in token_times for gap in token_gaps(times)]
    end = max(times[-1] for times in token_times)
    total = sum(len(times) for times in token_times)
    return Run(
        path=path,
        tok_s=total / (end - start),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
        itl_p50_ms=percentile(itl, 50),
        duration_s=end - start,
        output_tokens=total,
    )


def token_gaps(times: list[float]) -> list[float]:
    """Each token's gap to the arrival before it. Tokens that arrive together (one message
    carrying several) split their arrival's gap rather than counting as zero-length gaps."""
    arrivals: list[list[float]] = []  # [time, tokens]
    for now in times:
        if arrivals and arrivals[-1][0] == now:
            arrivals[-1][1] += 1
        else:
            arrivals.append([now, 1])
    gaps: list[float] = []
    for (before, _), (now, count) in zip(arrivals, arrivals[1:], strict=False):
        gaps += [(now - before) / count] * int(count)
    return gaps


# ---- the engine ---------------------------------------------------------------------------------


def engine_config(name: str, work: Workload, args: argparse.Namespace) -> Any:
    """Room for the workload's sequences (twice over, and at least one sequence of the context
    bound; no memory-sized cache), a context bound of 4,096 or the preset's, and a step budget
    that admits half the prompts at once."""
    from engine_core.config import EngineConfig
    from engine_core.kv_groups import model_kv_layout, pool_blocks_for_one_sequence
    from engine_core.presets import PRESETS

    per_seq = -(-(work.prompt_len + work.output_len) // args.block_size) + 1
    max_model_len = min(4096, PRESETS[name].max_position_embeddings)
    step_budget = max(8192, work.num_requests * work.prompt_len // 2)
    one_longest = pool_blocks_for_one_sequence(  # the pool must hold one
        model_kv_layout(PRESETS[name]), max_model_len, args.block_size, step_budget
    )
    optional = {"gpu_memory_utilization": args.gpu_memory_utilization}
    return EngineConfig(
        model=f"random:{name}",
        device=args.device,
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_kv_blocks=max(2 * work.num_requests * per_seq, one_longest),
        max_num_seqs=work.num_requests,
        max_num_batched_tokens=step_budget,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.overlap,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_all_reduce=args.tp_all_reduce,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_lora=bool(work.loras),
        max_loras=max(1, len(work.loras)),
        max_lora_rank=lora_rank(args),
        **{k: v for k, v in optional.items() if v is not None},
    )


def engine_flags(config: Any) -> list[str]:
    """`tandem engine` flags for every EngineConfig field that differs from its default."""
    from engine_core.config import EngineConfig

    flags = []
    for f in fields(EngineConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        flag = f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags.append(f"--{flag}={value}")
    return flags


def run_inproc(core: Any, work: Workload, vocab: int, tag: str) -> Run:
    """Add every request at once, step until all finish, timing each token's arrival."""
    from engine_core.request import Request

    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(work.prompts(vocab)):
        times[f"{tag}-{i}"] = []
        core.add_request(Request(f"{tag}-{i}", prompt, work.params(), lora=work.lora(i)))
    while core.has_unfinished():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request.request_id].extend([now] * len(out.new_token_ids))
    return summarize("inproc", start, list(times.values()))


def bench_inproc(name: str, work: Workload, args: argparse.Namespace) -> Run:
    from engine_core.core import EngineCore

    core = EngineCore(engine_config(name, work, args))
    vocab = core.model_config.vocab_size
    try:
        with serving_collector():
            run_inproc(core, work.warmup(), vocab, "warmup")
            run = run_inproc(core, work, vocab, "main")
        if args.profile_steps:
            run.profile = profile_run(core, work, vocab, args)
        return run
    finally:
        core.shutdown()  # tensor-parallel workers, before the next engine takes the GPUs


def profile_run(core: Any, work: Workload, vocab: int, args: argparse.Namespace) -> list[Any]:
    """The workload's shape again (other prompts) under the profiler: its prompt steps, then
    ``--profile-steps`` decode steps (step_profile.py)."""
    import torch

    from benchmarks.step_profile import profile_phases

    again = replace(work, seed=work.seed + 2)
    prompts, params = again.prompts(vocab), again.params()
    loras = [again.lora(i) for i in range(len(prompts))]
    return profile_phases(
        core, torch.device(args.device), prompts, params, args.profile_steps, loras
    )


@contextlib.contextmanager
def serving_collector() -> Iterator[None]:
    """The garbage collector as the engine process sets it before its loop (the start-up heap
    frozen, young collections spread out), so that the in-process path measures the loop that
    `tandem serve` runs."""
    from common.processes import freeze_startup_heap, spread_young_collections

    threshold = gc.get_threshold()
    freeze_startup_heap()
    spread_young_collections()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@contextlib.contextmanager
def engine_process(config: Any, timeout_s: float) -> Iterator[Any]:
    """A `tandem engine` process for ``config`` on a private ipc:// address; yields a raw ZMQ
    client connected to it. The process is stopped afterwards."""
    from protocol.address import private_ipc_address
    from protocol.client import EngineClient

    address = str(private_ipc_address())
    command = [*tandem_command(), "engine", "--address", address, "--log-level", "WARNING"]
    command += engine_flags(config)
    proc = subprocess.Popen(command, env=server_env())
    try:
        with EngineClient(address) as client:
            connect(client, proc, timeout_s)
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def connect(client: Any, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Handshake with the engine, giving up at once if its process dies while starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.connect(timeout=2.0)
            return
        except TimeoutError:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise


def run_zmq(client: Any, work: Workload, vocab: int, tag: str) -> Run:
    from protocol.messages import RequestError, StepOutputs

    times: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(work.num_requests)}
    pending = set(times)
    start = time.perf_counter()
    for rid, prompt in zip(times, work.prompts(vocab), strict=True):
        client.add_request(rid, prompt, work.params())
    while pending:
        msg = client.recv(timeout=120.0)
        now = time.perf_counter()
        if msg is None:
            raise TimeoutError("the engine sent nothing for 120 s")
        if isinstance(msg, RequestError):
            raise RuntimeError(f"the engine refused {msg.request_id}: {msg.message}")
        if not isinstance(msg, StepOutputs):
            continue
        for out in msg.outputs:
            times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finish_reason is not None:
                pending.discard(out.request_id)
        pending.difference_update(msg.finished_without_tokens)
    return summarize("zmq", start, list(times.values()))


def bench_zmq(name: str, work: Workload, args: argparse.Namespace) -> Run:
    from engine_core.presets import PRESETS

    vocab = PRESETS[name].vocab_size
    with engine_process(engine_config(name, work, args), args.engine_start_timeout) as client:
        run_zmq(client, work.warmup(), vocab, "warmup")
        return run_zmq(client, work, vocab, "main")


# ---- uniform routing for a mixture of experts ---------------------------------------------------


@contextlib.contextmanager
def uniform_routing(preset: str) -> Iterator[None]:
    """Every MoE router's logits [T, E] replaced by standard normals while the block runs: a
    global forward hook, in place before the engine captures its CUDA graphs, so the graphs draw
    fresh normals at every replay. A single token's router may run fused into one kernel that
    the hook does not see; any routing of one token reaches exactly top-k experts, so its bytes
    and its roofline are the same."""
    import torch

    from engine_core.presets import PRESETS

    config = PRESETS[preset]
    shape = (config.num_experts, config.hidden_size)

    def draw(module: Any, inputs: Any, logits: Any) -> Any:
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == shape:
            return torch.randn_like(logits)
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(draw)
    try:
        yield
    finally:
        handle.remove()


# ---- the driver ---------------------------------------------------------------------------------


def bench_model(name: str, work: Workload, args: argparse.Namespace, bw: float) -> ModelResult:
    bytes_ = model_bytes(name, args.quantization, args.kv_cache_dtype)
    step = step_bytes(bytes_, work.num_requests, work.mean_context)
    label = f"{name} + {args.lora} LoRA (rank {lora_rank(args)})" if args.lora else name
    roofline = work.num_requests * bw / step
    result = ModelResult(label, bytes_.weights, step, roofline, 1e3 * step / bw)
    with contextlib.ExitStack() as stack:
        try:
            loras = stack.enter_context(adapters(name, args))
        except Exception as exc:  # the other models' figures are still printed
            result.errors.append(f"--lora adapters: {type(exc).__name__}: {exc}")
            print(f"[{name}] writing the adapters failed: {exc!r}", flush=True)
            return result
        for path in args.paths:
            bench_path(name, path, replace(work, loras=loras), args, bytes_, result)
    return result


def lora_rank(args: argparse.Namespace) -> int:
    return args.lora_rank if args.lora_rank is not None else DEFAULT_LORA_RANK


@contextlib.contextmanager
def adapters(name: str, args: argparse.Namespace) -> Iterator[tuple[LoraRef, ...]]:
    """--lora's random adapters of preset ``name`` in a temporary folder, as LoraRefs."""
    if not args.lora:
        yield ()
        return
    from benchmarks.lora_adapters import model_config, write_random_adapters
    from protocol.messages import LoraRef

    with tempfile.TemporaryDirectory(prefix="tandem-lora-") as tmp:
        folders = write_random_adapters(model_config(name), Path(tmp), args.lora, lora_rank(args))
        yield tuple(LoraRef(lora, str(folder)) for lora, folder in folders.items())


def bench_path(
    name: str,
    path: str,
    work: Workload,
    args: argparse.Namespace,
    bytes_: ModelBytes,
    result: ModelResult,
) -> None:
    """One path's run into ``result`` (its error instead, where it fails)."""
    started = time.perf_counter()
    try:
        with routing(name, args, bytes_):
            result.runs.append(BENCHES[path](name, work, args))
    except Exception as exc:  # one failed path must not lose the others' figures
        result.errors.append(f"{path}: {type(exc).__name__}: {exc}")
        print(f"[{name}] {path} failed: {exc!r}", flush=True)
    free_device_memory()
    print(f"[{name}] {path} done in {time.perf_counter() - started:.1f} s", flush=True)


BENCHES = {"inproc": bench_inproc, "zmq": bench_zmq}


def routing(name: str, args: argparse.Namespace, bytes_: ModelBytes) -> Any:
    if args.routing == "uniform" and bytes_.moe_layers:
        return uniform_routing(name)
    return contextlib.nullcontext()


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def format_results(results: list[ModelResult]) -> str:
    headers = ["model", "path", "tok/s", "TPOT p50 ms", "p99", "TTFT p50 ms", "p99"]
    headers += ["roofline tok/s", "%roof", "ITL p50 ms", "step%"]
    rows = []
    for r in results:
        for run in r.runs:
            rows.append(
                [
                    r.model, run.path, fmt(run.tok_s, ",.0f"), fmt(run.tpot_p50_ms),
                    fmt(run.tpot_p99_ms), fmt(run.ttft_p50_ms, ",.1f"),
                    fmt(run.ttft_p99_ms, ",.1f"), fmt(r.roofline_tok_s, ",.0f"),
                    fmt(100 * run.tok_s / r.roofline_tok_s, ".1f"), fmt(run.itl_p50_ms),
                    fmt(100 * r.roofline_step_ms / run.itl_p50_ms, ".1f"),
                ]
            )  # fmt: skip
        rows += [[r.model, "error", *([""] * 8), e] for e in r.errors]
    note = (
        "%roof: the run's tok/s over the roofline's (prefill included); step%: the roofline "
        "step time over ITL p50 (a steady decode step)"
    )
    return "\n\n".join([f"{format_table(headers, rows)}\n{note}", *profile_tables(results)])


def profile_tables(results: list[ModelResult]) -> list[str]:
    from benchmarks.step_profile import format_phase

    return [
        format_phase(r.model, phase) for r in results for run in r.runs for phase in run.profile
    ]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="smollm2-135m,llama-1b,llama-8b",
        type=lambda s: s.split(","), help="comma-separated presets (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--paths", default="inproc,zmq", type=lambda s: s.split(","),
        help="inproc and/or zmq (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=64, help="batch (default: 64)")
    parser.add_argument("--prompt-len", type=int, default=128, help="default: 128")
    parser.add_argument("--output-len", type=int, default=256, help="default: 256")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="the simple loop instead of the overlapped one")  # fmt: skip
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--tp-all-reduce", default="auto", choices=("auto", "nccl"))
    parser.add_argument(
        "--quantization", choices=("fp8", "w8a8", "gptq", "awq", "compressed-tensors"),
        help="quantized random weights: FP8, W8A8 int8, or W4A16 in the GPTQ, AWQ or "
        "compressed-tensors layout (128-column groups where they divide the inputs)",
    )  # fmt: skip
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument(
        "--block-size", type=int, default=16,
        help="tokens a KV-cache block (default: %(default)s, the engine's)",
    )  # fmt: skip
    parser.add_argument(
        "--routing", choices=("model", "uniform"), default="model",
        help="mixtures of experts: the random routers' own choices, or uniformly random top-k "
        "at every step (in process only; see above)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="the engine's (default: its own); qwen3-30b-a3b at batch 256 needs about 0.93 of "
        "an 80 GB GPU",
    )  # fmt: skip
    parser.add_argument(
        "--profile-steps", type=int, default=0, metavar="N",
        help="in process: after the run, its shape again under torch.profiler, the prompt steps "
        "and N decode steps apart; prints the top kernels of each (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--lora", type=int, default=0, metavar="N",
        help="in process: N random LoRA adapters (peft's layout), the requests spread over them "
        "in turn (default: none)",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=int, help=f"their rank (default: {DEFAULT_LORA_RANK})")
    parser.add_argument("--engine-start-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--json", type=Path, help="write the provenance and figures here")


def check_args(args: argparse.Namespace) -> None:
    from engine_core.presets import PRESETS

    unknown = [m for m in args.models if m not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; choose from {', '.join(PRESETS)}")
    if set(args.paths) - set(PATHS):
        raise SystemExit(f"--paths takes {' and/or '.join(PATHS)}, not {args.paths}")
    if args.profile_steps and "inproc" not in args.paths:
        raise SystemExit("--profile-steps profiles the in-process engine: give --paths inproc")
    if args.lora < 0:
        raise SystemExit(f"--lora takes a number of adapters, not {args.lora}")
    if args.lora_rank is not None and (not args.lora or args.lora_rank < 1):
        raise SystemExit(f"--lora-rank {args.lora_rank}: a rank of 1 or more, with --lora N")
    if args.lora and "zmq" in args.paths:
        raise SystemExit("--lora runs the in-process engine: give --paths inproc")
    if args.routing == "uniform" and "zmq" in args.paths:
        raise SystemExit("--routing uniform hooks this process's model: give --paths inproc")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    work = Workload(args.num_requests, args.prompt_len, args.output_len)
    bandwidth = measure_bandwidth(args.device) * args.tensor_parallel_size
    print(f"memory bandwidth (copy): {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = [bench_model(name, work, args, bandwidth) for name in args.models]
    provenance = Provenance.here(args.argv)
    print(f"\n{provenance.format()}")
    print(f"bandwidth {bandwidth / 1e12:.2f} TB/s; workload {work.num_requests} x "
          f"({work.prompt_len} -> {work.output_len}), greedy, EOS ignored\n")  # fmt: skip
    print(format_results(results))
    if args.json:
        write_json(args.json, provenance, {"bandwidth": bandwidth, "models": results})
    return 0 if all(r.runs and not r.errors for r in results) else 1
