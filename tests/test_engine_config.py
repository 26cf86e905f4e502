"""Engine limits that cannot work together are refused up front, with a message naming them,
by the config and by every command that takes them (vLLM refuses the same)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_core.config import EngineConfig


def test_a_token_budget_below_the_sequence_cap_is_refused() -> None:
    """Each running sequence takes a token of every step's budget: below the cap, the last
    decodes of a full batch would stall and nothing new would be admitted."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\).*max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    EngineConfig(max_num_seqs=16, max_num_batched_tokens=16)  # equal is fine


@pytest.mark.parametrize("name", ["block_size", "max_num_seqs", "max_num_batched_tokens"])
def test_limits_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be at least 1"):
        EngineConfig(**{name: 0})


@pytest.mark.parametrize("command", ["serve", "engine", "generate"])
def test_commands_refuse_it_with_the_message_and_no_traceback(command: str) -> None:
    extra = ["--prompt", "hi"] if command == "generate" else []
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", command, "--max-num-seqs", "16",
         "--max-num-batched-tokens", "8", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "max_num_batched_tokens (8) must be greater than or equal to max_num_seqs (16)" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_engine_flags_with_a_remote_engine_are_refused() -> None:
    """With --engine ADDRESS nothing is started here: an engine flag would be silently ignored
    (the remote engine runs with its own), so it is refused, naming it."""
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--engine", "tcp://127.0.0.1:9",
         "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--max-num-seqs: engine flags set up an engine core that tandem serve starts" in (
        result.stderr
    )


def test_a_negative_prefill_graph_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_prefill_graph_tokens must be 0"):
        EngineConfig(max_prefill_graph_tokens=-1)
    EngineConfig(max_prefill_graph_tokens=0)  # 0 turns prefill graphs off


def test_an_unknown_tp_all_reduce_is_refused() -> None:
    with pytest.raises(ValueError, match="--tp-all-reduce 'custom' is not supported; choose one"):
        EngineConfig(tp_all_reduce="custom")
    for value in ("auto", "nccl"):
        EngineConfig(tp_all_reduce=value)
