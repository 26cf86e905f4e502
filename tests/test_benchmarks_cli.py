"""`python -m benchmarks NAME [flags]`: the list of benchmarks, each one's --help, and the
defaults each parses to."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS, build_parser, main, parse
from benchmarks.servers import Workload


def test_without_a_name_it_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("decode", "serving", "first-token", "prefill", "soak", "cpu"):
        assert f"\n  {name} " in listed
    assert main([]) == 2


def test_an_unknown_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decod"]) == 2
    assert "unknown benchmark 'decod'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_help_explains_and_shows_its_command(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m benchmarks {name}")
    assert f"python -m benchmarks {name} " in text.split("options:")[0]  # an example command
    assert "--json" in text


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_json_flag_parses_to_a_path(name: str) -> None:
    """report.write_json writes through Path: a string left by a flag without a type fails
    only after the whole run."""
    assert parse([name, "--json", "out.json"]).json == Path("out.json")


def test_parsed_arguments_keep_the_command_line() -> None:
    args = parse(["decode", "--models", "llama-8b", "--num-requests", "256"])
    assert args.argv == ["decode", "--models", "llama-8b", "--num-requests", "256"]
    assert (args.models, args.num_requests, args.paths) == (["llama-8b"], 256, ["inproc", "zmq"])


def test_defaults_are_the_design_cards_workloads() -> None:
    serving = parse(["serving"])
    assert serving.workloads == [Workload(64, 128, 256), Workload(256, 128, 256),
                                 Workload(32, 3600, 256)]  # fmt: skip
    assert (serving.model, serving.max_model_len, serving.vllm_python) == ("llama-8b", 4096, None)
    assert parse(["prefill"]).workloads == [Workload(64, 2048, 1)]
    assert parse(["cpu"]).workloads == [Workload(20, 128, 32, 1), Workload(16, 128, 64),
                                        Workload(64, 256, 128)]  # fmt: skip
    decode = parse(["decode"])
    assert (decode.num_requests, decode.prompt_len, decode.output_len) == (64, 128, 256)
    assert decode.models == ["smollm2-135m", "llama-1b", "llama-8b"]


def test_bad_flags_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser("serving").parse_args(["--workloads", "64:128"])
    assert done.value.code == 2
    assert "--workloads" in capsys.readouterr().err


def test_the_attention_peer_is_timed_only_when_its_output_equals_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`benchmarks attention --peer`: where vLLM cannot be imported, or its call gives other
    numbers than our kernel's, the peer's row is an error saying why (timed() catches it), and
    the run goes on; a call whose output equals ours is returned to be timed."""
    import torch

    from benchmarks import attention

    ours = torch.randn(4, 8, 64) * 0.1
    shape = {"heads": 8, "kv": 2, "d": 64}
    args = argparse.Namespace(iters=1)
    if importlib.util.find_spec("vllm") is None:
        missing = attention.peer_decode(ours, {}, shape, ours)
        assert "No module named 'vllm" in attention.timed(missing, args)["error"]
    wrong = ours + 2 * attention.PEER_TOLERANCE
    monkeypatch.setattr(attention, "_peer_decode_call", lambda *_: lambda: wrong)
    row = attention.timed(attention.peer_decode(ours, {}, shape, ours), args)
    assert "differs from the engine's" in row["error"]
    right = ours + attention.PEER_TOLERANCE / 2
    monkeypatch.setattr(attention, "_peer_decode_call", lambda *_: lambda: right)
    assert attention.peer_decode(ours, {}, shape, ours)() is right


def test_attention_cases_and_flops_by_hand() -> None:
    from benchmarks.attention import parse_decode, parse_prefill, prefill_flops

    assert parse_prefill("512@3584x2") == ([512, 512], [3584, 3584])
    assert parse_prefill("8192") == ([8192], [0])
    assert parse_decode("3700x32") == ([3700] * 32, 0)
    assert parse_decode("2600x32:2000") == ([2600] * 32, 2000)
    assert parse_decode("64-2560x4") == ([64, 896, 1728, 2560], 0)  # steps of 2,496 / 3
    assert parse_decode("100-200x1") == ([100], 0)
    with pytest.raises(SystemExit, match="more shared tokens"):
        parse_decode("600x32:2000")
    with pytest.raises(SystemExit, match="more shared tokens"):
        parse_decode("1000-3000x8:2000")  # the shortest row is under the shared pages
    # Two new tokens after three cached: the first sees 4 keys, the second 5; 9 dot products of
    # length head_dim for QK and as many for PV, two flops each.
    assert prefill_flops([2], [3], heads=1, head_dim=8) == 4 * 9 * 8


