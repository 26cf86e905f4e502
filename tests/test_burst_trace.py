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
        "llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True),"
        " detokenize=False)\n"
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
    assert sum(r[1] == "add" for r in records) == 2
    updates = [r for r in records if r[1] == "upd"]
    assert sum(r[2] for r in updates) == 2  # each request's first token, once
    assert sum(r[3] for r in updates) == 2  # each request's finish, once
    steps = [r for r in records if r[1] == "step"]
    assert sum(r[2] for r in steps) == 5  # the two prompts' tokens (3 + 2), in prompt steps
