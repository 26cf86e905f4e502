"""The frontend's one connection to the engine core.

One reader task awaits the protocol client and routes each message: a step's RequestOutputs go to
the asyncio queue of the HTTP request that owns them, a RequestError goes through the same queue,
control replies resolve the future of the call that asked, and every message counts as a sign of
life. A watchdog fails every queue with EngineDeadError once the engine process has exited (seen
within _WATCHDOG_INTERVAL_S) or been silent too long, so no HTTP request ever waits forever; while
the engine is down but its process lives (a stall, or a remote engine that restarted and forgot
us), it says HELLO every second so the engine is taken back as soon as it answers. Routing is a
dict lookup per output: no locks, since everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import zmq

from protocol.messages import (
    ControlKind,
    EngineMessage,
    Ready,
    RequestError,
    RequestOutput,
    SamplingParams,
    Stats,
    StepOutputs,
)

if TYPE_CHECKING:
    from protocol.curve import CurveClientKeys

logger = logging.getLogger("tandem.frontend")

HEALTH_WINDOW_S = 3.0  # /health is 200 only if the engine spoke this recently (heartbeat 0.5 s)
DEAD_AFTER_S = 30.0  # in-flight requests fail after this much silence (a long step is not death)
_WATCHDOG_INTERVAL_S = 0.25
_REHELLO_INTERVAL_S = 1.0


class EngineDeadError(Exception):
    """The engine core is gone (exited, or silent for too long): answer 503."""


class EngineRequestError(Exception):
    """The engine refused or failed one request."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


QueueItem = tuple[int, RequestOutput | Exception]


