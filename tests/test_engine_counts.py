"""The counts behind /metrics' engine counters and per-request engine timings, on a real
EngineCore (tiny random Llama, with and without overlap), and the frontend's totals of them.

Prefix-cache queries and hits, preemptions and tokens per step are hand-computed from the block
size and the prompts; a request's timeline (arrival, first step, first token, finish) must be in
order, stamped once, and its timings must add up to its time in the engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.request import Request
from frontend.engine_pool import EngineCountTotals
from frontend.metrics import Metrics
from protocol.messages import STEP_TOKEN_BUCKETS, EngineCounts, SamplingParams, Stats
from tests.factories import write_tiny_llama

BLOCK = 4
VOCAB = 384


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB)


def make_core(model: Path, overlap: bool, **config: object) -> EngineCore:
    options: dict[str, object] = {"num_kv_blocks": 256, "block_size": BLOCK}
    options.update(config)
    return EngineCore(
        EngineConfig(model=str(model), device="cpu", async_scheduling=overlap, **options)
    )


def run(core: EngineCore, requests: list[Request]) -> None:
    for request in requests:
        core.add_request(request)
    while core.has_unfinished():
        core.step()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_cache_and_step_tokens_count_what_was_computed(
    tiny_llama: Path, overlap: bool
) -> None:
    core = make_core(tiny_llama, overlap)
    shared = list(range(10, 27))  # 17 tokens: 4 full blocks and one more token
    a = Request("a", [*shared, 50, 51], params(5))  # 19 tokens
    run(core, [a])
    b = Request("b", [*shared, 60], params(3))  # 18 tokens, shares a's 4 full blocks
    run(core, [b])
    counts = core.stats().counts
    assert counts.prefix_cache_queries == 19 + 18
    assert counts.prefix_cache_hits == 4 * BLOCK
    assert b.num_cached_tokens == 4 * BLOCK
    # Every token computed once: the prompts less the hits, and each output but the last.
    assert counts.step_tokens_sum == (19 + 5 - 1) + (18 - 4 * BLOCK + 3 - 1)
    # a: a 19-token prefill and 4 decodes; b: a 2-token prefill and 2 decodes, one bucket each.
    expected = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
    for tokens in (19, 1, 1, 1, 1, 2, 1, 1):
        expected[next(i for i, b in enumerate(STEP_TOKEN_BUCKETS) if tokens <= b)] += 1
    assert list(counts.step_tokens) == expected
    assert counts.preemptions == 0


def test_no_prefix_cache_counts_no_queries(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, False, enable_prefix_caching=False)
    run(core, [Request("a", list(range(10, 30)), params(2))])
    counts = core.stats().counts
    assert (counts.prefix_cache_queries, counts.prefix_cache_hits) == (0, 0)
    assert counts.step_tokens_sum == 20 + 1


@pytest.mark.parametrize("overlap", [False, True])
def test_preemptions_are_counted(tiny_llama: Path, overlap: bool) -> None:
    # 8 requests growing to ~40 tokens (10 blocks) each in a pool of 24 blocks.
    core = make_core(tiny_llama, overlap, num_kv_blocks=24, enable_prefix_caching=False)
    requests = [Request(f"r{i}", [3 + i] * (10 + i), params(24)) for i in range(8)]
    run(core, requests)
    preemptions = sum(r.num_preemptions for r in requests)
    assert preemptions > 0
    assert core.stats().counts.preemptions == preemptions


@pytest.mark.parametrize("overlap", [False, True])
def test_timings_follow_each_request(tiny_llama: Path, overlap: bool) -> None:
    core = make_core(tiny_llama, overlap, max_num_seqs=2)  # the later requests queue
    start = time.monotonic()
    requests = [Request(f"r{i}", list(range(5, 25 + i)), params(6)) for i in range(5)]
    run(core, requests)
    end = time.monotonic()
    for r in requests:
        assert start <= r.arrival_time <= r.first_scheduled_time
        assert r.first_scheduled_time < r.first_token_time <= r.finish_time <= end
        t = r.timings()
        assert min(t.queue_s, t.prefill_s, t.decode_s) >= 0
        total = t.queue_s + t.prefill_s + t.decode_s
        assert total == pytest.approx(r.finish_time - r.arrival_time)
    assert requests[-1].timings().queue_s > requests[0].timings().queue_s  # it waited its turn
    assert core.scheduler._awaiting_first_token == []  # nothing held after the run


def test_a_request_that_ends_at_its_first_token(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, True)
    r = Request("one", [5, 6, 7], params(1))
    run(core, [r])
    t = r.timings()
    assert t.decode_s == 0 and t.prefill_s > 0


def test_aborted_before_a_step_holds_nothing(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, True)
    r = Request("a", [5, 6, 7], params(4))
    core.add_request(r)
    core.step()  # admitted and launched, no token yet
    core.abort(["a"])
    while core.has_unfinished():
        core.step()
    assert core.scheduler._awaiting_first_token == []
    assert r.timings().decode_s == 0


# ---- frontend: totals over engines and restarts, and what /metrics shows ---------------------


def counts(run_id: int, queries: int, hits: int, preemptions: int, steps: int) -> EngineCounts:
    buckets = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
    buckets[0] = steps
    return EngineCounts(run_id, queries, hits, preemptions, tuple(buckets), steps)


def test_totals_sum_engines_and_survive_restarts() -> None:
    totals = EngineCountTotals()
    totals.update(0, counts(7, 100, 40, 1, 10))
    totals.update(1, counts(8, 50, 10, 0, 5))
    assert totals.total().prefix_cache_queries == 150
    totals.update(0, counts(7, 120, 50, 2, 12))
    # Engine 1 restarts (a new run id) and counts from zero again; engine 0 is not polled.
    totals.update(1, counts(9, 5, 0, 0, 1))
    total = totals.total()
    assert (total.prefix_cache_queries, total.prefix_cache_hits) == (120 + 50 + 5, 50 + 10)
    assert (total.preemptions, total.step_tokens_sum, total.step_tokens[0]) == (2, 18, 18)
    totals.update(1, counts(9, 7, 1, 0, 2))
    assert totals.total().prefix_cache_queries == 120 + 50 + 7


def test_metrics_show_the_totals_as_counters_and_a_histogram() -> None:
    metrics = Metrics("m")
    buckets = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
    buckets[0], buckets[3], buckets[-1] = 5, 2, 1  # 5 steps of 1 token, 2 of 17..32, 1 huge
    c = EngineCounts(1, 300, 128, 3, tuple(buckets), 5 + 40 + 20000)
    metrics.record_engine_stats(Stats(0, 0, 10, 0, 10, 8, c), healthy=True)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {s.name: s for f in families.values() for s in f.samples if "le" not in s.labels}
    assert families["tandem_prefix_cache_queries"].type == "counter"
    assert samples["tandem_prefix_cache_queries_total"].value == 300
    assert samples["tandem_prefix_cache_hits_total"].value == 128
    assert samples["tandem_num_preemptions_total"].value == 3
    steps = families["tandem_iteration_tokens_total"]
    assert steps.type == "histogram"
    le = {s.labels["le"]: s.value for s in steps.samples if s.name.endswith("_bucket")}
    assert (le["1.0"], le["16.0"], le["32.0"], le["16384.0"], le["+Inf"]) == (5, 5, 7, 7, 8)
    assert samples["tandem_iteration_tokens_total_count"].value == 8
    assert samples["tandem_iteration_tokens_total_sum"].value == 20045


class FakeEngine:
    """What EnginePool.stats reads of an engine connection."""

    def __init__(self, stats: Stats) -> None:
        self.stats_reply, self.dead_reason, self.healthy, self.num_requests = stats, None, True, 0

    async def stats(self, timeout: float) -> Stats:
        return self.stats_reply


def test_pool_sums_gauges_and_keeps_counts_of_a_dead_engine() -> None:
    import asyncio

    from prometheus_client import CollectorRegistry

    from frontend.engine_pool import EngineGauges, EnginePool

    engines = [FakeEngine(Stats(1, 2, 3, 0, 10, 5, counts(1, 40, 16, 1, 5))) for _ in range(2)]
    pool = EnginePool(engines)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    pool.gauges = EngineGauges(registry, "m", 2)

    def up(index: int) -> float | None:
        labels = {"model_name": "m", "engine": str(index)}
        return registry.get_sample_value("tandem_engine_up", labels)

    summed = asyncio.run(pool.stats())
    assert (summed.num_running, summed.num_steps) == (2, 10)
    assert (summed.counts.prefix_cache_queries, summed.counts.preemptions) == (80, 2)
    assert [up(0), up(1)] == [1.0, 1.0]
    engines[1].dead_reason = "gone"  # not polled while down: its counts stay in the total
    engines[1].healthy = False
    engines[0].stats_reply = Stats(0, 0, 3, 0, 10, 6, counts(1, 50, 16, 1, 6))
    summed = asyncio.run(pool.stats())
    assert (summed.num_running, summed.counts.prefix_cache_queries) == (0, 90)
    assert [up(0), up(1)] == [1.0, 0.0]  # the dead engine is down, not its last poll's 1
    # Every engine dead: nothing is polled, and each one's gauge says so all the same.
    from types import SimpleNamespace

    from frontend.app import refresh_engine_gauges
    from frontend.metrics import Metrics

    engines[0].dead_reason, engines[0].healthy = "gone too", False
    ctx = SimpleNamespace(engine=pool, metrics=Metrics("m"))
    asyncio.run(refresh_engine_gauges(ctx))  # type: ignore[arg-type]
    assert [up(0), up(1)] == [0.0, 0.0]


def test_a_pool_with_one_engine_down_is_degraded_not_down() -> None:
    from frontend.engine_pool import EnginePool

    engines = [FakeEngine(Stats(0, 0, 3, 0, 10, 5, counts(1, 0, 0, 0, 0))) for _ in range(2)]
    pool = EnginePool(engines)  # type: ignore[arg-type]
    assert pool.degraded() is None and pool.healthy
    engines[1].healthy, engines[1].dead_reason = False, "the engine process exited"
    assert pool.degraded() == "engine 1: the engine process exited"
    assert pool.dead_reason is None  # engine 0 takes the requests
    engines[0].healthy, engines[0].dead_reason = False, "gone"
    assert pool.degraded() is None and pool.dead_reason is not None  # all down: a 503
    alone = EnginePool([FakeEngine(Stats(0, 0, 3, 0, 10, 5, counts(1, 0, 0, 0, 0)))])  # type: ignore[list-item]
    alone.engines[0].healthy = False
    assert alone.degraded() is None  # one engine: down is down
