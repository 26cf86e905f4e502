"""The raw ZMQ client of an engine core, synchronous and asyncio; the frontend and scripts share it.

Token ids in, token ids out: no tokenizer here. The socket pattern and the HELLO/READY handshake
are described in ``protocol/address.py``. Typical use::

    with EngineClient("ipc:///run/user/1000/tandem-x/engine") as client:
        client.connect()
        for out in client.generate("r1", [1, 2, 3], SamplingParams(max_tokens=8)):
            print(out.new_token_ids)

For many requests at once, call ``add_request`` for each and read ``recv()`` in one loop (in the
asyncio client: one reader task), routing ``StepOutputs`` by request id.

HELLOs are sent without blocking: a DEALER whose connection was refused (a CURVE key the engine
does not accept) has no pipe to queue into, and a blocking send would hang instead of timing out.

Frames from the engine that fail to decode are logged and skipped. READY messages after the
handshake (answers to surplus HELLOs) refresh ``ready`` and are not returned; control replies
are consumed by ``control()`` and never returned by ``recv()``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from protocol.address import (
    EngineAddress,
    as_address,
    check_identity,
    connect_client_sockets,
    new_identity,
)
from protocol.codec import ProtocolError, decode_engine_message, encode
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    ClientMessage,
    Control,
    ControlKind,
    ControlReply,
    EngineMessage,
    Hello,
    Ready,
    RequestError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
)

if TYPE_CHECKING:
    from protocol.curve import CurveClientKeys

logger = logging.getLogger(__name__)

HELLO_INTERVAL_S = 0.1


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request (a RequestError for it arrived)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(f"request {error.request_id!r} failed ({error.code}): {error.message}")
        self.error = error


class _ClientBase:
    """State and message routing shared by the sync and asyncio clients."""

    def __init__(
        self,
        address: EngineAddress | str,
        identity: bytes | None,
        name: str,
        new_context: Callable[[], zmq.Context],
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.address = as_address(address)
        self.identity = check_identity(identity) if identity is not None else new_identity()
        self.name = name
        self.ready: Ready | None = None
        self._ctx = new_context()
        try:
            self._input, self._output = connect_client_sockets(
                self._ctx, self.address, self.identity, curve
            )
        except BaseException:
            self._ctx.term()
            raise
        self._buffer: deque[EngineMessage] = deque()  # read while waiting for something else
        self._tokens = itertools.count(1)
        self._closed = False

    def close(self) -> None:
        """Close both sockets and the context; pending messages are discarded."""
        if self._closed:
            return
        self._closed = True
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()

    def _hello(self) -> bytes:
        return encode(Hello(self.name))

    def _add_frame(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> bytes:
        # Any int sequence (tuple, numpy array) packs like a list, so no copy into one here.
        return encode(AddRequest(request_id, prompt_token_ids, params))  # type: ignore[arg-type]

    def _decode(self, frame: bytes) -> EngineMessage | None:
        try:
            return decode_engine_message(frame)
        except ProtocolError as exc:
            logger.warning("skipped a malformed message from the engine: %s", exc)
            return None

    def _absorb(self, msg: EngineMessage) -> EngineMessage | None:
        """Keep what is not for the caller of recv(): late READYs and control replies."""
        if isinstance(msg, Ready):
            self.ready = msg
            return None
        if isinstance(msg, ControlReply):
            self._on_control_reply(msg)
            return None
        return msg

    def _on_control_reply(self, reply: ControlReply) -> None:
        logger.debug("dropped a control reply nobody waits for (token %d)", reply.token)

    def _timeout_error(self, timeout: float) -> TimeoutError:
        return TimeoutError(
            f"no READY from an engine at {self.address} within {timeout:g} s: is an engine "
            f"(`tandem engine` or `tandem serve`) running there, speaking protocol version "
            f"{PROTOCOL_VERSION}?"
        )


class EngineClient(_ClientBase):
    """Synchronous client. Not thread-safe: use it from one thread.

    ``curve``: this client's CURVE keys, for an engine on tcp:// that requires them
    (``protocol.curve.load_client_keys``); with wrong keys ``connect()`` times out.
    """

    def __init__(
        self,
        address: EngineAddress | str,
        *,
        identity: bytes | None = None,
        name: str = "",
        curve: CurveClientKeys | None = None,
    ) -> None:
        super().__init__(address, identity, name, zmq.Context, curve)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout: float = 60.0) -> Ready:
        """HELLO/READY handshake; raises TimeoutError when no READY comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        hello = self._hello()
        while True:
            _send_nowait(self._input, hello)
            retry_at = min(time.monotonic() + HELLO_INTERVAL_S, deadline)
            while (msg := self._read(_remaining(retry_at))) is not None:
                if isinstance(msg, Ready):
                    self.ready = msg
                    return msg
                if (msg := self._absorb(msg)) is not None:
                    self._buffer.append(msg)
            if time.monotonic() >= deadline:
                raise self._timeout_error(timeout)

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Send a request; invalid ids or params raise ProtocolError here, before sending."""
        self._input.send(self._add_frame(request_id, prompt_token_ids, params))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._send(Abort(list(request_ids)))

    def control(self, kind: ControlKind, timeout: float = 10.0) -> ControlReply:
        """Send a control message and wait for its reply; other messages meanwhile are kept."""
        token = next(self._tokens)
        self._send(Control(kind, token))
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read(_remaining(deadline))
            if msg is None:
                raise TimeoutError(f"no reply to control {kind.name} within {timeout:g} s")
            if isinstance(msg, ControlReply) and msg.token == token:
                return msg
            if (msg := self._absorb(msg)) is not None:
                self._buffer.append(msg)

    def recv(self, timeout: float | None = None) -> EngineMessage | None:
        """The next message (StepOutputs, RequestError, Heartbeat); None after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._buffer:
                return self._buffer.popleft()
            msg = self._read(_remaining(deadline))
            if msg is None:
                return None
            if (msg := self._absorb(msg)) is not None:
                return msg

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        timeout: float | None = None,
    ) -> Iterator[RequestOutput]:
        """Add one request and yield its outputs until it finishes.

        Raises EngineRequestError on a RequestError for it, TimeoutError when nothing arrives for
        ``timeout`` s. Leaving early aborts the request. Messages for other requests are kept
        for ``recv()``; do not interleave two generate() iterators on one client.
        """
        self.add_request(request_id, prompt_token_ids, params)
        others: list[EngineMessage] = []
        finished = False
        try:
            while not finished:
                msg = self.recv(timeout)
                if msg is None:
                    raise TimeoutError(f"no output for {request_id!r} within {timeout:g} s")
                try:
                    mine, rest = split_for_request(msg, request_id)
                except EngineRequestError:
                    finished = True  # the engine has already dropped it: nothing to abort
                    raise
                if rest is not None:
                    others.append(rest)
                for out in mine:
                    finished = out.finish_reason is not None
                    yield out
        finally:
            if not finished and not self._closed:
                self.abort([request_id])
            self._buffer.extendleft(reversed(others))

    def _send(self, msg: ClientMessage) -> None:
        self._input.send(encode(msg))

    def _read(self, timeout: float | None) -> EngineMessage | None:
        """One decoded message from the output socket; None when ``timeout`` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._output.poll(_poll_ms(_remaining(deadline))):
                if (msg := self._decode(self._output.recv())) is not None:
                    return msg
            elif deadline is not None and time.monotonic() >= deadline:
                return None


class AsyncEngineClient(_ClientBase):
    """asyncio client (zmq.asyncio). ``recv()`` is meant for ONE reader task.

    ``control()`` works with or without that reader: whoever is reading the socket hands the
    reply to the waiting ``control()`` call, and messages read by ``control()`` itself are kept
    for ``recv()``. An asyncio lock makes sure only one coroutine reads the socket at a time.
    """

    def __init__(
        self,
        address: EngineAddress | str,
        *,
        identity: bytes | None = None,
        name: str = "",
        curve: CurveClientKeys | None = None,
    ) -> None:
        super().__init__(address, identity, name, zmq.asyncio.Context, curve)
        self._lock = asyncio.Lock()
        self._waiters: dict[int, asyncio.Future[ControlReply]] = {}

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fut in self._waiters.values():
            fut.cancel()
        self._waiters.clear()
        super().close()

    async def connect(self, timeout: float = 60.0) -> Ready:
        """HELLO/READY handshake; raises TimeoutError when no READY comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        hello = self._hello()
        while True:
            _send_nowait(self._input, hello)
            retry_at = min(time.monotonic() + HELLO_INTERVAL_S, deadline)
            async with self._lock:
                while (msg := await self._read(_remaining(retry_at))) is not None:
                    if isinstance(msg, Ready):
                        self.ready = msg
                        return msg
                    if (msg := self._absorb(msg)) is not None:
                        self._buffer.append(msg)
            if time.monotonic() >= deadline:
                raise self._timeout_error(timeout)

    async def hello(self) -> None:
        """Send one HELLO without waiting: an engine that restarted (and so forgot this client)
        answers READY and heart-beats it again; ``recv()`` absorbs the READY."""
        _send_nowait(self._input, self._hello())

    async def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Send a request; invalid ids or params raise ProtocolError here, before sending."""
        await self._input.send(self._add_frame(request_id, prompt_token_ids, params))

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._send(Abort(list(request_ids)))

    async def control(self, kind: ControlKind, timeout: float = 10.0) -> ControlReply:
        """Send a control message and wait for its reply; other messages meanwhile are kept."""
        token = next(self._tokens)
        reply: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._waiters[token] = reply
        try:
            await self._send(Control(kind, token))
            return await asyncio.wait_for(self._await_reply(reply), timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply to control {kind.name} within {timeout:g} s") from None
        finally:
            self._waiters.pop(token, None)

    async def recv(self, timeout: float | None = None) -> EngineMessage | None:
        """The next message (StepOutputs, RequestError, Heartbeat); None after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._buffer:
                return self._buffer.popleft()
            if not await self._acquire(_remaining(deadline)):
                return None
            try:
                # control() may have filled the buffer while we waited for the lock.
                msg = None if self._buffer else await self._read(_remaining(deadline))
            finally:
                self._lock.release()
            if msg is None:
                if self._buffer:
                    continue
                return None
            if (msg := self._absorb(msg)) is not None:
                return msg

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Like EngineClient.generate; not to be mixed with a reader task on the same client."""
        await self.add_request(request_id, prompt_token_ids, params)
        others: list[EngineMessage] = []
        finished = False
        try:
            while not finished:
                msg = await self.recv(timeout)
                if msg is None:
                    raise TimeoutError(f"no output for {request_id!r} within {timeout:g} s")
                try:
                    mine, rest = split_for_request(msg, request_id)
                except EngineRequestError:
                    finished = True  # the engine has already dropped it: nothing to abort
                    raise
                if rest is not None:
                    others.append(rest)
                for out in mine:
                    finished = out.finish_reason is not None
                    yield out
        finally:
            if not finished and not self._closed:
                await self.abort([request_id])
            self._buffer.extendleft(reversed(others))

    async def _acquire(self, timeout: float | None) -> bool:
        """Take the read lock within ``timeout`` s (at once when it is free, even for 0 s)."""
        if not self._lock.locked():
            await self._lock.acquire()
            return True
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
        except TimeoutError:
            return False
        return True

    def _on_control_reply(self, reply: ControlReply) -> None:
        waiter = self._waiters.get(reply.token)
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)
        else:
            super()._on_control_reply(reply)

    async def _await_reply(self, reply: asyncio.Future[ControlReply]) -> ControlReply:
        """Wait for the reader to deliver ``reply``, or read the socket ourselves when idle."""
        while not reply.done():
            acquire = asyncio.ensure_future(self._lock.acquire())
            try:
                await asyncio.wait({reply, acquire}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                _drop_acquire(self._lock, acquire)
                raise
            if not acquire.done():
                _drop_acquire(self._lock, acquire)  # the reader delivered the reply
                continue
            try:
                while not reply.done():
                    msg = await self._read(None)
                    if msg is not None and (msg := self._absorb(msg)) is not None:
                        self._buffer.append(msg)
            finally:
                self._lock.release()
        return reply.result()

    async def _send(self, msg: ClientMessage) -> None:
        await self._input.send(encode(msg))

    async def _read(self, timeout: float | None) -> EngineMessage | None:
        """One decoded message from the output socket; None when ``timeout`` s pass first.

        The caller holds ``_lock``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # A poll can wake with no event (pyzmq's asyncio poller); only the clock says when.
            if await self._output.poll(_poll_ms(_remaining(deadline))):
                if (msg := self._decode(await self._output.recv())) is not None:
                    return msg
            elif deadline is not None and time.monotonic() >= deadline:
                return None


