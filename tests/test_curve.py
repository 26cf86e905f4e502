"""Engine sockets over tcp:// with ZMQ CURVE: only a client whose public key the engine lists, and
which expects the engine's own public key, ever gets READY; everyone else's handshake times out.
Non-loopback addresses are refused without keys. First on the transport double (EchoEngine),
then end to end: `tandem engine --listen tcp://...` with keys, `tandem client` and
`tandem serve --engine tcp://...` (the short form of --remote-engine --engine-address)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from frontend.cli import main as tandem
from protocol.address import EngineAddress
from protocol.client import AsyncEngineClient, EngineClient
from protocol.curve import (
    CurveClientKeys,
    create_key_pair,
    load_client_keys,
    load_key_pair,
    load_server_keys,
)
from tests.server_fixture import free_port, pid_alive, stop_process, wait_healthy
from tests.test_client_sockets import PARAMS, READY, EchoEngine, collect

REFUSED_TIMEOUT_S = 2.0  # a refused client never gets READY; this is how long we wait for it


@dataclass
class Keys:
    engine_secret: Path
    engine_public: Path
    authorized: Path  # the engine's directory of client public keys
    good_secret: Path  # a client whose public key is in ``authorized``
    stranger_secret: Path  # a client the engine does not know

    def client(self, secret: Path | None = None, server: Path | None = None) -> CurveClientKeys:
        return load_client_keys(secret or self.good_secret, server or self.engine_public)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    root = tmp_path_factory.mktemp("curve")
    engine_public, engine_secret = create_key_pair(root / "engine", "engine")
    good_public, good_secret = create_key_pair(root / "clients", "frontend")
    _, stranger_secret = create_key_pair(root / "strangers", "stranger")
    authorized = root / "authorized"
    authorized.mkdir()
    shutil.copy(good_public, authorized)
    return Keys(engine_secret, engine_public, authorized, good_secret, stranger_secret)


def free_port_pair() -> int:
    """A PORT with PORT + 1 also free (the engine's output socket)."""
    return free_port(count=2)


def wait_engine_ready(
    engine: subprocess.Popen, address: str, curve: CurveClientKeys, timeout: float = 120
) -> None:
    """READY from the engine process at ``address``; fails at once if that process exits."""
    deadline = time.monotonic() + timeout
    with EngineClient(address, curve=curve) as client:
        while True:
            assert engine.poll() is None, f"the engine exited with {engine.returncode}"
            try:
                client.connect(timeout=2)
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise


@pytest.fixture
def curve_echo(keys: Keys) -> Iterator[EngineAddress]:
    address = EngineAddress.parse(f"tcp://127.0.0.1:{free_port_pair()}")
    engine = EchoEngine(address, load_server_keys(keys.engine_secret, keys.authorized))
    try:
        yield address
    finally:
        engine.stop()


# ---- keys -------------------------------------------------------------------------------------


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    assert tandem(["keygen", "--dir", str(tmp_path), "--name", "node"]) == 0
    public, secret = tmp_path / "node.key", tmp_path / "node.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = load_key_pair(secret)
    assert len(pub) == len(sec) == 40  # Z85 text of 32-byte Curve25519 keys
    assert "secret-key" not in public.read_text()  # the public file carries no secret
    before = secret.read_bytes()
    assert tandem(["keygen", "--dir", str(tmp_path), "--name", "node"]) == 1
    assert secret.read_bytes() == before


def test_a_secret_key_others_can_read_is_refused(tmp_path: Path) -> None:
    _, secret = create_key_pair(tmp_path, "loose")
    os.chmod(secret, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_key_pair(secret)


# ---- the transport double ---------------------------------------------------------------------


def test_the_right_keys_get_ready_and_requests_flow(keys: Keys, curve_echo: EngineAddress) -> None:
    with EngineClient(curve_echo, curve=keys.client()) as client:
        assert client.connect(timeout=10) == READY
        client.add_request("r", [7, 8, 9], PARAMS)
        assert collect(client, {"r"}) == {"r": [7, 8, 9]}

    async def over_asyncio() -> None:
        async with AsyncEngineClient(curve_echo, curve=keys.client()) as client:
            assert await client.connect(timeout=10) == READY

    asyncio.run(over_asyncio())


@pytest.mark.parametrize("who", ["stranger", "wrong-server-key", "no-keys"])
def test_every_other_client_is_refused(keys: Keys, curve_echo: EngineAddress, who: str) -> None:
    curve = {
        "stranger": keys.client(secret=keys.stranger_secret),  # key not in the engine's list
        "wrong-server-key": keys.client(server=keys.good_secret),  # expects another engine
        "no-keys": None,  # a plain client: no CURVE handshake at all
    }[who]
    with EngineClient(curve_echo, curve=curve) as client, pytest.raises(TimeoutError):
        client.connect(timeout=REFUSED_TIMEOUT_S)


def test_non_loopback_binds_only_with_keys(keys: Keys) -> None:
    port = free_port_pair()
    with pytest.raises(ValueError, match="not loopback"):
        EchoEngine(EngineAddress.parse(f"tcp://0.0.0.0:{port}"))
    server_keys = load_server_keys(keys.engine_secret, keys.authorized)
    engine = EchoEngine(EngineAddress.parse(f"tcp://0.0.0.0:{port}"), server_keys)
    try:
        with EngineClient(f"tcp://127.0.0.1:{port}", curve=keys.client()) as client:
            assert client.connect(timeout=10) == READY
    finally:
        engine.stop()


# ---- end to end -------------------------------------------------------------------------------


def restarts(exposition: str) -> float | None:
    for line in exposition.splitlines():
        if line.startswith("tandem_engine_restarts_total{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_engine_cli_refuses_non_loopback_without_keys() -> None:
    cmd = [sys.executable, "-m", "frontend.cli", "engine", "--address", "tcp://0.0.0.0:5555"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "without authentication" in done.stderr


@pytest.mark.slow
def test_curve_engine_with_tandem_client_and_remote_serve(
    keys: Keys, tiny_model_dir: Path, tmp_path: Path
) -> None:
    address = f"tcp://127.0.0.1:{free_port_pair()}"

    def start_engine() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "frontend.cli", "engine", "--model", str(tiny_model_dir),
             "--listen", address, "--log-level", "WARNING",
             "--curve-secret-key", str(keys.engine_secret),
             "--curve-authorized-keys", str(keys.authorized)]
        )  # fmt: skip

    engine = start_engine()
    serve = None
    try:
        wait_engine_ready(engine, address, keys.client())
        stranger = keys.client(secret=keys.stranger_secret)
        with EngineClient(address, curve=stranger) as client, pytest.raises(TimeoutError):
            client.connect(timeout=REFUSED_TIMEOUT_S)
        cli = [sys.executable, "-m", "frontend.cli", "client", "--address", address,
               "--token-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos",
               "--curve-secret-key", str(keys.good_secret),
               "--curve-server-key", str(keys.engine_public)]  # fmt: skip
        done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.split()) == 4 and "finish_reason: length" in done.stderr

        port = free_port()
        log = tmp_path / "serve.log"
        with open(log, "wb") as out:
            serve = subprocess.Popen(
                [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir),
                 "--port", str(port), "--log-level", "WARNING", "--engine", address,
                 "--curve-secret-key", str(keys.good_secret),
                 "--curve-server-key", str(keys.engine_public)],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, serve, log)
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{base}/v1/engine", timeout=10).json()["pid"] is None  # not ours
        # The remote engine restarted by its owner: the server counts the restart it sees
        # (a new engine run in its polls), as no supervisor of its own does.
        engine.send_signal(signal.SIGTERM)
        engine.wait(timeout=30)
        engine = start_engine()
        wait_engine_ready(engine, address, keys.client())
        deadline = time.monotonic() + 60
        while restarts(httpx.get(f"{base}/metrics", timeout=10).text) != 1:
            assert time.monotonic() < deadline, "the restart was never counted"
            time.sleep(0.2)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        stop_process(serve)
        assert serve.returncode == 0
        assert pid_alive(engine.pid), "a remote engine is not the frontend's to stop"
    finally:
        if serve is not None:
            stop_process(serve)
        engine.send_signal(signal.SIGTERM)
        engine.wait(timeout=30)
