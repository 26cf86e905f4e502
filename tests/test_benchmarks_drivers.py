"""The servers each side-by-side benchmark starts, from its flags: Tandem on the random preset,
vLLM on a folder of the same shapes with dummy weights, each with its own import path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import cpu, multi_turn, serving
from benchmarks.__main__ import parse
from benchmarks.report import ROOT


@pytest.fixture
def tokenizer_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("TANDEM_TOKENIZER_DIR", str(folder))
    return folder


def test_serving_a_preset_gives_both_servers_the_same_shapes(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    args = parse([
        "serving", "--model", "llama-1b", "--port", "8300", "--tandem-args", "--api-servers 4",
        "--vllm-python", "python3", "--vllm-pythonpath", "/tmp/vsite",
        "--vllm-args", "--api-server-count 4",
    ])  # fmt: skip
    model_dir, tokenizer = serving.model_folder(args.model, tmp_path)
    # The load generator reads the folder both servers load: the same tokenizer files, and the
    # config.json a Hugging Face folder needs.
    assert tokenizer == str(model_dir)
    assert (model_dir / "tokenizer.json").read_bytes() == (
        tokenizer_dir / "tokenizer.json"
    ).read_bytes()
    assert json.loads((model_dir / "config.json").read_text())["hidden_size"] == 2048
    tandem, vllm = serving.build_servers(args, model_dir)
    assert tandem.command == [
        sys.executable, "-m", "frontend.cli", "serve", "--model", "random:llama-1b",
        "--host", "127.0.0.1", "--port", "8300", "--max-model-len", "4096", "--api-servers", "4",
    ]  # fmt: skip
    assert vllm.command == [
        "python3", "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", "8301", "--max-model-len", "4096",
        "--served-model-name", "default", "--dtype", "bfloat16", "--load-format", "dummy",
        "--api-server-count", "4",
    ]  # fmt: skip
    assert tandem.cwd == ROOT and str(ROOT) in tandem.env["PYTHONPATH"]
    assert vllm.cwd == model_dir and vllm.env["PYTHONPATH"] == "/tmp/vsite"


def test_serving_awq_gives_both_servers_the_same_quantized_layout(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """vLLM's dummy weights take the layout its config names: the same group size and zero
    points as Tandem's random AWQ weights of the preset, run by its Marlin kernels."""
    from engine_core.models.quant_config import random_weights_config
    from engine_core.presets import PRESETS

    args = parse(["serving", "--model", "llama-8b", "--quantization", "awq",
                  "--vllm-python", "python3"])  # fmt: skip
    model_dir, _ = serving.model_folder(args.model, tmp_path)
    serving.add_quantization_flags(args, model_dir)
    peer = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    ours = random_weights_config("awq", PRESETS["llama-8b"])
    assert (peer["quant_method"], peer["bits"]) == ("awq", 4)
    assert (peer["group_size"], peer["zero_point"]) == (ours.group_size, ours.zero_points)
    tandem, vllm = serving.build_servers(args, model_dir)
    assert tandem.command[-2:] == ["--quantization", "awq"]
    assert vllm.command[-2:] == ["--quantization", "awq_marlin"]


