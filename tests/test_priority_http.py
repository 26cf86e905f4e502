"""`priority` over HTTP with the official openai client: taken by a server started with
--scheduling-policy priority on completions, chat and responses (a better priority is served
first when both wait for the one running seat), refused by name with a 400 on a first come,
first served server (streamed or not), and over the raw ZMQ client the engine itself refuses
it; every engine left idle with all its blocks free."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from protocol.client import EngineClient, EngineRequestError
from protocol.messages import ControlKind, SamplingParams, SchedulingPolicy
from tests.server_fixture import (  # noqa: F401
    Server,
    start_server,
    stop_server,
    tiny_server,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def ranked_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Server]:
    """The tiny model, ranking requests, with one running seat (the others wait in order)."""
    args = ["--scheduling-policy", "priority", "--max-num-seqs", "1", "--num-kv-blocks", "64"]
    srv = start_server(
        tmp_path_factory.mktemp("serve-ranked"), model=str(tiny_model_dir), args=args
    )
    yield srv
    stop_server(srv)


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0, timeout=120)


ROUTES = ("completions", "chat", "responses")


def ask(client: openai.OpenAI, route: str, priority: Any, stream: bool = False) -> Any:
    """One short request on ``route`` with ``priority``; a stream is read to its end."""
    model = client.models.list().data[0].id
    extra = {"priority": priority}
    if route == "completions":
        result: Any = client.completions.create(
            model=model, prompt="Hi", max_tokens=3, stream=stream, extra_body=extra
        )
    elif route == "chat":
        result = client.chat.completions.create(
            model=model, messages=USER, max_tokens=3, stream=stream, extra_body=extra
        )
    else:
        result = client.responses.create(
            model=model, input="Hi", max_output_tokens=3, stream=stream, extra_body=extra
        )
    return list(result) if stream else result


def test_a_priority_is_taken_on_every_route(ranked_server: Server) -> None:
    client = client_of(ranked_server)
    completion, chat, response = (ask(client, route, -7) for route in ROUTES)
    assert completion.choices[0].finish_reason == "length"
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete"  # max_output_tokens reached
    for route in ROUTES:
        assert ask(client, route, 2**63 - 1, stream=True)
    wait_engine_idle(ranked_server)


@pytest.mark.parametrize("stream", [False, True])
def test_first_come_first_served_refuses_a_priority_by_name(
    tiny_server: Server, stream: bool
) -> None:
    client = client_of(tiny_server)
    for route in ROUTES:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, route, 1, stream)
        assert info.value.status_code == 400
        assert info.value.body["param"] == "priority", info.value.body
        assert "--scheduling-policy priority" in info.value.body["message"]
        assert ask(client, route, 0, stream)  # 0, the default, is what it takes
    wait_engine_idle(tiny_server)


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, 1.5, "high"])
def test_a_priority_outside_int64_is_a_400(ranked_server: Server, priority: Any) -> None:
    for route in ROUTES:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client_of(ranked_server), route, priority)
        assert info.value.body["param"] == "priority", info.value.body


def engine_stats(srv: Server) -> Any:
    with EngineClient(srv.engine_address) as engine:
        engine.connect(timeout=30)
        return engine.control(ControlKind.STATS).stats


def test_the_better_priority_takes_the_seat_first(ranked_server: Server) -> None:
    """A stream holds the one running seat while "worse" (priority 5) and then "better"
    (priority -5) queue; once the stream is closed (its request aborted), "better" runs to its
    end before "worse" is admitted, so it is answered first."""

    async def scenario() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{ranked_server.base_url}/v1", api_key="none", max_retries=0, timeout=120
        )
        model = (await client.models.list()).data[0].id
        holder = await client.completions.create(
            model=model, prompt="Hi", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        await anext(aiter(holder))  # it runs: the seat is taken

        async def ask(name: str, priority: int) -> str:
            await client.completions.create(
                model=model,
                prompt="Hello there",
                max_tokens=24,
                extra_body={"priority": priority, "ignore_eos": True},
            )
            return name

        worse = asyncio.create_task(ask("worse", 5))
        await wait_for_waiting(1)
        better = asyncio.create_task(ask("better", -5))
        await wait_for_waiting(2)
        await holder.close()  # aborts the stream's request: the seat is free
        order = []
        for done in asyncio.as_completed([worse, better]):
            order.append(await done)
        return order

    async def wait_for_waiting(count: int) -> None:
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(engine_stats, ranked_server)).num_waiting < count:
            assert time.monotonic() < deadline, "the requests never queued"
            await asyncio.sleep(0.05)

    assert asyncio.run(scenario()) == ["better", "worse"]
    wait_engine_idle(ranked_server)


def test_the_engine_says_its_policy_and_refuses_a_priority_under_fcfs(
    tiny_server: Server, ranked_server: Server
) -> None:
    """Over the raw ZMQ client: Ready names the policy, and an FCFS engine refuses a priority
    itself (a client that skips the frontend's check gets the same answer)."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with EngineClient(ranked_server.engine_address) as engine:
        assert engine.connect(timeout=30).scheduling_policy == SchedulingPolicy.PRIORITY
        outputs = list(engine.generate("ranked", [5, 6, 7], params, timeout=60, priority=-1))
        assert sum(len(o.new_token_ids) for o in outputs) == 2
    with EngineClient(tiny_server.engine_address) as engine:
        assert engine.connect(timeout=30).scheduling_policy == SchedulingPolicy.FCFS
        with pytest.raises(EngineRequestError) as info:
            list(engine.generate("fcfs", [5, 6, 7], params, timeout=60, priority=3))
        assert info.value.code == 400 and "--scheduling-policy priority" in info.value.message
    wait_engine_idle(tiny_server)
    wait_engine_idle(ranked_server)


def test_the_document_states_what_each_server_takes(
    tiny_server: Server, ranked_server: Server
) -> None:
    """/openapi.json: any int64 priority where the server ranks requests, only 0 where not."""
    for srv, low, high in ((ranked_server, -(2**63), 2**63 - 1), (tiny_server, 0, 0)):
        doc = httpx.get(f"{srv.base_url}/openapi.json", timeout=30).json()
        for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
            field = doc["components"]["schemas"][name]["properties"]["priority"]
            assert (field["minimum"], field["maximum"]) == (low, high), (srv.base_url, name)
