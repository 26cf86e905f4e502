"""Scheduler: budgets and caps, chunked prefill, preemption by recompute, stop rules, aborts.

A fake model stands in for the forward pass only where the scheduler needs one: its next token is
a fixed function of the whole context, so a recomputed sequence must continue exactly as an
uninterrupted one would, and a fake KV cache records which token each slot was computed from, so
every block a request reads must hold that request's own tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine_core.config import EngineConfig
from engine_core.kv_offload import KVMoves
from engine_core.request import EngineOutput, Request, RequestStatus, SchedulerOutput
from engine_core.scheduler import Scheduler
from protocol.messages import FinishReason, SamplingParams
from tests.test_block_manager import copy_tokens

EOS = 0
BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], **params: object) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**params))


def make_scheduler(
    num_kv_blocks: int = 64,
    max_model_len: int = 256,
    eos_token_ids: tuple[int, ...] = (EOS,),
    asked_max_model_len: int | None = None,
    **config: object,
) -> Scheduler:
    """``max_model_len``: the runner's (the model's limit, or ``asked_max_model_len``, the
    --max-model-len given)."""
    # As the runner resolves an unset --max-num-seqs where the GPU is not a large one.
    engine_config = EngineConfig(
        block_size=BLOCK_SIZE, max_model_len=asked_max_model_len, **config
    ).with_max_num_seqs(large_gpu=False)
    return Scheduler(engine_config, num_kv_blocks, max_model_len, eos_token_ids)


def fake_next_token(context: list[int]) -> int:
    """The fake model: deterministic in the context, never EOS (ids 3..99)."""
    return 3 + (31 * sum(context) + 7 * len(context)) % 97


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_next_token(tokens))
    return tokens[len(prompt) :]


def step(scheduler: Scheduler, tokens: list[int]) -> list[EngineOutput]:
    """One step with hand-picked sampled tokens (one per sampling row)."""
    return scheduler.update_from_output(scheduler.schedule(), tokens)


@dataclass
class FakeRunner:
    block_size: int = BLOCK_SIZE
    slots: dict[int, int] = field(default_factory=dict)  # slot -> token its K/V came from
    host: dict[tuple[int, int], int | None] = field(default_factory=dict)  # the host KV tier

    def execute(self, output: SchedulerOutput) -> list[int]:
        if output.kv_moves is not None:
            self._move(output.kv_moves)
        sampled = []
        for s in output.scheduled:
            request, end = s.request, s.start + s.num_new_tokens
            assert s.num_new_tokens >= 1 and end <= request.num_tokens
            assert len(s.block_ids) * self.block_size >= end  # the table covers the chunk
            for pos in range(s.start, end):
                self.slots[self._slot(s.block_ids, pos)] = request.token_ids[pos]
            for pos in range(end):  # attention reads the whole context through the table
                assert self.slots[self._slot(s.block_ids, pos)] == request.token_ids[pos]
            if s.samples:  # the context is the known tokens, before the step's placeholder
                sampled.append(fake_next_token(request.token_ids[:end]))
        return sampled

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _move(self, moves: KVMoves) -> None:
        """The host tier's copies, as the runner makes them: every copy out, then every in."""
        copy_tokens(moves, self.slots, self.host, self.block_size)


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 2000, arrivals: dict[int, list[Request]] | None = None
) -> list[SchedulerOutput]:
    """Drive the scheduler with the fake runner, checking the per-step invariants."""
    runner, outputs, arrivals = FakeRunner(), [], arrivals or {}
    config = scheduler.config
    for step_index in range(max_steps):
        for request in arrivals.get(step_index, []):
            scheduler.add_request(request)
        if not scheduler.has_unfinished() and step_index > max(arrivals, default=-1):
            return outputs
        waiting_before = {r.request_id for r in scheduler.waiting}
        output = scheduler.schedule()
        admitted = [s for s in output.scheduled if s.request.request_id in waiting_before]
        assert output.num_batched_tokens <= config.token_budget
        assert len(admitted) <= config.max_prefills_per_step
        assert not (admitted and output.preempted_ids)  # no admissions right after preempting
        assert scheduler.num_running <= config.max_num_seqs
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.block_manager.check_integrity()
        outputs.append(output)
    raise AssertionError(f"not finished after {max_steps} steps")


