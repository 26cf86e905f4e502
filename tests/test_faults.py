"""Process faults under a live `tandem serve` on the tiny model: the engine core is SIGKILLed
(requests in flight fail cleanly, /health goes 503 then 200 once a new engine core is up, new
requests succeed), and the frontend is SIGKILLed (its engine core exits on its own). The
no-restart mode is covered in test_http_errors.py (keyed_server runs --no-restart-engine)."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.address import private_ipc_address, remove_ipc_files
from protocol.client import EngineClient
from protocol.messages import ControlKind
from tests.server_fixture import (
    TINY_ARGS,
    Server,
    pid_alive,
    start_server,
    stop_process,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow

# 500 tokens take seconds even on the tiny model: the requests are surely running when killed.
LONG = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
# The last flag wins: room for 3 x 502 tokens. No resumes: these tests are about what the
# client sees when requests do fail with their engine (test_resume.py covers resuming).
FAULT_ARGS = [*TINY_ARGS, "--num-kv-blocks", "128", "--max-request-resumes", "0"]
RESTART_TIMEOUT_S = 120.0
ORPHAN_TIMEOUT_S = 15.0  # the engine polls its parent every second, then has 5 s to stop


@pytest.fixture(scope="module")
def fault_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Server]:
    """A server of its own (restart on, the default): these tests kill its processes."""
    log_dir = tmp_path_factory.mktemp("serve-faults")
    srv = start_server(log_dir, model=str(tiny_model_dir), args=FAULT_ARGS)
    try:
        yield srv
    finally:
        engine_pid = srv.engine_pid
        stop_process(srv.process)
        if pid_alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def running(raw: EngineClient) -> int:
    return raw.control(ControlKind.STATS).stats.num_running


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def metric(srv: Server, name: str) -> float:
    for line in httpx.get(f"{srv.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class HealthWatcher:
    """Polls /health in a thread and keeps the sequence of distinct statuses it saw."""

    def __init__(self, srv: Server) -> None:
        self.url = f"{srv.base_url}/health"
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status = httpx.get(self.url, timeout=10).status_code
            except httpx.HTTPError:
                status = -1  # no answer at all: would fail the test below
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            time.sleep(0.02)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.seen


def test_engine_sigkill_fails_requests_then_a_new_engine_serves(fault_server: Server) -> None:
    srv = fault_server
    url = f"{srv.base_url}/v1/completions"
    results: dict[str, Any] = {}

    def whole() -> None:
        results["whole"] = httpx.post(url, json=LONG, timeout=60)

    def streamed(key: str) -> None:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
            results[key] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=whole)]
    threads += [threading.Thread(target=streamed, args=(f"stream{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    with EngineClient(srv.engine_address) as raw:
        raw.connect(timeout=30)
        wait_until(lambda: running(raw) == 3, 60, "three requests running")
    old_pid = srv.engine_info()["pid"]
    health = HealthWatcher(srv)
    os.kill(old_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a request hung after the engine died"

    # In flight: a 503 in the OpenAI shape with Retry-After, or a final SSE error event.
    r = results["whole"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down", r.text
    assert int(r.headers["Retry-After"]) > 0
    for key in ("stream0", "stream1"):
        events = results[key]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "engine_down"

    # /health: 503 while the engine is down, 200 once the new one has shaken hands.
    wait_until(lambda: health.seen[-1:] == [200] and 503 in health.seen, RESTART_TIMEOUT_S,
               "health back to 200 after a 503")  # fmt: skip
    seen = health.stop()
    assert seen[seen.index(503) :][-1] == 200, seen
    new_pid = srv.engine_info()["pid"]
    assert new_pid != old_pid and pid_alive(new_pid) and not pid_alive(old_pid)
    assert metric(srv, "tandem_engine_restarts_total") == 1

    # Served again, streamed and not; the new engine holds nothing afterwards.
    short = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(url, json=short, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", url, json={**short, "stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    wait_engine_idle(srv)


def test_killed_serve_takes_its_engine_down(fault_server: Server) -> None:
    """SIGKILL: no cleanup code runs in `tandem serve`; the engine goes within seconds. (The
    next test shows the engine's own parent poll without the death signal.)"""
    srv = fault_server
    engine_pid = srv.engine_info()["pid"]
    cmdline = Path(f"/proc/{engine_pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[cmdline.index(b"--parent-pid") + 1] == str(srv.process.pid).encode()
    srv.process.kill()
    srv.process.wait()
    wait_until(lambda: not pid_alive(engine_pid), ORPHAN_TIMEOUT_S, "engine exit")


_PARENT = """
import subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-m", "frontend.cli", "engine", "--model", sys.argv[1],
                           "--address", sys.argv[2], "--parent-pid", str(__import__("os").getpid()),
                           "--log-level", "WARNING"])
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_engine_exits_when_its_parent_vanishes_without_a_death_signal(
    tiny_model_dir: Path,
) -> None:
    """A parent that sets no PR_SET_PDEATHSIG (as on macOS, or with a wrapper in between): the
    engine's --parent-pid poll alone must notice and exit."""
    address = private_ipc_address()
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tiny_model_dir), str(address)],
        stdout=subprocess.PIPE,
        text=True,
    )
    engine_pid = int(parent.stdout.readline())
    try:
        with EngineClient(address) as client:
            client.connect(timeout=120)  # up and serving
        parent.kill()
        parent.wait()
        wait_until(lambda: not pid_alive(engine_pid), ORPHAN_TIMEOUT_S, "orphaned engine exit")
    finally:
        if pid_alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
        remove_ipc_files(address)
