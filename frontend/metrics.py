"""Prometheus metrics of the frontend, served as text at GET /metrics.

Per-request figures (finish reasons, tokens, latencies) are recorded by the frontend as requests
end; the engine's share of a request (queue, prefill and decode time) comes in the output that
finishes it. Engine-wide gauges (running and waiting requests, KV-cache usage) and counters
(prefix-cache queries and hits, preemptions, tokens per step) come from a periodic
ControlKind.STATS call; the counters are the engines' own counts (summed over engines and
restarts by the EnginePool), exported as they are at each scrape by ``EngineCountsCollector``.
Each server owns its registry, so two apps in one process never clash. With
``--metrics-name-alias vllm`` the families whose meaning is vLLM's are also exposed under vLLM's
names (``VLLM_NAMES``; docs/deployment.md lists them), so vLLM's Grafana dashboard reads them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.messages import STEP_TOKEN_BUCKETS, EngineCounts, RequestTimings, Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Our family -> vLLM's names for it, where the meaning is the same (vLLM v1's metrics; a few
# have a second, older name that dashboards still read). Label names are vLLM's already
# (model_name, finished_reason).
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tandem_request_success": ("vllm:request_success",),
    "tandem_prompt_tokens": ("vllm:prompt_tokens",),
    "tandem_generation_tokens": ("vllm:generation_tokens",),
    "tandem_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tandem_time_per_output_token_seconds": (
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "tandem_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "tandem_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tandem_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "tandem_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "tandem_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "tandem_num_requests_running": ("vllm:num_requests_running",),
    "tandem_num_requests_waiting": ("vllm:num_requests_waiting",),
    "tandem_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tandem_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tandem_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    # vLLM counts the tokens its KV connectors (its CPU offloading among them) load as these.
    "tandem_kv_offload_queries": ("vllm:external_prefix_cache_queries",),
    "tandem_kv_offload_hits": ("vllm:external_prefix_cache_hits",),
    "tandem_num_preemptions": ("vllm:num_preemptions",),
    "tandem_iteration_tokens_total": ("vllm:iteration_tokens_total",),
    "tandem_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tandem_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tandem_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
METRIC_NAME_ALIASES = {"vllm": VLLM_NAMES}  # --metrics-name-alias

_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metric families; record_* methods are called from the request handlers."""

    def __init__(self, model_name: str, alias: str | None = None) -> None:
        self.registry = CollectorRegistry()
        # The aliases live in a registry of their own: one that collected itself would loop.
        self.aliases = CollectorRegistry()
        if alias is not None:
            self.aliases.register(RenamedCollector(self.registry, METRIC_NAME_ALIASES[alias]))
        self.model_name = model_name
        self._label = {"model_name": model_name}
        self._define_request_metrics()
        self._define_engine_gauges()
        self._define_frontend_gauges()
        # Children resolved once: .labels() takes a lock and builds a key on every call.
        name = self._label
        self._prompt_tokens = self.prompt_tokens.labels(**name)
        self._generation_tokens = self.generation_tokens.labels(**name)
        self._ttft, self._tpot, self._e2e = (
            h.labels(**name) for h in (self.ttft, self.tpot, self.e2e)
        )
        self._queue, self._prefill, self._decode, self._spec_acceptance = (
            h.labels(**name)
            for h in (self.queue_time, self.prefill_time, self.decode_time, self.spec_acceptance)
        )
        self.engine_counts = EngineCountsCollector(model_name)
        self.registry.register(self.engine_counts)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ["model_name", *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def _define_request_metrics(self) -> None:
        self.requests = self._counter(
            "tandem_request_success",
            "Engine requests finished, by finish reason (stop, length, abort, error).",
            "finished_reason",
        )
        self.prompt_tokens = self._counter(
            "tandem_prompt_tokens", "Prompt tokens of finished requests."
        )
        self.generation_tokens = self._counter("tandem_generation_tokens", "Tokens generated.")
        self.ttft = self._histogram(
            "tandem_time_to_first_token_seconds",
            "Time from arrival at the frontend to the first generated token.",
            _LATENCY_BUCKETS,
        )
        self.tpot = self._histogram(
            "tandem_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            _TOKEN_BUCKETS,
        )
        self.e2e = self._histogram(
            "tandem_e2e_request_latency_seconds",
            "Time from arrival at the frontend to the end of the request.",
            _LATENCY_BUCKETS,
        )
        # Observed once per request per engine step (tens of thousands a second at 256
        # streams): a plain histogram of our own, without prometheus_client's locks.
        self.itl = StepHistogram(
            "tandem_inter_token_latency_seconds",
            "Time between two tokens of a request, as the frontend gets them (an output of n "
            "tokens counts n times, its gap to the last output spread over them).",
            _TOKEN_BUCKETS,
            self.model_name,
        )
        self.registry.register(self.itl)
        self.queue_time = self._histogram(
            "tandem_request_queue_time_seconds",
            "Engine time from a request's arrival to its first step (finished requests).",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = self._histogram(
            "tandem_request_prefill_time_seconds",
            "Engine time from a request's first step to its first token (finished requests).",
            _LATENCY_BUCKETS,
        )
        self.decode_time = self._histogram(
            "tandem_request_decode_time_seconds",
            "Engine time from a request's first token to its end (finished requests).",
            _LATENCY_BUCKETS,
        )
        self.spec_acceptance = self._histogram(
            "tandem_request_spec_decode_acceptance_rate",
            "Per finished request that was drafted for: the share of its draft tokens it kept.",
            (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
        )
        self.lora_requests = self._counter(
            "tandem_lora_requests",
            "Completion, chat and responses requests served with a LoRA adapter, by adapter.",
            "lora_name",
        )
        self.rejected = self._counter(
            "tandem_requests_rejected",
            "HTTP requests refused before reaching the engine, by reason (overloaded).",
            "reason",
        )
        self.resumed = self._counter(
            "tandem_requests_resumed",
            "Engine requests sent again, with what they had generated, after their engine died.",
        )
        self.resume_latency = self._histogram(
            "tandem_request_resume_seconds",
            "A resume's extra latency: from the engine's death seen to the next output.",
            _LATENCY_BUCKETS,
        )

    def _define_engine_gauges(self) -> None:
        self.running = self._gauge("tandem_num_requests_running", "Requests running in the engine.")
        self.waiting = self._gauge("tandem_num_requests_waiting", "Requests waiting in the engine.")
        self.kv_usage = self._gauge(
            "tandem_kv_cache_usage_perc",
            "KV-cache blocks held by requests as a fraction of all (cached free blocks are free).",
        )
        self.host_kv_usage = self._gauge(
            "tandem_kv_offload_usage_perc",
            "Host KV tier (--kv-offload-gb) slots holding a block as a fraction of all (0: none).",
        )
        self.engine_steps = self._gauge("tandem_engine_steps", "Engine steps run since start.")
        self.engine_healthy = self._gauge(
            "tandem_engine_healthy", "1 while the engine core answers, else 0."
        )
        self.engine_restarts = self._counter(
            "tandem_engine_restarts", "Engine cores started after one died."
        )
        self._new_runs = 0  # record_new_runs's total so far

    def _define_frontend_gauges(self) -> None:
        self.admitted = self._gauge(
            "tandem_frontend_sequences_admitted",
            "Engine requests (prompts x n) admitted by the frontend and not yet finished.",
        )
        self.admitted_peak = self._gauge(
            "tandem_frontend_sequences_admitted_peak",
            "The most engine requests admitted at once since start.",
        )
        self.admitted_limit = self._gauge(
            "tandem_frontend_sequences_admitted_limit",
            "The admission bound: --max-num-seqs + --max-waiting-requests.",
        )
        self.in_flight = self._gauge(
            "tandem_frontend_engine_requests",
            "Engine requests the frontend routes outputs for (its per-request state).",
        )

    def record_finished(
        self,
        reason: str,
        prompt_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
        num_output_tokens: int,
    ) -> None:
        """One engine request ended (a choice of an HTTP request)."""
        self.requests.labels(finished_reason=reason, **self._label).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._e2e.observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            self._tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def record_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def record_inter_token(self, seconds: float, tokens: int = 1) -> None:
        """``seconds`` since the request's last output, for an output of ``tokens`` tokens:
        one observation per token, of the mean gap."""
        self.itl.observe(seconds / tokens, tokens)

    def record_engine_timings(self, timings: RequestTimings) -> None:
        """The engine's share of one request it finished (stop, length)."""
        self._queue.observe(timings.queue_s)
        self._prefill.observe(timings.prefill_s)
        self._decode.observe(timings.decode_s)
        if timings.draft_tokens:
            self._spec_acceptance.observe(timings.accepted_tokens / timings.draft_tokens)

    def record_tokens(self, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)

    def record_engine_stats(self, stats: Stats, healthy: bool) -> None:
        self.running.labels(**self._label).set(stats.num_running)
        self.waiting.labels(**self._label).set(stats.num_waiting)
        self.kv_usage.labels(**self._label).set(stats.kv_cache_usage)
        self.host_kv_usage.labels(**self._label).set(stats.host_kv_usage)
        self.engine_steps.labels(**self._label).set(stats.num_steps)
        self.engine_healthy.labels(**self._label).set(1.0 if healthy else 0.0)
        self.engine_counts.counts = stats.counts

    def watch_frontend(
        self,
        admitted: Callable[[], float],
        peak: Callable[[], float],
        limit: Callable[[], float],
        in_flight: Callable[[], float],
    ) -> None:
        """Frontend gauges read at scrape time, so they are never stale."""
        for gauge, fn in (
            (self.admitted, admitted),
            (self.admitted_peak, peak),
            (self.admitted_limit, limit),
            (self.in_flight, in_flight),
        ):
            gauge.labels(**self._label).set_function(fn)

    def record_resumed(self, count: int) -> None:
        self.resumed.labels(**self._label).inc(count)

    def record_resume_latency(self, seconds: float) -> None:
        self.resume_latency.labels(**self._label).observe(seconds)

    def record_lora_request(self, lora_name: str) -> None:
        self.lora_requests.labels(lora_name=lora_name, **self._label).inc()

    def record_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason, **self._label).inc()

    def record_restart(self) -> None:
        self.engine_restarts.labels(**self._label).inc()

    def record_new_runs(self, total: int) -> None:
        """Restarts seen as new engine runs in the polled counts (``total`` so far): the count
        of an API process that does not supervise the engine cores itself."""
        if total > self._new_runs:
            self.engine_restarts.labels(**self._label).inc(total - self._new_runs)
            self._new_runs = total

    def record_health(self, healthy: bool) -> None:
        self.engine_healthy.labels(**self._label).set(1.0 if healthy else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.aliases)


class RenamedCollector(Collector):
    """Each family of ``source`` named in ``names`` again under each of its other names (same
    samples, same labels), collected at the scrape, so both names always agree."""

    def __init__(self, source: CollectorRegistry, names: dict[str, tuple[str, ...]]) -> None:
        self.source = source
        self.names = names

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            for alias in self.names.get(family.name, ()):
                yield renamed(family, alias)


def renamed(family: Metric, name: str) -> Metric:
    """A copy of ``family`` called ``name``: its samples' names keep their suffixes."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [
        s._replace(name=name + s.name.removeprefix(family.name)) for s in family.samples
    ]
    return copy


class EngineCountsCollector(Collector):
    """The engines' counts as Prometheus counters and a histogram, at each scrape: a
    prometheus_client Counter can only be incremented, and these arrive as totals."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.counts = EngineCounts()  # the latest totals (EnginePool.stats), zero until then

    def collect(self) -> Iterator[Metric]:
        c, label = self.counts, [self.model_name]
        for name, doc, value in (
            (
                "tandem_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache when requests were admitted.",
                c.prefix_cache_queries,
            ),
            (
                "tandem_prefix_cache_hits",
                "Of those, tokens found in the device KV cache (not computed again).",
                c.prefix_cache_hits,
            ),
            (
                "tandem_kv_offload_queries",
                "Prompt tokens looked up in the prefix cache with a host KV tier to fall back on.",
                c.kv_offload_queries,
            ),
            (
                "tandem_kv_offload_hits",
                "Of those, tokens copied back from the host KV tier (not computed again).",
                c.kv_offload_hits,
            ),
            (
                "tandem_kv_offload_stored_blocks",
                "KV blocks copied to the host KV tier as they were evicted from the device.",
                c.kv_offload_stored_blocks,
            ),
            (
                "tandem_kv_offload_restored_blocks",
                "KV blocks copied back from the host KV tier for a prefix hit.",
                c.kv_offload_restored_blocks,
            ),
            ("tandem_num_preemptions", "Requests preempted for KV room.", c.preemptions),
            (
                "tandem_spec_decode_num_drafts",
                "Speculative decoding: request steps that carried drafts.",
                c.spec_drafts,
            ),
            (
                "tandem_spec_decode_num_draft_tokens",
                "Speculative decoding: draft tokens scored by the target model.",
                c.spec_draft_tokens,
            ),
            (
                "tandem_spec_decode_num_accepted_tokens",
                "Speculative decoding: of those, drafts the target agreed with (kept).",
                c.spec_accepted_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
        yield histogram_family(
            "tandem_iteration_tokens_total",
            "Tokens scheduled per engine step (prompt chunks and decodes).",
            self.model_name,
            STEP_TOKEN_BUCKETS,
            c.step_tokens,
            c.step_tokens_sum,
        )


def histogram_family(
    name: str,
    doc: str,
    model_name: str,
    bounds: Sequence[float],
    counts: Sequence[int],
    total: float,
) -> HistogramMetricFamily:
    """A histogram kept as per-bucket counts (the last above every bound), as Prometheus
    exposes it: cumulative counts by upper bound, then +Inf."""
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    labels = [*(str(float(b)) for b in bounds), "+Inf"]
    for bound, count in zip(labels, counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric([model_name], buckets, total)
    return family


class StepHistogram(Collector):
    """A histogram observed from the event loop only (no lock) and exposed like any other.

    ``observe`` is a bisect and two additions, without prometheus_client's lock, per-bucket
    walk and value objects: it is recorded once per request per engine step.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str) -> None:
        self.name = name
        self.doc = doc
        self.bounds = list(buckets)
        self.model_name = model_name
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self) -> Iterator[Metric]:
        yield histogram_family(
            self.name, self.doc, self.model_name, self.bounds, self.counts, self.sum
        )
