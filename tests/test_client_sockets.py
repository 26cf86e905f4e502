"""The raw clients (sync and asyncio) over real ZMQ sockets.

The engine side is a tiny echo thread built on ``bind_engine_sockets``: it answers HELLO with
READY, echoes each AddRequest's prompt back one token per StepOutputs, and answers controls.
It tests the transport only (routing, handshake, buffering), not engine behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from protocol import client_cli
from protocol.address import (
    AddressInUse,
    EngineAddress,
    bind_engine_sockets,
    private_ipc_address,
    recv_from_client,
    remove_ipc_files,
    send_to_client,
)
from protocol.client import (
    AsyncEngineClient,
    EngineClient,
    EngineDeadError,
    EngineRequest,
    EngineRequestError,
    HandshakeError,
)
from protocol.codec import ProtocolError, decode_client_message, encode
from protocol.curve import CurveServerKeys, start_authenticator
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    ClientMessage,
    Control,
    ControlKind,
    ControlReply,
    EngineMessage,
    FinishReason,
    Heartbeat,
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
    """Transport double. For every Control it first sends a stale reply and (unless told not
    to) a garbage frame, which a client must skip, then the real reply. A request with
    ``ignore_eos`` is echoed but never finished (until aborted). With ``curve`` it is a CURVE
    server that lets in only the client keys in ``curve.authorized_dir`` (as the real engine
    does)."""

    def __init__(
        self,
        address: EngineAddress,
        curve: CurveServerKeys | None = None,
        garbage: bool = True,
        busy_for_s: float = 0.0,
    ) -> None:
        self.garbage = garbage  # send an undecodable frame before each control reply
        self.busy_for_s = busy_for_s  # > 0: READY is followed by a heartbeat announcing a step
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, curve) if curve is not None else None
        try:
            self.inp, self.out = bind_engine_sockets(self.ctx, address, curve=curve)
        except (zmq.ZMQError, ValueError):
            self._stop_auth()
            self.ctx.term()
            raise
        self.stopping = threading.Event()
        self.aborted: list[str] = []  # every request id an Abort named, in order
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
                if self.busy_for_s:
                    self._send(client, Heartbeat(1, self.busy_for_s))
            case AddRequest():
                self._echo(client, msg)
            case Abort():
                self.aborted += msg.request_ids
                self._send(
                    client, StepOutputs([], dict.fromkeys(msg.request_ids, FinishReason.ABORT))
                )
            case Control():
                self._send(
                    client, ControlReply(msg.kind, msg.token + 1000, ok=False, message="stale")
                )
                if self.garbage:
                    send_to_client(self.out, client, b"\xc1 not msgpack")
                self._send(client, ControlReply(msg.kind, msg.token, stats=STATS))

    def _echo(self, client: bytes, msg: AddRequest) -> None:
        if max(msg.prompt_token_ids) >= VOCAB:
            self._send(client, RequestError(msg.request_id, "token id out of vocabulary"))
            return
        ids = msg.prompt_token_ids
        for i, tid in enumerate(ids):
            last = i == len(ids) - 1 and not msg.params.ignore_eos
            reason = FinishReason.LENGTH if last else None
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


_KILLED_ENGINE = """
import sys, time, zmq
from protocol.address import bind_engine_sockets, private_ipc_address
address = private_ipc_address()
bind_engine_sockets(zmq.Context(), address)
print(address, flush=True)
time.sleep(600)
"""


def _stale_dir(base: Path, pid: int, files: dict[str, str], listening: list[Any]) -> Path:
    """A private ipc directory named for ``pid``, untouched for two minutes, holding ``files``:
    "socket" (bound, then closed: nobody listens), "listening" (its socket kept open in
    ``listening``) or "file"."""
    import socket

    directory = base / f"tandem-{pid}-test{len(list(base.iterdir()))}"
    directory.mkdir(mode=0o700)
    for name, kind in files.items():
        if kind == "file":
            (directory / name).write_text("not a socket")
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(directory / name))
        if kind == "listening":
            sock.listen()
            listening.append(sock)
        else:
            sock.close()
    old = time.time() - 120
    os.utime(directory, (old, old))
    return directory


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder whose paths fit a unix socket's 108 bytes (pytest's own can be too long, and a
    private address then falls back to the temp folder)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="tdm", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_next_server_removes_what_a_killed_one_left(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 leaves a server's private ipc directory and its socket files; the next private
    address taken there removes them, and only what is surely stale: not a live process's, not
    one just made, not an empty one, not one where somebody listens, not one holding other
    files, not one whose name holds no pid."""
    import signal
    import subprocess
    import sys

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_tmp))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_ENGINE], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "XDG_RUNTIME_DIR": str(short_tmp)},
    )  # fmt: skip
    assert proc.stdout is not None
    killed = EngineAddress.parse(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_dir = Path(killed.ipc_paths[0]).parent
    assert killed_dir.parent == short_tmp and sorted(os.listdir(killed_dir)) == [
        "engine-in",
        "engine-out",
    ]
    old = time.time() - 120
    os.utime(killed_dir, (old, old))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    listening: list[Any] = []
    kept = [
        _stale_dir(short_tmp, os.getpid(), {"engine-in": "socket"}, listening),  # a live process's
        _stale_dir(short_tmp, gone.pid, {"engine-in": "listening"}, listening),
        _stale_dir(short_tmp, gone.pid, {"engine-in": "socket", "notes": "file"}, listening),
        _stale_dir(short_tmp, gone.pid, {}, listening),  # empty until its engine binds
        _stale_dir(short_tmp, gone.pid, {"engine-in": "socket"}, listening),
    ]
    os.utime(kept[-1])  # just made (another pid namespace's server may be starting in it)
    for odd in ("tandem-99999999999999999999-x", "tandem-\u00b2-x", "tandem--x"):  # not a pid
        (short_tmp / odd).mkdir()
        kept.append(short_tmp / odd)
    try:
        fresh = private_ipc_address()
    finally:
        for sock in listening:
            sock.close()
    assert not killed_dir.exists()
    assert all(d.exists() for d in kept)
    assert Path(fresh.ipc_paths[0]).parent.name.startswith(f"tandem-{os.getpid()}-")


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


def test_a_client_name_the_engine_would_drop_is_refused_at_once(
    address: EngineAddress, engine: EchoEngine
) -> None:
    """Over 256 characters the engine drops the HELLO unanswered, and the handshake waited out
    its whole timeout asking whether an engine runs there."""
    name = "n" * 257  # ProtocolError, not the TimeoutError of a handshake waited out
    refused = pytest.raises(ProtocolError, match="client_name is longer than 256")
    with EngineClient(address, name=name) as client, refused:
        client.connect(timeout=30)

    async def main() -> None:
        async with AsyncEngineClient(address, name=name) as client:
            with pytest.raises(ProtocolError, match="client_name is longer than 256"):
                await client.connect(timeout=30)

    asyncio.run(main())


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
        assert info.value.request_id == "bad"


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
        with pytest.raises(ProtocolError, match="params must be SamplingParams, got dict"):
            client.add_request("d", [1], {"max_tokens": 3})  # type: ignore[arg-type]


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


class OtherVersionEngine(EchoEngine):
    """An engine of another protocol version: its READY carries that version."""

    def _send(self, client: bytes, msg: EngineMessage) -> None:
        tag, version, *fields = msgpack.unpackb(encode(msg))
        send_to_client(self.out, client, msgpack.packb([tag, version + 1, *fields]))


def test_a_handshake_answered_in_another_protocol_fails_at_once(
    address: EngineAddress, capsys: pytest.CaptureFixture[str]
) -> None:
    """No waiting out the start timeout for an engine that cannot be spoken to: the sync and
    async clients and `tandem client` name the version the reply carried."""
    eng = OtherVersionEngine(address)
    expected = f"protocol version {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}"

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            with pytest.raises(HandshakeError, match=expected):
                await client.connect(timeout=60)

    try:  # a client that waited would time out after 60 s, with a TimeoutError
        with EngineClient(address) as client, pytest.raises(HandshakeError, match=expected):
            client.connect(timeout=60)
        asyncio.run(main())
        parser = argparse.ArgumentParser()
        client_cli.add_args(parser)
        args = parser.parse_args(["--address", str(address), "--token-ids", "11"])
        assert client_cli.run(args) == 1
        assert expected in capsys.readouterr().err
    finally:
        eng.stop()


def test_async_reader_routes_to_each_group_while_control_waits(address: EngineAddress) -> None:
    """The frontend's shape: the client's one reader task routes outputs to each request's
    queue while other coroutines add requests and make control calls; two clients on one
    engine each get their own requests' outputs, even under the same request ids."""

    async def tokens(client: AsyncEngineClient, rid: str, prompt: list[int]) -> list[int]:
        return [t async for out in client.generate(rid, prompt, PARAMS) for t in out.new_token_ids]

    async def main() -> None:
        async with AsyncEngineClient(address) as a, AsyncEngineClient(address) as b:
            await asyncio.gather(a.connect(timeout=10), b.connect(timeout=10))
            work = [tokens(a, f"r{i}", [10, i]) for i in range(4)]
            work += [tokens(b, f"r{i}", [20, i, i]) for i in range(4)]
            controls = [a.control(ControlKind.STATS), b.control(ControlKind.STATS)]
            *got, reply_a, reply_b = await asyncio.wait_for(asyncio.gather(*work, *controls), 10)
            assert [reply_a.stats, reply_b.stats] == [STATS, STATS]  # the stale ones skipped
            assert got[:4] == [[10, i] for i in range(4)]
            assert got[4:] == [[20, i, i] for i in range(4)]
            assert a.num_requests == b.num_requests == 0

    eng = EchoEngine(address, garbage=False)  # garbage fails what is in flight: see below
    try:
        asyncio.run(main())
    finally:
        eng.stop()


def test_async_control_timeout_covers_a_send_that_never_completes(
    address: EngineAddress, engine: EchoEngine
) -> None:
    """A control call's timeout bounds its send as well as the reply: the frontend's gauge
    poll awaits STATS calls in a loop, and one stuck send would freeze /metrics for good."""

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)

            async def stuck_send(*args: object, **kwargs: object) -> None:
                await asyncio.Event().wait()

            real_send = client._input.send
            client._input.send = stuck_send
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="no reply to control STATS within 0.5 s"):
                await asyncio.wait_for(client.control(ControlKind.STATS, timeout=0.5), 10)
            assert time.monotonic() - started < 5
            client._input.send = real_send
            assert (await client.control(ControlKind.STATS)).stats == STATS

    asyncio.run(main())


