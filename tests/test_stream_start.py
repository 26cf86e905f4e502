"""How a streamed request starts (frontend/app.py ``start_stream``): its engine requests go out
before its response is set up, a burst's requests all go out before any of them sets up its
response, and a response that never streams aborts what was sent.

The engine side is a real RequestGroup on no client (opening it records the send instead of
sending; what it would abort is kept), as in tests/test_generation_engine_death.py; the serving
context holds only what ``start_stream`` and a Generation read. The streamed path end to end,
disconnects included, is tested with a real server in tests/test_openai_server.py and
tests/test_disconnect_storm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from types import SimpleNamespace
from typing import Any

from frontend.app import AdmittedStreamingResponse, start_stream
from frontend.generation import Generation
from protocol.client import EngineRequest, RequestGroup
from protocol.messages import FinishReason, RequestOutput, SamplingParams


class NoMetrics:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class RecordingGroup(RequestGroup):
    """Opening records the send in the shared log; aborting keeps the ids it would abort."""

    log: list[tuple[str, str]]
    aborted: list[str] | None = None

    async def send(self) -> None:
        self.log.append(("send", self.requests[0].request_id))

    def abort_unfinished(self) -> None:
        self.aborted = sorted(self.unfinished)


class RecordingEngine:
    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log
        self.groups: list[RecordingGroup] = []

    def open(self, requests: Sequence[EngineRequest], wake_every: int | None) -> RequestGroup:
        group = RecordingGroup(None, requests, wake_every)  # type: ignore[arg-type]
        group.log = self.log
        self.groups.append(group)
        return group


class Lease:
    def __init__(self) -> None:
        self.returned = 0

    def release(self) -> None:
        self.returned += 1


def serving_context(engine: RecordingEngine, leases: list[Lease]) -> Any:
    async def wait_for_engine() -> None:
        return None

    def admit(num_sequences: int) -> Lease:
        leases.append(Lease())
        return leases[-1]

    return SimpleNamespace(
        served_model="m",
        engine=engine,
        metrics=NoMetrics(),
        max_resumes=0,
        resume_timeout_s=1.0,
        eos_token_ids=(),
        wait_for_engine=wait_for_engine,
        admit=admit,
        check_generates=lambda: None,  # a generative model
        tokenizer=SimpleNamespace(
            decode=lambda ids: "".join(f"<{i}>" for i in ids), byte_level=False
        ),
    )


def generation(ctx: Any, name: str) -> Generation:
    params = SamplingParams(max_tokens=2)
    return Generation(ctx, [[1, 2, 3]], [params], 1, [], name, 0.0, 16)


async def deltas_text(ctx: Any, body: Any, gen: Generation) -> AsyncGenerator[str, None]:
    async for deltas in gen.run():
        yield "".join(d.text for d in deltas)


def test_a_burst_sends_every_request_before_any_sets_up_its_response() -> None:
    log: list[tuple[str, str]] = []
    leases: list[Lease] = []
    ctx = serving_context(RecordingEngine(log), leases)
    encoded = asyncio.Event()  # the prompt encode that the whole burst waits on

    async def one(name: str) -> AdmittedStreamingResponse:
        async def prepare(ctx: Any, body: Any) -> Generation:
            await encoded.wait()
            return generation(ctx, name)

        response = await start_stream(ctx, SimpleNamespace(num_sequences=1), prepare, deltas_text)
        log.append(("response", f"{name}-0"))
        return response  # type: ignore[return-value]

    async def burst() -> list[AdmittedStreamingResponse]:
        tasks = [asyncio.ensure_future(one(f"cmpl-{i}")) for i in range(4)]
        await asyncio.sleep(0)  # every request waits on the encode
        encoded.set()
        return await asyncio.gather(*tasks)

    responses = asyncio.run(burst())
    kinds = [kind for kind, _ in log]
    assert kinds == ["send"] * 4 + ["response"] * 4, log
    assert sorted(rid for _, rid in log[:4]) == [f"cmpl-{i}-0" for i in range(4)]
    for response in responses:
        response.release()  # as the response does when it ends without having streamed
    assert [g.aborted for g in ctx.engine.groups] == [[f"cmpl-{i}-0"] for i in range(4)]
    assert [lease.returned for lease in leases] == [1] * 4


def test_a_stream_that_runs_takes_its_sent_requests_over() -> None:
    log: list[tuple[str, str]] = []
    leases: list[Lease] = []
    ctx = serving_context(RecordingEngine(log), leases)

    async def prepare(ctx: Any, body: Any) -> Generation:
        return generation(ctx, "cmpl-a")

    async def stream_all() -> list[str]:
        response = await start_stream(ctx, SimpleNamespace(num_sequences=1), prepare, deltas_text)
        assert isinstance(response, AdmittedStreamingResponse)
        group = ctx.engine.groups[0]
        now = asyncio.get_running_loop().time()
        group.deliver(0, RequestOutput("cmpl-a-0", [5, 6], FinishReason.LENGTH), now)
        texts = [chunk async for chunk in response.content]
        response.release()
        return texts

    assert asyncio.run(stream_all()) == ["<5><6>"]
    # Sent once (not again by run), and nothing left unfinished to abort at the end.
    assert log == [("send", "cmpl-a-0")]
    assert [g.aborted for g in ctx.engine.groups] == [[]]
    assert leases[0].returned == 1


def test_a_failed_prepare_returns_the_lease_and_sends_nothing() -> None:
    log: list[tuple[str, str]] = []
    leases: list[Lease] = []
    ctx = serving_context(RecordingEngine(log), leases)

    async def prepare(ctx: Any, body: Any) -> Generation:
        raise ValueError("a prompt too long")

    async def start() -> None:
        await start_stream(ctx, SimpleNamespace(num_sequences=1), prepare, deltas_text)

    try:
        asyncio.run(start())
    except ValueError:
        pass
    else:
        raise AssertionError("start_stream swallowed the error")
    assert log == [] and leases[0].returned == 1
