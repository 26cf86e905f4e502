"""An embedding request whose engine dies: the inputs that have their vectors keep them, the
others are sent again (and only they); a death in the batch that brings the last vector ends
nothing early and resumes nothing.

The engine side is a real RequestGroup fed by hand, as the client's reader feeds it (the group
is never opened on a client); the serving context holds only what an Embedding reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from frontend.embeddings import Embedding
from protocol.client import EngineDeadError, EngineRequest, RequestGroup
from protocol.messages import FinishReason, PoolingParams, RequestOutput

PROMPTS = [[1, 2], [3], [4, 5, 6]]


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
    """The first group gets the vectors of its first ``before_death`` requests, then the
    engine's death; a later group gets every vector."""

    def __init__(self, before_death: int) -> None:
        self.before_death = before_death
        self.groups: list[HandFedGroup] = []
        self.resume_waits = 0

    def open(self, requests: Sequence[EngineRequest], wake_every: int | None) -> RequestGroup:
        group = HandFedGroup(None, requests, wake_every)  # type: ignore[arg-type]
        now = asyncio.get_running_loop().time()
        dies = not self.groups
        for i, r in enumerate(requests):
            if not dies or i < self.before_death:
                vector = [float(len(r.prompt_token_ids))]
                output = RequestOutput(r.request_id, [], FinishReason.POOLED, embedding=vector)
                group.deliver(i, output, now)
        if dies:
            group.deliver(0, EngineDeadError("the engine core exited"), now)
        self.groups.append(group)
        return group

    async def wait_until_serving(self, timeout: float) -> float:
        self.resume_waits += 1
        return 0.0


async def no_wait() -> None:
    return None


def embed_with(engine: DyingEngine, wave: int = len(PROMPTS)) -> list[list[float]]:
    ctx = SimpleNamespace(
        engine=engine,
        metrics=NoMetrics(),
        max_resumes=3,
        resume_timeout_s=120.0,
        wait_for_engine=no_wait,
    )
    embedding = Embedding(ctx, PROMPTS, PoolingParams(), 0.0, wave)  # type: ignore[arg-type]
    return asyncio.run(embedding.run())


def test_the_inputs_without_a_vector_are_sent_again() -> None:
    engine = DyingEngine(before_death=1)
    assert embed_with(engine) == [[2.0], [1.0], [3.0]]
    assert engine.resume_waits == 1
    sent = [[list(r.prompt_token_ids) for r in g.requests] for g in engine.groups]
    assert sent == [PROMPTS, PROMPTS[1:]]
    assert engine.groups[1].requests[0].pooling == PoolingParams()


def test_a_death_after_the_last_vector_resumes_nothing() -> None:
    engine = DyingEngine(before_death=len(PROMPTS))
    assert embed_with(engine) == [[2.0], [1.0], [3.0]]
    assert engine.resume_waits == 0 and len(engine.groups) == 1
    assert engine.groups[0].aborted == []


def test_inputs_go_a_wave_at_a_time_and_a_death_resumes_only_the_unfinished() -> None:
    """Two inputs a wave: the first wave's second input dies with its engine, so the resumed
    attempt's wave is that input and the third (the first wave's vector is kept)."""
    engine = DyingEngine(before_death=1)
    assert embed_with(engine, wave=2) == [[2.0], [1.0], [3.0]]
    sent = [[list(r.prompt_token_ids) for r in g.requests] for g in engine.groups]
    assert sent == [PROMPTS[:2], PROMPTS[1:]]
    assert engine.resume_waits == 1


def test_a_death_counts_as_resumed_only_the_inputs_its_wave_lost() -> None:
    """Three inputs, waves of two: the first wave's second input is cut by the death; the
    third was never sent, so it is no resumed request."""
    resumed: list[int] = []
    engine = DyingEngine(before_death=1)
    ctx = SimpleNamespace(
        engine=engine,
        metrics=SimpleNamespace(record_resumed=resumed.append, record_finished=print_nothing),
        max_resumes=3,
        resume_timeout_s=120.0,
        wait_for_engine=no_wait,
    )
    embedding = Embedding(ctx, PROMPTS, PoolingParams(), 0.0, 2)  # type: ignore[arg-type]
    assert asyncio.run(embedding.run()) == [[2.0], [1.0], [3.0]]
    assert resumed == [1]


def print_nothing(*args: object) -> None:
    pass


def test_a_request_past_the_bound_asks_for_what_is_free_and_never_the_whole_bound() -> None:
    from frontend.admission import AdmissionGate
    from frontend.embeddings import embedding_wave

    gate = AdmissionGate(32)
    ctx = SimpleNamespace(admission=gate)
    assert embedding_wave(ctx, 20) == 20  # within the bound: all or none, as every request
    held = gate.admit(10)
    assert embedding_wave(ctx, 40) == 22  # past it: what is free now, in waves
    assert embedding_wave(ctx, 30) == 30  # within it: all, so a 503 now rather than waves
    more = gate.admit(22)
    assert embedding_wave(ctx, 40) == 1  # nothing free: one, which the gate refuses (503)
    held.release()
    more.release()
