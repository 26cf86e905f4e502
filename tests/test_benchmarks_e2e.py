"""Benchmarks run end to end on the CPU, as documented (`python -m benchmarks NAME ...` in a
fresh process), on small models and workloads: the real engine, servers and load generator.
What is checked is what they print and write, never how fast anything was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.report import ROOT
from benchmarks.servers import free_port

pytestmark = pytest.mark.slow


def run_benchmark(*argv: str, timeout: float = 600) -> str:
    """The benchmark's stdout; fails with its output when it exits non-zero."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith(f"| {first_cell}")
    ]


def test_decode_on_the_cpu_both_paths(tmp_path: Path) -> None:
    flags = "--device cpu --models smollm2-135m --num-requests 2 --prompt-len 8 --output-len 4"
    argv = ["decode", *flags.split(), "--profile-steps", "2", "--json", str(tmp_path / "d.json")]
    out = run_benchmark(*argv)
    assert f"command: python -m benchmarks {' '.join(argv)}" in out
    assert "| model" in out and "%roof" in out and "step%" in out
    rows = table_rows(out, "smollm2-135m")
    assert [row[1] for row in rows] == ["inproc", "zmq"]
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["provenance"]["command"] == f"python -m benchmarks {' '.join(argv)}"
    (model,) = result["results"]["models"]
    assert [run["output_tokens"] for run in model["runs"]] == [8, 8] and model["errors"] == []
    assert model["bytes_per_step"] == 269_030_016 + 2 * (8 + 2) * 23_040
    # The in-process run profiled again: its prompt steps, then the two decode steps asked for.
    prompt, decode = model["runs"][0]["profile"]
    assert (prompt["phase"], decode["phase"]) == ("prompt steps", "decode steps")
    assert decode["steps"] == 2
    for phase in (prompt, decode):
        shares = [op["share"] for op in phase["top"]]
        assert phase["busy_ms_per_step"] > 0 and shares == sorted(shares, reverse=True)
        assert 0 < sum(shares) <= 1 + 1e-9
        assert f"[smollm2-135m] {phase['phase']}: {phase['steps']} steps" in out
    assert model["runs"][1]["profile"] == []  # the zmq path is not profiled


def test_decode_in_process_with_lora_adapters() -> None:
    """--lora: the engine serves the random adapters, the requests take them in turn (each
    folder read once, both in slots), and every request runs to its last token."""
    from benchmarks.__main__ import parse
    from benchmarks.decode import Workload, adapters, check_args, engine_config, run_inproc
    from engine_core.core import EngineCore

    args = parse(["decode", "--device", "cpu", "--models", "smollm2-135m", "--paths", "inproc",
                  "--lora", "2", "--lora-rank", "8"])  # fmt: skip
    check_args(args)
    with adapters("smollm2-135m", args) as loras:
        assert [ref.name for ref in loras] == ["lora0", "lora1"]
        work = Workload(3, 8, 4, loras=loras)
        assert [work.lora(i).name for i in range(3)] == ["lora0", "lora1", "lora0"]
        assert work.warmup().loras == loras
        config = engine_config("smollm2-135m", work, args)
        assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 8)
        core = EngineCore(config)
        try:
            run = run_inproc(core, work, core.model_config.vocab_size, "lora")
            assert core.runner.loras.reads == 2
            assert sorted(core.runner.loras.resident()) == ["lora0", "lora1"]
        finally:
            core.shutdown()
    assert run.output_tokens == 3 * 4
    with pytest.raises(SystemExit, match="--paths inproc"):
        check_args(parse(["decode", "--lora", "2"]))


def test_serving_driver_on_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["serving", "--model", str(tiny_model_dir), "--workloads", "4:16:4,2:16:1:1",
            "--max-model-len", "512", "--port", str(free_port()), "--out-dir", str(tmp_path),
            "--json", str(tmp_path / "s.json")]  # fmt: skip
    out = run_benchmark(*argv)
    assert f"command: python -m benchmarks {' '.join(argv)}" in out
    assert f"tandem: {sys.executable} -m frontend.cli serve --model {tiny_model_dir}" in out
    rows = table_rows(out, "4 x (16 -> 4)") + table_rows(out, "2 x (16 -> 1), 1 at a time")
    assert len(rows) == 2 and rows[1][-1] == "-"  # one output token: no TPOT
    figures = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [(f["server"], f["workload"]) for f in figures] == [
        ("tandem", "4 x (16 -> 4)"), ("tandem", "2 x (16 -> 1), 1 at a time"),
    ]  # fmt: skip
    assert all(f["output_tok_s"] > 0 for f in figures)
    assert (tmp_path / "tandem-server.log").exists()


