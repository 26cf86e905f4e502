"""The priority scheduling policy (vLLM's): the waiting queue in (priority, arrival) order, the
worst-ranked running request preempted first (even one already planned in the step, whose row
is taken back out), and FCFS refusing any priority but 0.

Each scenario is small enough to count blocks by hand (BLOCK_SIZE tokens a block); the random
run checks the invariants and that every request's tokens are those of the fake model, however
often it was preempted and re-planned.
"""

from __future__ import annotations

import random

import pytest

from engine_core.config import EngineConfig
from engine_core.request import Request, RequestStatus, SchedulerOutput
from engine_core.scheduler import PLACEHOLDER, Scheduler, priority_rank
from protocol.messages import FinishReason, SamplingParams
from tests.test_scheduler import EOS, fake_next_token, make_scheduler, reference_outputs
from tests.test_speculative import ListProposer


def ranked(
    request_id: str,
    prompt: list[int],
    priority: int,
    arrival: float,
    max_tokens: int = 20,
    prompt_logprobs: int | None = None,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return Request(request_id, prompt, params, arrival_time=arrival, priority=priority)


def settle(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Update with the fake model's tokens (no overlap: every context is known)."""
    tokens = [
        fake_next_token(s.request.token_ids[: s.start + s.num_new_tokens])
        for s in output.scheduled
        if s.samples
    ]
    scheduler.update_from_output(output, tokens)


def test_fcfs_refuses_a_priority_by_name_and_takes_zero() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="priority 3.*--scheduling-policy priority"):
        scheduler.add_request(ranked("r", [5], priority=3, arrival=0.0))
    assert not scheduler.has_unfinished()
    scheduler.add_request(ranked("r", [5], priority=0, arrival=0.0))


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--scheduling-policy 'lifo'"):
        EngineConfig(scheduling_policy="lifo")


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", prefill_max_batch_size=1)
    arrivals = [("a", 5, 0.0), ("b", 0, 1.0), ("late", 0, 4.0), ("d", -1, 3.0), ("c", 0, 2.0)]
    for name, priority, arrival in arrivals:  # "late" is added before "d" and "c"
        scheduler.add_request(ranked(name, [5, 6], priority, arrival))
    assert [r.request_id for r in scheduler.waiting] == ["d", "b", "c", "late", "a"]
    admitted = []
    while scheduler.waiting:
        output = scheduler.schedule()
        admitted += [s.request.request_id for s in output.scheduled if s.start == 0]
        settle(scheduler, output)
    assert admitted == ["d", "b", "c", "late", "a"]


def full_pool_scenario(
    policy: str,
    first: tuple[int, float],
    second: tuple[int, float],
    prompt_logprobs: int | None = None,
) -> tuple[Scheduler, SchedulerOutput, Request, Request]:
    """A pool of 4 blocks. ``first`` (6 tokens) runs alone for a step, then ``second`` (8
    tokens) joins it: both hold 2 blocks. At the third step ``first`` decodes in its own
    second block (planned first, as the earlier admitted) and ``second`` needs a third block:
    someone must be preempted. Returns the third step's plan and the two requests."""
    scheduler = make_scheduler(num_kv_blocks=4, scheduling_policy=policy)
    one = ranked("first", list(range(10, 16)), *first)
    two = ranked("second", list(range(20, 28)), *second)
    scheduler.add_request(one)
    settle(scheduler, scheduler.schedule())
    scheduler.add_request(two)
    settle(scheduler, scheduler.schedule())
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, scheduler.schedule(), one, two


@pytest.mark.parametrize(
    ("first", "second", "victim"),
    [
        ((2, 0.0), (0, 1.0), "first"),  # the worse priority, though planned already
        ((1, 2.0), (1, 1.0), "first"),  # a tie: the later arrival
        ((0, 0.0), (1, 1.0), "second"),  # the worse is the one that needs the block
    ],
)
def test_preemption_takes_the_worst_ranked_request(
    first: tuple[int, float], second: tuple[int, float], victim: str
) -> None:
    scheduler, output, one, two = full_pool_scenario("priority", first, second)
    assert output.preempted_ids == [victim]
    preempted, kept = (one, two) if victim == "first" else (two, one)
    assert [s.request.request_id for s in output.scheduled] == [kept.request_id]
    # The victim's row is gone from the plan with its placeholder: it recomputes from scratch.
    assert PLACEHOLDER not in preempted.token_ids
    assert (preempted.status, preempted.num_computed_tokens) == (RequestStatus.WAITING, 0)
    assert output.num_batched_tokens == 1
    settle(scheduler, output)
    scheduler.block_manager.check_integrity()


def test_the_rows_that_score_prompt_tokens_are_renumbered() -> None:
    """A pool of 6 blocks. "worst" (6 tokens) runs a step alone; then "scored" (6 tokens, with
    prompt logprobs, which in the scheduler alone make every row of it score) and "needy" (8)
    join: 2 blocks each. At the next step "worst" and "scored" decode in their own blocks and
    "needy" needs a third: "worst", planned first, is taken out, and the scoring row, planned
    second, is named by its new position."""
    scheduler = make_scheduler(num_kv_blocks=6, scheduling_policy="priority")
    worst = ranked("worst", list(range(10, 16)), 5, 0.0)
    scored = ranked("scored", list(range(30, 36)), 0, 1.0, prompt_logprobs=0)
    needy = ranked("needy", list(range(20, 28)), 0, 2.0)
    scheduler.add_request(worst)
    settle(scheduler, scheduler.schedule())
    scheduler.add_request(scored)
    scheduler.add_request(needy)
    settle(scheduler, scheduler.schedule())
    output = scheduler.schedule()
    assert output.preempted_ids == ["worst"]
    assert [s.request for s in output.scheduled] == [scored, needy]
    assert output.prompt_logprob_seqs == [0]
    settle(scheduler, output)
    scheduler.block_manager.check_integrity()


def test_fcfs_preempts_the_latest_admitted_in_the_same_scenario() -> None:
    _, output, _, _ = full_pool_scenario("fcfs", (0, 0.0), (0, 1.0))
    assert output.preempted_ids == ["second"]


def test_a_preempted_request_goes_back_to_its_rank_in_the_queue() -> None:
    scheduler, output, one, _ = full_pool_scenario("priority", (2, 0.0), (0, 1.0))
    scheduler.add_request(ranked("better", [5], 1, 9.0))
    scheduler.add_request(ranked("worse", [5], 3, 0.5))
    assert [r.request_id for r in scheduler.waiting] == ["better", "first", "worse"]
    settle(scheduler, output)


def test_a_planned_row_with_drafts_is_taken_back_whole() -> None:
    """The victim was planned with speculative drafts: they leave its tokens with its row, and
    the speculation counts forget them."""
    config = EngineConfig(
        block_size=4,
        scheduling_policy="priority",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
    ).with_max_num_seqs(large_gpu=False)
    proposer = ListProposer()
    scheduler = Scheduler(config, 4, 256, (EOS,), proposer=proposer)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    one = Request("first", list(range(10, 15)), greedy, arrival_time=0.0, priority=5)
    two = Request("second", list(range(20, 28)), greedy, arrival_time=1.0)
    scheduler.add_request(one)
    settle(scheduler, scheduler.schedule())  # 5 prompt tokens + 1: 2 blocks
    scheduler.add_request(two)
    settle(scheduler, scheduler.schedule())  # first decodes to 7 tokens; second takes 2 blocks
    proposer.next = [40]  # first drafts one token into its own second block; second none
    before = list(one.token_ids)
    output = scheduler.schedule()
    assert output.preempted_ids == ["first"]
    assert one.token_ids == before and one.num_draft_tokens == 0
    assert scheduler.counts().spec_drafts == scheduler.counts().spec_draft_tokens == 0
    assert [(s.request.request_id, s.drafts) for s in output.scheduled] == [("second", ())]
    settle(scheduler, output)
    scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_random_runs_keep_the_order_and_lose_nothing(seed: int) -> None:
    """With overlap (step N+1 planned before step N's tokens are known): at every step the
    queue is in rank order, every preempted request ranks no better than any request left
    running, and at the end each request has the fake model's tokens and no block is held."""
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_kv_blocks=14,
        max_num_seqs=5,
        max_num_batched_tokens=20,
        scheduling_policy="priority",
    )
    requests: dict[int, list[Request]] = {}
    everyone = []
    for i in range(20):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(1, 14))]
        request = ranked(f"r{i}", prompt, rng.randint(-2, 2), float(i), rng.randint(1, 14))
        requests.setdefault(rng.randrange(25), []).append(request)
        everyone.append(request)
    pending: SchedulerOutput | None = None
    for step_index in range(3000):
        for request in requests.get(step_index, []):
            scheduler.add_request(request)
        if not scheduler.has_unfinished() and pending is None and step_index > 25:
            break
        plan = scheduler.schedule() if scheduler.has_unfinished() else None
        # A preempted request's blocks are gone: no row of it may stay in the plan.
        assert plan is None or all(
            s.request.status == RequestStatus.RUNNING for s in plan.scheduled
        )
        if plan is not None and plan.preempted_ids:
            worst_left = max((priority_rank(r) for r in scheduler.running), default=None)
            preempted = [scheduler.requests[rid] for rid in plan.preempted_ids]
            assert worst_left is None or min(map(priority_rank, preempted)) >= worst_left
        waiting = [priority_rank(r) for r in scheduler.waiting]
        assert waiting == sorted(waiting)
        if pending is not None:
            settle(scheduler, pending)
        pending = plan
        scheduler.block_manager.check_integrity()
    assert not scheduler.has_unfinished()
    assert sum(r.num_preemptions for r in everyone) > 0  # the pool was short enough
    for request in everyone:
        assert request.finish_reason == FinishReason.LENGTH
        expected = reference_outputs(request.prompt_token_ids, request.params.max_tokens)
        assert request.output_token_ids == expected
    assert scheduler.block_manager.num_used_blocks == 0
