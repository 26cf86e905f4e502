"""The load generator for real: a live `tandem serve` on the default model, over both OpenAI
HTTP routes and over raw ZMQ to the engine behind it.

Invariants checked on every run: each request sent has exactly one record, all of them
completed, with EOS ignored each produced exactly the tokens asked for, the timestamps are in
order, the summary adds up to the records, and afterwards the engine holds no request and no KV
block. A run with one impossible request shows a failure is counted, not lost.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from frontend.cli import main as tandem_main

# Fixtures are parameters named like the imported fixture, hence F811 off for this file.
# ruff: noqa: F811
from tests.server_fixture import MAX_MODEL_LEN, Server, server, wait_engine_idle  # noqa: F401

pytestmark = pytest.mark.slow

N, IN, OUT = 8, 16, 8  # requests, prompt tokens, output tokens: seconds on the CPU engine
SMALL = ["-n", str(N), "--input-len", str(IN), "--output-len", str(OUT), "--ignore-eos",
         "--no-progress", "--request-timeout", "300"]  # fmt: skip
REPO = Path(__file__).resolve().parents[1]


def bench(argv: list[str], out: Path) -> tuple[int, dict[str, Any]]:
    """`tandem bench ARGV --result-json OUT` in this process; its exit status and JSON."""
    rc = tandem_main(["bench", *argv, "--result-json", str(out)])
    return rc, json.loads(out.read_text())


def check_complete_run(doc: dict[str, Any], prompt_len: int | None) -> list[dict[str, Any]]:
    """Every request accounted for and completed with OUT tokens; returns the records."""
    (run,) = doc["runs"]
    reqs, s = run["requests"], run["summary"]
    assert len(reqs) == N and len({r["request_id"] for r in reqs}) == N
    assert (s["num_requests"], s["completed"], s["failed"]) == (N, N, 0), s["errors"]
    for r in reqs:
        assert r["ok"] and r["error"] is None
        assert r["output_tokens"] == OUT and r["finish_reason"] == "length"
        if prompt_len is not None:
            assert r["prompt_len"] == prompt_len
        times = [r["scheduled_at"], r["submitted_at"], *r["chunk_times"], r["ended_at"]]
        assert times == sorted(times), times
        assert 1 <= len(r["chunk_times"]) <= OUT  # a chunk may carry several tokens
    assert s["total_output_tokens"] == N * OUT
    assert s["total_input_tokens"] == sum(r["prompt_len"] for r in reqs)
    assert s["ttft"]["count"] == N and s["tpot"]["count"] == N
    assert s["itl"]["count"] == sum(len(r["chunk_times"]) - 1 for r in reqs)
    return reqs


def test_openai_completions_text_and_token_ids(server: Server, tmp_path: Path) -> None:
    url = ["--url", server.base_url]
    rc, doc = bench(["--backend", "openai-completions", *url, *SMALL], tmp_path / "text.json")
    assert rc == 0
    # Random ids decoded to text and re-encoded by the server: about IN tokens, not exactly.
    check_complete_run(doc, None)
    wait_engine_idle(server)
    rc, doc = bench(
        ["--backend", "openai-completions", "--pretok", *url, *SMALL], tmp_path / "ids.json"
    )
    assert rc == 0 and doc["config"]["pretok"] is True
    check_complete_run(doc, IN)  # ids go through as they are
    wait_engine_idle(server)


def test_openai_chat(server: Server, tmp_path: Path) -> None:
    argv = ["--backend", "openai-chat", "--url", server.base_url, *SMALL, "--max-concurrency", "4"]
    rc, doc = bench(argv, tmp_path / "chat.json")
    assert rc == 0
    reqs = check_complete_run(doc, None)
    assert all(r["prompt_len"] > IN for r in reqs)  # the chat template adds its own tokens
    wait_engine_idle(server)


def test_zmq_through_python_m_loadgen(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "zmq.json"
    cmd = [sys.executable, "-m", "loadgen", "--backend", "zmq",
           "--address", server.engine_address, *SMALL, "--request-rate", "20",
           "--result-json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Successful requests:" in proc.stdout and "Median TTFT (ms):" in proc.stdout
    reqs = check_complete_run(json.loads(out.read_text()), IN)
    # Straight from the engine: one step, one chunk, one token.
    assert all(len(r["chunk_times"]) == OUT for r in reqs)
    wait_engine_idle(server)


def test_zmq_with_an_output_interval_gets_runs_of_tokens(server: Server, tmp_path: Path) -> None:
    interval = 3
    argv = ["--backend", "zmq", "--url", server.base_url, "--output-interval", str(interval)]
    rc, doc = bench([*argv, *SMALL], tmp_path / "runs.json")
    assert rc == 0
    reqs = check_complete_run(doc, IN)
    # The first token alone, then runs of 3, then the rest with the end: 1 + 3 + 3 + 1.
    assert all(len(r["chunk_times"]) == 1 + math.ceil((OUT - 1) / interval) for r in reqs)
    wait_engine_idle(server)


@pytest.mark.parametrize("backend", ["openai-completions", "zmq"])
def test_a_failed_request_is_counted_not_lost(server: Server, tmp_path: Path, backend: str) -> None:
    """Three requests, one with a prompt longer than the model's context: two complete, one
    fails with the server's reason, and the exit status says so."""
    data = tmp_path / "d.jsonl"
    lines = [{"prompt_token_ids": [100 + i] * 8, "output_len": 2} for i in range(2)]
    lines.append({"prompt_token_ids": [7] * (MAX_MODEL_LEN + 10), "output_len": 2})
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["--backend", backend, "--url", server.base_url, "--dataset", str(data), "-n", "3",
            "--no-progress", "--request-timeout", "300"]  # fmt: skip
    if backend == "openai-completions":
        argv.append("--pretok")
    rc, doc = bench(argv, tmp_path / "out.json")
    assert rc == 1
    (run,) = doc["runs"]
    s = run["summary"]
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    (bad,) = [r for r in run["requests"] if not r["ok"]]
    assert bad["prompt_len"] == MAX_MODEL_LEN + 10 and bad["error"]
    assert s["errors"] == {bad["error"]: 1}
    assert all(r["output_tokens"] == 2 for r in run["requests"] if r["ok"])
    wait_engine_idle(server)


