"""`tandem client` against a real `tandem engine` process: an engine that stops answering
mid-request fails the request after --engine-timeout of silence (heartbeats included) instead of
leaving the client waiting for ever, a tokenizer that cannot load is one line, not a
traceback, and the engine's refusals name the request as the client does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.processes import die_with_parent
from protocol.address import private_ipc_address, remove_ipc_files
from tests.server_fixture import stop_process


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A standalone engine on the tiny model, once it says it serves: (address, process)."""
    address = private_ipc_address()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", "engine", "--address", str(address),
         "--model", str(tiny_model_dir), "--num-kv-blocks", "64", "--max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        preexec_fn=die_with_parent(),
    )  # fmt: skip
    assert proc.stdout is not None
    assert any("serving" in line for line in proc.stdout), "the engine did not start"
    try:
        yield str(address), proc
    finally:
        if proc.poll() is None:
            stop_process(proc)
        remove_ipc_files(address)


def client(address: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "frontend.cli", "client", "--address", address, *flags]


def test_a_tokenizer_that_does_not_load_is_one_line(
    engine: tuple[str, subprocess.Popen[str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    address, _ = engine
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, bare / name)
    for model, said in ((bare, "cannot load the tokenizer of"), (tmp_path / "nope", "nope")):
        done = subprocess.run(
            client(address, "--prompt", "hi", "--model", str(model), "--max-tokens", "2"),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("tandem client: ") and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert "or send --token-ids" in subprocess.run(
        client(address, "--prompt", "hi", "--model", str(bare)), capture_output=True, text=True,
        timeout=120,
    ).stderr  # fmt: skip


def test_the_engines_refusal_names_the_request_by_the_id_the_client_gave(
    engine: tuple[str, subprocess.Popen[str]],
) -> None:
    """Not the engine's own id, which scopes it by the client's socket identity."""
    address, _ = engine
    ids = ",".join(["7"] * 5000)  # past the engine's --max-model-len 512
    done = subprocess.run(
        client(address, "--token-ids", ids, "--request-id", "mine-1"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "request 'mine-1': prompt of 5000 tokens leaves no room to generate" in done.stderr


def test_an_engine_that_stops_answering_fails_the_request_after_the_engine_timeout(
    engine: tuple[str, subprocess.Popen[str]],
) -> None:
    """The engine is frozen (SIGSTOP) once tokens flow: no more outputs, no heartbeats. The
    client ends with exit code 1 and says why; it waited for ever before. The engine then
    goes on (SIGCONT)."""
    address, proc = engine
    cli = subprocess.Popen(
        client(address, "--token-ids", "1,2,3", "--max-tokens", "4000", "--ignore-eos",
               "--temperature", "0", "--engine-timeout", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert cli.stdout is not None
        cli.stdout.read(20)  # tokens are flowing
        os.kill(proc.pid, signal.SIGSTOP)
        _, stderr = cli.communicate(timeout=60)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 1, stderr
    assert "the engine sent nothing for 2 s (not even a heartbeat)" in stderr, stderr
    assert "Traceback" not in stderr
