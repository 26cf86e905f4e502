"""An engine process whose input thread dies, or whose output socket fails to send, must end (so
its supervisor starts a new one), with the cause logged: never live on, heart-beating, with
requests that can never finish."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import protocol.address
import protocol.codec
from engine_core.config import EngineConfig
from engine_core.server import EngineServer, SocketFailed
from protocol.address import EngineAddress, private_ipc_address, remove_ipc_files
from protocol.client import EngineClient

END_WITHIN_S = 10.0


@pytest.fixture
def address() -> Iterator[EngineAddress]:
    addr = private_ipc_address()
    yield addr
    remove_ipc_files(addr)


def run_in_thread(proc: EngineServer) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            proc.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def make_engine(model_dir: Path, address: EngineAddress) -> EngineServer:
    config = EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=32, max_model_len=64, max_num_seqs=4
    )
    return EngineServer(config, address)


def broken(what: str) -> object:
    def fail(*_args: object) -> object:
        raise RuntimeError(f"{what} broke")

    return fail


@pytest.mark.parametrize(
    ("module", "name", "cause", "logged"),
    [
        # The input thread decodes: it dies.
        (
            protocol.codec,
            "decode_client_message",
            "the input socket thread died",
            "input thread died",
        ),
        # The busy loop sends (the HELLO's READY is the first send): the send fails.
        (protocol.address, "send_to_client", "the output socket failed", "output socket failed"),
    ],
)
def test_a_broken_socket_ends_the_engine_with_its_cause(
    tiny_model_dir: Path,
    address: EngineAddress,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    module: object,
    name: str,
    cause: str,
    logged: str,
) -> None:
    proc = make_engine(tiny_model_dir, address)
    monkeypatch.setattr(module, name, broken(name))
    caplog.set_level(logging.CRITICAL, logger="tandem.engine")
    runner, raised = run_in_thread(proc)
    with EngineClient(address) as client:
        with pytest.raises(TimeoutError):
            client.connect(timeout=2)  # the HELLO (or its READY) is what breaks
        runner.join(END_WITHIN_S)
    assert not runner.is_alive(), f"the engine lived on after {cause}"
    assert len(raised) == 1 and isinstance(raised[0], SocketFailed)
    assert cause in str(raised[0])
    assert f"{name} broke" in str(raised[0])
    assert any(logged in r.getMessage() for r in caplog.records)


def test_only_the_busy_loop_sends(
    tiny_model_dir: Path, address: EngineAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output socket is the busy loop's alone (ZMQ sockets are not thread-safe): READY, step
    outputs, an abort's reply, a STATS reply and a refusal of a malformed request (which the
    input thread finds) are all sent from the thread that runs the loop."""
    from protocol.messages import ControlKind, RequestError, SamplingParams, StepOutputs
    from tests.test_engine_burst_intake import max_tokens_zero_frame

    senders: list[int] = []
    send = protocol.address.send_to_client

    def recording_send(*args: object) -> bool:
        senders.append(threading.get_ident())
        return send(*args)

    monkeypatch.setattr(protocol.address, "send_to_client", recording_send)
    proc = make_engine(tiny_model_dir, address)
    runner, raised = run_in_thread(proc)
    kinds: set[type] = set()
    with EngineClient(address) as client:
        client.connect(timeout=30)
        client.add_request("done", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        client.add_request("aborted", [4, 5, 6], SamplingParams(max_tokens=40, ignore_eos=True))
        client._input.send(max_tokens_zero_frame("refused"))
        client.abort(["aborted"])
        assert client.control(ControlKind.STATS).stats is not None
        deadline = time.monotonic() + 30
        while {StepOutputs, RequestError} - kinds and time.monotonic() < deadline:
            msg = client.recv(timeout=1)
            if msg is not None:
                kinds.add(type(msg))
        proc.running = False
        runner.join(END_WITHIN_S)
    assert not raised and not runner.is_alive()
    assert {StepOutputs, RequestError} <= kinds
    assert len(senders) >= 4 and set(senders) == {runner.ident}


def test_requests_dropped_on_an_unreachable_client_are_told_and_resumed(
    tiny_model_dir: Path, address: EngineAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send the ROUTER cannot deliver (a dropped TCP connection, EHOSTUNREACH, which ZMQ then
    makes again) makes the engine forget the client and drop its requests. When the client
    speaks again (here the STATS poll the API process runs every second), the engine tells it
    which requests it dropped, and the client resumes them with what it has: the output is
    the undisturbed run's, token for token, rather than a request left waiting forever."""
    import asyncio

    from protocol.client import AsyncEngineClient
    from protocol.messages import DROPPED_UNREACHABLE, RequestError, SamplingParams, StepOutputs

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    send = protocol.address.send_to_client
    outputs_sent = 0
    dropped_at = 4  # the fourth step-outputs frame does not reach the client
    told: list[str] = []  # the engine's word of the dropped request, each time it tried

    def unreachable_twice(sock: object, client: bytes, frame: bytes) -> bool:
        nonlocal outputs_sent
        msg = protocol.codec.decode_engine_message(frame)
        if isinstance(msg, StepOutputs):
            outputs_sent += 1
            if outputs_sent == dropped_at:
                return False  # as send_to_client answers EHOSTUNREACH
        if isinstance(msg, RequestError) and msg.code == DROPPED_UNREACHABLE:
            told.append(msg.request_id)
            if len(told) == 1:
                return False  # the word itself is lost once: it is told again the next time
        return send(sock, client, frame)

    proc = make_engine(tiny_model_dir, address)
    runner, raised = run_in_thread(proc)

    async def generate(rid: str) -> list[int]:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=30)
            tokens: list[int] = []

            async def poll() -> None:
                while True:  # as frontend/app.py poll_engine_stats
                    await asyncio.sleep(0.2)
                    await client.stats()

            poller = asyncio.ensure_future(poll())
            try:
                async for out in client.generate(rid, [5, 6, 7, 8], params, max_resumes=1):
                    tokens += out.new_token_ids
            finally:
                poller.cancel()
            return tokens

    try:
        undisturbed = asyncio.run(generate("calm"))
        monkeypatch.setattr(protocol.address, "send_to_client", unreachable_twice)
        # Without the engine's word the request would wait forever: bounded, it fails.
        resumed = asyncio.run(asyncio.wait_for(generate("dropped"), 60))
        assert outputs_sent > dropped_at and told == ["dropped", "dropped"]
        assert not any(proc.forgotten.values())  # (closed clients are forgotten, idle)
    finally:
        proc.running = False
        runner.join(END_WITHIN_S)
    assert not raised
    assert len(undisturbed) == 24 and resumed == undisturbed
