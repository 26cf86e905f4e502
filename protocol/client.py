"""The raw ZMQ client of an engine core, synchronous and asyncio; the frontend and scripts share it.

Token ids in, token ids out: no tokenizer here. The socket pattern and the HELLO/READY handshake
are described in ``protocol/address.py``.

The synchronous ``EngineClient`` reads the socket in the caller's thread::

    with EngineClient("ipc:///run/user/1000/tandem-x/engine") as client:
        client.connect()
        for out in client.generate("r1", [1, 2, 3], SamplingParams(max_tokens=8)):
            print(out.new_token_ids)

For many requests at once, call ``add_request`` for each and read ``recv()`` in one loop.

The asyncio ``AsyncEngineClient`` owns one reader task that routes every message: a request's
outputs and errors go to the ``RequestGroup`` that sent it (stamped with the time they arrived),
control replies resolve the future of the call that asked, and every message is a sign of life.
A group wakes its consumer for every output by default; a consumer that only acts every N tokens
(a stream with ``--stream-interval N``) asks to be woken only then (``wake_every``), for a
request's first tokens, and for its end: at 256 streams that is 16 times fewer task switches.
A watchdog fails every group with EngineDeadError once the engine's process has exited or been
silent too long, so no caller waits forever::

    async with AsyncEngineClient(address) as client:
        await client.connect()
        async with client.open([EngineRequest("r1", [1, 2, 3], params)]) as group:
            ...  # await group.next_batch() until the request finishes

Both clients cut a message into per-request items the same way (``split_outputs``). HELLOs are
sent without blocking: a DEALER whose connection was refused (a CURVE key the engine does not
accept) has no pipe to queue into, and a blocking send would hang instead of timing out. Frames
from the engine that fail to decode are logged and skipped; the asyncio client also fails every
request in flight with a 500 (a lost step would leave them waiting for ever).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from protocol.address import (
    EngineAddress,
    as_address,
    check_identity,
    connect_client_sockets,
    new_identity,
)
from protocol.codec import ProtocolError, decode_engine_message, encode, encode_frames
from protocol.messages import (
    DROPPED_UNREACHABLE,
    HEARTBEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    ClientMessage,
    Control,
    ControlKind,
    ControlReply,
    EngineMessage,
    Heartbeat,
    Hello,
    ImageInput,
    LoraRef,
    PoolingParams,
    Ready,
    RequestError,
    RequestOutput,
    SamplingParams,
    Stats,
    StepOutputs,
)
from protocol.output_interval import IntervalCounter, OutputInterval

if TYPE_CHECKING:
    from protocol.curve import CurveClientKeys

logger = logging.getLogger(__name__)

HELLO_INTERVAL_S = 0.1
DEAD_AFTER_S = 30.0  # requests in flight fail after this much silence (a long step is not death)
# The shortest silence that may count as death: two heartbeats, so that an idle engine is never
# taken for dead between two of them.
MIN_DEAD_AFTER_S = 2 * HEARTBEAT_INTERVAL_S
WATCHDOG_INTERVAL_S = 0.25
REHELLO_INTERVAL_S = 1.0


def engine_timeout(text: str) -> float:
    """An argparse type for --engine-timeout: seconds, at least MIN_DEAD_AFTER_S."""
    value = float(text)
    if not MIN_DEAD_AFTER_S <= value < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_DEAD_AFTER_S:g} s (the engine sends a heartbeat every "
            f"{HEARTBEAT_INTERVAL_S:g} s between steps), got {text}"
        )
    return value


class EngineDeadError(Exception):
    """The engine core is gone (its process exited, or it was silent for too long)."""


class RequestDroppedError(EngineDeadError):
    """The engine dropped one request when it could not reach this client for a moment
    (RequestError code DROPPED_UNREACHABLE): as after the engine's death, it may be resumed."""


class HandshakeError(ConnectionError):
    """What answered the handshake is no engine this client can speak to: its reply does not
    decode (another protocol version, or not a Tandem engine)."""


