"""RequestGroup's wake-ups: a consumer is woken only when it has something to do (its
``wake_every``), takes everything delivered so far, and sees when each item arrived.

The reader task's side (``deliver``) is called here by hand, as the client's router calls it; the
groups are never opened, so no engine is involved. What the server streams with these groups is
tested end to end in tests/test_api_servers.py (the chunking rule) and tests/test_metrics.py (the
inter-token latency, counted per step whatever the wake-ups). Last, the other half of a quiet
event loop: the start-up heap frozen out of the garbage collector's reach.
"""

from __future__ import annotations

import asyncio

import pytest

from protocol.client import Delivery, EngineDeadError, EngineRequest, RequestGroup
from protocol.messages import FinishReason, RequestOutput, SamplingParams

NOT_WOKEN_S = 0.05


def group_of(num_requests: int, wake_every: int | None) -> RequestGroup:
    params = SamplingParams(max_tokens=64)
    requests = [EngineRequest(f"r{i}", [1, 2, 3], params) for i in range(num_requests)]
    return RequestGroup(None, requests, wake_every)  # type: ignore[arg-type]  # never opened


def tokens(rid: str, n: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(rid, list(range(n)), finish)


async def woken(group: RequestGroup) -> list[Delivery] | None:
    """What the consumer takes if it is woken now, else None."""
    try:
        return await asyncio.wait_for(group.next_batch(), NOT_WOKEN_S)
    except TimeoutError:
        return None


def test_every_output_wakes_by_default() -> None:
    async def scenario() -> None:
        group = group_of(1, wake_every=1)
        for step in range(3):
            group.deliver(0, tokens("r0", 1), arrived=float(step))
            batch = await woken(group)
            assert batch == [(0, tokens("r0", 1), float(step))]

    asyncio.run(scenario())


def test_wakes_for_first_tokens_then_every_n_since_the_last_flush() -> None:
    async def scenario() -> None:
        group = group_of(2, wake_every=4)
        group.deliver(0, tokens("r0", 1), arrived=1.0)
        assert [index for index, _, _ in await woken(group) or []] == [0]  # r0's first token
        group.flushed(0)
        for t in range(3):
            group.deliver(0, tokens("r0", 1), arrived=2.0 + t)
        assert await woken(group) is None  # 3 of 4
        group.deliver(1, tokens("r1", 1), arrived=5.0)  # r1's first token: wake
        batch = await woken(group)
        assert batch is not None
        assert [(i, t) for i, _, t in batch] == [(0, 2.0), (0, 3.0), (0, 4.0), (1, 5.0)]
        group.flushed(1)  # the consumer flushed r1's first token; r0's 3 were not due
        group.deliver(0, tokens("r0", 1), arrived=6.0)  # r0: 4 since its last flush
        assert [t for _, _, t in await woken(group) or []] == [6.0]
        group.flushed(0)
        group.deliver(0, tokens("r0", 2), arrived=7.0)
        group.deliver(1, tokens("r1", 3), arrived=7.0)
        assert await woken(group) is None  # 2 and 3 of 4
        group.deliver(1, tokens("r1", 1), arrived=8.0)
        assert len(await woken(group) or []) == 3

    asyncio.run(scenario())


@pytest.mark.parametrize("wake_every", [None, 16])
def test_ends_and_errors_always_wake(wake_every: int | None) -> None:
    async def scenario() -> None:
        group = group_of(2, wake_every)
        group.deliver(0, tokens("r0", 1), arrived=1.0)
        if wake_every is None:
            assert await woken(group) is None  # not streamed: only ends matter
        else:
            assert await woken(group) is not None
        group.deliver(0, tokens("r0", 1), arrived=2.0)
        assert await woken(group) is None
        group.deliver(0, tokens("r0", 1, FinishReason.LENGTH), arrived=3.0)
        batch = await woken(group)
        assert batch is not None and batch[-1][1].finish_reason == FinishReason.LENGTH
        error = EngineDeadError("gone")
        group.deliver(1, error, arrived=4.0)
        assert await woken(group) == [(1, error, 4.0)]

    asyncio.run(scenario())


def test_a_waiting_consumer_is_woken_by_a_later_delivery() -> None:
    async def scenario() -> None:
        group = group_of(1, wake_every=2)
        waiting = asyncio.ensure_future(group.next_batch())
        await asyncio.sleep(0)
        group.deliver(0, tokens("r0", 1), arrived=1.0)
        assert await asyncio.wait_for(waiting, 1.0) == [(0, tokens("r0", 1), 1.0)]

    asyncio.run(scenario())


def test_wake_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="output interval"):
        group_of(1, wake_every=0)


def test_freeze_startup_heap_puts_what_lives_beyond_the_collector() -> None:
    import gc

    from common.processes import freeze_startup_heap

    startup = [[i] for i in range(50_000)]  # long-lived containers, as a process's start-up
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(startup)
        collectable = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
        assert not any(id(x) in collectable for x in startup)
    finally:
        gc.unfreeze()  # the rest of the suite runs with the usual collector
    assert gc.get_freeze_count() == 0


def _young_collections_during(steps: int, live_per_step: int) -> int:
    """How many young collections a loop sets off whose every step holds ``live_per_step``
    containers at once, all freed by reference count (an engine step's plan and outputs)."""
    import gc

    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 0:
            started.append(1)

    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            live = [[i] for i in range(live_per_step)]
            del live
    finally:
        gc.callbacks.remove(count)
    return len(started)


def test_spread_young_collections_lets_a_step_die_before_any_collection() -> None:
    import gc

    from common.processes import YOUNG_COLLECTION_THRESHOLD, spread_young_collections

    default = gc.get_threshold()
    try:
        gc.set_threshold(700, *default[1:])  # CPython's default
        assert _young_collections_during(50, 2_000) >= 50  # at least one per step
        spread_young_collections()
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *default[1:])
        assert _young_collections_during(50, 2_000) <= 1  # none, or one already due
    finally:
        gc.set_threshold(*default)