# ----------------------------------------------------------------------------- batching


def test_randomized_run_respects_budget_and_caps_and_matches_reference() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(
        num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=24, prefill_max_batch_size=2
    )
    prefixes = [[rng.randrange(3, 100) for _ in range(16)] for _ in range(3)]
    arrivals: dict[int, list[Request]] = {}
    requests = []
    for i in range(24):
        prompt = rng.choice(prefixes)[: rng.randint(0, 16)]
        prompt += [rng.randrange(3, 100) for _ in range(rng.randint(1, 24))]
        request = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 12))
        arrivals.setdefault(rng.randrange(30), []).append(request)
        requests.append(request)

    outputs = run_to_completion(scheduler, arrivals=arrivals)

    for request in requests:
        assert request.finish_reason == FinishReason.LENGTH
        expected = reference_outputs(request.prompt_token_ids, request.params.max_tokens)
        assert request.output_token_ids == expected
    assert scheduler.block_manager.num_used_blocks == 0
    # The run was busy enough to test the caps, and the prefix cache served some prompts.
    assert max(o.num_batched_tokens for o in outputs) == 24
    first_starts = {}
    for output in outputs:
        for s in output.scheduled:
            first_starts.setdefault(s.request.request_id, s.start)
    assert any(start > 0 for start in first_starts.values())


def test_randomized_run_with_a_host_tier_restores_exactly_what_was_evicted() -> None:
    """A pool too small for the shared prefixes to stay, with a host KV tier behind it: the
    fake runner makes the plans' copies, and every step reads exactly its request's tokens;
    the outputs are the reference's and both pools end accounted for."""
    rng = random.Random(3)
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=24)
    scheduler = Scheduler(config, 20, 256, (EOS,), host_kv_blocks=8)
    prefixes = [[rng.randrange(3, 100) for _ in range(16)] for _ in range(4)]
    arrivals: dict[int, list[Request]] = {}
    requests = []
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 100) for _ in range(rng.randint(1, 8))]
        request = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 10))
        arrivals.setdefault(rng.randrange(60), []).append(request)
        requests.append(request)

    run_to_completion(scheduler, arrivals=arrivals)

    for request in requests:
        expected = reference_outputs(request.prompt_token_ids, request.params.max_tokens)
        assert request.output_token_ids == expected
    bm = scheduler.block_manager
    assert bm.num_used_blocks == 0
    assert bm.num_host_used_blocks == bm.num_host_blocks == 8
    counts = scheduler.counts()
    assert counts.kv_offload_restored_blocks > 0 and counts.kv_offload_hits > 0
    assert counts.preemptions > 0  # preempted requests came back through the tiers too
    assert counts.kv_offload_hits <= counts.kv_offload_restored_blocks * BLOCK_SIZE
    assert counts.kv_offload_queries == counts.prefix_cache_queries


def test_admission_cap_and_seq_cap() -> None:
    scheduler = make_scheduler(max_num_seqs=3, prefill_max_batch_size=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [5, 6], max_tokens=4))
    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["r0", "r1"]
    scheduler.update_from_output(first, [7, 7])
    second = scheduler.schedule()
    # Two decodes, then one admission: the running cap of 3 stops the second.
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 2),
    ]
    assert (scheduler.num_running, scheduler.num_waiting) == (3, 2)


def test_long_prompt_is_split_into_budget_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=16)
    scheduler.add_request(make_request("long", list(range(3, 53)), max_tokens=2))  # 50 tokens
    plan = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        s = output.scheduled[0]
        plan.append((s.start, s.num_new_tokens, s.samples))
        scheduler.update_from_output(output, [9] if s.samples else [])
    assert plan == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True)]


