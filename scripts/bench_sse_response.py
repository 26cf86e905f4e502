"""What one streamed response's ASGI call costs the API process, apart from its chunks: the
app's SSE response (frontend/app.py: AdmittedStreamingResponse) against Starlette's own
StreamingResponse, which under uvicorn's ASGI 2.3 opens an anyio task group per response.

    python scripts/bench_sse_response.py [--responses 20000]

Each response sends one chunk; receive() waits for ever (a client that stays) and send() does
nothing, on one uvloop event loop as the server runs. Prints microseconds per response, three
rounds, the two alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvloop
from starlette.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from frontend.app import SSE_HEADERS, AdmittedStreamingResponse  # noqa: E402

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}  # what uvicorn's httptools gives


async def one_chunk() -> AsyncIterator[str]:
    yield "data: {}\n\n"


async def client_stays() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def discard(_message: Any) -> None:
    pass


async def per_response_us(make: Callable[[], Any], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        await make()(SCOPE, client_stays, discard)
    return (time.perf_counter() - start) / count * 1e6


def ours() -> AdmittedStreamingResponse:
    return AdmittedStreamingResponse(one_chunk(), lambda: None)


def starlettes() -> StreamingResponse:
    return StreamingResponse(one_chunk(), media_type="text/event-stream", headers=SSE_HEADERS)


async def main(count: int) -> None:
    for _ in range(3):
        theirs = await per_response_us(starlettes, count)
        mine = await per_response_us(ours, count)
        print(f"Starlette's StreamingResponse {theirs:.1f} us a response, ours {mine:.1f} us")
    print(f"command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=20000)
    uvloop.run(main(parser.parse_args().responses))