def test_client_processes_share_one_run(server: Server, tmp_path: Path) -> None:
    """Two client processes send one run between them; the parent gets every record back, on
    one timeline (no record ends before its first token), each complete."""
    argv = ["--backend", "openai-completions", "--url", server.base_url, "--client-processes", "2"]
    rc, doc = bench([*argv, *SMALL], tmp_path / "pool.json")
    assert rc == 0
    reqs = check_complete_run(doc, None)
    starts = sorted(r["submitted_at"] for r in reqs)
    assert starts[-1] - starts[0] < 5.0  # both processes sent at once, on a shared clock
    wait_engine_idle(server)


def test_client_processes_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    rc = tandem_main(["bench", "--backend", "zmq", "--client-processes", "2"])
    assert rc == 2
    rc = tandem_main(["bench", "--client-processes", "2", "--request-rate", "5"])
    assert rc == 2
    rc = tandem_main(["bench", "--backend", "openai-chat", "--output-interval", "16"])
    assert rc == 2  # over HTTP the server's --stream-interval sets it
    rc = tandem_main(["bench", "--backend", "zmq", "--output-interval", "0"])
    assert rc == 2


COMPLETED = "tandem_request_success_total"  # counted by finish reason: aborts too


def counted(server: Server, name: str) -> float:
    """A counter of the server's /metrics, summed over its labels; the request counter's
    completions only (finished by a stop or the length, not aborted or failed)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    samples = [s for s in samples if s.name == name]
    if name == COMPLETED:
        samples = [s for s in samples if s.labels.get("finished_reason") in ("stop", "length")]
    return sum(s.value for s in samples)


def requests_finished(server: Server) -> float:
    """The server's count of completed requests."""
    return counted(server, COMPLETED)


def processes_marked(marker: str) -> list[int]:
    """The pids of the live processes started with ``marker`` in their environment (a load
    generator from start_loadgen, and its client processes)."""
    entry_wanted, pids = f"LOADGEN_TEST_MARK={marker}".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if entry_wanted in environ.split(b"\0") and state != "Z":
            pids.append(int(entry.name))
    return pids