class EngineRequestError(Exception):
    """The engine refused or failed one request (a RequestError for it arrived)."""

    def __init__(self, request_id: str, message: str, code: int = 400) -> None:
        super().__init__(f"request {request_id!r} failed ({code}): {message}")
        self.request_id = request_id
        self.message = message
        self.code = code


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    num_output_tokens: int = 0  # a resume: the prompt's tail that was generated already
    output_interval: int = 1  # tokens the engine gathers before it sends them (AddRequest)
    pooling: PoolingParams | None = None  # an embedding request (AddRequest)
    lora: LoraRef | None = None  # its LoRA adapter; a resume names it again (AddRequest)
    images: tuple[ImageInput, ...] = ()  # the prompt's images (AddRequest)
    priority: int = 0  # lower is scheduled sooner, where the engine ranks requests (AddRequest)

    def resumed(self, request_id: str, generated: Sequence[int]) -> EngineRequest:
        """This request again, for another engine, with ``generated`` (the tokens it produced
        since this request was sent) appended to its prompt as output."""
        prompt = [*self.prompt_token_ids, *generated]
        num_output = self.num_output_tokens + len(generated)
        return dataclasses.replace(
            self, request_id=request_id, prompt_token_ids=prompt, num_output_tokens=num_output
        )


RequestItem = RequestOutput | Exception  # what a request's consumer receives


# One item for a request of a group, as the reader handed it over: (the request's place in its
# group, its output or error, time.monotonic() when the reader took in the message that carried
# it). A plain tuple: one is made per request per engine step, and a NamedTuple's constructor
# costs five times as much.
Delivery = tuple[int, RequestItem, float]


def split_outputs(msg: EngineMessage) -> list[tuple[str, RequestItem]]:
    """Each request's share of one engine message, in order: its outputs (a finish without
    tokens as an output with no tokens) or, for a RequestError, an EngineRequestError. Messages
    that concern no request (heartbeats, READY, control replies) give nothing."""
    if isinstance(msg, StepOutputs):
        items: list[tuple[str, RequestItem]] = [(o.request_id, o) for o in msg.outputs]
        for rid, reason in msg.finished_without_tokens.items():
            items.append((rid, RequestOutput(rid, [], reason)))
        return items
    if isinstance(msg, RequestError):
        if msg.code == DROPPED_UNREACHABLE:
            return [(msg.request_id, RequestDroppedError(msg.message))]
        return [(msg.request_id, EngineRequestError(msg.request_id, msg.message, msg.code))]
    return []


def is_last(item: RequestItem) -> bool:
    """Whether nothing more will come for the request after ``item``."""
    return isinstance(item, Exception) or item.finish_reason is not None


class _Connection:
    """The two DEALER sockets, the handshake frames and decoding, shared by both clients."""

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
        self._undecodable: ProtocolError | None = None  # the last frame that did not decode
        self._ctx = new_context()
        try:
            self._input, self._output = connect_client_sockets(
                self._ctx, self.address, self.identity, curve
            )
        except BaseException:
            self._ctx.term()
            raise
        self._tokens = itertools.count(1)
        self._closed = False

    def _close_sockets(self) -> None:
        """Close both sockets and the context; what they still queue is dropped."""
        if self._closed:
            return
        self._closed = True
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()

    def _hello(self) -> bytes:
        return encode(Hello(self.name))

    @staticmethod
    def _add_frames(request: EngineRequest) -> list[bytes | memoryview]:
        """The ADD_REQUEST message's frames (its images' pixels after it, uncopied: sent with
        ``copy=False``, ZMQ holds the buffers until they are out); invalid ids or params raise
        ProtocolError here."""
        # Any int sequence (tuple, numpy array) packs like a list, so no copy into one here.
        msg = AddRequest(
            request.request_id,
            request.prompt_token_ids,  # type: ignore[arg-type]
            request.params,
            request.num_output_tokens,
            request.output_interval,
            request.pooling,
            request.lora,
            request.images,
            request.priority,
        )
        return encode_frames(msg)

    def _decode(self, frame: bytes) -> EngineMessage | None:
        try:
            return decode_engine_message(frame)
        except ProtocolError as exc:
            self._malformed(exc)
            return None

    def _malformed(self, error: ProtocolError) -> None:
        self._undecodable = error
        logger.warning("skipped a malformed message from the engine: %s", error)

    def _check_handshake_replies(self) -> None:
        """Before its READY an engine sends nothing a client must skip: a frame that does not
        decode then is an answer in another protocol, which no wait will fix."""
        if self._undecodable is not None:
            raise HandshakeError(
                f"the engine at {self.address} answered with a message that does not decode "
                f"({self._undecodable}): is it a Tandem engine of this version (protocol "
                f"{PROTOCOL_VERSION})?"
            )

    def _timeout_error(self, timeout: float) -> TimeoutError:
        return TimeoutError(
            f"no READY from an engine at {self.address} within {timeout:g} s: is an engine "
            f"(`tandem engine` or `tandem serve`) running there, speaking protocol version "
            f"{PROTOCOL_VERSION}?"
        )