def test_serving_w8a8_gives_vllm_the_scheme_tandem_runs(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The peer's compressed-tensors config, read by Tandem's own parser, is the W8A8 scheme
    that --quantization w8a8 quantizes a plain checkpoint to (int8 rows, per-token int8
    activations), and vLLM is told to read it as compressed-tensors."""
    from engine_core.config import Int8Config, is_ignored
    from engine_core.models.quant_config import quant_config_from_hf

    args = parse(["prefill", "--model", "llama-8b", "--quantization", "w8a8",
                  "--vllm-python", "python3"])  # fmt: skip
    model_dir, _ = serving.model_folder(args.model, tmp_path)
    serving.add_quantization_flags(args, model_dir)
    peer = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    read = quant_config_from_hf({"quantization_config": peer})
    assert isinstance(read, Int8Config)
    assert read.source == "compressed-tensors" and read.prequantized
    assert is_ignored("lm_head", read) and not is_ignored("model.layers.0.mlp.down_proj", read)
    tandem, vllm = serving.build_servers(args, model_dir)
    assert tandem.command[-2:] == ["--quantization", "w8a8"]
    assert vllm.command[-2:] == ["--quantization", "compressed-tensors"]


def test_serving_awq_refuses_a_preset_whose_groups_differ(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    args = parse(["serving", "--model", "smollm2-135m", "--quantization", "awq"])
    model_dir, _ = serving.model_folder(args.model, tmp_path)
    with pytest.raises(SystemExit, match="groups of 64"):
        serving.add_quantization_flags(args, model_dir)


def test_serving_a_folder_loads_its_weights(tmp_path: Path) -> None:
    args = parse(["serving", "--model", str(tmp_path), "--vllm-python", "python3"])
    model_dir, tokenizer = serving.model_folder(args.model, tmp_path / "out")
    assert (model_dir, tokenizer) == (tmp_path, str(tmp_path))
    tandem, vllm = serving.build_servers(args, model_dir)
    assert tandem.command[5] == str(tmp_path) and "--load-format" not in vllm.command


def test_serving_with_sglang_starts_it_after_vllm_on_the_same_folder(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """SGLang as docs/design/peers.md launches it: the folder with dummy weights, bf16, the
    context length, the served name, on the port after vLLM's, with only its bundle on the
    import path; adapters or a quantized layout (written for vLLM) refuse it by name."""
    flags = ["serving", "--model", "llama-1b", "--port", "8300", "--vllm-python", "python3",
             "--sglang-python", "python3", "--sglang-pythonpath", "/tmp/sgsite",
             "--sglang-args", "--sampling-backend pytorch"]  # fmt: skip
    args = parse(flags)
    model_dir, _ = serving.model_folder(args.model, tmp_path)
    tandem, vllm, sglang = serving.build_servers(args, model_dir)
    assert sglang.command == [
        "python3", "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--host", "127.0.0.1", "--port", "8302", "--context-length", "4096",
        "--served-model-name", "default", "--dtype", "bfloat16", "--skip-server-warmup",
        "--load-format", "dummy", "--sampling-backend", "pytorch",
    ]  # fmt: skip
    assert sglang.cwd == model_dir and sglang.env["PYTHONPATH"] == "/tmp/sgsite"
    assert [s.name for s in (tandem, vllm, sglang)] == ["tandem", "vllm", "sglang"]
    for extra in (["--lora", "2"], ["--quantization", "awq"]):
        with pytest.raises(SystemExit, match=f"--sglang-python with {extra[0]}"):
            serving.build_servers(parse(flags + extra), model_dir)


def test_profile_turns_on_each_servers_profiler_into_its_own_folder(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """--profile: Tandem's --profile-dir and vLLM's --profiler-config (torch, an absolute
    folder, as vLLM requires), each under the output folder; SGLang is refused by name."""
    flags = ["serving", "--model", "llama-1b", "--vllm-python", "python3", "--profile"]
    model_dir, _ = serving.model_folder("llama-1b", tmp_path)
    tandem, vllm = serving.build_servers(parse(flags), model_dir, tmp_path)
    assert tandem.command[-2:] == ["--profile-dir", str(tmp_path / "tandem-profile")]
    assert tandem.profile_dir == tmp_path / "tandem-profile"
    assert vllm.command[-2] == "--profiler-config"
    config = json.loads(vllm.command[-1])
    assert config["profiler"] == "torch"
    assert config["torch_profiler_dir"] == str((tmp_path / "vllm-profile").resolve())
    assert vllm.profile_dir == tmp_path / "vllm-profile"
    with pytest.raises(SystemExit, match="not sglang"):
        serving.build_servers(parse([*flags, "--sglang-python", "python3"]), model_dir, tmp_path)
    plain = serving.build_servers(parse(flags[:-1]), model_dir, tmp_path)
    assert all(s.profile_dir is None and "--profile-dir" not in s.command for s in plain)


def test_kernel_times_sum_each_kernel_over_the_traces() -> None:
    """By hand: kernel A twice (10 + 25 us), B once (30): A first with 35 of 65 us; CPU ops are
    left out where kernels are there, and counted where they are not."""
    from benchmarks.server_profile import kernel_times

    events = [
        {"cat": "kernel", "name": "A", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "B", "ts": 12, "dur": 30},
        {"cat": "kernel", "name": "A", "ts": 50, "dur": 25},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99},
    ]  # fmt: skip
    times, kind = kernel_times(events)
    assert kind == "kernels"
    assert [(t.name, t.calls, t.total_us) for t in times] == [("A", 2, 35.0), ("B", 1, 30.0)]
    assert times[0].share == pytest.approx(35 / 65)
    ops, kind = kernel_times([e for e in events if e["cat"] == "cpu_op"])
    assert kind == "ops" and [(t.name, t.calls, t.share) for t in ops] == [("aten::mm", 1, 1.0)]


def test_a_kernel_launched_early_counts_only_past_the_one_before_it() -> None:
    """By hand, programmatic dependent launch: on stream 7 A runs 0-10 us, B 10-40 and the next
    A opens at 35 (resident, waiting) and ends at 60, so it owns 40-60; on stream 8 another A
    runs 0-25, overlapping stream 7's kernels but not its own stream's: all 25 are its own.
    A: 10 + 20 + 25 = 55 us in 3 calls, B 30; 85 in all (each stream's busy time)."""
    from benchmarks.server_profile import kernel_times

    def kernel(name: str, stream: int, ts: float, dur: float) -> dict:
        return {"cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur}

    events = [kernel("A", 7, 35, 25), kernel("B", 7, 10, 30), kernel("A", 7, 0, 10)]
    events.append(kernel("A", 8, 0, 25))
    times, _ = kernel_times(events)
    assert [(t.name, t.calls, t.total_us) for t in times] == [("A", 3, 55.0), ("B", 1, 30.0)]
    assert times[1].share == pytest.approx(30 / 85)


def test_serving_without_vllm_is_tandem_alone_and_without_either_refused() -> None:
    assert [s.name for s in serving.build_servers(parse(["serving"]), None)] == ["tandem"]
    with pytest.raises(SystemExit, match="nothing to run"):
        serving.build_servers(parse(["serving", "--no-tandem"]), None)


def test_cpu_serves_the_default_model_in_float32_on_both(tmp_path: Path) -> None:
    args = parse(["cpu", "--vllm-python", "/venv/bin/python", "--port", "8150"])
    tandem, vllm = cpu.build_servers(args, tmp_path)
    assert tandem.command[4:] == [
        "--model", "default", "--host", "127.0.0.1", "--port", "8150", "--max-model-len", "2048",
        "--kv-cache-memory-gb", "4", "--dtype", "float32",
    ]  # fmt: skip
    assert vllm.command[1] == "-c" and vllm.command[3:5] == ["serve", str(tmp_path)]
    assert vllm.command[-2:] == ["--dtype", "float32"] and "--load-format" not in vllm.command
    assert vllm.env["VLLM_TARGET_DEVICE"] == "cpu" and "PYTHONPATH" not in vllm.env


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "/some/folder"], "needs a random preset"),
        (["--model", "llama-8b", "--quantization", "awq"], "--quantization"),
    ],
)
def test_a_checkpoint_is_refused_where_it_cannot_be_written(
    flags: list[str], named: str, tmp_path: Path
) -> None:
    """--checkpoint writes a preset's bf16 weights: a folder or a 4-bit format is refused
    before anything is written or started."""
    args = parse(["serving", "--checkpoint", *flags])
    with pytest.raises(SystemExit, match=named):
        serving.served_model(args, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--model", "llama-8b", "--vllm-python", "python3"], True),
        (["--model", "llama-8b", "--sglang-python", "python3"], True),
        (["--model", "llama-8b", "--vllm-python", "python3", "--no-checkpoint"], False),
        (["--model", "llama-8b"], False),  # Tandem alone: its own random weights
        (["--model", "llama-8b", "--checkpoint"], True),
        (["--model", "/some/folder", "--vllm-python", "python3"], False),  # real weights already
    ],
)
def test_multi_turn_serves_one_checkpoint_beside_a_peer(flags: list[str], expected: bool) -> None:
    """Turns send the servers' own replies back, so beside a peer both serve one checkpoint
    unless told otherwise; a folder is served as it is."""
    assert multi_turn.uses_checkpoint(parse(["multi-turn", *flags])) is expected


