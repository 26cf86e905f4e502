"""The decode benchmark's pure parts: its client-side metrics against hand computations, the
`tandem engine` flags of its raw-ZMQ path, its workload and the checks of its flags."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.__main__ import parse
from benchmarks.decode import (
    Workload,
    check_args,
    engine_config,
    engine_flags,
    summarize,
    token_gaps,
)


def test_tokens_that_arrive_together_split_their_gap() -> None:
    # Arrivals at 1 s (one token), 2 s (two tokens), 4 s (one token).
    assert token_gaps([1.0, 2.0, 2.0, 4.0]) == [0.5, 0.5, 2.0]
    assert token_gaps([3.0]) == []


def test_itl_is_the_steady_step_despite_a_prefill_stall() -> None:
    # Request a: tokens every 10 ms but one 500 ms stall; request b: every 10 ms.
    a = [0.1, 0.11, 0.12, 0.62, 0.63, 0.64]
    b = [0.62, 0.63, 0.64, 0.65, 0.66, 0.67]
    run = summarize("inproc", 0.0, [a, b])
    assert run.itl_p50_ms == pytest.approx(10.0)
    assert run.tpot_p50_ms == pytest.approx((108.0 + 10.0) / 2)  # (540/5 + 50/5) / 2
    assert run.ttft_p50_ms == pytest.approx(360.0)
    assert run.tok_s == pytest.approx(12 / 0.67)
    assert (run.output_tokens, run.duration_s) == (12, pytest.approx(0.67))


def test_workload_prompts_are_seeded_and_inside_the_vocabulary() -> None:
    work = Workload(3, 5, 7, seed=4)
    prompts = work.prompts(100)
    assert prompts == work.prompts(100) and len(prompts) == 3
    assert all(len(p) == 5 and all(3 <= t < 100 for t in p) for p in prompts)
    assert work.warmup().prompts(100) != prompts and work.warmup().output_len == 7
    assert work.mean_context == 5 + 3.5
    params = work.params()
    assert (params.max_tokens, params.temperature, params.ignore_eos) == (7, 0.0, True)


def args(*flags: str) -> argparse.Namespace:
    return parse(["decode", *flags])


def test_engine_sized_for_the_workload() -> None:
    config = engine_config("llama-1b", Workload(64, 128, 256), args("--device", "cpu"))
    assert config.model == "random:llama-1b" and config.max_model_len == 4096
    # (128 + 256) / 16 = 24 blocks a sequence, one spare, twice over for 64 sequences.
    assert config.num_kv_blocks == 2 * 64 * 25
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 8192)


def test_the_raw_zmq_engine_gets_exactly_the_in_process_config() -> None:
    from engine_core.args import add_engine_args, engine_config_from_args

    flags = args("--device", "cpu", "--no-overlap", "--quantization", "fp8", "--enforce-eager")
    # 2 x 8 x (2 + 1) blocks for the workload, but at least one sequence of 4,096 tokens.
    config = engine_config("smollm2-135m", Workload(8, 16, 4), flags)
    assert engine_flags(config) == [
        "--model=random:smollm2-135m", "--device=cpu", "--max-model-len=4096",
        "--num-kv-blocks=256", "--max-num-seqs=8", "--max-num-batched-tokens=8192",
        "--enforce-eager", "--no-async-scheduling", "--quantization=fp8",
    ]  # fmt: skip
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(engine_flags(config))) == config


def test_flags_are_checked_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match="unknown preset"):
        check_args(args("--models", "llama-1b,llama-70b"))
    with pytest.raises(SystemExit, match="--paths"):
        check_args(args("--paths", "inproc,http"))
    with pytest.raises(SystemExit, match="--paths inproc"):
        check_args(args("--models", "qwen3-30b-a3b", "--routing", "uniform"))
    check_args(args("--models", "qwen3-30b-a3b", "--routing", "uniform", "--paths", "inproc"))
    with pytest.raises(SystemExit, match="--lora takes a number"):
        check_args(args("--lora", "-1", "--paths", "inproc"))
    with pytest.raises(SystemExit, match="--lora-rank 8: .* with --lora N"):
        check_args(args("--lora-rank", "8", "--paths", "inproc"))  # a rank, but no adapters
    with pytest.raises(SystemExit, match="--lora-rank 0"):
        check_args(args("--lora", "2", "--lora-rank", "0", "--paths", "inproc"))
    with pytest.raises(SystemExit, match="--paths inproc"):
        check_args(args("--lora", "2"))