def test_async_close_fails_a_control_call_in_flight_with_an_error(address: EngineAddress) -> None:
    """A control call waiting when its client closes (the supervisor closes the connection of
    an engine that died) gets EngineDeadError, not a cancel: the frontend's gauge poll catches
    errors and goes on, and a CancelledError ended it, freezing /metrics after a restart."""

    async def main() -> None:
        eng = EchoEngine(address)
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            eng.stop()  # silent: the STATS call waits for a reply that will not come
            call = asyncio.ensure_future(client.control(ControlKind.STATS, timeout=30))
            await asyncio.sleep(0.2)
            await client.close("the engine process exited (code -9); restarting it")
            with pytest.raises(EngineDeadError, match="restarting it"):
                await asyncio.wait_for(call, 5)

    asyncio.run(main())


def test_async_undecodable_frame_fails_what_is_in_flight_not_later_requests(
    address: EngineAddress, engine: EchoEngine
) -> None:
    """A frame that does not decode may have held any request's tokens: the requests in flight
    end with a 500 instead of waiting for ever; the client goes on serving."""

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            open_ended = EngineRequest("waiting", [1], SamplingParams(ignore_eos=True))
            async with client.open([open_ended]) as group:
                [(_, first, _)] = await asyncio.wait_for(group.next_batch(), 10)
                assert first.new_token_ids == [1] and first.finish_reason is None
                await client.control(ControlKind.STATS)  # garbage comes before its reply
                [(_, failed, _)] = await asyncio.wait_for(group.next_batch(), 10)
            assert isinstance(failed, EngineRequestError) and failed.code == 500
            assert "malformed" in failed.message and failed.request_id == "waiting"
            assert client.num_requests == 0
            outs = client.generate("after", [3, 4], PARAMS)
            assert [t async for out in outs for t in out.new_token_ids] == [3, 4]
        assert engine.aborted == ["waiting"]  # the engine was told to drop it

    asyncio.run(main())