def test_chunked_prefill_shares_the_step_with_decodes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=16)
    scheduler.add_request(make_request("short", [3, 4, 5, 6], max_tokens=5))
    # 40 tokens sharing no block with "short" (which would be a hit in the same plan)
    scheduler.add_request(make_request("long", list(range(10, 50)), max_tokens=1))
    plans = []
    for _ in range(4):
        output = scheduler.schedule()
        plans.append([(s.request.request_id, s.start, s.num_new_tokens) for s in output.scheduled])
        scheduler.update_from_output(output, [9] * sum(s.samples for s in output.scheduled))
    assert plans == [
        [("short", 0, 4), ("long", 0, 12)],
        [("short", 4, 1), ("long", 12, 15)],
        [("short", 5, 1), ("long", 27, 13)],  # long samples and finishes (max_tokens=1)
        [("short", 6, 1)],
    ]


def test_prefix_cache_hit_starts_after_the_cached_blocks() -> None:
    scheduler = make_scheduler()
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    first = scheduler.schedule()
    scheduler.update_from_output(first, [9])
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    second = scheduler.schedule().scheduled[0]
    assert (second.start, second.num_new_tokens) == (8, 2)
    assert second.request.num_cached_tokens == 8
    assert second.block_ids[:2] == first.scheduled[0].block_ids[:2]


@pytest.mark.parametrize("host_tier", [False, True])
def test_a_burst_sharing_a_prompt_computes_its_blocks_once(host_tier: bool) -> None:
    """Requests admitted in one plan share the blocks an earlier one of them fills in that very
    step (registered as it is planned); with a host tier they join at the update, so each
    request computes them. Every read slot holds the request's own token (the fake runner)."""
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    scheduler = Scheduler(config, 64, 256, (EOS,), host_kv_blocks=8 if host_tier else 0)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks
    requests = [make_request(f"r{i}", prompt, max_tokens=3) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner()
    first = scheduler.schedule()
    starts = [(s.start, s.num_new_tokens) for s in first.scheduled]
    shared = 0 if host_tier else 8
    assert starts == [(0, 10), (shared, 10 - shared), (shared, 10 - shared)]
    if not host_tier:
        tables = [s.block_ids[:2] for s in first.scheduled]
        assert tables[1] == tables[2] == tables[0]
    scheduler.update_from_output(first, runner.execute(first))
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
        scheduler.block_manager.check_integrity()
    assert all(r.output_token_ids == reference_outputs(prompt, 3) for r in requests)
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_next_plan_hits_blocks_of_a_step_still_in_flight() -> None:
    """With overlap the next plan is made before this step's update: a request admitted then
    hits the blocks this step's prompt fills."""
    scheduler = make_scheduler()
    prompt = list(range(3, 13))
    scheduler.add_request(make_request("a", prompt, max_tokens=2))
    in_flight = scheduler.schedule()
    scheduler.add_request(make_request("b", prompt + [20, 21], max_tokens=2))
    second = scheduler.schedule()
    b = next(s for s in second.scheduled if s.request.request_id == "b")
    assert (b.start, b.request.num_cached_tokens) == (8, 8)
    assert b.block_ids[:2] == in_flight.scheduled[0].block_ids[:2]


def test_a_failed_step_forgets_the_prefixes_it_registered() -> None:
    """Blocks registered as a step is planned hold no K/V if the step fails: every prefix is
    forgotten, the state stays whole, and the next request with that prompt computes it."""
    scheduler = make_scheduler()
    prompt = list(range(3, 13))
    scheduler.add_request(make_request("a", prompt, max_tokens=2))
    scheduler.schedule()
    assert scheduler.block_manager.num_cached_blocks == 0  # a holds them: used, not cached
    scheduler.step_failed()
    scheduler.abort_requests(["a"])  # what the server does with the live requests
    scheduler.block_manager.check_integrity()
    assert scheduler.block_manager.num_cached_blocks == 0
    assert scheduler.block_manager.num_used_blocks == 0
    scheduler.add_request(make_request("b", prompt, max_tokens=2))
    assert scheduler.schedule().scheduled[0].start == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_blocks_filled_by_chunks_and_decodes_are_shared(overlap: bool) -> None:
    """Every block that a prompt chunk or a decoded token fills is registered in the prefix
    cache (the update asks the block manager only when a chunk reaches a block's end): a later
    prompt made of a finished request's prompt and output reuses all its full blocks."""
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=6, max_num_seqs=4)
    scheduler = Scheduler(config, 64, 256, (EOS,))
    prompt = list(range(3, 17))  # 14 tokens: chunks of 6, 6 and 2
    scheduler.add_request(make_request("a", prompt, max_tokens=11, ignore_eos=True))
    outputs: list[int] = []
    pending: SchedulerOutput | None = None  # with overlap: the planned step whose tokens wait
    while scheduler.has_unfinished() or pending is not None:
        plan = scheduler.schedule() if scheduler.has_unfinished() else None
        settle, pending = (pending, plan) if overlap else (plan, None)
        if settle is None:
            continue
        sampled = [fake_next_token(s.request.token_ids[: s.start + s.num_new_tokens])
                   for s in settle.scheduled if s.samples]  # fmt: skip
        for event in scheduler.update_from_output(settle, sampled):
            outputs += event.new_token_ids
    assert len(outputs) == 11
    context = prompt + outputs  # 25 tokens; the last one's K/V was never computed
    full = (len(context) - 1) // BLOCK_SIZE * BLOCK_SIZE
    scheduler.add_request(make_request("b", context + [5], max_tokens=1))
    first = scheduler.schedule().scheduled[0]
    assert first.request.num_cached_tokens == full
    assert first.start == full


