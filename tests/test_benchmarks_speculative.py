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
