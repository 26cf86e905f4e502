"""The three ways the load generator reaches an engine: two OpenAI HTTP routes and raw ZMQ.

Each backend's ``send(spec, rec)`` sends one request, stamps ``rec`` (submit, every chunk that
carried output, end) on the shared run clock, fills in the token counts, and raises on failure;
the runner turns a raise into a failed record. HTTP backends stream server-sent events over
``ConnectionLanes``: as many keep-alive connections as the concurrency asked for, so the client
library never caps the offered load, each in an ``httpx.AsyncClient`` of its own (see there why);
token counts come from the final usage chunk (``stream_options.include_usage``). The ZMQ backend
drives the raw asyncio client, whose one reader task routes each engine step's outputs to the
waiting requests by id.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from loadgen.metrics import RequestRecord
from loadgen.workload import RequestSpec
from protocol.client import AsyncEngineClient, EngineRequest, RequestItem, is_last
from protocol.messages import FinishReason, SamplingParams

BACKENDS = ("openai-completions", "openai-chat", "zmq")
CONNECT_TIMEOUT_S = 60.0  # zmq: the engine handshake's wait, unless --connect-timeout says


class Clock:
    """Seconds since the start of the current run; one clock shared by runner and backend."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def origin(self) -> float:
        """The run's start on time.perf_counter's clock (CLOCK_MONOTONIC: one for all processes
        on the machine, so client processes can share a timeline)."""
        return self._t0


@dataclass(frozen=True)
class RequestOptions:
    """What every request asks for besides its prompt and length."""

    temperature: float = 0.0
    ignore_eos: bool = False
    pretok: bool = False  # HTTP: send token ids as the prompt rather than text
    output_interval: int = 1  # zmq: tokens the engine gathers before it sends them


class BackendError(RuntimeError):
    """A request failed: an HTTP error status, an error event, or an engine error."""


class Backend(Protocol):
    """What the runner needs of a backend."""

    kind: str
    wants_ids: bool
    clock: Clock

    async def start(self) -> None: ...

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None: ...

    async def close(self) -> None: ...


# ---- HTTP -------------------------------------------------------------------------------------


