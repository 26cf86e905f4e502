"""The burst trace (scripts/device/burst_trace/): its report against hand computations on made-up
records, and the tracer itself in a real engine process, where each traced name must still exist
and every request, step and finish must be recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.factories import write_tiny_llama
from tests.script_modules import SCRIPTS, load_script


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return load_script("device/burst_trace_report")


def burst_records(t0: float, http: bool) -> list[list]:
    """Two requests: read (HTTP only), taken in, a prompt step, first tokens, a decode step
    that finishes both."""
    records = [[t0 + 0.001, "http"], [t0 + 0.003, "http"]] if http else []
    records += [
        [t0 + 0.004, "add"],
        [t0 + 0.006, "add"],
        [t0 + 0.007, "step", 20, 0, 2, 0],
        [t0 + 0.010, "upd", 2, 0],
        [t0 + 0.011, "step", 0, 2, 2, 0],
        [t0 + 0.013, "upd", 0, 2],
    ]
    return records


def test_bursts_are_cut_where_the_engine_was_idle(report: ModuleType) -> None:
    records = burst_records(10.0, http=False) + burst_records(11.0, http=True)
    bursts = report.bursts(records)
    assert [len(b) for b in bursts] == [6, 8]
    assert bursts[1][0] == [11.001, "http"]


def test_aborted_requests_leave_the_burst_too(report: ModuleType) -> None:
    """One request finishes, the other is aborted (a client that left): the engine is idle, so
    the next request starts a burst."""
    records = [
        [1.000, "add"],
        [1.001, "add"],
        [1.002, "step", 10, 0, 2, 0],
        [1.004, "upd", 2, 1],
        [1.005, "abort", 1],
        [2.000, "add"],
        [2.001, "step", 5, 0, 1, 0],
    ]
    assert [len(b) for b in report.bursts(records)] == [5, 2]


def test_the_step_pace_after_the_last_first_token(report: ModuleType) -> None:
    """Steps at 10, 12, 15 and 16 ms after the last first token (9 ms): gaps 2, 3 and 1 ms."""
    plan = [(6.0, 20, 0, 2, 0), (10.0, 0, 2, 2, 0), (12.0, 0, 2, 2, 0), (15.0, 0, 2, 2, 0)]
    plan.append((16.0, 0, 2, 2, 0))
    (line,) = report.step_lines(plan, 9.0, each=False)
    assert line == "  steps 5, 1 with prompt tokens (20); then a step every 2.00 ms (median)"


def test_a_burst_summary(report: ModuleType) -> None:
    lines = [" ".join(line.split()) for line in report.summary(burst_records(0.0, True), True)]
    assert lines[:5] == [
        "--- 2 requests, HTTP",
        "HTTP request read 0/2/2 (n=2)",
        "engine took it in 3/5/5 (n=2)",
        "engine first tokens 9/9/9 (n=2)",
        "engine finishes 12/12",
    ]
    # Steps at 6 and 10 ms; the one after the last first token (9 ms) has no successor.
    assert lines[5:] == ["steps 2, 1 with prompt tokens (20)", "6: 20+0 2/0"]


def test_the_tracer_records_a_real_engine(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "model")
    out = tmp_path / "trace"
    out.mkdir()
    script = (
        "import time\n"
        "from engine_core.llm import LLM\n"
        "from protocol.messages import SamplingParams\n"
        f"llm = LLM({str(model)!r}, device='cpu', block_size=4, num_kv_blocks=64)\n"
        "three, one = SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=1)\n"
        "llm.generate([[5, 6, 7], [8, 9], [4, 4]], [three, three, one], detokenize=False)\n"
        "time.sleep(0.8)  # one dump of the tracer's thread\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "BURST_TRACE_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS / "device" / "burst_trace"), str(root)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "not traced" not in done.stderr
    (path,) = out.glob("trace-*.json")
    records = json.loads(path.read_text())
    assert sum(r[1] == "add" for r in records) == 3
    updates = [r for r in records if r[1] == "upd"]
    # Each request's first token and finish, once; the third ends at its first token.
    assert sum(r[2] for r in updates) == 3
    assert sum(r[3] for r in updates) == 3
    steps = [r for r in records if r[1] == "step"]
    assert sum(r[2] for r in steps) == 7  # the prompts' tokens (3 + 2 + 2), in prompt steps
    assert all(r[2] or r[3] for r in steps)  # no step that runs nothing