# ---------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_when_the_pool_is_short_loses_nothing(prefix_caching: bool) -> None:
    # Each request grows to 24 tokens = 6 blocks; four of them need 24 blocks, the pool has 12.
    scheduler = make_scheduler(num_kv_blocks=12, enable_prefix_caching=prefix_caching)
    rng = random.Random(5)
    requests = [
        make_request(f"r{i}", [rng.randrange(3, 100) for _ in range(10)], max_tokens=14)
        for i in range(4)
    ]
    for request in requests:
        scheduler.add_request(request)

    outputs = run_to_completion(scheduler)

    preempted = [rid for o in outputs for rid in o.preempted_ids]
    assert preempted and sum(r.num_preemptions for r in requests) == len(preempted)
    for request in requests:
        assert request.finish_reason == FinishReason.LENGTH
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 14)
    assert scheduler.block_manager.num_used_blocks == 0


def test_preemption_takes_the_latest_admitted_and_requeues_it_first() -> None:
    scheduler = make_scheduler(num_kv_blocks=6, max_num_seqs=3)  # 24 tokens of KV
    for name, first in (("a", 10), ("b", 20), ("c", 30)):
        scheduler.add_request(make_request(name, list(range(first, first + 8)), max_tokens=20))
    scheduler.add_request(make_request("d", [5], max_tokens=1))  # held back by max_num_seqs
    runner = FakeRunner()
    while True:
        output = scheduler.schedule()
        if output.preempted_ids:
            break
        scheduler.update_from_output(output, runner.execute(output))
    # a, b and c each held 2 blocks (8 tokens); a's growth needs a 7th block: c goes first.
    assert output.preempted_ids == ["c"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    c = scheduler.waiting[0]
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.WAITING, 0, 1)
    assert c.output_token_ids == [fake_next_token(c.prompt_token_ids)]  # kept for recompute
    assert [s.request.request_id for s in output.scheduled] == ["a", "b"]


def test_lone_request_is_capped_by_the_pool_instead_of_looping() -> None:
    scheduler = make_scheduler(num_kv_blocks=3, max_model_len=256)  # 12 tokens of KV
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("big", list(range(3, 15))))
    request = make_request("r", [3, 4, 5, 6, 7], max_tokens=100)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.finish_reason == FinishReason.LENGTH
    assert request.num_tokens == 12


# ------------------------------------------------------------------------ stop conditions


