"""The app's SSE response (frontend/app.py: AdmittedStreamingResponse) over a hand-driven ASGI
connection that behaves as uvicorn's does (receive() answers http.disconnect once the client
has gone or the response is complete): a stream runs to its end with the lease returned once; a
client that leaves mid-stream stops the stream, runs the generator's cleanup and ends the call
normally; a server that cancels the task mid-stream (its graceful shutdown ran out) ends the
stream with the route's last event and the call normally, and before the response began sees
its cancellation; the lease returns every time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from frontend.app import AdmittedStreamingResponse


class Connection:
    """One HTTP exchange as uvicorn runs it, from the app's side."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()  # the client closed the connection
        self.complete = asyncio.Event()  # the app sent its last body message

    async def receive(self) -> dict[str, Any]:
        done = [asyncio.ensure_future(e.wait()) for e in (self.gone, self.complete)]
        try:
            await asyncio.wait(done, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in done:
                task.cancel()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone.is_set():
            return  # uvicorn drops what is sent after a disconnect
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Chunks:
    """An SSE generator that records whether its cleanup ran."""

    def __init__(self, count: int, pause: asyncio.Event | None = None) -> None:
        self.count, self.pause, self.cleaned_up = count, pause, False

    async def stream(self) -> AsyncGenerator[str, None]:
        try:
            for i in range(self.count):
                if i == 1 and self.pause is not None:
                    await self.pause.wait()  # waits for tokens that never come
                yield f"data: {i}\n\n"
        finally:
            self.cleaned_up = True


CUT = "data: cut\n\ndata: [DONE]\n\n"


def respond(chunks: Chunks, releases: list[int]) -> AdmittedStreamingResponse:
    return AdmittedStreamingResponse(chunks.stream(), lambda: releases.append(1), lambda: CUT)


SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


def test_a_stream_runs_to_its_end_and_returns_its_lease_once() -> None:
    async def main() -> None:
        conn, chunks, releases = Connection(), Chunks(3), []
        await respond(chunks, releases)(SCOPE, conn.receive, conn.send)
        assert conn.sent[0]["type"] == "http.response.start"
        assert conn.bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        assert releases == [1] and chunks.cleaned_up
        await asyncio.sleep(0.01)  # the watcher, answered by the complete response, does nothing

    asyncio.run(main())


def test_a_client_that_leaves_mid_stream_stops_it_and_the_call_ends_normally() -> None:
    async def main() -> None:
        conn, chunks, releases = Connection(), Chunks(3, pause=asyncio.Event()), []
        call = asyncio.ensure_future(respond(chunks, releases)(SCOPE, conn.receive, conn.send))
        await asyncio.sleep(0.01)
        assert conn.bodies == [b"data: 0\n\n"]  # the stream waits on its second chunk
        conn.gone.set()
        await asyncio.wait_for(call, 1)  # returns, without a CancelledError
        assert chunks.cleaned_up and releases == [1]
        assert not call.cancelled()

    asyncio.run(main())


def test_a_server_that_cancels_a_stream_midway_ends_it_with_the_cut_event() -> None:
    async def main() -> None:
        conn, chunks, releases = Connection(), Chunks(3, pause=asyncio.Event()), []
        call = asyncio.ensure_future(respond(chunks, releases)(SCOPE, conn.receive, conn.send))
        await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.wait_for(call, 1)  # returns, without a CancelledError
        assert conn.bodies == [b"data: 0\n\n", CUT.encode()]
        assert conn.sent[-1]["more_body"] is False
        assert chunks.cleaned_up and releases == [1]

    asyncio.run(main())


def test_a_server_that_cancels_before_the_response_began_sees_the_cancellation() -> None:
    class SlowStart(Connection):
        async def send(self, message: dict[str, Any]) -> None:
            await asyncio.Event().wait()  # the start message never goes out

    async def main() -> None:
        conn, chunks, releases = SlowStart(), Chunks(3), []
        call = asyncio.ensure_future(respond(chunks, releases)(SCOPE, conn.receive, conn.send))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert conn.sent == [] and releases == [1]

    asyncio.run(main())


def test_the_chunk_that_ends_with_done_ends_the_response() -> None:
    """Our streams end with one chunk (last deltas, usage, [DONE]): it goes out as the response's
    last body, with no empty body after it, and the generator still cleans up."""

    async def stream(cleaned: list[bool]) -> AsyncGenerator[str, None]:
        try:
            yield "data: 0\n\n"
            yield "data: 1\n\ndata: [DONE]\n\n"
            yield "data: never\n\n"  # nothing follows [DONE]: the response has ended
        finally:
            cleaned.append(True)

    async def main() -> None:
        conn, releases, cleaned = Connection(), [], []
        response = AdmittedStreamingResponse(
            stream(cleaned), lambda: releases.append(1), lambda: CUT
        )
        await response(SCOPE, conn.receive, conn.send)
        assert conn.bodies == [b"data: 0\n\n", b"data: 1\n\ndata: [DONE]\n\n"]
        assert [m.get("more_body") for m in conn.sent[1:]] == [True, False]
        assert releases == [1] and cleaned == [True]

    asyncio.run(main())


def test_a_server_that_cancels_after_the_last_chunk_adds_no_cut_event() -> None:
    """The content ended (its last chunk out) but the empty last body waits for a slow client
    when the server cancels: the response ends with that empty body, no error after the end."""

    class SlowEnd(Connection):
        held = False

        async def send(self, message: dict[str, Any]) -> None:
            last = message.get("body") == b"" and not message.get("more_body", False)
            if last and not self.held:
                self.held = True
                await asyncio.Event().wait()  # the first try waits until cancelled
            await super().send(message)

    async def main() -> None:
        conn, chunks, releases = SlowEnd(), Chunks(2), []
        call = asyncio.ensure_future(respond(chunks, releases)(SCOPE, conn.receive, conn.send))
        await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.wait_for(call, 1)
        assert conn.bodies == [b"data: 0\n\n", b"data: 1\n\n", b""]
        assert releases == [1]

    asyncio.run(main())


def test_a_client_that_leaves_while_the_cut_event_is_sent_ends_the_call_normally() -> None:
    """The server cuts the stream, the cut event's send waits on a slow client, and the client
    goes meanwhile: the call still ends normally (no CancelledError for the server to log)."""

    class SlowCut(Connection):
        def __init__(self) -> None:
            super().__init__()
            self.cut_pending = asyncio.Event()
            self.flushed = asyncio.Event()

        async def send(self, message: dict[str, Any]) -> None:
            if message.get("body") == CUT.encode():
                self.cut_pending.set()
                await self.flushed.wait()  # the socket's buffer is full
            await super().send(message)

    async def main() -> None:
        conn, chunks, releases = SlowCut(), Chunks(3, pause=asyncio.Event()), []
        call = asyncio.ensure_future(respond(chunks, releases)(SCOPE, conn.receive, conn.send))
        await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.wait_for(conn.cut_pending.wait(), 1)
        conn.gone.set()  # the disconnect arrives while the cut waits to go out
        await asyncio.sleep(0.01)
        conn.flushed.set()
        await asyncio.wait_for(call, 1)  # returns, without a CancelledError
        assert not call.cancelled()
        assert chunks.cleaned_up and releases == [1]

    asyncio.run(main())


@pytest.mark.parametrize("text", ["a\u2028b", "x\x85y", "p\u2029q", "plain"])
def test_a_chunk_is_one_line_to_a_reader_that_splits_as_splitlines(text: str) -> None:
    """httpx's iter_lines (and requests') split where str.splitlines does, which JSON leaves
    raw at U+0085, U+2028 and U+2029: a random-token stream cut a chunk there and the load
    generator failed to decode it. Each event is one data line, decoding to the same text."""
    import json

    from httpx._decoders import LineDecoder

    from frontend.responses import EventWriter
    from frontend.sse import ChunkWriter, sse

    events = [
        ChunkWriter("cmpl-1", "text_completion", "default", True).chunk([{"text": text}]),
        sse({"error": {"message": text}}),
        EventWriter().event("response.output_text.delta", delta=text),
    ]
    for event in events:
        decoder = LineDecoder()
        lines = [*decoder.decode(event), *decoder.flush()]
        data = [line for line in lines if line.startswith("data: ")]
        assert len(data) == 1, lines
        assert text in json.dumps(json.loads(data[0].removeprefix("data: ")), ensure_ascii=False)
