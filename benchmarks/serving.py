"""`serving`: Tandem beside vLLM on the same GPU, over HTTP, under the same load generator.

    python -m benchmarks serving --model llama-8b \\
        --vllm-python python3 --vllm-pythonpath /tmp/vsite --json OUT.json

One server at a time (side_by_side.py): `tandem serve --model random:PRESET`, then
`vllm serve` on a folder with the preset's config.json and the same tokenizer, with
`--load-format dummy`: both run random weights of exactly the same shapes. Each workload
(N:INPUT:OUTPUT[:CONCURRENCY]) is one warm-up run and --runs reported runs of
`python -m loadgen --backend openai-completions --ignore-eos` with fresh random prompts.
Defaults against defaults; --tandem-args / --vllm-args set each at its best (say which in the
result). Without --vllm-python, Tandem alone. Prints the provenance, both server command lines
and one table with Tandem's advantage per column.

Random presets take the default model's tokenizer ($TANDEM_TOKENIZER_DIR where the default
model is absent, as on the GPU machine).

With --lora N, both servers serve N random rank-R adapters (benchmarks/lora_adapters.py, PEFT's
layout) beside the base model, and the requests name them in turn: the issue's many-adapter
figure is this run's output tok/s over the same run without --lora.

    python -m benchmarks serving --model llama-8b --workloads 64:128:256 --lora 8

With --quantization awq both run the preset's random weights in AWQ's 4-bit layout (vLLM: its
Marlin kernels), the issue's "beside vLLM's Marlin" figure; --quantization w8a8: int8 weights
and per-token int8 activations (vLLM: compressed-tensors' W8A8 config, its CUTLASS kernels):

    python -m benchmarks serving --model llama-8b --quantization awq --workloads 1:128:256:1
    python -m benchmarks prefill --model llama-8b --quantization w8a8

With --sglang-python (and --sglang-pythonpath, the bundle's site: docs/design/peers.md) SGLang
runs third, `sglang.launch_server` on the same folder with dummy weights, on the port after
vLLM's; the table then gives Tandem's advantage over each peer. Adapters and quantized layouts
are wired for vLLM only: with --lora or --quantization SGLang is refused by name.
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks import server_profile
from benchmarks.report import Provenance, write_json
from benchmarks.servers import (
    Server,
    SglangInstall,
    VllmInstall,
    parse_workloads,
    peer_model_dir,
    sglang_server,
    tandem_serve_command,
    vllm_server,
    write_config_entry,
)
from benchmarks.side_by_side import (
    SERVING_METRICS,
    Figures,
    Metric,
    print_comparison,
    run_sequential,
)

DEFAULT_WORKLOADS = "64:128:256,256:128:256,32:3600:256"


def add_args(parser: argparse.ArgumentParser, workloads: str = DEFAULT_WORKLOADS) -> None:
    add_model_arg(parser)
    add_checkpoint_args(parser)
    parser.add_argument(
        "--workloads", default=workloads, type=parse_workloads,
        help="comma-separated N:INPUT:OUTPUT[:CONCURRENCY] (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=1, help="reported runs per workload")
    add_server_args(parser)
    parser.add_argument(
        "--lora", type=int, default=0, metavar="N",
        help="serve N random LoRA adapters and spread the requests over them (default: none)",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=16, help="their rank (default: 16)")
    parser.add_argument(
        "--quantization", choices=tuple(PEER_QUANTIZATION),
        help="both servers run the preset's random weights in this format (awq: 4-bit, groups of "
        "128 with zero points, vLLM with its Marlin kernels; w8a8: int8 weights and per-token "
        "int8 activations, vLLM with CUTLASS) (default: bf16)",
    )  # fmt: skip
    add_output_args(parser)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="llama-8b",
        help="a random preset (engine_core/presets.py) or a model folder both servers load "
        "(default: %(default)s)",
    )  # fmt: skip


CHECKPOINT_HELP = (
    "write the preset's random weights once as a Hugging Face checkpoint "
    "(OUT-DIR/PRESET-checkpoint) and serve that on both servers, instead of each one's own "
    "random weights (vLLM's dummy weights route MoE rows alike, so it reads fewer experts)"
)


def add_checkpoint_args(parser: argparse.ArgumentParser, extra_help: str = "") -> None:
    """--checkpoint: both servers load one random checkpoint of the preset (see
    benchmarks/random_checkpoint.py for why a mixture of experts needs it). With ``extra_help``
    (a benchmark whose figures depend on the weights' outputs), --checkpoint / --no-checkpoint
    with no default: the benchmark decides (None) and says why in ``extra_help``."""
    if extra_help:
        parser.add_argument(
            "--checkpoint", action=argparse.BooleanOptionalAction, default=None,
            help=f"{CHECKPOINT_HELP}; {extra_help}",
        )  # fmt: skip
    else:
        parser.add_argument("--checkpoint", action="store_true", help=CHECKPOINT_HELP)
    parser.add_argument(
        "--checkpoint-device", default="cuda",
        help="where the checkpoint's weights are initialised (default: %(default)s)",
    )  # fmt: skip


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the two servers and of the load generator that every side-by-side
    benchmark over HTTP takes (`serving`, `prefill`, `goodput`, `multi-turn`)."""
    parser.add_argument(
        "--max-model-len", type=int, default=4096,
        help="both servers' longest prompt + output (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    add_vllm_args(parser)
    parser.add_argument(
        "--loadgen-args", default="",
        help="extra load-generator flags, e.g. '--client-processes 4' at hundreds of streams",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="after each workload's measured runs, one more run under each server's torch "
        "profiler (Tandem --profile-dir, vLLM --profiler-config), not reported; prints the "
        "kernels it spent its device time in, and keeps the traces in OUT-DIR/NAME-profile",
    )  # fmt: skip


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's interpreter, import path and extra flags, and --no-tandem (vLLM alone)."""
    parser.add_argument("--no-tandem", action="store_true", help="vLLM alone")
    parser.add_argument("--vllm-python", help="the interpreter that imports vllm (default: none)")
    parser.add_argument("--vllm-pythonpath", help="vLLM's PYTHONPATH (a bundle's site folder)")
    parser.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    parser.add_argument(
        "--sglang-python",
        help="the interpreter that imports sglang (default: none); run after vLLM, on the next "
        "port (docs/design/peers.md: the bundle and its install calls)",
    )
    parser.add_argument("--sglang-pythonpath", help="SGLang's PYTHONPATH (the bundle's site)")
    parser.add_argument("--sglang-args", default="", help="extra `sglang.launch_server` flags")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8100, help="Tandem's; vLLM's is one more")
    parser.add_argument("--out-dir", type=Path, help="server logs and loadgen JSON (default: tmp)")
    parser.add_argument("--json", type=Path, help="write the provenance and figures here")


def run(args: argparse.Namespace) -> int:
    return compare(args, SERVING_METRICS)


def compare(
    args: argparse.Namespace,
    metrics: tuple[Metric, ...],
    notes: Callable[[list[Figures]], list[str]] | None = None,
) -> int:
    """The servers one at a time over args.workloads; prints and writes the comparison, with
    the lines ``notes`` makes of the results under the table."""
    out_dir = output_dir(args, "tandem-serving-")
    model_dir, tokenizer = served_model(args, out_dir)
    loadgen_args = shlex.split(args.loadgen_args)
    if args.lora:
        loadgen_args += add_lora_flags(args, out_dir)
    if getattr(args, "quantization", None):
        add_quantization_flags(args, model_dir)
    servers = build_servers(args, model_dir, out_dir)
    results = run_sequential(servers, args.workloads, tokenizer, out_dir, args.runs, loadgen_args)
    provenance = Provenance.here(args.argv)
    print_comparison(provenance, servers, results, metrics, out_dir)
    for line in notes(results) if notes else []:
        print(line)
    if args.json:
        write_json(args.json, provenance, results)
    return 0


def output_dir(args: argparse.Namespace, prefix: str) -> Path:
    """--out-dir, or a new temporary folder named ``prefix``..., made absolute: each server
    starts in a folder of its own and reads the model's and adapters' paths from there."""
    out_dir = (args.out_dir or Path(tempfile.mkdtemp(prefix=prefix))).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def add_lora_flags(args: argparse.Namespace, out_dir: Path) -> list[str]:
    """Write args.lora random adapters, add the flags that serve them to both servers' extra
    flags, and return the load generator's (the adapters' names, each in turn)."""
    from benchmarks.lora_adapters import model_config, serve_flags, write_random_adapters

    config = model_config(args.model)
    folders = write_random_adapters(config, out_dir / "lora", args.lora, args.lora_rank)
    flags = shlex.join(serve_flags(folders, args.lora_rank))
    args.tandem_args = f"{args.tandem_args} {flags}"
    args.vllm_args = f"{args.vllm_args} {flags}"
    return ["--model", ",".join(folders)]


# vLLM's view of Tandem's random quantized weights (quant_config.random_weights_config): AWQ's
# groups of 128 with zero points (for every preset whose inputs 128 divides), or W8A8's int8
# rows and per-token activations; the checkpoint config its dummy loader builds the same layers
# from, and the method it is asked to run them with.
PEER_QUANTIZATION = {
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
         "version": "gemm"},
        "awq_marlin",
    ),
    # compressed-tensors' W8A8 as llm-compressor writes it: int8 weights, a scale per output
    # row; int8 activations, a scale per token computed at run time (vLLM: CUTLASS).
    "w8a8": (
        {"quant_method": "compressed-tensors", "format": "int-quantized",
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                         "strategy": "channel", "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                   "strategy": "token", "dynamic": True}}},
         "ignore": ["lm_head"]},
        "compressed-tensors",
    ),
}  # fmt: skip