def split_for_request(
    msg: EngineMessage, request_id: str
) -> tuple[list[RequestOutput], EngineMessage | None]:
    """Split a message into ``request_id``'s outputs and what is left for other requests.

    A finish without tokens becomes a RequestOutput with no tokens; a RequestError for the
    request raises EngineRequestError.
    """
    if isinstance(msg, RequestError) and msg.request_id == request_id:
        raise EngineRequestError(msg)
    if not isinstance(msg, StepOutputs):
        return [], msg
    mine = [o for o in msg.outputs if o.request_id == request_id]
    reason = msg.finished_without_tokens.get(request_id)
    if not mine and reason is None:
        return [], msg
    others = [o for o in msg.outputs if o.request_id != request_id]
    finished = {rid: r for rid, r in msg.finished_without_tokens.items() if rid != request_id}
    if reason is not None:
        mine.append(RequestOutput(request_id, [], reason))
    return mine, StepOutputs(others, finished) if others or finished else None


def _drop_acquire(lock: asyncio.Lock, acquire: asyncio.Future[bool]) -> None:
    """Undo a lock.acquire() task that lost a race: cancel it, or release what it took."""
    if not acquire.done():
        acquire.cancel()  # asyncio.Lock hands the lock on if the grant raced the cancel
    elif not acquire.cancelled() and acquire.exception() is None:
        lock.release()


def _send_nowait(sock: zmq.Socket, frame: bytes) -> bool:
    """Send unless the socket would block (no connected pipe); False when it would have.

    An asyncio socket is sent on through a plain shadow of it, which fails at once instead of
    returning a future that waits (the caller is on the socket's event-loop thread)."""
    if isinstance(sock, zmq.asyncio.Socket):
        sock = zmq.Socket.shadow(sock.underlying)
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _poll_ms(timeout: float | None) -> int | None:
    return None if timeout is None else max(0, math.ceil(timeout * 1000))
