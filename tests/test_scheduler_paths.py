"""The scheduler's fast paths against its general rules, on random workloads.

The scheduler writes two common cases out inline for speed: planning a running request whose
block table covers its chunk (``BlockManager.table_covering`` in ``_schedule_running``) and
updating a step in which every row sampled (``_update_decodes``). Each must do exactly what the
general rule does (``allocate_slots`` + ``_add_scheduled``; ``_update_row`` for every row). Two
schedulers are driven in lockstep through the same random workload, one with both fast paths
turned off, and every plan, every event and every request's state must agree at every step.
The driver overlaps as the engine core does: step N+1 is planned before step N's tokens arrive.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.config import EngineConfig
from engine_core.request import EngineOutput, Request, SchedulerOutput
from engine_core.scheduler import Scheduler
from protocol.messages import SamplingParams

BLOCK_SIZE = 4
EOS = 1


def general_only(scheduler: Scheduler) -> Scheduler:
    """The same scheduler with its two fast paths replaced by the general rules."""
    scheduler.block_manager.table_covering = lambda request, num_new: None  # type: ignore[method-assign]
    scheduler._update_decodes = scheduler._update_rows  # type: ignore[method-assign]
    return scheduler


def make_pair(
    num_blocks: int, max_num_seqs: int, budget: int, policy: str = "fcfs"
) -> tuple[Scheduler, Scheduler]:
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_seqs=min(max_num_seqs, budget),
        max_num_batched_tokens=budget,
        scheduling_policy=policy,
    )
    fast = Scheduler(config, num_blocks, 128, (EOS,))
    return fast, general_only(Scheduler(config, num_blocks, 128, (EOS,)))


def random_request(
    rng: random.Random, index: int, prefixes: list[list[int]], ranked: bool = False
) -> Request:
    prompt = rng.choice(prefixes)[: rng.randint(0, 12)]
    prompt += [rng.randrange(2, 40) for _ in range(rng.randint(1, 14))]
    params = SamplingParams(
        max_tokens=rng.randint(1, 20),
        min_tokens=rng.choice([0, 0, 2]),
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=tuple(rng.sample(range(2, 40), rng.choice([0, 0, 1]))),
        prompt_logprobs=rng.choice([None, None, None, 0]),
    )
    priority = rng.randint(-2, 2) if ranked else 0
    return Request(f"r{index}", prompt, params, arrival_time=float(index), priority=priority)


def plan_of(plan: SchedulerOutput) -> list[tuple[object, ...]]:
    return [
        (s.request.request_id, s.num_new_tokens, s.start, s.samples, list(s.block_ids))
        for s in plan.scheduled
    ] + [tuple(plan.preempted_ids), tuple(plan.prompt_logprob_seqs), plan.decode_only]


def events_of(events: list[EngineOutput]) -> list[tuple[object, ...]]:
    return [(e.request.request_id, e.new_token_ids, e.finish_reason) for e in events]


def state_of(scheduler: Scheduler, requests: list[Request]) -> list[tuple[object, ...]]:
    bm = scheduler.block_manager
    rows: list[tuple[object, ...]] = [
        (
            r.request_id,
            list(r.token_ids),
            r.num_computed_tokens,
            r.status,
            r.finish_reason,
            r.num_preemptions,
            r.num_cached_tokens,
            bm.block_ids(r.request_id),
        )
        for r in requests
    ]
    running = [r.request_id for r in scheduler.running]
    waiting = [r.request_id for r in scheduler.waiting]
    rows.append((running, waiting, bm.num_free_blocks, bm.num_cached_blocks))
    return rows


def twin(request: Request) -> Request:
    return Request(
        request.request_id,
        list(request.prompt_token_ids),
        request.params,
        arrival_time=request.arrival_time,
        priority=request.priority,
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(12, 48),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(8, 40),
    overlap=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_fast_paths_plan_and_update_as_the_general_rules(
    seed: int, num_blocks: int, max_num_seqs: int, budget: int, overlap: bool, policy: str
) -> None:
    rng = random.Random(seed)
    fast, general = make_pair(num_blocks, max_num_seqs, budget, policy)
    prefixes = [[rng.randrange(2, 40) for _ in range(12)] for _ in range(2)]
    mine: list[Request] = []  # the fast scheduler's requests; the general one has twins
    theirs: list[Request] = []
    pending: tuple[SchedulerOutput, SchedulerOutput] | None = None
    for step in range(120):
        if step < 60 and rng.random() < 0.4:
            request = random_request(rng, len(mine), prefixes, policy == "priority")
            mine.append(request)
            theirs.append(twin(request))
            fast.add_request(request)
            general.add_request(theirs[-1])
        live = [r.request_id for r in mine if not r.is_finished]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert [r.request_id for r in fast.abort_requests([victim])] == [victim]
            assert [r.request_id for r in general.abort_requests([victim])] == [victim]
        plans = (fast.schedule(), general.schedule())
        assert plan_of(plans[0]) == plan_of(plans[1])
        settle, pending = (pending, plans) if overlap else (plans, None)
        if settle is not None:
            num_sampling = sum(s.samples for s in settle[0].scheduled)
            tokens = [rng.choice([EOS, *range(2, 40)]) for _ in range(num_sampling)]
            got = fast.update_from_output(settle[0], list(tokens))
            want = general.update_from_output(settle[1], list(tokens))
            assert events_of(got) == events_of(want)
        assert state_of(fast, mine) == state_of(general, theirs)
        fast.block_manager.check_integrity()
    if pending is not None:
        num_sampling = sum(s.samples for s in pending[0].scheduled)
        tokens = [2] * num_sampling
        assert events_of(fast.update_from_output(pending[0], tokens)) == events_of(
            general.update_from_output(pending[1], tokens)
        )
    assert state_of(fast, mine) == state_of(general, theirs)