def test_eos_stops_and_frees() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5, 6, 7], max_tokens=10))
    assert step(scheduler, [9])[0].finish_reason is None
    event = step(scheduler, [EOS])[0]
    assert (event.new_token_ids, event.finish_reason) == ([EOS], FinishReason.STOP)
    assert event.request.output_token_ids == [9, EOS]
    assert not scheduler.has_unfinished() and scheduler.block_manager.num_used_blocks == 0


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5], max_tokens=3, ignore_eos=True))
    reasons = [step(scheduler, [EOS])[0].finish_reason for _ in range(3)]
    assert reasons == [None, None, FinishReason.LENGTH]


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5], stop_token_ids=(42,), ignore_eos=True))
    assert step(scheduler, [EOS])[0].finish_reason is None
    assert step(scheduler, [42])[0].finish_reason == FinishReason.STOP


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5], min_tokens=3, stop_token_ids=(42,)))
    reasons = [step(scheduler, [token])[0].finish_reason for token in (EOS, 42, EOS)]
    assert reasons == [None, None, FinishReason.STOP]


def test_max_tokens_gives_length_and_stop_wins_a_tie() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [5], max_tokens=2))
    scheduler.add_request(make_request("b", [5], max_tokens=2))
    step(scheduler, [9, 9])
    events = step(scheduler, [9, EOS])
    assert [(e.request.request_id, e.finish_reason) for e in events] == [
        ("a", FinishReason.LENGTH),
        ("b", FinishReason.STOP),
    ]
    assert scheduler.num_running == 0


def test_max_model_len_gives_length() -> None:
    scheduler = make_scheduler(max_model_len=6)
    scheduler.add_request(make_request("r", [5, 6, 7, 8], max_tokens=100))
    reasons = [step(scheduler, [9])[0].finish_reason for _ in range(2)]
    assert reasons == [None, FinishReason.LENGTH]


# --------------------------------------------------------------------- intake and aborts


def test_add_request_rejects_what_it_cannot_serve() -> None:
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("empty", []))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", list(range(3, 11))))  # 8 tokens
    scheduler.add_request(make_request("r", [5], max_tokens=1))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("r", [5]))
    step(scheduler, [9])  # r finishes; its id is free again
    scheduler.add_request(make_request("r", [5]))


def test_abort_waiting_and_running_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(prefill_max_batch_size=1)
    scheduler.add_request(make_request("run", list(range(3, 13)), max_tokens=10))
    scheduler.add_request(make_request("wait", [5, 6], max_tokens=10))
    step(scheduler, [9])  # "run" admitted and prefilled; "wait" still queued
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert scheduler.block_manager.num_used_blocks == 3

    aborted = scheduler.abort_requests(["wait", "unknown"])
    assert [r.request_id for r in aborted] == ["wait"]
    assert scheduler.num_waiting == 0

    output = scheduler.schedule()
    [run] = scheduler.abort_requests(["run"])  # while its step is in flight
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.update_from_output(output, [9]) == []  # the late token is dropped
    for request in (aborted[0], run):
        assert (request.status, request.finish_reason) == (
            RequestStatus.FINISHED,
            FinishReason.ABORT,
        )
    assert not scheduler.has_unfinished()
    scheduler.block_manager.check_integrity()


def test_wrong_number_of_sampled_tokens_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5, 6]))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled"):
        scheduler.update_from_output(output, [])
    assert scheduler.update_from_output(output, [9])[0].new_token_ids == [9]


def test_a_pool_smaller_than_the_models_limit_caps_it_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # --max-model-len unset: the model's limit, lowered to what one sequence can hold.
    with caplog.at_level("WARNING", logger="engine_core.scheduler"):
        capped = make_scheduler(num_kv_blocks=4, max_model_len=4096)
    assert capped.max_model_len == 4 * BLOCK_SIZE
    assert f"max_model_len is {4 * BLOCK_SIZE}, not the model's 4096" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine_core.scheduler"):
        make_scheduler(num_kv_blocks=64, max_model_len=256)
    assert "max_model_len is" not in caplog.text


def test_a_pool_smaller_than_an_asked_max_model_len_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than --max-model-len 4096"):
        make_scheduler(num_kv_blocks=4, max_model_len=4096, asked_max_model_len=4096)
    fits = make_scheduler(num_kv_blocks=4, max_model_len=16, asked_max_model_len=16)
    assert fits.max_model_len == 16 == 4 * BLOCK_SIZE