class OpenAIBackend:
    """Streams /v1/completions or /v1/chat/completions over keep-alive connection lanes."""

    def __init__(
        self,
        kind: str,
        url: str,
        clock: Clock,
        options: RequestOptions,
        pool_size: int,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        if kind not in ("openai-completions", "openai-chat"):
            raise ValueError(f"not an HTTP backend: {kind}")
        if kind == "openai-chat" and options.pretok:
            raise ValueError("--pretok needs openai-completions: chat takes messages, not ids")
        self.kind = kind
        self.base = api_base(url)
        self.clock = clock
        self.options = options
        self.model = model
        # --model A,B,...: the requests name each in turn (LoRA adapters of one base model).
        self._names = itertools.cycle(model.split(",")) if model and "," in model else None
        self.model_root: str | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeouts = httpx.Timeout(timeout, connect=30.0)
        self.lanes = ConnectionLanes(max(1, pool_size), headers, timeouts)

    @property
    def wants_ids(self) -> bool:
        return self.options.pretok

    async def start(self) -> None:
        """Learn the served model's name (unless given) and where its weights live."""
        async with self.lanes.lane() as http:
            resp = await http.get(f"{self.base}/models")
            raise_for_status(resp, await resp.aread())
        card = resp.json()["data"][0]
        self.model = self.model or card["id"]
        self.model_root = card.get("root")

    async def close(self) -> None:
        await self.lanes.aclose()

    def body(self, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
        """The route and JSON body for one request."""
        body: dict[str, Any] = {
            "model": self.model if self._names is None else next(self._names),
            "max_tokens": spec.output_len,
            "temperature": self.options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.options.ignore_eos:
            body["ignore_eos"] = True  # a vLLM-style extra: only sent when asked for
        if self.kind == "openai-chat":
            one_message = [{"role": "user", "content": spec.prompt_text}]
            body["messages"] = spec.messages or one_message
            return "/chat/completions", body
        body["prompt"] = spec.prompt_ids if self.options.pretok else spec.prompt_text
        return "/completions", body

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        route, body = self.body(spec)
        rec.submitted_at = self.clock.now()
        async with (
            self.lanes.lane() as http,
            http.stream("POST", self.base + route, json=body) as resp,
        ):
            if resp.status_code != 200:
                raise_for_status(resp, await resp.aread())
            lines = resp.aiter_lines()
            reply: list[str] | None = [] if spec.keep_reply else None
            done = await self.read_stream(sse_events(lines), rec, reply)
            rec.ended_at = self.clock.now()
            await drain(lines)
        if not done:
            raise BackendError("the stream ended without [DONE]")
        if rec.finish_reason is None:
            raise BackendError("the stream ended without a finish reason")
        if reply is not None:
            rec.reply = "".join(reply)

    async def read_stream(
        self, events: AsyncIterator[str], rec: RequestRecord, reply: list[str] | None = None
    ) -> bool:
        """Stamp every event that carries output, its text appended to ``reply`` when one is
        given; True when the stream ended with [DONE]."""
        usage: dict[str, Any] | None = None
        chunks = 0
        async for data in events:
            now = self.clock.now()
            if data.strip() == "[DONE]":
                break
            event = json.loads(data)
            if error := event.get("error"):
                message = error.get("message", error) if isinstance(error, dict) else error
                raise BackendError(f"error event: {message}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                text = choice_text(choice)
                # The chat role chunk carries no text: it is not a token and not the TTFT.
                if text or choice.get("finish_reason"):
                    rec.chunk_times.append(now)
                    chunks += 1 if text else 0
                if text and reply is not None:
                    reply.append(text)
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
        else:
            return False
        if usage:
            rec.prompt_len = int(usage.get("prompt_tokens", rec.prompt_len))
            rec.output_tokens = int(usage.get("completion_tokens", chunks))
        else:
            rec.output_tokens = chunks  # a server without usage: one token per text chunk
        return True


async def drain(lines: AsyncIterator[str], timeout: float = 1.0) -> None:
    """Read what follows ``[DONE]`` (the chunked body's end), so that httpx keeps the connection
    for the next request rather than closing an unfinished response. A server that holds the
    stream open past ``timeout`` loses the connection instead."""

    async def rest() -> None:
        async for _ in lines:
            pass

    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        await asyncio.wait_for(rest(), timeout)


class ConnectionLanes:
    """At most ``size`` HTTP/1.1 keep-alive connections, each in an ``httpx.AsyncClient`` of its
    own, lent to one request at a time; a request past ``size`` waits for a lane to come back.

    Why not one client with a pool of ``size``: httpcore 1.0's pool walks every connection it holds
    on each request and each release (encode/httpx#3215), so a burst of n requests over kept
    connections costs O(n²). On the CPU machine one process took about 0.5 s of CPU to put 64
    streamed requests on the wire through one pool of 64 idle connections, the last arriving
    450-530 ms after the first was sent; in lanes, 50-90 ms of CPU and 14-48 ms. (The load
    generator used to close each connection at [DONE] instead, which kept it clear of that; on a
    GPU machine's host the lanes changed no measured throughput: they are for small machines.
    docs/design/frontend-host-costs.md, "Tried and dropped", the last paragraph.)"""

    def __init__(self, size: int, headers: dict[str, str], timeout: httpx.Timeout) -> None:
        self._headers = headers
        self._timeout = timeout
        # One TLS context for every lane: each client would otherwise load the CA bundle itself
        # (about 20 ms apiece, seconds for a few hundred lanes).
        self._tls = httpx.create_ssl_context()
        self._slots = asyncio.Semaphore(size)
        self._idle: list[httpx.AsyncClient] = []
        self._opened: list[httpx.AsyncClient] = []

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client no other request is using; its connection is kept for the next one."""
        async with self._slots:
            client = self._idle.pop() if self._idle else self._open()
            try:
                yield client
            finally:
                self._idle.append(client)

    def _open(self) -> httpx.AsyncClient:
        one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        client = httpx.AsyncClient(
            headers=self._headers, limits=one, timeout=self._timeout, verify=self._tls
        )
        self._opened.append(client)
        return client

    async def aclose(self) -> None:
        for client in self._opened:
            await client.aclose()
        self._opened.clear()
        self._idle.clear()


def choice_text(choice: dict[str, Any]) -> str | None:
    """The text of one streamed choice: ``text`` for completions, ``delta.content`` for chat."""
    if "text" in choice:
        return choice["text"]
    return (choice.get("delta") or {}).get("content")


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def raise_for_status(resp: httpx.Response, content: bytes) -> None:
    if resp.status_code == 200:
        return
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode(errors="replace")
    raise BackendError(f"HTTP {resp.status_code}: {message}")


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event: ``data:`` lines joined, events ended by a blank line."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # comments (":...") and other fields (event:, id:, retry:) carry nothing we use
    if data:
        yield "\n".join(data)


async def engine_addresses(url: str, api_key: str | None = None) -> list[str]:
    """The raw ZMQ addresses of the engine cores behind a `tandem serve` (its GET /v1/engine:
    every data-parallel engine's, or the one engine's)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as http:
        resp = await http.get(f"{api_base(url)}/engine")
        raise_for_status(resp, await resp.aread())
        info = resp.json()
        engines = info.get("engines") or [info]
        return [str(engine["address"]) for engine in engines]


# ---- ZMQ --------------------------------------------------------------------------------------


class ZmqBackend:
    """Token ids straight to the engine cores through the raw asyncio client (whose one reader
    task routes each step's outputs to the request's queue). With several engines (a
    data-parallel server's) each request goes to the one with the fewest in flight, as the
    server's own pool sends them."""

    kind = "zmq"
    wants_ids = True

    def __init__(
        self,
        addresses: list[str],
        clock: Clock,
        options: RequestOptions,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.addresses = addresses
        self.clock = clock
        self.options = options
        self.connect_timeout = connect_timeout
        self.clients: list[AsyncEngineClient] = []
        self.in_flight: list[int] = []  # requests each engine is running for this run
        self.model: str | None = None
        self.vocab: list[int] | None = None

    async def start(self) -> None:
        for address in self.addresses:
            client = AsyncEngineClient(address, name="loadgen")
            self.clients.append(client)
            ready = await client.connect(self.connect_timeout)
            if self.model is not None and ready.model != self.model:
                raise BackendError(
                    f"the engines serve different models: {self.model!r} and {ready.model!r} "
                    f"(at {address})"
                )
            self.model = ready.model
            eos = set(ready.eos_token_ids)
            self.vocab = [i for i in range(ready.vocab_size) if i not in eos]
        self.in_flight = [0] * len(self.clients)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        """Run one request to its end; cancelling it (a timeout) aborts it in the engine, which
        frees its KV blocks."""
        assert self.clients and spec.prompt_ids is not None
        params = SamplingParams(
            max_tokens=spec.output_len,
            temperature=self.options.temperature,
            ignore_eos=self.options.ignore_eos,
        )
        interval = self.options.output_interval
        request = EngineRequest(rec.request_id, spec.prompt_ids, params, 0, interval)
        engine = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        self.in_flight[engine] += 1
        rec.submitted_at = self.clock.now()
        try:
            async with self.clients[engine].open([request]) as group:
                while group.unfinished:
                    batch = await group.next_batch()
                    now = self.clock.now()
                    for _, item, _ in batch:
                        if is_last(item):
                            group.finished(0)
                        record_item(rec, item, now)
        finally:
            self.in_flight[engine] -= 1


def record_item(rec: RequestRecord, item: RequestItem, now: float) -> None:
    """Account for one output (or the error) of a request; BackendError if it failed."""
    if isinstance(item, Exception):
        rec.ended_at = now
        raise BackendError(str(item))
    if item.new_token_ids:
        rec.chunk_times.append(now)
        rec.output_tokens += len(item.new_token_ids)
    reason = item.finish_reason
    if reason is not None:
        rec.finish_reason = reason.openai_name
        rec.ended_at = now
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            raise BackendError(f"the engine finished it with '{reason.openai_name}'")


async def open_backend(args: argparse.Namespace, clock: Clock) -> Backend:
    """The backend the flags name, started."""
    options = RequestOptions(args.temperature, args.ignore_eos, args.pretok, args.output_interval)
    if args.backend == "zmq":
        addresses = args.address or await engine_addresses(args.url, args.api_key)
        timeout = args.connect_timeout or CONNECT_TIMEOUT_S
        backend: Backend = ZmqBackend(addresses, clock, options, timeout)
    else:
        backend = OpenAIBackend(
            args.backend, args.url, clock, options, pool_size(args), args.model, args.api_key,
            args.request_timeout,
        )  # fmt: skip
    await backend.start()
    return backend


def pool_size(args: argparse.Namespace) -> int:
    """HTTP connections to keep: one per request that may be in flight at once."""
    if args.conversations is not None:  # a conversation has one turn in flight at a time
        return min(args.max_concurrency or args.conversations, args.conversations)
    caps = [args.max_concurrency or args.num_requests]
    if args.sweep is not None and args.sweep.param == "concurrency":
        caps += [int(v) for v in args.sweep.values]
    return min(max(caps), args.num_requests)
