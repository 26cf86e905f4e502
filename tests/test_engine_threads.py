"""An engine process whose socket thread dies must end (so its supervisor starts a new one),
with the cause logged: never live on, heart-beating, with requests that can never finish."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import protocol.address
import protocol.codec
from engine_core.config import EngineConfig
from engine_core.proc import EngineProc, SocketThreadDied
from protocol.address import EngineAddress, private_ipc_address, remove_ipc_files
from protocol.client import EngineClient

END_WITHIN_S = 10.0


@pytest.fixture
def address() -> Iterator[EngineAddress]:
    addr = private_ipc_address()
    yield addr
    remove_ipc_files(addr)


def run_in_thread(proc: EngineProc) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            proc.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def make_engine(model_dir: Path, address: EngineAddress) -> EngineProc:
    config = EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=32, max_model_len=64, max_num_seqs=4
    )
    return EngineProc(config, address)


def broken(what: str) -> object:
    def fail(*_args: object) -> object:
        raise RuntimeError(f"{what} broke")

    return fail


@pytest.mark.parametrize(
    ("thread", "module", "name"),
    [
        ("input", protocol.codec, "decode_client_message"),  # the input thread decodes
        ("output", protocol.address, "send_to_client"),  # the output thread sends
    ],
)
def test_a_dead_socket_thread_ends_the_engine_with_its_cause(
    tiny_model_dir: Path,
    address: EngineAddress,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    thread: str,
    module: object,
    name: str,
) -> None:
    proc = make_engine(tiny_model_dir, address)
    monkeypatch.setattr(module, name, broken(name))
    caplog.set_level(logging.CRITICAL, logger="tandem.engine")
    runner, raised = run_in_thread(proc)
    with EngineClient(address) as client:
        with pytest.raises(TimeoutError):
            client.connect(timeout=2)  # the HELLO is what the broken thread chokes on
        runner.join(END_WITHIN_S)
    assert not runner.is_alive(), f"the engine lived on without its {thread} thread"
    assert len(raised) == 1 and isinstance(raised[0], SocketThreadDied)
    assert f"the {thread} socket thread died" in str(raised[0])
    assert f"{name} broke" in str(raised[0])
    assert any(f"{thread} thread died" in r.getMessage() for r in caplog.records)
