"""The load generator's HTTP connection lanes against a real socket server on loopback: no more
connections than the pool size, each of them reused, connections kept across runs, and every
streamed request read to its end."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from loadgen.backends import Clock, OpenAIBackend, RequestOptions
from loadgen.metrics import RequestRecord
from loadgen.workload import RequestSpec

CHUNKS = 3  # text events per response


@dataclass
class ServerLog:
    """What the server saw: each request's client port, and the most requests in flight."""

    ports: list[int] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: ServerLog
) -> None:
    """HTTP/1.1 keep-alive: /v1/models, and streamed completions of CHUNKS events and usage."""
    port = writer.get_extra_info("peername")[1]
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if head.startswith(b"GET /v1/models"):
                body = json.dumps({"data": [{"id": "m", "root": "m"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                continue
            log.ports.append(port)
            log.in_flight += 1
            log.most_in_flight = max(log.most_in_flight, log.in_flight)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            await asyncio.sleep(0.02)  # long enough for the others to pile up
            for _ in range(CHUNKS):
                event = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
                writer.write(_chunk(b"data: %s\n\n" % json.dumps(event).encode()))
            last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": CHUNKS}}
            for event in (last, usage):
                writer.write(_chunk(b"data: %s\n\n" % json.dumps(event).encode()))
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            log.in_flight -= 1
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _bursts(pool_size: int, requests: int, runs: int) -> tuple[ServerLog, list[list[int]]]:
    """``runs`` bursts of ``requests`` at once through one backend; the ports each run used."""
    log = ServerLog()
    server = await asyncio.start_server(lambda r, w: _serve_connection(r, w, log), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = OpenAIBackend(
        "openai-completions", f"http://127.0.0.1:{port}", Clock(), RequestOptions(), pool_size
    )
    spec = RequestSpec(None, "hello", CHUNKS)
    ports_per_run: list[list[int]] = []
    try:
        await backend.start()
        for run in range(runs):
            records = [RequestRecord(f"{run}-{i}", 0, CHUNKS, 0.0) for i in range(requests)]
            seen = len(log.ports)
            await asyncio.gather(*(backend.send(spec, rec) for rec in records))
            ports_per_run.append(log.ports[seen:])
            for rec in records:
                assert rec.ok and rec.finish_reason == "length"
                assert rec.output_tokens == CHUNKS and len(rec.chunk_times) == CHUNKS + 1
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
    return log, ports_per_run


def test_lanes_cap_connections_and_keep_them_across_runs() -> None:
    log, ports_per_run = asyncio.run(_bursts(pool_size=3, requests=7, runs=2))
    assert log.most_in_flight == 3  # the burst filled every lane, and no more
    first, second = (set(ports) for ports in ports_per_run)
    assert len(first) == 3  # connections are reused within a run ...
    assert second <= first  # ... and kept for the next (the models lookup's too)


def test_lanes_as_wide_as_the_burst_send_it_at_once() -> None:
    log, ports_per_run = asyncio.run(_bursts(pool_size=8, requests=8, runs=1))
    assert log.most_in_flight == 8
    assert len(set(ports_per_run[0])) == 8
