"""A Generation whose engine dies in the very batch that ends every choice: the request is done,
so its stream ends at once instead of waiting for an engine to resume on.

The engine side is a real RequestGroup fed by hand, as the client's reader feeds it (the group is
never opened on a client, so no engine is involved); the serving context holds only what a
Generation reads. What happens when an engine dies mid-request is tested end to end in
tests/test_resume.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from frontend.generation import ChoiceDelta, Generation
from protocol.client import EngineDeadError, EngineRequest, RequestGroup
from protocol.messages import FinishReason, RequestOutput, SamplingParams


class NoMetrics:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class HandFedGroup(RequestGroup):
    """A RequestGroup on no client: opening sends nothing, and what it would abort is kept."""

    aborted: list[str] | None = None

    async def send(self) -> None:
        pass

    def abort_unfinished(self) -> None:
        self.aborted = sorted(self.unfinished)


class DyingEngine:
    """Delivers each request's last tokens and the engine's death in one batch."""

    def __init__(self) -> None:
        self.resume_waits = 0
        self.groups: list[HandFedGroup] = []

    def open(self, requests: Sequence[EngineRequest], wake_every: int | None) -> RequestGroup:
        group = HandFedGroup(None, requests, wake_every)  # type: ignore[arg-type]
        now = asyncio.get_running_loop().time()
        for i, r in enumerate(requests):
            group.deliver(i, RequestOutput(r.request_id, [5, 6], FinishReason.LENGTH), now)
            group.deliver(i, EngineDeadError("the engine core exited"), now)
        self.groups.append(group)
        return group

    async def wait_until_serving(self, timeout: float) -> float:
        self.resume_waits += 1
        raise EngineDeadError("no engine came back")


async def wait_for_engine() -> None:
    return None


def test_an_engine_death_in_the_batch_that_ends_every_choice_ends_the_stream() -> None:
    engine = DyingEngine()
    ctx = SimpleNamespace(
        engine=engine,
        metrics=NoMetrics(),
        max_resumes=3,
        served_model="m",
        resume_timeout_s=120.0,
        eos_token_ids=(),
        wait_for_engine=wait_for_engine,
        tokenizer=SimpleNamespace(
            decode=lambda ids: "".join(f"<{i}>" for i in ids), byte_level=False
        ),
    )
    params = SamplingParams(max_tokens=2)
    gen = Generation(ctx, [[1, 2, 3]], [params] * 2, 2, [], "cmpl-x", 0.0, 16)  # type: ignore[arg-type]

    async def deltas() -> list[ChoiceDelta]:
        return [d async for batch in gen.run() for d in batch]

    out = asyncio.run(deltas())
    assert sorted((d.index, d.text, d.finish_reason) for d in out) == [
        (0, "<5><6>", "length"),
        (1, "<5><6>", "length"),
    ]
    assert gen.finished and engine.resume_waits == 0
    # One group, left with nothing unfinished to abort.
    assert [g.aborted for g in engine.groups] == [[]]