def start_loadgen(cmd: list[str], marker: str) -> subprocess.Popen[str]:
    """The load generator as from a terminal: the leader of its own process group (Ctrl-C is
    sent to the group: ctrl_c), SIGINT handled (a pytest-xdist worker's children inherit it
    ignored), its environment marked for processes_marked."""
    env = {**os.environ, "LOADGEN_TEST_MARK": marker}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), start_new_session=True,
    )  # fmt: skip


def ctrl_c(proc: subprocess.Popen[str]) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground group."""
    os.killpg(proc.pid, signal.SIGINT)


def wait_for_count(
    server: Server,
    proc: subprocess.Popen[str],
    count: float,
    name: str = "tandem_request_success_total",
) -> None:
    """Wait (the load generator still running) until the server's counter ``name`` reaches
    ``count``."""
    deadline = time.monotonic() + 120
    while counted(server, name) < count:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)


@pytest.mark.parametrize(
    "arrivals",
    [["--interval", "0.5"], [], ["--client-processes", "2"]],
    ids=["while-sending", "all-sent", "client-processes"],
)
def test_ctrl_c_reports_the_requests_that_had_ended(
    server: Server, tmp_path: Path, arrivals: list[str]
) -> None:
    """SIGINT in the middle of a run, once the server has finished a few of its requests (while
    the run still sends, or with all sent and in flight, or from two client processes): exit
    130, the cut run printed and written with the records of the requests that had ended (each
    complete), none of those cut short; no client process left; the server holds nothing
    afterwards."""
    out, total, marker = tmp_path / "cut.json", 40, f"cut-{os.getpid()}-{time.monotonic_ns()}"
    before = requests_finished(server)
    cmd = [sys.executable, "-m", "loadgen", "--backend", "openai-completions",
           "--url", server.base_url, *SMALL[2:], "-n", str(total), *arrivals,
           "--warmup-runs", "0", "--result-json", str(out)]  # fmt: skip
    proc = start_loadgen(cmd, marker)
    try:
        wait_for_count(server, proc, before + 3)
        ctrl_c(proc)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout[-3000:] + stderr[-3000:]
    assert processes_marked(marker) == []
    assert "INTERRUPTED: the " in stdout and f"of {total} requests that had ended" in stdout
    assert "loadgen: interrupted; the runs up to it are reported above" in stderr
    (run,) = json.loads(out.read_text())["runs"]
    reqs, s = run["requests"], run["summary"]
    assert run["interrupted"] is True
    assert 3 <= len(reqs) < total and s["num_requests"] == len(reqs)
    assert (s["completed"], s["failed"]) == (len(reqs), 0), s["errors"]
    assert all(r["ok"] and r["output_tokens"] == OUT for r in reqs)
    assert s["total_output_tokens"] == OUT * len(reqs)
    assert len(reqs) <= requests_finished(server) - before
    wait_engine_idle(server)


def test_client_processes_end_with_their_parent(server: Server, tmp_path: Path) -> None:
    """The load generator killed outright in a run (SIGKILL: nothing of it runs again): its
    client processes, which a terminal's Ctrl-C does not reach, end too, within seconds, not
    after sending their shares; the server holds nothing afterwards."""
    marker = f"orphans-{os.getpid()}-{time.monotonic_ns()}"
    before = requests_finished(server)
    tokens_before = counted(server, "tandem_generation_tokens_total")
    # Long enough (tens of seconds on the CPU engine) that shares sent to the end outlast the
    # wait below.
    cmd = [sys.executable, "-m", "loadgen", "--backend", "openai-completions",
           "--url", server.base_url, "--input-len", str(IN), "--output-len", "256",
           "--ignore-eos", "--no-progress", "-n", "40", "--client-processes", "2",
           "--warmup-runs", "0"]  # fmt: skip
    proc = start_loadgen(cmd, marker)
    try:
        # The first requests running, none near its end (256 tokens each).
        wait_for_count(server, proc, tokens_before + 40 * 8, "tandem_generation_tokens_total")
        assert len(processes_marked(marker)) == 3  # the parent and its two client processes
        proc.kill()
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while processes_marked(marker):
            assert time.monotonic() < deadline, processes_marked(marker)
            time.sleep(0.1)
    finally:
        proc.kill()
    assert requests_finished(server) < before + 40  # not all sent to the end
    wait_engine_idle(server)