def test_async_group_sees_the_request_error_and_refuses_bad_params(
    address: EngineAddress, engine: EchoEngine
) -> None:
    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            with pytest.raises(EngineRequestError, match="out of vocabulary") as info:
                async for _ in client.generate("bad", [VOCAB + 1], PARAMS):
                    pass
            assert info.value.request_id == "bad" and info.value.code == 400
            request = EngineRequest("p", [1], SamplingParams(top_p=0.0))
            with pytest.raises(ProtocolError, match="top_p"):
                async with client.open([request]):
                    pass
            assert client.num_requests == 0  # nothing sent, nothing left routed

    asyncio.run(main())


def test_sync_a_request_id_in_use_is_refused_until_it_ends(
    address: EngineAddress, engine: EchoEngine
) -> None:
    """The synchronous client refuses a second live request under one id before sending it:
    the engine would refuse it with an error naming that id, which a consumer keyed on ids
    takes for the first request's end, orphaning it. An id is free again once its request
    ended (its last output read) or was aborted."""
    with EngineClient(address) as client:
        client.connect(timeout=10)
        client.add_request("same", [1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
        with pytest.raises(ValueError, match="'same' is already in use on this client"):
            client.add_request("same", [3], PARAMS)
        client.abort(["same"])
        client.add_request("same", [3], PARAMS)  # free once aborted
        for _ in range(2):  # and once ended: generate reads its last output
            outputs = list(client.generate("once", [4], PARAMS, timeout=10))
            assert outputs[-1].finish_reason is not None


def test_async_a_request_id_in_use_is_refused_and_the_first_request_goes_on(
    address: EngineAddress, engine: EchoEngine
) -> None:
    """A second live request under the same id (or the same id twice in one group) is refused
    before anything is sent: it took over the first one's route, whose consumer then waited
    for ever. Once the first finishes, its id is free again."""

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            endless = SamplingParams(max_tokens=8, ignore_eos=True)
            async with contextlib.aclosing(client.generate("same", [1, 2], endless)) as first:
                assert (await anext(first)).new_token_ids == [1]
                with pytest.raises(ValueError, match="already in use on this client: same"):
                    async for _ in client.generate("same", [3], PARAMS):
                        pass
                assert client.num_requests == 1  # the first's route, untouched
                assert (await anext(first)).new_token_ids == [2]  # and it goes on
            twice = [EngineRequest("dup", [5], PARAMS), EngineRequest("dup", [6], PARAMS)]
            with pytest.raises(ValueError, match="already in use on this client: dup"):
                async with client.open(twice):
                    pass
            async for out in client.generate("same", [4], PARAMS):  # free again
                assert out.new_token_ids == [4]
            assert client.num_requests == 0

    asyncio.run(main())


def test_async_leaving_a_group_early_aborts_the_rest(
    address: EngineAddress, engine: EchoEngine
) -> None:
    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            # Never finished by the engine (ignore_eos): only leaving the loop ends it.
            endless = SamplingParams(max_tokens=8, ignore_eos=True)
            async with contextlib.aclosing(client.generate("early", [1, 2, 3], endless)) as outs:
                async for out in outs:
                    assert out.new_token_ids == [1]
                    break
            assert client.num_requests == 0
            async for out in client.generate("next", [4], PARAMS):  # served as before
                assert out.new_token_ids == [4]
            # The abort goes out from a task the client spawns (abort() never blocks), so it can
            # follow "next" onto the socket: wait for the engine's thread to have read it.
            deadline = time.monotonic() + 5
            while not engine.aborted and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert engine.aborted == ["early"]

    asyncio.run(main())


def test_async_close_fails_what_is_in_flight(address: EngineAddress) -> None:
    """A request waiting on an engine that never answers ends with EngineDeadError when the
    client closes, rather than waiting forever."""

    async def main() -> None:
        eng = EchoEngine(address)
        client = AsyncEngineClient(address)
        await client.connect(timeout=10)
        eng.stop()  # nobody answers from now on
        group = client.open([EngineRequest("r", [1, 2], PARAMS)])
        async with group:
            await client.close("going away")
            (index, item, _), *_ = await asyncio.wait_for(group.next_batch(), 5)
        assert index == 0 and isinstance(item, EngineDeadError) and "going away" in str(item)

    asyncio.run(main())


def test_a_silent_engine_stays_healthy_until_it_is_declared_dead(address: EngineAddress) -> None:
    """A step longer than a heartbeat's interval is silence with nothing wrong (a long prompt on
    a slow device): the client stays healthy (/health 200) until the silence reaches its
    dead_after_s, and only then is the engine declared dead."""

    async def main() -> None:
        eng = EchoEngine(address)
        async with AsyncEngineClient(address, dead_after_s=6.0) as client:
            await client.connect(timeout=10)
            eng.stop()  # silent from now on
            silent_since = time.monotonic()
            await asyncio.sleep(4.0)  # eight heartbeats' intervals without a word
            assert client.healthy and client.dead_reason is None
            while client.healthy and time.monotonic() - silent_since < 10:
                await asyncio.sleep(0.1)
            assert time.monotonic() - silent_since >= 6.0
            assert not client.healthy and "has not answered" in (client.dead_reason or "")

    asyncio.run(main())


def test_silence_after_an_announced_step_counts_from_its_expected_end(
    address: EngineAddress,
) -> None:
    """A heartbeat announcing a 4 s step, then silence, under a 1 s death limit: healthy through
    the step's expected time, declared dead once its expected end is a second past (a stuck step
    is still caught), the reason naming the announced step."""

    async def main() -> None:
        eng = EchoEngine(address, busy_for_s=4.0)
        async with AsyncEngineClient(address, dead_after_s=1.0) as client:
            await client.connect(timeout=10)
            await asyncio.sleep(0.3)  # the heartbeat that follows READY is read
            eng.stop()
            silent_since = time.monotonic()
            await asyncio.sleep(3.0)  # three death limits into the announced step
            assert client.healthy and client.dead_reason is None
            while client.healthy and time.monotonic() - silent_since < 10:
                await asyncio.sleep(0.05)
            assert time.monotonic() - silent_since >= 4.0
            assert "past the 4 s step it announced" in (client.dead_reason or "")

    asyncio.run(main())


def test_a_read_announcement_does_not_stretch_a_later_generate(address: EngineAddress) -> None:
    """The sync client: a heartbeat announcing a step, read during one generate(), is not kept
    for the next, whose silence limit stays its own (the engine stopped: TimeoutError within
    about that limit, not the announced step's 20 s)."""
    eng = EchoEngine(address, busy_for_s=20.0)
    try:
        with EngineClient(address) as client:
            client.connect(timeout=10)
            outs = list(client.generate("first", [1, 2], PARAMS, timeout=5.0))
            assert [o.new_token_ids for o in outs] == [[1], [2]]
            eng.stop()
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="sent nothing for 1 s"):
                list(client.generate("second", [3], PARAMS, timeout=1.0))
            assert time.monotonic() - started < 5.0
    finally:
        if not eng.stopping.is_set():
            eng.stop()


def test_a_message_after_an_announced_step_ends_it(address: EngineAddress) -> None:
    """The engine speaks between steps only: a message after the announcement (here a control
    reply) ends the announced step, so silence after it counts from that message, not from
    the announced step's end (a stuck engine is not given the rest of the announced time)."""

    async def main() -> None:
        eng = EchoEngine(address, busy_for_s=60.0, garbage=False)
        async with AsyncEngineClient(address, dead_after_s=1.0) as client:
            await client.connect(timeout=10)
            await asyncio.sleep(0.3)  # the announcement is read
            await client.control(ControlKind.STATS)  # and a message after it
            eng.stop()
            silent_since = time.monotonic()
            while client.healthy and time.monotonic() - silent_since < 10:
                await asyncio.sleep(0.05)
            assert not client.healthy and time.monotonic() - silent_since < 5.0
            assert "announced" not in (client.dead_reason or "")

    asyncio.run(main())


def test_async_watchdog_fails_requests_when_the_process_dies(address: EngineAddress) -> None:
    alive = [True]

    async def main() -> None:
        eng = EchoEngine(address)
        async with AsyncEngineClient(address, is_process_alive=lambda: alive[0]) as client:
            await client.connect(timeout=10)
            eng.stop()  # the engine goes silent with a request on its way
            async with client.open([EngineRequest("r", [1, 2], PARAMS)]) as group:
                alive[0] = False  # its process "exits": the watchdog sees it within 0.25 s
                [(index, item, _)] = await asyncio.wait_for(group.next_batch(), 5)
            assert index == 0 and isinstance(item, EngineDeadError)
            assert client.dead_reason == "the engine process exited" and not client.healthy
            with pytest.raises(EngineDeadError):
                await client.control(ControlKind.STATS)

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


@pytest.mark.parametrize(("max_resumes", "timeout"), [(-1, 60.0), (1, 0.0)])
def test_async_generate_refuses_bad_resume_settings(
    address: EngineAddress, engine: EchoEngine, max_resumes: int, timeout: float
) -> None:
    """Not a silent empty stream: a negative resume count or a timeout of nothing is an error."""

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            await client.connect(timeout=10)
            outputs = client.generate("bad", [1], PARAMS, max_resumes, resume_timeout=timeout)
            with pytest.raises(ValueError, match="max_resumes must be at least 0"):
                async for _ in outputs:
                    pass

    asyncio.run(main())


def test_a_client_that_met_another_protocol_waits_for_a_later_engine(
    address: EngineAddress,
) -> None:
    """A reply that did not decode fails that handshake only: the same client's next connect
    waits for an engine that starts later (it failed at once, on the stale reply)."""
    other = OtherVersionEngine(address)
    with EngineClient(address) as client:
        with pytest.raises(HandshakeError):
            client.connect(timeout=60)
        other.stop()
        later: list[EchoEngine] = []
        starter = threading.Timer(0.5, lambda: later.append(EchoEngine(address)))
        starter.start()
        try:
            assert client.connect(timeout=30) == READY
        finally:
            starter.join()
            for eng in later:
                eng.stop()


def test_token_ids_print_their_top_logprobs_when_asked() -> None:
    """`tandem client --token-ids ... --logprobs N` prints each token's top N beside it."""
    import io

    from protocol.client_cli import _IdPrinter
    from protocol.messages import RequestOutput, TokenLogprobs

    out = io.StringIO()
    printer = _IdPrinter(out)
    lps = [TokenLogprobs(-0.5, [7, 9], [-0.5, -1.25]), TokenLogprobs(-0.1, [], [])]
    printer.feed(RequestOutput("r", [7, 3], logprobs=lps))
    printer.feed(RequestOutput("r", [4]))
    assert out.getvalue() == "7(-0.5000 [7:-0.500 9:-1.250]) 3(-0.1000) 4 "


# ---- a second engine on a live address -------------------------------------------------------


def test_a_second_engine_cannot_take_a_live_ipc_address(address: EngineAddress) -> None:
    """ZMQ binds an ipc path by replacing its file: a second engine on a live engine's address
    would take new clients from it with no error. The bind refuses it (and `tandem engine`
    before it loads a model); a dead engine's stale files are still replaced."""
    import subprocess
    import sys

    eng = EchoEngine(address)
    try:
        ctx = zmq.Context()
        try:
            with pytest.raises(AddressInUse, match="another process is serving at"):
                bind_engine_sockets(ctx, address)
        finally:
            ctx.term()
        cli = subprocess.run(
            [sys.executable, "-m", "frontend.cli", "engine", "--address", str(address)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 2, cli.stderr
        assert "another process is serving at" in cli.stderr and "Traceback" not in cli.stderr
        with EngineClient(address) as still:  # the first engine still answers
            assert still.connect(timeout=10) is not None
    finally:
        eng.stop()
    assert all(os.path.exists(p) for p in address.ipc_paths)  # stale files of a stopped engine
    again = EchoEngine(address)
    again.stop()