def test_goodput_and_multi_turn_defaults_are_the_issues_workloads() -> None:
    from loadgen.metrics import Slo
    from loadgen.workload import LenRange

    goodput = parse(["goodput"])
    assert (goodput.rates, goodput.duration) == ([2.0, 4.0, 8.0, 16.0, 32.0], 20.0)
    assert (goodput.input_len, goodput.output_len) == (LenRange(64, 2048), LenRange(32, 512))
    assert goodput.slo == Slo(ttft=0.5, tpot=0.05) and goodput.warmup_requests == 32
    turns = parse(["multi-turn"])
    assert (turns.conversations, turns.turns, turns.shared_prefix_len) == (32, 5, 2000)
    assert (turns.backend, turns.input_len, turns.output_len) == (
        "openai-chat", LenRange(128, 128), LenRange(128, 128),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["goodput", "--input-len", "64:4000", "--output-len", "32:512"], "--max-model-len 4096"),
        (["multi-turn", "--turns", "10"], "more than --max-model-len 4096"),
        (["multi-turn", "--conversations", "0"], "--conversations and --turns must be >= 1"),
        (["goodput", "--duration", "0"], "--duration must be > 0"),
    ],
)
def test_workloads_the_servers_would_refuse_stop_before_they_start(
    argv: list[str], message: str
) -> None:
    args = parse(argv)
    module = __import__(BENCHMARKS[argv[0]][0], fromlist=["check"])
    with pytest.raises(SystemExit, match=message):
        module.check(args)


@pytest.mark.parametrize("rates", ["", "0,2", "inf", "2,x"])
def test_bad_rates_exit_with_usage(rates: str) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser("goodput").parse_args(["--rates", rates])
    assert done.value.code == 2


def test_image_stages_runs_each_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["image-stages", "--image-size", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for stage in ("base64", "PNG decode", "rounding to bfloat16", "SHA-256", "batch's pixels"):
        assert stage in out


def test_replayed_steps_are_a_profiled_runs_decode_steps_as_they_were_launched(
    tmp_path: Path,
) -> None:
    """`benchmarks attention --replay`: of a STEPS file (engine_core/profiler.py), the steps
    whose rows each computed one token, evenly spaced when fewer are asked for; each with the
    empty rows of the graph it replayed and its shared-prefix tokens; a file without its engine
    line refused; the replay's totals by kernel, by hand."""
    from benchmarks.attention import Replayed, read_steps, replay_steps, replay_totals

    steps = tmp_path / "tandem-engine-1-1.steps.jsonl"
    engine = {
        "model": "m", "heads": 8, "kv_heads": 2, "head_dim": 64, "block_size": 16,
        "max_model_len": 512, "plain_attention": True, "kv_cache_dtype": "bfloat16",
    }  # fmt: skip
    lines = [{"new": [40], "lens": [40], "graph_rows": 0, "shared": 0}]  # a prompt
    lines += [
        {"new": [1] * (k + 1), "lens": [41 + k] * (k + 1), "graph_rows": 8, "shared": 32 * k}
        for k in range(9)
    ]
    lines.insert(4, {"new": [1, 7], "lens": [44, 7], "graph_rows": 0, "shared": 0})  # mixed
    text = json.dumps({"engine": engine}) + "\n" + "".join(json.dumps(x) + "\n" for x in lines)
    steps.write_text(text)
    read, shapes = read_steps(steps)
    assert read == engine and shapes == lines
    decodes = replay_steps(shapes, 0)
    assert [d.line for d in decodes] == [2, 3, 4, 6, 7, 8, 9, 10, 11]  # the file's lines
    assert decodes[3] == Replayed(6, [44] * 4, 8, 96)
    assert decodes[3].padded == [44] * 4 + [0] * 4  # the graph of 8 rows it replayed
    assert Replayed(1, [5, 6], 0, 0).padded == [5, 6]  # eager: no padding
    assert [d.line for d in replay_steps(shapes, 3)] == [2, 6, 9]  # strides of 3 of 9
    assert replay_steps(shapes, 20) == decodes
    steps.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(SystemExit, match="not a profiler's steps file"):
        read_steps(steps)
    rows = [
        {"case": "step 2", "kernel": "engine's", "us": 10.0},
        {"case": "step 2", "kernel": "engine's, 2 splits", "us": 12.0},
        {"case": "step 2", "kernel": "vLLM FlashAttention 3", "us": 9.0},
        {"case": "step 3", "kernel": "engine's", "us": 20.0},
        {"case": "step 3", "kernel": "engine's, 2 splits", "error": "too much shared memory"},
        {"case": "step 3", "kernel": "vLLM FlashAttention 3", "us": 15.0},
    ]
    lines = replay_totals(rows).splitlines()
    assert lines[0] == "2 steps, a layer's call each, summed:"
    sums = {line[2:42].strip(): line[42:].split() for line in lines[1:]}
    assert sums["engine's"] == ["30.0", "us", "1.000"]
    assert sums["vLLM FlashAttention 3"] == ["24.0", "us", "0.800"]
    assert sums["engine's, 2 splits"] == ["failed", "on", "1", "of", "2", "steps"]


def test_a_replay_takes_the_engines_pages_and_width_from_its_file(tmp_path: Path) -> None:
    """--page-size and --max-model-len would be ignored by --replay: refused."""
    for flag in ("--page-size", "--max-model-len"):
        with pytest.raises(SystemExit, match="--replay takes the engine's"):
            main(["attention", "--replay", str(tmp_path / "s.jsonl"), flag, "32"])