# ---- synchronous ------------------------------------------------------------------------------


class EngineClient(_Connection):
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
        self._buffer: deque[EngineMessage] = deque()  # read while waiting for something else
        # Ids of the requests sent and not yet seen to end (or aborted): a second request under
        # one of them would be refused by the engine in an error that names the live one.
        self._live: set[str] = set()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close both sockets and the context; pending messages are discarded."""
        self._close_sockets()

    def connect(self, timeout: float = 60.0) -> Ready:
        """HELLO/READY handshake; raises TimeoutError when no READY comes within ``timeout``,
        HandshakeError at once when the reply does not decode."""
        deadline = time.monotonic() + timeout
        hello = self._hello()
        self._undecodable = None  # only this handshake's replies count
        while True:
            _send_nowait(self._input, hello)
            retry_at = min(time.monotonic() + HELLO_INTERVAL_S, deadline)
            while (msg := self._read(_remaining(retry_at))) is not None:
                if isinstance(msg, Ready):
                    self.ready = msg
                    return msg
                if (msg := self._absorb(msg)) is not None:
                    self._buffer.append(msg)
            self._check_handshake_replies()
            if time.monotonic() >= deadline:
                raise self._timeout_error(timeout)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_interval: int = 1,
        priority: int = 0,
    ) -> None:
        """Send a request; invalid ids or params raise ProtocolError here, before sending.
        ``output_interval``: the engine sends its tokens once this many have gathered (and its
        first token and its end at once), not every step. ``priority``: lower is scheduled
        sooner, on an engine whose Ready says it ranks requests (others refuse all but 0)."""
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use on this client")
        request = EngineRequest(
            request_id, prompt_token_ids, params, 0, output_interval, priority=priority
        )
        self._input.send_multipart(self._add_frames(request), copy=False)
        self._live.add(request_id)

    def abort(self, request_ids: Sequence[str]) -> None:
        self._live.difference_update(request_ids)
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
        priority: int = 0,
    ) -> Iterator[RequestOutput]:
        """Add one request (with ``priority``: see ``add_request``) and yield its outputs until
        it finishes.

        Raises EngineRequestError on a RequestError for it, TimeoutError when nothing arrives for
        ``timeout`` s. Leaving early aborts the request. Messages for other requests are kept
        for ``recv()``; do not interleave two generate() iterators on one client.
        """
        self.add_request(request_id, prompt_token_ids, params, priority=priority)
        others: list[EngineMessage] = []
        finished = False
        wait = timeout
        try:
            while not finished:
                msg = self.recv(wait)
                if msg is None:  # not even a heartbeat: the engine is gone or stuck
                    raise TimeoutError(
                        f"the engine sent nothing for {wait:g} s (not even a heartbeat) "
                        f"while {request_id!r} ran: it died or hangs"
                    )
                wait = _after(msg, timeout)
                mine, rest = split_for_request(msg, request_id)
                if rest is not None and not isinstance(rest, Heartbeat):  # stale once read
                    others.append(rest)
                for item in mine:
                    finished = is_last(item)
                    if isinstance(item, Exception):
                        raise item  # the engine has already dropped it: nothing to abort
                    yield item
        finally:
            if not finished and not self._closed:
                self.abort([request_id])
            self._buffer.extendleft(reversed(others))

    def _absorb(self, msg: EngineMessage) -> EngineMessage | None:
        """Keep what is not for the caller of recv(): late READYs and stale control replies
        (and note the requests a message ends)."""
        for request_id, item in split_outputs(msg):
            if is_last(item):
                self._live.discard(request_id)
        if isinstance(msg, Ready):
            self.ready = msg
            return None
        if isinstance(msg, ControlReply):
            logger.debug("dropped a control reply nobody waits for (token %d)", msg.token)
            return None
        return msg

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


def split_for_request(
    msg: EngineMessage, request_id: str
) -> tuple[list[RequestItem], EngineMessage | None]:
    """``request_id``'s items of a message (see ``split_outputs``) and what is left for others."""
    items = split_outputs(msg)
    mine = [item for rid, item in items if rid == request_id]
    if not mine:
        return [], msg
    if not isinstance(msg, StepOutputs):
        return mine, None  # a RequestError concerns one request
    others = [o for o in msg.outputs if o.request_id != request_id]
    finished = {rid: r for rid, r in msg.finished_without_tokens.items() if rid != request_id}
    return mine, StepOutputs(others, finished) if others or finished else None