def test_serving_with_profile_prints_the_profiled_runs_ops(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--profile: after the measured runs, one more under Tandem's profiler; its table lists
    the attention op the tiny model's 2 layers ran every step (on the CPU: torch ops), the
    trace stays in OUT-DIR/tandem-profile, and the reported figures are the measured run's."""
    argv = ["serving", "--model", str(tiny_model_dir), "--workloads", "4:16:4",
            "--max-model-len", "512", "--port", str(free_port()), "--out-dir", str(tmp_path),
            "--json", str(tmp_path / "s.json"), "--profile"]  # fmt: skip
    out = run_benchmark(*argv)
    assert "[tandem] 4 x (16 -> 4), profiled run:" in out and "ms of ops" in out
    (attention,) = table_rows(out, "aten::scaled_dot_product_attention ")
    calls = int(attention[1])
    assert calls >= 2 * 4 and calls % 2 == 0, attention  # 2 layers, 4 tokens: >= 4 forwards
    assert list((tmp_path / "tandem-profile").glob("tandem-engine-*.trace.json.gz"))
    figures = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [(f["server"], f["workload"]) for f in figures] == [("tandem", "4 x (16 -> 4)")]


def test_first_token_on_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = f"--model {tiny_model_dir} --trials 2 --warmup 1 --prompt-len 32 --port {free_port()}"
    argv = ["first-token", *flags.split(), "--json", str(tmp_path / "f.json")]
    out = run_benchmark(*argv)
    assert f"command: python -m benchmarks {' '.join(argv)}" in out
    assert table_rows(out, "first token over raw ZMQ")
    assert "prompt tokens as the server counted them, median: completions 32" in out
    trials = json.loads((tmp_path / "f.json").read_text())["results"]
    assert len(trials["zmq"]) == len(trials["http"]) == len(trials["chat"]) == 2
    assert trials["http_prompt_tokens"] == [32, 32]


def test_a_short_soak_loses_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["soak", "--model", str(tiny_model_dir), "--duration", "8", "--kill-every", "4",
            "--concurrency", "4", "--json", str(tmp_path / "k.json")]  # fmt: skip
    out = run_benchmark(*argv)
    assert f"command: python -m benchmarks {' '.join(argv)}" in out
    result = json.loads((tmp_path / "k.json").read_text())["results"]
    counts = result["counts"]
    assert counts["sent"] > 0 and counts["lost"] == 0 and counts["engine_kills"] == 1
    assert result["end_state"]["kv_all_free"] and result["end_state"]["kv_integrity"]


def test_goodput_is_the_hand_count_of_records_meeting_both_slos(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = ["goodput", "--model", str(tiny_model_dir), "--rates", "4,8", "--duration", "1",
            "--input-len", "8:48", "--output-len", "2:8", "--slo", "ttft=500,tpot=50",
            "--warmup-requests", "2", "--max-model-len", "512", "--port", str(free_port()),
            "--out-dir", str(tmp_path), "--json", str(tmp_path / "g.json")]  # fmt: skip
    out = run_benchmark(*argv)
    assert f"command: python -m benchmarks {' '.join(argv)}" in out
    figures = json.loads((tmp_path / "g.json").read_text())["results"]
    assert [f["workload"] for f in figures] == ["4 req/s: 4 x (8:48 -> 2:8)",
                                                "8 req/s: 8 x (8:48 -> 2:8)"]  # fmt: skip
    warm_up = json.loads((tmp_path / "tandem-warm-up.json").read_text())
    assert len(warm_up["runs"][0]["requests"]) == 2  # once, as the server started
    for i, (rate, n) in enumerate([(4, 4), (8, 8)]):
        doc = json.loads((tmp_path / f"tandem-w{i}.json").read_text())
        assert doc["config"]["warmup_runs"] == 0 and doc["config"]["request_rate"] == rate
        (run,) = doc["runs"]
        records = run["requests"]
        assert len(records) == n and all(r["ok"] for r in records)
        assert all(2 <= r["max_tokens"] <= 8 for r in records)
        good = sum(r["ttft"] <= 0.5 and (r["tpot"] is None or r["tpot"] <= 0.05) for r in records)
        duration = max(r["ended_at"] for r in records)
        assert good > 0
        assert run["summary"]["good_requests"] == good
        assert figures[i]["goodput"] == pytest.approx(good / duration)
        assert figures[i]["request_rate"] == pytest.approx(n / duration)
        (row,) = table_rows(out, figures[i]["workload"])
        assert row[1] == f"{good / duration:.2f}"  # the table's goodput column
        # The pool holds every request of the run at once: nothing is preempted.
        assert figures[i]["preemptions"] == 0 and row[7] == "0"


def test_multi_turn_driver_on_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["multi-turn", "--model", str(tiny_model_dir), "--conversations", "2", "--turns", "2",
            "--shared-prefix-len", "32", "--input-len", "8", "--output-len", "4",
            "--max-model-len", "512", "--port", str(free_port()), "--out-dir", str(tmp_path),
            "--json", str(tmp_path / "m.json")]  # fmt: skip
    out = run_benchmark(*argv)
    assert "serve --model" in out and "--enable-prefix-caching" in out  # on, whatever the default
    label = "2 x 2 turns (8 -> 4), 32-token system prompt"
    assert len(table_rows(out, label)) == 1
    doc = json.loads((tmp_path / "tandem-w0.json").read_text())
    assert doc["config"]["backend"] == "openai-chat" and doc["config"]["warmup_runs"] == 1
    (run,) = doc["runs"]
    assert [(r["conversation"], r["turn"]) for r in run["requests"]] == [
        (0, 0), (0, 1), (1, 0), (1, 1),
    ]  # fmt: skip
    (figures,) = json.loads((tmp_path / "m.json").read_text())["results"]
    assert figures["request_rate"] == pytest.approx(4 / run["summary"]["duration_s"])
    # Each turn's TTFT from the records: two first turns, two later ones (p50: their mean).
    ttft = {k: [1e3 * r["ttft"] for r in run["requests"] if r["turn"] == k] for k in (0, 1)}
    assert figures["ttft_first_turn_p50_ms"] == pytest.approx(sum(ttft[0]) / 2)
    assert figures["ttft_later_turns_p50_ms"] == pytest.approx(sum(ttft[1]) / 2)
    # Every turn after the first conversation's first shares at least the system prompt's
    # blocks; no turn is served whole from the cache.
    assert 0 < figures["prefix_cache_hit_rate"] < 1