def test_vllm_cpu_reads_the_converted_folder_without_the_kept_gguf_blocks(tmp_path: Path) -> None:
    """vLLM loads every safetensors file in its folder, and the kept blocks carry the float
    tensors' names in packed rows: its folder links every other file of the conversion."""
    from engine_core.model_dir import GGUF_BLOCKS_FILE

    converted = tmp_path / "converted"
    converted.mkdir()
    names = ["config.json", "model.safetensors", "tokenizer.json", GGUF_BLOCKS_FILE]
    for name in names:
        (converted / name).write_text(name)
    folder = cpu.float_folder(converted, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == sorted(names[:3])
    assert all((folder / n).read_text() == n for n in names[:3])
    assert cpu.float_folder(converted, tmp_path / "out") == folder  # a second run reuses it
    newer = tmp_path / "newer"  # another conversion (the cache key changed): links follow it
    newer.mkdir()
    for name in names:
        (newer / name).write_text(f"new {name}")
    assert cpu.float_folder(newer, tmp_path / "out") == folder
    assert all((folder / n).read_text() == f"new {n}" for n in names[:3])


def test_a_profiled_run_draws_prompts_no_measured_run_drew() -> None:
    """Goodput seeds each rate's prompts: its profiled run, seeded alike, would be the measured
    run's prompts again, all served by the prefix cache. It gets a seed no rate and no warm-up
    of the run has; an unseeded workload (fresh prompts each run) stays as it is."""
    from benchmarks import goodput
    from benchmarks.side_by_side import fresh_prompts

    args = parse(["goodput", "--rates", "2,4,8", "--seed", "5"])
    measured = goodput.rate_workloads(args)
    taken = {w.seed for w in measured} | {goodput.warm_up_workload(args).seed}
    for workload in measured:
        profiled = fresh_prompts(workload)
        assert profiled.seed not in taken
        assert profiled.loadgen_args() != workload.loadgen_args()
        assert profiled.num_requests == workload.num_requests and profiled.rate == workload.rate
    turns = multi_turn.workload(parse(["multi-turn"]))
    assert fresh_prompts(turns) is turns and "--seed" not in turns.loadgen_args()


def test_kernels_by_kind_name_both_servers_attention_and_products() -> None:
    """By hand, with kernel names from a Tandem and a vLLM trace: attention 10 + 20 + 5 + 8
    us, products 40 + 7 + 3 + 4, the rest 1 + 2 + 6 (Tandem's sampler staging is not its
    decode kernel, vLLM's cache write not its attention)."""
    from benchmarks.server_profile import KernelTime, by_kind, format_profile

    names = {
        "_decode_kernel": 10, "void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>": 20,
        "_decode_merge_kernel": 5, "_shared_prefix_kernel": 8, "_skinny_gemm_tma_kernel": 40,
        "nvjet_sm90_tst_128x32_64x10_2x1_v_bz_TNT": 7,
        "void cublasLt::splitKreduce_kernel<32, 16, int, float>": 3,
        "_skinny_reduce_kernel": 4, "_stage_decode_kernel": 1,
        "triton_red_fused_fused_add_rms_norm_2": 2,
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": 6,
    }  # fmt: skip
    times = [KernelTime(name, 1, float(us), us / 106) for name, us in names.items()]
    assert by_kind(times) == {"attention": 43.0, "matrix products": 54.0, "the rest": 9.0}
    head = format_profile("tandem", "w", times, "kernels").splitlines()[0]
    assert "(attention 0.0, matrix products 0.1, the rest 0.0)" in head