# ---- asyncio ----------------------------------------------------------------------------------


@dataclass
class _Route:
    group: RequestGroup
    index: int  # the request's place in its group


class AsyncEngineClient(_Connection):
    """asyncio client with one reader task (see the module docstring).

    ``is_process_alive`` tells whether the engine's process lives (without it, death is seen
    only as ``dead_after_s`` of silence). While the engine is down but its process lives (a
    stall, or a remote engine that restarted and forgot us), the watchdog says HELLO every
    second, so the engine is taken back as soon as it answers. Everything runs on the event
    loop: routing is a dict lookup per output, with no locks.
    """

    def __init__(
        self,
        address: EngineAddress | str,
        *,
        identity: bytes | None = None,
        name: str = "",
        curve: CurveClientKeys | None = None,
        is_process_alive: Callable[[], bool] | None = None,
        dead_after_s: float = DEAD_AFTER_S,
    ) -> None:
        super().__init__(address, identity, name, zmq.asyncio.Context, curve)
        self._is_process_alive = is_process_alive or (lambda: True)
        self._dead_after_s = dead_after_s
        self._routes: dict[str, _Route] = {}
        self._replies: dict[int, asyncio.Future[ControlReply]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_seen = 0.0
        # Where a heartbeat announced a long step: its expected end (silence counts from it).
        self._busy_until = 0.0
        self._last_hello = 0.0
        self._dead_reason: str | None = "not connected"

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def connect(self, timeout: float = 60.0) -> Ready:
        """HELLO/READY handshake, then start the reader and the watchdog. Raises TimeoutError
        when no READY comes within ``timeout``, HandshakeError at once when the reply does not
        decode, EngineDeadError if the process exits first."""
        handshake = asyncio.ensure_future(self._handshake(timeout))
        while not handshake.done():
            if not self._is_process_alive():
                handshake.cancel()
                raise EngineDeadError("the engine process exited before its handshake")
            await asyncio.wait({handshake}, timeout=0.2)
        self.ready = handshake.result()
        self._last_seen, self._busy_until = time.monotonic(), 0.0
        self._dead_reason = None
        self._spawn(self._read_loop())
        self._spawn(self._watch_loop())
        return self.ready

    async def close(self, reason: str = "the client is closing") -> None:
        """Fail what is in flight with ``reason``, refuse new requests, close the sockets (what
        they still queue is dropped, so nothing reaches an engine started later)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        for reply in self._replies.values():
            if not reply.done():  # an error, not a cancel: a CancelledError ends the caller's task
                reply.set_exception(EngineDeadError(reason))
        self._replies.clear()
        self._close_sockets()

    # ---- state --------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True until the engine is declared dead (its process gone, or silent for
        ``dead_after_s``). A step longer than a heartbeat's interval (a long prompt on a slow
        device) is silence too, and no sign of death: /health stays 200 through it, as vLLM's."""
        return self._dead_reason is None and self._is_process_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why new requests are refused (None while the engine is up)."""
        return self._dead_reason

    @property
    def num_requests(self) -> int:
        """Requests sent and not yet finished, failed or aborted (as far as this client knows)."""
        return len(self._routes)

    # ---- requests -----------------------------------------------------------------------------

    def open(self, requests: Sequence[EngineRequest], wake_every: int | None = 1) -> RequestGroup:
        """Send requests whose outputs share one group; abort what is unfinished on exit.
        ``wake_every``: see ``RequestGroup``."""
        return RequestGroup(self, requests, wake_every)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        max_resumes: int = 0,
        resume_timeout: float = 60.0,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Add one request and yield its outputs until it finishes; EngineRequestError or
        EngineDeadError if it fails. Leaving early aborts it: at once inside
        ``contextlib.aclosing(...)``, else when asyncio finalizes the abandoned generator.

        ``max_resumes``: when the engine dies mid-request, wait for it to serve again
        (``resume_timeout`` s in all, over every resume) and send the request again with what it
        generated so far, as output, up to this many times: the outputs go on as if nothing
        happened (a seeded request draws what it would have drawn). Death is seen when the
        process exits (``is_process_alive``) or after ``dead_after_s`` of silence. ``priority``:
        lower is scheduled sooner, on an engine whose Ready says it ranks requests."""
        if max_resumes < 0 or not resume_timeout > 0:
            raise ValueError(
                f"max_resumes must be at least 0 and resume_timeout more than 0, got "
                f"{max_resumes} and {resume_timeout}"
            )
        request = EngineRequest(request_id, prompt_token_ids, params, priority=priority)
        wait_left = resume_timeout
        for attempt in range(max_resumes + 1):
            generated: list[int] = []
            try:
                # aclosing: when our caller leaves early, the request is aborted at once.
                async with contextlib.aclosing(self._outputs(request)) as outputs:
                    async for out in outputs:
                        generated += out.new_token_ids
                        yield out
                return
            except EngineDeadError:
                if attempt == max_resumes:
                    raise
                wait_left -= await self.wait_until_serving(wait_left)
                request = request.resumed(f"{request_id}~{attempt + 1}", generated)

    async def _outputs(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        async with self.open([request]) as group:
            while group.unfinished:
                for _, item, _ in await group.next_batch():
                    if is_last(item):
                        group.finished(0)
                    if isinstance(item, Exception):
                        raise item
                    yield item

    async def wait_until_serving(self, timeout: float) -> float:
        """Return once the engine answers (again), with the seconds waited; EngineDeadError
        after ``timeout`` s."""
        return await wait_while_dead(lambda: self._dead_reason, timeout, WATCHDOG_INTERVAL_S)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Tell the engine to drop these requests; never blocks (safe in cleanup paths)."""
        ids = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if ids and self._dead_reason is None:
            self._spawn(self._send_abort(ids))

    async def control(self, kind: ControlKind, timeout: float = 10.0) -> ControlReply:
        """Send a control message; the reader hands its reply over."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        token = next(self._tokens)
        reply: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._replies[token] = reply
        try:
            async with asyncio.timeout(timeout):  # the send too: it must never stall a caller
                await self._input.send(encode(Control(kind, token)))
                return await reply
        except TimeoutError:  # asyncio's own since Python 3.11, the floor this project sets
            raise TimeoutError(f"no reply to control {kind.name} within {timeout:g} s") from None
        finally:
            self._replies.pop(token, None)

    async def stats(self, timeout: float = 2.0) -> Stats | None:
        """The engine's counters (running, waiting, KV blocks) through a STATS control call."""
        return (await self.control(ControlKind.STATS, timeout)).stats

    def _check_ids_free(self, requests: Sequence[EngineRequest]) -> None:
        """ValueError for an id that a live request of this client has, or that two of
        ``requests`` share: a second route would orphan the first request's consumer."""
        given = Counter(r.request_id for r in requests)
        taken = sorted(rid for rid, n in given.items() if n > 1 or rid in self._routes)
        if taken:
            raise ValueError(f"request ids already in use on this client: {', '.join(taken)}")

    async def _add(self, group: RequestGroup, requests: Sequence[EngineRequest]) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        messages = [self._add_frames(r) for r in requests]  # ProtocolError before any is sent
        for index, r in enumerate(requests):
            self._routes[r.request_id] = _Route(group, index)
        for frames in messages:
            await self._input.send_multipart(frames, copy=False)

    async def _send_abort(self, ids: list[str]) -> None:
        try:
            await self._input.send(encode(Abort(ids)))
        except Exception:  # the engine is going away; the watchdog reports it
            logger.warning("could not send an abort for %d requests", len(ids))

    # ---- the handshake, the reader and the watchdog -------------------------------------------

    async def _handshake(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        hello = self._hello()
        self._undecodable = None  # only this handshake's replies count
        while True:
            _send_nowait(self._input, hello)
            retry_at = min(time.monotonic() + HELLO_INTERVAL_S, deadline)
            while (msg := await self._read(_remaining(retry_at))) is not None:
                if isinstance(msg, Ready):
                    return msg  # anything else before READY concerns no request of ours
            self._check_handshake_replies()
            if time.monotonic() >= deadline:
                raise self._timeout_error(timeout)

    async def _read_loop(self) -> None:
        # Recv on the same socket without the asyncio wrapper: once a poll has woken the
        # reader, everything already queued is taken in one go, with no await per message.
        drain = zmq.Socket.shadow(self._output.underlying)
        while True:
            try:
                msg = await self._read(None)
            except zmq.ZMQError as exc:  # the socket is closed: the client is stopping
                logger.debug("engine reader stopped: %s", exc)
                return
            while msg is not None:
                self._take(msg)
                msg = self._read_nowait(drain)

    def _read_nowait(self, drain: zmq.Socket) -> EngineMessage | None:
        """The next message already queued on the output socket, or None."""
        while True:
            try:
                frame = drain.recv(zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing queued (EAGAIN), or closed: the awaited read says
                return None
            if (msg := self._decode(frame)) is not None:
                return msg

    def _take(self, msg: EngineMessage) -> None:
        self._last_seen = time.monotonic()
        # Any other message ends an announced step: the engine speaks between steps only.
        announced = msg.busy_for_s if isinstance(msg, Heartbeat) else 0.0
        self._busy_until = self._last_seen + announced if announced else 0.0
        if self._dead_reason is not None and self._is_process_alive():
            logger.warning("the engine core answers again")
            self._dead_reason = None
        self._route(msg, self._last_seen)

    def _route(self, msg: EngineMessage, arrived: float) -> None:
        if isinstance(msg, Ready):
            self.ready = msg
        elif isinstance(msg, ControlReply):
            reply = self._replies.get(msg.token)
            if reply is not None and not reply.done():
                reply.set_result(msg)
        for rid, item in split_outputs(msg):
            last = is_last(item)
            route = self._routes.pop(rid, None) if last else self._routes.get(rid)
            if route is not None:
                route.group.deliver(route.index, item, arrived)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self._dead_reason is None and (reason := self._why_dead()) is not None:
                self._declare_dead(reason)
            elif self._dead_reason is not None and self._is_process_alive():
                self._hello_again()

    def _hello_again(self) -> None:
        now = time.monotonic()
        if now - self._last_hello >= REHELLO_INTERVAL_S:
            self._last_hello = now
            _send_nowait(self._input, self._hello())

    def _why_dead(self) -> str | None:
        if not self._is_process_alive():
            return "the engine process exited"
        now = time.monotonic()
        if now - max(self._last_seen, self._busy_until) > self._dead_after_s:
            busy = self._busy_until - self._last_seen
            step = f", past the {busy:.0f} s step it announced" if busy > 0 else ""
            return f"the engine has not answered for {now - self._last_seen:.0f} s{step}"
        return None

    def _declare_dead(self, reason: str) -> None:
        """Fail every request in flight. A process exit is final; a silent engine that speaks
        again is taken back (the reader clears the reason), so abort what we gave up on."""
        logger.error("engine core unavailable: %s", reason)
        self._dead_reason = reason
        ids = self._fail_all(EngineDeadError(reason))
        if ids and self._is_process_alive():
            self._spawn(self._send_abort(ids))

    def _malformed(self, error: ProtocolError) -> None:
        """A frame that does not decode may have carried any request's tokens: rather than
        leave every request in flight waiting for outputs that will never come, fail them (and
        abort them in the engine). Before the handshake nothing is in flight: just skip it."""
        if not self._routes:
            super()._malformed(error)
            return
        logger.error(
            "the engine sent a message that does not decode (%s): failing the %d requests in "
            "flight, whose outputs it may have held",
            error,
            len(self._routes),
        )
        message = f"the engine sent a malformed message ({error}); this request was failed"
        routes, self._routes = self._routes, {}
        now = time.monotonic()
        for rid, route in routes.items():
            route.group.deliver(route.index, EngineRequestError(rid, message, 500), now)
        self._spawn(self._send_abort(list(routes)))

    def _fail_all(self, error: Exception) -> list[str]:
        routes, self._routes = self._routes, {}
        now = time.monotonic()
        for route in routes.values():
            route.group.deliver(route.index, error, now)
        return list(routes)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read(self, timeout: float | None) -> EngineMessage | None:
        """One decoded message from the output socket; None when ``timeout`` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # A poll can wake with no event (pyzmq's asyncio poller); only the clock says when.
            if await self._output.poll(_poll_ms(_remaining(deadline))):
                if (msg := self._decode(await self._output.recv())) is not None:
                    return msg
            elif deadline is not None and time.monotonic() >= deadline:
                return None


class RequestGroup:
    """Engine requests whose outputs share one consumer (for the frontend: the prompts × n
    choices of one HTTP request).

    ``async with client.open(requests) as group`` sends them; leaving the block, by return,
    error or cancellation (a client that disconnected), aborts every request not finished.

    The reader hands each item over with ``deliver``; ``next_batch`` waits until the consumer
    has something to do, then takes everything delivered so far. When that is, the output
    interval ``wake_every`` says (protocol/output_interval.py), counting each request's tokens
    since the consumer last said it ``flushed`` that request: 1 (the default) wakes it for every
    output; N for a request's first tokens and once N have gathered; None only for what ends a
    request. Errors and ends always wake it. Each item keeps the time it arrived, so what the
    consumer measures does not depend on when it was woken.
    """

    def __init__(
        self,
        client: AsyncEngineClient,
        requests: Sequence[EngineRequest],
        wake_every: int | None = 1,
    ) -> None:
        interval = OutputInterval(wake_every)
        self._client = client
        self.requests = list(requests)
        self.unfinished = {r.request_id for r in self.requests}
        self._delivered: list[Delivery] = []
        self._due = False  # something delivered needs the consumer
        self._waiter: asyncio.Future[None] | None = None
        self._counters = [IntervalCounter(interval) for _ in self.requests]

    async def __aenter__(self) -> RequestGroup:
        await self.send()
        return self

    async def send(self) -> None:
        """Send the group's requests (what entering the block does); if sending fails, abort
        them all, since some may have gone. An id in use is refused before anything is sent
        (its abort would end the request that has it)."""
        self._client._check_ids_free(self.requests)
        try:
            await self._client._add(self, self.requests)
        except BaseException:
            self._client.abort([r.request_id for r in self.requests])
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort_unfinished()

    def abort_unfinished(self) -> None:
        """Abort every request of the group that has not finished (never blocks)."""
        self._client.abort(sorted(self.unfinished))

    def deliver(self, index: int, item: RequestItem, arrived: float) -> None:
        """Keep one item for request ``index``; wake the consumer if it needs it now."""
        self._delivered.append((index, item, arrived))
        if self._needs_consumer(index, item) and not self._due:
            self._due = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    def _needs_consumer(self, index: int, item: RequestItem) -> bool:
        """Whether ``item`` makes the group due (an error, an end, an output without tokens, or
        tokens the interval says are due)."""
        if isinstance(item, Exception):
            return True
        tokens = len(item.new_token_ids)
        ending = item.finish_reason is not None or not tokens
        return self._counters[index].add(tokens, ending)

    async def next_batch(self) -> list[Delivery]:
        """Wait until the consumer has something to do, then take every item delivered so far
        (index of the request in the group, its output or its error, when it arrived)."""
        while not self._due:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._due = False
        batch, self._delivered = self._delivered, []
        return batch

    def flushed(self, index: int) -> None:
        """The consumer sent out what request ``index`` had (``wake_every`` counts from here)."""
        self._counters[index].went_on()

    def finished(self, index: int) -> None:
        """The caller saw request ``index`` end (or stopped it itself and aborted it)."""
        self.unfinished.discard(self.requests[index].request_id)

    def stop(self, index: int) -> None:
        """End one request early (a stop string matched): abort it in the engine now."""
        rid = self.requests[index].request_id
        self.unfinished.discard(rid)
        self._client.abort([rid])


async def wait_while_dead(
    dead_reason: Callable[[], str | None], timeout: float, poll_s: float
) -> float:
    """Poll ``dead_reason`` every ``poll_s`` until it is None; return the seconds waited, or
    raise EngineDeadError with the last reason once ``timeout`` s have passed."""
    started = time.monotonic()
    while (reason := dead_reason()) is not None:
        if time.monotonic() - started >= timeout:
            raise EngineDeadError(f"{reason}; not back within {timeout:.0f} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - started


def _after(msg: EngineMessage, timeout: float | None) -> float | None:
    """How long to wait for the message after ``msg``: ``timeout``, and past a step that a
    heartbeat announced, that step's expected time too."""
    if timeout is not None and isinstance(msg, Heartbeat):
        return timeout + msg.busy_for_s
    return timeout


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
