"""Real `tandem serve` subprocesses for the HTTP tests.

``server`` (session scope) is ONE server on the default model, shared by every module that
imports it; pytest registers an imported fixture once per module, so the instance is cached here
and stopped once at the end of the session. ``keyed_server`` (module scope) is a second one with
--api-key, for the 401 tests and for tests that take its engine down.

Import both names into a test module: ``from tests.server_fixture import server  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from frontend.launcher import die_with_parent

MAX_MODEL_LEN = 2048
# Small KV cache: 256 blocks x 16 tokens = 4096 tokens, two full-length sequences.
SERVE_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-kv-blocks",
    "256",
    "--max-num-seqs",
    "16",
]
START_TIMEOUT_S = 300.0
API_KEY = "test-key-123"
KEYED_ENGINE_TIMEOUT_S = 3.0


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None
    engine_address: str  # the engine core's raw ZMQ address (from GET /v1/engine)
    engine_pid: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, api_key: str | None = None, extra: Sequence[str] = ()) -> Server:
    """Start `tandem serve` on the default model and wait until /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", "default", "--host",
           "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *SERVE_ARGS]  # fmt: skip
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += extra
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        # die_with_parent: a pytest run killed mid-way must not leave a server behind.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent()
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        info = httpx.get(f"{base}/v1/engine", headers=headers, timeout=10).json()
    except BaseException:
        stop_process(proc)
        raise
    return Server(base, api_key, info["address"], info["pid"], proc, log_path)


def wait_healthy(base: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"tandem serve exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"tandem serve not healthy within {START_TIMEOUT_S:.0f} s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_server(srv: Server) -> None:
    """SIGTERM, as a user would; the server must exit cleanly and take its engine with it."""
    stop_process(srv.process)
    assert srv.process.returncode == 0, srv.log_tail()
    assert not pid_alive(srv.engine_pid), "the engine core outlived tandem serve"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


def wait_engine_idle(server: Server, timeout: float = 20.0) -> None:
    """Poll the engine over raw ZMQ until no request is left and every KV block is free."""
    from protocol.client import EngineClient
    from protocol.messages import ControlKind

    with EngineClient(server.engine_address) as client:
        client.connect(timeout=30)
        deadline = time.monotonic() + timeout
        while True:
            stats = client.control(ControlKind.STATS).stats
            idle = stats.num_running == 0 and stats.num_waiting == 0
            free = stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
            if idle and free:
                break
            assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {stats}"
            time.sleep(0.1)
        assert client.control(ControlKind.CHECK_INTEGRITY).ok


_SHARED: dict[str, Server] = {}


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One `tandem serve` on the default model for the whole session."""
    if "default" not in _SHARED:
        _SHARED["default"] = start_server(tmp_path_factory.mktemp("serve"))
        request.addfinalizer(lambda: stop_server(_SHARED.pop("default")))
    return _SHARED["default"]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server that requires API_KEY; tests may stall or kill its engine, which it
    gives up on after KEYED_ENGINE_TIMEOUT_S of silence."""
    extra = ["--engine-timeout", str(KEYED_ENGINE_TIMEOUT_S)]
    srv = start_server(tmp_path_factory.mktemp("serve-keyed"), api_key=API_KEY, extra=extra)
    try:
        yield srv
    finally:
        stop_server(srv)
