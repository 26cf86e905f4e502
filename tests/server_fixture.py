"""Real `tandem serve` subprocesses for the HTTP tests.

``server`` (session scope) is ONE server on the default model, shared by every module that
imports it; pytest registers an imported fixture once per module, so the instance is cached here
and stopped once at the end of the session. ``keyed_server`` (module scope) is a second one with
--api-key and --no-restart-engine, for the 401 tests and for tests that take its engine down.
``tiny_server`` (session scope, cached like ``server``) serves the tiny random model with small
limits (TINY_ARGS: 4 running sequences + 8 waiting, a 16-block KV pool, 64 KiB bodies), for the
overload, KV-exhaustion, disconnect-storm and bad-input tests, which exercise the serving
machinery rather than the model.

Import both names into a test module: ``from tests.server_fixture import server  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from common.processes import die_with_parent, pid_alive

if TYPE_CHECKING:
    from protocol.client import EngineClient
    from protocol.messages import Stats

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
# The tiny model's server: small limits that the overload and storm tests push against.
TINY_MAX_NUM_SEQS = 4
TINY_MAX_WAITING = 8
TINY_KV_BLOCKS = 16  # x 16 tokens: 256 tokens in all, so a few long requests must preempt
TINY_MAX_BODY_BYTES = 64 << 10
TINY_ARGS = [
    "--max-num-seqs", str(TINY_MAX_NUM_SEQS),
    "--max-waiting-requests", str(TINY_MAX_WAITING),
    "--num-kv-blocks", str(TINY_KV_BLOCKS),
    "--max-body-bytes", str(TINY_MAX_BODY_BYTES),
]  # fmt: skip
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

    def engine_info(self) -> dict:
        """GET /v1/engine: the engine's address and pid (a new pid after a restart)."""
        return httpx.get(f"{self.base_url}/v1/engine", headers=self.headers, timeout=10).json()


def _ephemeral_port_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux's default is 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A PORT with PORT .. PORT + count - 1 free on loopback, below the ephemeral range.

    A port from bind(0) is an ephemeral one: between our check and the server's bind, any
    outgoing connection on the machine may take it (or the next one, for an engine's pair of
    sockets), and the server then dies with EADDRINUSE. Below the ephemeral range only another
    listener can take it."""
    floor = _ephemeral_port_floor()
    low, high = (20000, floor - count) if floor - count > 21000 else (1024, 65536 - count)
    # (a host whose ephemeral range starts low, or covers everything: any free port will do)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if all(_bindable(port + i) for i in range(count)):
            return port
    raise RuntimeError(f"no {count} free consecutive ports in [{low}, {high + count})")


def start_server(
    log_dir: Path,
    api_key: str | None = None,
    extra: Sequence[str] = (),
    model: str = "default",
    args: Sequence[str] = tuple(SERVE_ARGS),
    new_session: bool = False,
    cwd: Path | None = None,
) -> Server:
    """Start `tandem serve` on ``model`` and wait until /health answers 200; ``new_session``:
    in a process group of its own (for a test to signal the whole group, as systemd does);
    ``cwd``: from that folder, as the `tandem` script would start there (not on the path)."""
    port = free_port()
    python = [sys.executable, "-P"] if cwd is not None else [sys.executable]
    cmd = [*python, "-m", "frontend.cli", "serve", "--model", model, "--host",
           "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *args]  # fmt: skip
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += extra
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        # die_with_parent: a pytest run killed mid-way must not leave a server behind.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
            start_new_session=new_session, cwd=cwd,
        )  # fmt: skip
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
    engine_pid = srv.engine_pid
    if srv.process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            engine_pid = srv.engine_info()["pid"] or engine_pid  # restarted: a new pid
    stop_process(srv.process)
    assert srv.process.returncode == 0, srv.log_tail()
    assert not pid_alive(engine_pid), "the engine core outlived tandem serve"


def wait_engine_idle(server: Server, timeout: float = 20.0) -> None:
    """wait_address_idle on the server's engine core."""
    wait_address_idle(server.engine_address, timeout)


