"""Prometheus metrics of the frontend, served as text at GET /metrics.

Per-request figures (finish reasons, tokens, latencies) are recorded by the frontend as requests
end; engine-wide gauges (running and waiting requests, KV-cache usage) come from a periodic
ControlKind.STATS call. Each server owns its registry, so two apps in one process never clash.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from protocol.messages import Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metric families; record_* methods are called from the request handlers."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._label = {"model_name": model_name}
        r = self.registry
        self.requests = Counter(
            "tandem_request_success",
            "Engine requests finished, by finish reason (stop, length, abort, error).",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Time from arrival at the frontend to the first generated token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Time from arrival at the frontend to the end of the request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "tandem_num_requests_running", "Requests running in the engine.", labels, registry=r
        )
        self.waiting = Gauge(
            "tandem_num_requests_waiting", "Requests waiting in the engine.", labels, registry=r
        )
        self.kv_usage = Gauge(
            "tandem_kv_cache_usage_perc",
            "KV-cache blocks held by requests as a fraction of all (cached free blocks are free).",
            labels,
            registry=r,
        )
        self.engine_steps = Gauge(
            "tandem_engine_steps", "Engine steps run since start.", labels, registry=r
        )
        self.engine_healthy = Gauge(
            "tandem_engine_healthy", "1 while the engine core answers, else 0.", labels, registry=r
        )
        self.engine_restarts = Counter(
            "tandem_engine_restarts", "Engine cores started after one died.", labels, registry=r
        )
        self.rejected = Counter(
            "tandem_requests_rejected",
            "HTTP requests refused before reaching the engine, by reason (overloaded).",
            [*labels, "reason"],
            registry=r,
        )
        self.admitted = Gauge(
            "tandem_frontend_sequences_admitted",
            "Engine requests (prompts x n) admitted by the frontend and not yet finished.",
            labels,
            registry=r,
        )
        self.admitted_peak = Gauge(
            "tandem_frontend_sequences_admitted_peak",
            "The most engine requests admitted at once since start.",
            labels,
            registry=r,
        )
        self.admitted_limit = Gauge(
            "tandem_frontend_sequences_admitted_limit",
            "The admission bound: --max-num-seqs + --max-waiting-requests.",
            labels,
            registry=r,
        )
        self.in_flight = Gauge(
            "tandem_frontend_engine_requests",
            "Engine requests the frontend routes outputs for (its per-request state).",
            labels,
            registry=r,
        )

        # Children resolved once: .labels() takes a lock and builds a key on every call.
        name = self._label
        self._prompt_tokens = self.prompt_tokens.labels(**name)
        self._generation_tokens = self.generation_tokens.labels(**name)
        self._ttft, self._tpot, self._e2e = (
            h.labels(**name) for h in (self.ttft, self.tpot, self.e2e)
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

    def record_tokens(self, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)

    def record_engine_stats(self, stats: Stats, healthy: bool) -> None:
        self.running.labels(**self._label).set(stats.num_running)
        self.waiting.labels(**self._label).set(stats.num_waiting)
        used = stats.num_total_blocks - stats.num_free_blocks - stats.num_cached_blocks
        self.kv_usage.labels(**self._label).set(used / max(stats.num_total_blocks, 1))
        self.engine_steps.labels(**self._label).set(stats.num_steps)
        self.engine_healthy.labels(**self._label).set(1.0 if healthy else 0.0)

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

    def record_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason, **self._label).inc()

    def record_restart(self) -> None:
        self.engine_restarts.labels(**self._label).inc()

    def record_health(self, healthy: bool) -> None:
        self.engine_healthy.labels(**self._label).set(1.0 if healthy else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
