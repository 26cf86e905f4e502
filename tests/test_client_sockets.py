"""The raw clients (sync and asyncio) over real ZMQ sockets.

The engine side is a tiny echo thread built on ``bind_engine_sockets``: it answers HELLO with
READY, echoes each AddRequest's prompt back one token per StepOutputs, and answers controls.
It tests the transport only (routing, handshake, buffering), not engine behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from protocol import client_cli
from protocol.address import (
    EngineAddress,
    bind_engine_sockets,
    private_ipc_address,
    recv_from_client,
    remove_ipc_files,
    send_to_client,
)
from protocol.client import AsyncEngineClient, EngineClient, EngineRequestError
from protocol.codec import ProtocolError, decode_client_message, encode
from protocol.curve import CurveServerKeys, start_authenticator
from protocol.messages import (
    Abort,
    AddRequest,
    ClientMessage,
    Control,
    ControlKind,
    ControlReply,
    EngineMessage,
    FinishReason,
    Hello,
    Ready,
    RequestError,
    RequestOutput,
    SamplingParams,
    Stats,
    StepOutputs,
)

VOCAB = 49152
READY = Ready("echo", 512, VOCAB, [2], 16, 64, 8)
STATS = Stats(1, 2, 3, 4, 10, 99)
PARAMS = SamplingParams(max_tokens=8)


class EchoEngine:
    """Transport double. For every Control it first sends a stale reply and a garbage frame,
    which a client must skip, then the real reply. With ``curve`` it is a CURVE server that
    lets in only the client keys in ``curve.authorized_dir`` (as the real engine does)."""

    def __init__(self, address: EngineAddress, curve: CurveServerKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, curve) if curve is not None else None
        try:
            self.inp, self.out = bind_engine_sockets(self.ctx, address, curve=curve)
        except (zmq.ZMQError, ValueError):
            self._stop_auth()
            self.ctx.term()
            raise
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self._stop_auth()
        self.ctx.term()

    def _stop_auth(self) -> None:
        if self.auth is not None:
            self.auth.stop()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if not self.inp.poll(20):
                continue
            client, frame = recv_from_client(self.inp)
            try:
                self._handle(client, decode_client_message(frame))
            except ProtocolError as exc:
                if exc.request_id is not None:
                    self._send(client, RequestError(exc.request_id, str(exc)))
        self.inp.close(linger=0)
        self.out.close(linger=0)

    def _handle(self, client: bytes, msg: ClientMessage) -> None:
        match msg:
            case Hello():
                self._send(client, READY)
            case AddRequest():
                self._echo(client, msg)
            case Abort():
                self._send(
                    client, StepOutputs([], dict.fromkeys(msg.request_ids, FinishReason.ABORT))
                )
            case Control():
                self._send(
                    client, ControlReply(msg.kind, msg.token + 1000, ok=False, message="stale")
                )
                send_to_client(self.out, client, b"\xc1 not msgpack")
                self._send(client, ControlReply(msg.kind, msg.token, stats=STATS))

    def _echo(self, client: bytes, msg: AddRequest) -> None:
        if max(msg.prompt_token_ids) >= VOCAB:
            self._send(client, RequestError(msg.request_id, "token id out of vocabulary"))
            return
        ids = msg.prompt_token_ids
        for i, tid in enumerate(ids):
            reason = FinishReason.LENGTH if i == len(ids) - 1 else None
            self._send(client, StepOutputs([RequestOutput(msg.request_id, [tid], reason)]))

    def _send(self, client: bytes, msg: EngineMessage) -> None:
        send_to_client(self.out, client, encode(msg))


@pytest.fixture
def address() -> Iterator[EngineAddress]:
    addr = private_ipc_address()
    yield addr
    remove_ipc_files(addr)


@pytest.fixture
def engine(address: EngineAddress) -> Iterator[EchoEngine]:
    eng = EchoEngine(address)
    yield eng
    eng.stop()


def collect(client: EngineClient, request_ids: set[str]) -> dict[str, list[int]]:
    """Read until every id has finished; fail on anything unexpected."""
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    pending = set(request_ids)
    while pending:
        msg = client.recv(timeout=10)
        assert isinstance(msg, StepOutputs), msg
        for out in msg.outputs:
            tokens[out.request_id].extend(out.new_token_ids)  # KeyError: someone else's output
            if out.finish_reason is not None:
                pending.remove(out.request_id)
    return tokens


# ---- addresses and engine sockets ---------------------------------------------------------------


def test_private_ipc_directory_is_owner_only(address: EngineAddress, engine: EchoEngine) -> None:
    directory = os.path.dirname(address.ipc_paths[0])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert os.stat(directory).st_uid == os.getuid()
    for path in address.ipc_paths:  # both endpoints were bound inside it
        assert stat.S_ISSOCK(os.stat(path).st_mode)


def test_send_to_unknown_client_reports_false(engine: EchoEngine) -> None:
    assert send_to_client(engine.out, b"\x01nobody", encode(READY)) is False


def test_bind_refuses_unauthenticated_remote_tcp() -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="not loopback"):
            bind_engine_sockets(ctx, "tcp://0.0.0.0:5555")
    finally:
        ctx.term()


# ---- synchronous client -------------------------------------------------------------------------


def test_handshake_returns_ready(address: EngineAddress, engine: EchoEngine) -> None:
    with EngineClient(str(address)) as client:
        assert client.connect(timeout=10) == READY
        assert client.ready == READY


def test_handshake_over_loopback_tcp() -> None:
    rng = random.Random()
    for _ in range(20):  # a free pair of ports: PORT for input, PORT + 1 for output
        address = EngineAddress.parse(f"tcp://127.0.0.1:{rng.randrange(20000, 60000)}")
        try:
            eng = EchoEngine(address)
        except zmq.ZMQError:
            continue
        break
    else:
        pytest.skip("no free pair of loopback ports")
    try:
        with EngineClient(str(address)) as client:
            assert client.connect(timeout=10) == READY
            client.add_request("t", [4, 5], PARAMS)
            assert collect(client, {"t"}) == {"t": [4, 5]}
    finally:
        eng.stop()


def test_connect_times_out_when_nothing_listens(address: EngineAddress) -> None:
    with EngineClient(address) as client, pytest.raises(TimeoutError, match="no READY"):
        client.connect(timeout=0.3)


def test_two_clients_get_only_their_own_outputs(address: EngineAddress, engine: EchoEngine) -> None:
    # Both clients use the same request ids: routing must go by client, not by id.
    with EngineClient(address) as a, EngineClient(address) as b:
        a.connect(timeout=10)
        b.connect(timeout=10)
        for i in range(5):
            a.add_request(f"r{i}", [100, i, 7], PARAMS)
            b.add_request(f"r{i}", [200, i], PARAMS)
        got_a = collect(a, {f"r{i}" for i in range(5)})
        got_b = collect(b, {f"r{i}" for i in range(5)})
        assert got_a == {f"r{i}": [100, i, 7] for i in range(5)}
        assert got_b == {f"r{i}": [200, i] for i in range(5)}
        assert a.recv(timeout=0.2) is None
        assert b.recv(timeout=0.2) is None


def test_control_reply_matches_token_and_keeps_outputs(
    address: EngineAddress, engine: EchoEngine
) -> None:
    with EngineClient(address) as client:
        client.connect(timeout=10)
        client.add_request("x", [5, 6], PARAMS)
        client.add_request("y", [9], PARAMS)
        reply = client.control(ControlKind.STATS)
        # The engine sent x's and y's outputs, a stale reply and garbage before the real reply.
        assert reply == ControlReply(ControlKind.STATS, reply.token, stats=STATS)
        assert collect(client, {"x", "y"}) == {"x": [5, 6], "y": [9]}
        assert client.recv(timeout=0.2) is None  # the stale reply was dropped, not delivered
        second = client.control(ControlKind.CHECK_INTEGRITY)
        assert second.kind == ControlKind.CHECK_INTEGRITY and second.token != reply.token


def test_generate_streams_until_finished(address: EngineAddress, engine: EchoEngine) -> None:
    with EngineClient(address) as client:
        client.connect(timeout=10)
        client.add_request("other", [42], PARAMS)
        outs = list(client.generate("mine", [3, 1, 4, 1], PARAMS, timeout=10))
        assert [o.new_token_ids for o in outs] == [[3], [1], [4], [1]]
        assert [o.finish_reason for o in outs] == [None, None, None, FinishReason.LENGTH]
        assert collect(client, {"other"}) == {"other": [42]}  # kept for recv(), not lost


def test_generate_raises_on_request_error(address: EngineAddress, engine: EchoEngine) -> None:
    with EngineClient(address) as client:
        client.connect(timeout=10)
        with pytest.raises(EngineRequestError, match="out of vocabulary") as info:
            list(client.generate("bad", [VOCAB + 1], PARAMS, timeout=10))
        assert info.value.error.request_id == "bad"


def test_leaving_generate_early_aborts(address: EngineAddress, engine: EchoEngine) -> None:
    with EngineClient(address) as client:
        client.connect(timeout=10)
        for out in client.generate("early", [1, 2, 3], PARAMS, timeout=10):
            assert out.new_token_ids == [1]
            break
        # The echo answers the abort with a finish-without-tokens; it follows the echoed tokens.
        while True:
            msg = client.recv(timeout=10)
            assert isinstance(msg, StepOutputs)
            if msg.finished_without_tokens:
                assert msg.finished_without_tokens == {"early": FinishReason.ABORT}
                break


def test_invalid_request_is_refused_before_sending(
    address: EngineAddress, engine: EchoEngine
) -> None:
    with EngineClient(address) as client:
        client.connect(timeout=10)
        with pytest.raises(ProtocolError) as info:
            client.add_request("neg", [1, -5], PARAMS)
        assert info.value.request_id == "neg"
        with pytest.raises(ProtocolError, match="top_p"):
            client.add_request("p", [1], SamplingParams(top_p=0.0))


# ---- asyncio client -----------------------------------------------------------------------------


def test_async_handshake_and_timeout(address: EngineAddress) -> None:
    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            with pytest.raises(TimeoutError, match="no READY"):
                await client.connect(timeout=0.3)
        eng = EchoEngine(address)
        try:
            async with AsyncEngineClient(address) as client:
                assert await client.connect(timeout=10) == READY
        finally:
            eng.stop()

    asyncio.run(main())


def test_async_reader_task_routes_while_control_waits(
    address: EngineAddress, engine: EchoEngine
) -> None:
    """The frontend's shape: one reader task routes outputs to per-request queues while other
    coroutines add requests and make control calls."""

    async def reader(client: AsyncEngineClient, queues: dict[str, asyncio.Queue]) -> None:
        while True:
            msg = await client.recv()
            assert isinstance(msg, StepOutputs), msg
            for out in msg.outputs:
                queues[out.request_id].put_nowait(out)

    async def drain(queue: asyncio.Queue) -> list[int]:
        tokens: list[int] = []
        while True:
            out = await asyncio.wait_for(queue.get(), 10)
            tokens.extend(out.new_token_ids)
            if out.finish_reason is not None:
                return tokens

    async def main() -> None:
        async with AsyncEngineClient(address) as a, AsyncEngineClient(address) as b:
            await asyncio.gather(a.connect(timeout=10), b.connect(timeout=10))
            qa = {f"r{i}": asyncio.Queue() for i in range(4)}
            qb = {f"r{i}": asyncio.Queue() for i in range(4)}
            tasks = [asyncio.create_task(reader(a, qa)), asyncio.create_task(reader(b, qb))]
            for i in range(4):
                await a.add_request(f"r{i}", [10, i], PARAMS)
                await b.add_request(f"r{i}", [20, i, i], PARAMS)
            replies = await asyncio.gather(
                a.control(ControlKind.STATS), b.control(ControlKind.STATS)
            )
            assert [r.stats for r in replies] == [STATS, STATS]
            got_a = await asyncio.gather(*(drain(q) for q in qa.values()))
            got_b = await asyncio.gather(*(drain(q) for q in qb.values()))
            for t in tasks:
                assert not t.done()  # a reader that died on an assertion would be done
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert got_a == [[10, i] for i in range(4)]
            assert got_b == [[20, i, i] for i in range(4)]

    asyncio.run(main())


def test_async_control_without_reader_buffers_outputs(
    address: EngineAddress, engine: EchoEngine
) -> None:
    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            await client.add_request("x", [7, 8], PARAMS)
            reply = await client.control(ControlKind.CHECK_INTEGRITY)
            assert reply.kind == ControlKind.CHECK_INTEGRITY and reply.ok
            first = await client.recv(timeout=10)
            second = await client.recv(timeout=10)
            assert first == StepOutputs([RequestOutput("x", [7])])
            assert second == StepOutputs([RequestOutput("x", [8], FinishReason.LENGTH)])
            assert await client.recv(timeout=0.2) is None
            outs = [o async for o in client.generate("g", [1, 2], PARAMS, timeout=10)]
            assert [o.new_token_ids for o in outs] == [[1], [2]]

    asyncio.run(main())


# ---- tandem client ------------------------------------------------------------------------------


def test_cli_streams_token_ids(
    address: EngineAddress, engine: EchoEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    client_cli.add_args(parser)
    args = parser.parse_args(
        ["--address", str(address), "--token-ids", "11,12,13", "--max-tokens", "3"]
    )
    assert client_cli.run(args) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == ["11", "12", "13"]
    assert "finish_reason: length" in captured.err


def test_cli_streams_text_that_detokenizes_the_echo(
    address: EngineAddress,
    engine: EchoEngine,
    default_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The echo returns the prompt's own tokens, so the streamed text must be the prompt as the
    tokenizer round-trips it: incremental printing may not lose, split or repeat characters."""
    from transformers import AutoTokenizer

    text = "Héllo wörld! 日本語 🙂🙂 and   spaces\nnew line — done."
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    expected = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True)
    parser = argparse.ArgumentParser()
    client_cli.add_args(parser)
    args = parser.parse_args(
        ["--address", str(address), "--prompt", text, "--model", str(default_model_dir)]
    )
    assert client_cli.run(args) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert "finish_reason: length" in captured.err
