"""The speculative benchmark (benchmarks/speculative.py): its summary arithmetic by hand, and a
short run on the tiny random model that must print its table with the same tokens both ways."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.speculative import Timing, summarize
from protocol.messages import EngineCounts


def test_the_summary_counts_drafts_kept_and_tokens_a_step() -> None:
    before = EngineCounts(spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=20)
    after = EngineCounts(spec_drafts=30, spec_draft_tokens=120, spec_accepted_tokens=80)
    plain = [Timing([1, 2, 3], 0.1, 0.020), Timing([1, 2, 3], 0.1, 0.030)]
    spec = [Timing([1, 2, 3], 0.1, 0.010), Timing([1, 2, 3], 0.1, 0.010)]
    out = summarize("p", plain, spec, after, before, same=True)
    assert out["tpot_ms"] == pytest.approx(25.0) and out["spec_tpot_ms"] == pytest.approx(10.0)
    assert out["speedup"] == pytest.approx(2.5)
    assert out["drafts_per_step"] == pytest.approx(80 / 20)  # draft tokens a drafted step
    assert out["kept"] == pytest.approx(60 / 80)
    assert out["tokens_per_step"] == pytest.approx(1 + 60 / 20)


@pytest.mark.slow
def test_a_short_run_prints_its_table(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["speculative", "--model", str(tiny_model_dir), "--runs", "1", "--max-tokens", "24"]
    assert main(argv) == 0  # 0: the same tokens with drafts and without, for every prompt
    printed = capsys.readouterr().out
    assert "command: python -m benchmarks speculative --model" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "edit" in line]
    assert len(rows) == 2 and all(line.rstrip().endswith("yes |") for line in rows)


def test_the_verify_summary_splits_a_step_into_its_parts() -> None:
    from benchmarks.speculative_verify import Run
    from benchmarks.speculative_verify import summarize as verify_summary

    plain = Run([[1, 2, 3]], tpots=[0.010], steps=[0.010, 0.011, 0.009])
    spec = Run([[1, 2, 3]], [0.004], [0.020, 0.020], [0.006], [0.002], drafted=8, kept=6)
    spec.verify_forwards, spec.verify_replays = [0.003, 0.001, 0.002], 2
    out = verify_summary("m", 8, plain, spec, k=4)
    assert out["verify_forward_ms"] == pytest.approx(2.0)
    assert (out["verify_steps"], out["verify_replays"]) == (3, 2)
    assert out["step_ms"] == pytest.approx(10.0) and out["spec_step_ms"] == pytest.approx(20.0)
    assert out["verify_ms"] == pytest.approx(20.0 - 6.0 - 2.0)
    assert out["verify_over_step"] == pytest.approx(1.2)
    assert out["speedup"] == pytest.approx(2.5)
    assert out["tokens_per_step"] == pytest.approx((3 - 1) / 2) and out["same_tokens"]
    assert out["kept"] == pytest.approx(6 / 8)


@pytest.mark.slow
def test_the_verify_benchmark_runs_the_model_as_its_own_draft(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Every draft kept: 1 + 5 + 5 + 5 + 5 tokens, K + 1 = 5 a step after the first."""
    import json

    out = tmp_path / "verify.json"
    argv = ["speculative-verify", "--models", str(tiny_model_dir), "--device", "cpu",
            "--batches", "1,3", "--max-tokens", "21", "--prompt-tokens", "16",
            "--num-kv-blocks", "256", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0  # 0: the same tokens with drafts and without
    assert "command: python -m benchmarks speculative-verify" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in results] == [1, 3]
    assert all(r["same_tokens"] and r["tokens_per_step"] == 5.0 for r in results)
    assert all(r["kept"] == 1.0 for r in results)
    # Every step after the first token verifies 5 positions a row (timed); no graphs on the CPU.
    assert all(r["verify_steps"] >= 4 and r["verify_replays"] == 0 for r in results)


@pytest.mark.slow
def test_the_verify_benchmark_runs_a_random_eagle3_head(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--method eagle3``: a random head written at the model's shape drafts (eagerly on the
    CPU), and the outputs are still the plain engine's."""
    import json

    from tests.factories import write_tiny_llama

    model = write_tiny_llama(tmp_path / "llama", vocab_size=49152, num_layers=4)
    out = tmp_path / "verify.json"
    argv = ["speculative-verify", "--method", "eagle3", "--models", str(model), "--device",
            "cpu", "--batches", "2", "--max-tokens", "12", "--prompt-tokens", "16", "--k", "3",
            "--num-kv-blocks", "128", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0  # 0: the same tokens with drafts and without
    assert "a random EAGLE-3 head" in capsys.readouterr().out
    (result,) = json.loads(out.read_text())["results"]
    assert result["same_tokens"] and result["eager_draft_forwards"] > 0
    assert result["proposal_ms"] > 0 and result["draft_alongside_ms"] > 0