def add_quantization_flags(args: argparse.Namespace, model_dir: Path | None) -> None:
    """Both servers run args.quantization: Tandem's flag, and for vLLM the format's config in
    the peer folder's config.json (its dummy weights take the layers' quantized shapes) and
    its kernel's name."""
    from engine_core.models.quant_config import random_weights_config
    from engine_core.presets import PRESETS

    if args.model not in PRESETS or model_dir is None:
        raise SystemExit("--quantization needs a random preset (its weights are made quantized)")
    peer_config, peer_method = PEER_QUANTIZATION[args.quantization]
    ours = random_weights_config(args.quantization, PRESETS[args.model])
    if "group_size" in peer_config and ours.group_size != peer_config["group_size"]:
        raise SystemExit(
            f"--quantization {args.quantization}: {args.model}'s random weights take groups of "
            f"{ours.group_size}, the peer's config says {peer_config['group_size']}"
        )
    write_config_entry(model_dir, "quantization_config", peer_config)
    args.tandem_args = f"{args.tandem_args} --quantization {args.quantization}"
    args.vllm_args = f"{args.vllm_args} --quantization {peer_method}"


def served_model(args: argparse.Namespace, out_dir: Path) -> tuple[Path | None, str]:
    """``model_folder`` of args.model, after --checkpoint has written the preset's checkpoint
    and made args.model that folder."""
    from engine_core.presets import PRESETS

    if getattr(args, "checkpoint", False):
        if args.model not in PRESETS:
            raise SystemExit(f"--checkpoint needs a random preset, not {args.model!r}")
        if getattr(args, "quantization", None):
            raise SystemExit("--checkpoint writes bf16 weights (MXFP4 experts for gpt-oss): "
                             "drop --quantization")  # fmt: skip
        from benchmarks.random_checkpoint import write_preset_checkpoint

        folder = out_dir / f"{args.model}-checkpoint"
        print(f"writing {args.model}'s random checkpoint into {folder}", flush=True)
        args.model = str(write_preset_checkpoint(args.model, folder, args.checkpoint_device))
    return model_folder(args.model, out_dir)


