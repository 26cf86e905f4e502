"""A disconnect storm on the tiny server: 200 requests, streamed and not, each cut off at a random
point (before the answer, after some chunks, or never), leave no state behind: the frontend
routes no request and holds no admission, the engine has nothing running or waiting, every KV
block is free (or cached), and the block manager's integrity check passes."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.server_fixture import (  # noqa: F401
    TINY_MAX_NUM_SEQS,
    Server,
    tiny_server,
    wait_engine_idle,
    wait_frontend_idle,
)

pytestmark = pytest.mark.slow

STORM = 200
CONCURRENCY = 2 * TINY_MAX_NUM_SEQS  # within the admission bound, so few are turned away


async def cut_short(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """One request abandoned at a random point; returns how it ended, for the tally."""
    stream = rng.random() < 0.7
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"max_tokens": rng.randrange(4, 64), "ignore_eos": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"#{i}"}]
    else:
        path, body["prompt"] = "/v1/completions", f"Storm {i}"
    body["stream"] = stream
    if not stream:  # give up after a random wait: mid-prefill, mid-decode or after the end
        try:
            await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.0, 0.3))
        except TimeoutError:
            return "gave-up-waiting"
        return "finished"
    keep = rng.randrange(0, 12)  # chunks to read before hanging up; 0: as soon as headers come
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"status-{r.status_code}"
        read = 0
        async for line in r.aiter_lines():
            read += bool(line)
            if read > keep:
                return "hung-up"  # leaving the block closes the connection mid-stream
    return "finished"


async def storm(base_url: str) -> Counter[str]:
    rng = random.Random(8)
    gate = asyncio.Semaphore(CONCURRENCY)
    # No keep-alive: every abandoned request closes its own connection, as a browser tab would.
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)

    async def one(i: int) -> str:
        async with gate:
            return await cut_short(client, i, rng)

    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        return Counter(await asyncio.gather(*(one(i) for i in range(STORM))))


def test_disconnect_storm_leaves_no_state_anywhere(tiny_server: Server) -> None:
    outcomes = asyncio.run(storm(tiny_server.base_url))
    assert sum(outcomes.values()) == STORM
    assert outcomes["hung-up"] + outcomes["gave-up-waiting"] >= STORM // 2, outcomes
    assert set(outcomes) <= {"hung-up", "gave-up-waiting", "finished", "status-503"}, outcomes
    wait_frontend_idle(tiny_server)  # per-request routes and admission leases all returned
    wait_engine_idle(tiny_server)  # 0 running, 0 waiting, free + cached == total, integrity
    # And it still serves.
    body = {"prompt": "After the storm", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