@dataclass
class _Route:
    queue: asyncio.Queue[QueueItem]
    index: int  # which choice of the HTTP request this engine request is


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AsyncEngine:
    """Async facade over protocol.client.AsyncEngineClient with one routing reader task."""

    def __init__(
        self,
        address: Any,
        is_process_alive: Callable[[], bool] = lambda: True,
        dead_after_s: float = DEAD_AFTER_S,
        curve: CurveClientKeys | None = None,
    ) -> None:
        from protocol.client import AsyncEngineClient

        self.address = address
        self._client = AsyncEngineClient(address, name="tandem-frontend", curve=curve)
        self._is_process_alive = is_process_alive
        self._dead_after_s = dead_after_s
        self._routes: dict[str, _Route] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_seen = 0.0
        self._last_hello = 0.0
        self._dead_reason: str | None = None
        self.ready: Ready | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, timeout: float) -> Ready:
        """Handshake (fails fast if the process exits first), then start reader and watchdog."""
        handshake = asyncio.ensure_future(self._client.connect(timeout=timeout))
        while not handshake.done():
            if not self._is_process_alive():
                handshake.cancel()
                raise EngineDeadError("the engine process exited before its handshake")
            await asyncio.wait({handshake}, timeout=0.2)
        self.ready = handshake.result()
        self._last_seen = time.monotonic()
        self._spawn(self._read_loop())
        self._spawn(self._watch_loop())
        return self.ready

    async def close(self, reason: str = "the frontend is shutting down") -> None:
        """Fail what is in flight with ``reason``, refuse new requests, close the sockets (what
        they still queue is dropped, so nothing reaches an engine started later)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        self._client.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- state --------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while the engine answers: a message (heartbeats included) seen very recently."""
        recent = time.monotonic() - self._last_seen < HEALTH_WINDOW_S
        return self._dead_reason is None and recent and self._is_process_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why new requests are refused (None while the engine is up)."""
        return self._dead_reason

    @property
    def num_requests(self) -> int:
        """Engine requests sent and not yet finished, failed or aborted (frontend state)."""
        return len(self._routes)

    # ---- requests -----------------------------------------------------------------------------

    def open(self, requests: Sequence[EngineRequest]) -> RequestGroup:
        """Send requests whose outputs share one queue; abort what is unfinished on exit."""
        return RequestGroup(self, requests)

    async def _add(
        self, queue: asyncio.Queue[QueueItem], requests: Sequence[EngineRequest]
    ) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        for index, r in enumerate(requests):
            self._routes[r.request_id] = _Route(queue, index)
        for r in requests:
            await self._client.add_request(r.request_id, r.prompt_token_ids, r.params)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Tell the engine to drop these requests; never blocks (safe in cleanup paths)."""
        ids = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if ids and self._dead_reason is None:
            self._spawn(self._send_abort(ids))

    async def _send_abort(self, ids: list[str]) -> None:
        try:
            await self._client.abort(ids)
        except Exception:  # the engine is going away; the watchdog reports it
            logger.warning("could not send an abort for %d requests", len(ids))

    async def stats(self, timeout: float = 2.0) -> Stats | None:
        """The engine's counters (running, waiting, KV blocks) through a STATS control call."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        reply = await self._client.control(ControlKind.STATS, timeout=timeout)
        return reply.stats

    # ---- the reader and the watchdog ----------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            try:
                msg = await self._client.recv()
            except zmq.ZMQError as exc:  # the socket is closed: the frontend is stopping
                logger.debug("engine reader stopped: %s", exc)
                return
            self._last_seen = time.monotonic()
            if self._dead_reason is not None and self._is_process_alive():
                logger.warning("the engine core answers again")
                self._dead_reason = None
            self._route(msg)

    def _route(self, msg: EngineMessage) -> None:
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                self._deliver(out.request_id, out, out.finish_reason is not None)
            for rid, reason in msg.finished_without_tokens.items():
                self._deliver(rid, RequestOutput(rid, [], reason), True)
        elif isinstance(msg, RequestError):
            self._deliver(msg.request_id, EngineRequestError(msg.message, msg.code), True)

    def _deliver(self, request_id: str, item: RequestOutput | Exception, last: bool) -> None:
        route = self._routes.pop(request_id, None) if last else self._routes.get(request_id)
        if route is not None:
            route.queue.put_nowait((route.index, item))

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            if self._dead_reason is None and (reason := self._why_dead()) is not None:
                self._declare_dead(reason)
            elif self._dead_reason is not None and self._is_process_alive():
                await self._hello_again()

    async def _hello_again(self) -> None:
        now = time.monotonic()
        if now - self._last_hello < _REHELLO_INTERVAL_S:
            return
        self._last_hello = now
        try:
            await self._client.hello()
        except zmq.ZMQError as exc:
            logger.debug("could not send HELLO: %s", exc)

    def _why_dead(self) -> str | None:
        if not self._is_process_alive():
            return "the engine process exited"
        silent = time.monotonic() - self._last_seen
        if silent > self._dead_after_s:
            return f"the engine has not answered for {silent:.0f} s"
        return None

    def _declare_dead(self, reason: str) -> None:
        """Fail every request in flight. A process exit is final; a silent engine that speaks
        again is taken back (the reader clears the reason), so abort what we gave up on."""
        logger.error("engine core unavailable: %s", reason)
        self._dead_reason = reason
        ids = self._fail_all(EngineDeadError(reason))
        if ids and self._is_process_alive():
            self._spawn(self._send_abort(ids))

    def _fail_all(self, error: Exception) -> list[str]:
        routes, self._routes = self._routes, {}
        for route in routes.values():
            route.queue.put_nowait((route.index, error))
        return list(routes)


class RequestGroup:
    """The engine requests behind one HTTP request (n choices × prompts), sharing one queue.

    ``async with engine.open(reqs) as group`` sends them; leaving the block, by return, error or
    cancellation (a client that disconnected), aborts every request that has not finished.
    """

    def __init__(self, engine: AsyncEngine, requests: Sequence[EngineRequest]) -> None:
        self._engine = engine
        self.requests = list(requests)
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self.unfinished = {r.request_id for r in self.requests}

    async def __aenter__(self) -> RequestGroup:
        try:
            await self._engine._add(self.queue, self.requests)
        except BaseException:
            self._engine.abort([r.request_id for r in self.requests])
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._engine.abort(sorted(self.unfinished))

    async def next_batch(self) -> list[QueueItem]:
        """Wait for at least one item, then take everything already queued (one SSE flush)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def finished(self, index: int) -> None:
        """The caller saw choice ``index`` end (or stopped it itself and aborted it)."""
        self.unfinished.discard(self.requests[index].request_id)

    def stop(self, index: int) -> None:
        """End one choice early (a stop string matched): abort it in the engine now."""
        rid = self.requests[index].request_id
        self.unfinished.discard(rid)
        self._engine.abort([rid])