def wait_address_idle(address: str, timeout: float = 20.0) -> Stats:
    """Poll the engine at ``address`` over raw ZMQ until no request is left and every KV block
    is free, check the block manager's integrity, and return the idle engine's counters."""
    from protocol.client import EngineClient
    from protocol.messages import ControlKind

    with EngineClient(address) as client:
        client.connect(timeout=30)
        deadline = time.monotonic() + timeout
        while True:
            stats = client.control(ControlKind.STATS).stats
            idle = stats.num_running == 0 and stats.num_waiting == 0
            free = stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
            if idle and free:
                break
            assert time.monotonic() < deadline, f"{address} not idle after {timeout} s: {stats}"
            time.sleep(0.1)
        assert client.control(ControlKind.CHECK_INTEGRITY).ok
        return stats


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


_SHARED: dict[str, Server] = {}


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One `tandem serve` on the default model for the whole session."""
    if "default" not in _SHARED:
        _SHARED["default"] = start_server(tmp_path_factory.mktemp("serve"))
        request.addfinalizer(lambda: stop_server(_SHARED.pop("default")))
    return _SHARED["default"]


@pytest.fixture(scope="session")
def tiny_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Server:
    """One `tandem serve` on the tiny random model with TINY_ARGS, for the whole session."""
    if "tiny" not in _SHARED:
        log_dir = tmp_path_factory.mktemp("serve-tiny")
        _SHARED["tiny"] = start_server(log_dir, model=str(tiny_model_dir), args=TINY_ARGS)
        request.addfinalizer(lambda: stop_server(_SHARED.pop("tiny")))
    return _SHARED["tiny"]


def frontend_gauges(server: Server) -> dict[str, float]:
    """The frontend's own state from /metrics: sequences admitted (and the peak and limit) and
    engine requests it routes outputs for."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        family.name: family.samples[0].value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("tandem_frontend_") and family.samples
    }


def wait_frontend_idle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until the frontend holds no admitted sequence and routes no request."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = frontend_gauges(server)
        if gauges["tandem_frontend_sequences_admitted"] == 0 and (
            gauges["tandem_frontend_engine_requests"] == 0
        ):
            return gauges
        assert time.monotonic() < deadline, f"frontend state left after {timeout} s: {gauges}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server that requires API_KEY; tests may stall or kill its engine, which it
    gives up on after KEYED_ENGINE_TIMEOUT_S of silence and, a killed one, does not restart."""
    extra = ["--engine-timeout", str(KEYED_ENGINE_TIMEOUT_S), "--no-restart-engine"]
    srv = start_server(tmp_path_factory.mktemp("serve-keyed"), api_key=API_KEY, extra=extra)
    try:
        yield srv
    finally:
        stop_server(srv)


def outputs_of(client: EngineClient, expected: set[str], timeout: float = 300) -> dict[str, list]:
    """Read StepOutputs until every expected id has finished: id -> its RequestOutputs (an end
    without tokens, an abort, as an output without tokens, as split_outputs gives it)."""
    from protocol.client import split_outputs
    from protocol.messages import RequestError, StepOutputs

    outputs: dict[str, list] = {rid: [] for rid in expected}
    pending = set(expected)
    deadline = time.monotonic() + timeout
    while pending:
        assert time.monotonic() < deadline, f"requests never finished: {sorted(pending)[:5]}"
        msg = client.recv(timeout=1.0)
        if isinstance(msg, RequestError):
            raise AssertionError(f"engine error for {msg.request_id}: {msg.message}")
        if not isinstance(msg, StepOutputs):
            continue
        for rid, out in split_outputs(msg):
            outputs[rid].append(out)
            if out.finish_reason is not None:
                pending.discard(rid)
    return outputs