def model_folder(model: str, out_dir: Path) -> tuple[Path | None, str]:
    """(the folder vLLM loads, the load generator's tokenizer). For a preset: a folder with its
    config and the tokenizer of random models; for a folder: itself."""
    from engine_core.presets import PRESETS

    if model not in PRESETS:
        return Path(model), model
    from engine_core.model_dir import tokenizer_dir_for_random

    # The folder holds the tokenizer's files and a config.json: the load generator's tokenizer.
    folder = peer_model_dir(model, tokenizer_dir_for_random(), out_dir / f"{model}-model")
    return folder, str(folder)


def build_servers(
    args: argparse.Namespace, model_dir: Path | None, out_dir: Path | None = None
) -> list[Server]:
    """The servers to compare; with --profile, each with its profiler on, writing under
    ``out_dir``."""
    servers = servers_of(args, model_dir)
    if getattr(args, "profile", False) and out_dir is not None:
        for server in servers:
            server_profile.enable(server, out_dir / f"{server.name}-profile")
    return servers


def servers_of(args: argparse.Namespace, model_dir: Path | None) -> list[Server]:
    from engine_core.presets import PRESETS

    preset = args.model in PRESETS
    servers = []
    if not args.no_tandem:
        model = f"random:{args.model}" if preset else args.model
        extra = shlex.split(args.tandem_args)
        command = tandem_serve_command(model, args.port, args.max_model_len, extra)
        servers.append(Server("tandem", command, args.port))
    if args.vllm_python and model_dir is not None:
        install = VllmInstall(args.vllm_python, args.vllm_pythonpath)
        extra = shlex.split(args.vllm_args)
        servers.append(
            vllm_server(install, model_dir, args.port + 1, args.max_model_len, preset, extra)
        )
    if getattr(args, "sglang_python", None) and model_dir is not None:
        servers.append(sglang_peer(args, model_dir, preset))
    if not servers:
        raise SystemExit("nothing to run: --no-tandem and no --vllm-python or --sglang-python")
    return servers


def sglang_peer(args: argparse.Namespace, model_dir: Path, dummy_weights: bool) -> Server:
    """SGLang on the port after vLLM's. Adapters and quantized layouts are given to vLLM only
    (its flags are written for it): SGLang is refused with them rather than run without."""
    for flag in ("--lora", "--quantization"):
        value = getattr(args, flag[2:], None)
        if value:
            raise SystemExit(f"--sglang-python with {flag}: not wired for SGLang yet")
    install = SglangInstall(args.sglang_python, args.sglang_pythonpath)
    extra = shlex.split(args.sglang_args)
    port = args.port + 2
    return sglang_server(install, model_dir, port, args.max_model_len, dummy_weights, extra)
