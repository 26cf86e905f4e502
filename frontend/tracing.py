"""OpenTelemetry tracing of requests, off unless ``--otlp-traces-endpoint`` is given.

One span per HTTP request in the API process (``llm_request``, SERVER kind; its parent is the
W3C ``traceparent`` the client sent, if any), and under it, for each engine request the HTTP
request became (a choice), three spans built from the engine's own timings of it:
``engine_queue`` → ``prefill`` → ``decode``. The engine core sends those timings (durations, in
protocol/messages.py ``RequestTimings``) in the output that finishes the request; the spans are
laid back from the moment that output reached this process, so the engine process needs no
tracing code and the spans share the API process's clock (the transfer from the engine, well
under a millisecond on ipc, is the error). /health and /metrics, which probes and scrapers call
every few seconds, are not traced.

Spans go to an OTLP/HTTP collector (protobuf) in batches, through the maintained
``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http`` packages, which are needed
only where tracing is on: ``pip install 'tandem[tracing]'``. Nothing here imports them until a
``RequestTracer`` is made.
"""

from __future__ import annotations

import importlib.util
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.request_id import current_request_id

if TYPE_CHECKING:
    from protocol.messages import RequestTimings

UNTRACED_PATHS = frozenset({"/health", "/metrics"})
TRACING_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
INSTALL_HINT = (
    "pip install 'tandem[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)


def check_tracing_endpoint(endpoint: str) -> None:
    """ValueError naming the flag unless the endpoint is an http(s) URL and the packages are
    installed: said at start-up, not at the first request."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-traces-endpoint {endpoint!r}: an OTLP/HTTP URL is expected, such as "
            "http://collector:4318/v1/traces (this server exports OTLP over HTTP, not gRPC)"
        )
    missing = [name for name in TRACING_PACKAGES if not installed(name)]
    if missing:
        raise ValueError(f"--otlp-traces-endpoint needs {', '.join(missing)}: {INSTALL_HINT}")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def traces_url(endpoint: str) -> str:
    """The endpoint, with OTLP's ``/v1/traces`` path when it names none (as the OTel SDK does
    for OTEL_EXPORTER_OTLP_ENDPOINT)."""
    return (
        endpoint
        if urlsplit(endpoint).path not in ("", "/")
        else endpoint.rstrip("/") + "/v1/traces"
    )


class RequestTracer:
    """The API process's tracer: its own provider (never the global one) and OTLP exporter."""

    def __init__(self, endpoint: str, model: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": "tandem", "gen_ai.request.model": model})
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tandem.frontend")
        self.propagator = TraceContextTextMapPropagator()

    def start_request(self, scope: Scope) -> Any:
        """The HTTP request's span, child of the client's traceparent if it sent one."""
        from opentelemetry.trace import SpanKind

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self.propagator.extract(headers)
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER)
        span.set_attribute("http.request.method", scope["method"])
        span.set_attribute("url.path", scope["path"])
        request_id = current_request_id.get()
        if request_id is not None:
            span.set_attribute("http.request.header.x-request-id", request_id)
        return span

    def record_engine_request(
        self, engine_request_id: str, timings: RequestTimings, finished_at: float
    ) -> None:
        """The engine's queue, prefill and decode spans of one engine request, under the
        current request's span; ``finished_at`` (time.monotonic) is when its end arrived."""
        from opentelemetry import trace

        end = wall_ns(finished_at)
        decode_start = end - seconds_ns(timings.decode_s)
        prefill_start = decode_start - seconds_ns(timings.prefill_s)
        queue_start = prefill_start - seconds_ns(timings.queue_s)
        parent = trace.set_span_in_context(trace.get_current_span())
        for name, start, stop in (
            ("engine_queue", queue_start, prefill_start),
            ("prefill", prefill_start, decode_start),
            ("decode", decode_start, end),
        ):
            span = self.tracer.start_span(name, context=parent, start_time=start)
            span.set_attribute("tandem.engine_request_id", engine_request_id)
            if name == "decode" and timings.draft_tokens:
                span.set_attribute("tandem.spec_decode.draft_tokens", timings.draft_tokens)
                span.set_attribute("tandem.spec_decode.accepted_tokens", timings.accepted_tokens)
            span.end(end_time=stop)

    def shutdown(self) -> None:
        """Export what is still batched, then stop."""
        self.provider.shutdown()


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds, which spans are stamped in."""
    return time.time_ns() - seconds_ns(time.monotonic() - monotonic_s)


def seconds_ns(seconds: float) -> int:
    return round(seconds * 1e9)


class TracingMiddleware:
    """Each HTTP request but the probes' in a span, current while the app serves it (streamed
    responses included: the app returns once the stream has ended)."""

    def __init__(self, app: ASGIApp, tracer: RequestTracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, trace

        span = self.tracer.start_request(scope)
        token = context.attach(trace.set_span_in_context(span))

        async def send_recording_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:  # a server's span is an error for 5xx only (OTel's HTTP rules)
                    span.set_status(trace.StatusCode.ERROR)
            await send(message)

        try:
            await self.app(scope, receive, send_recording_status)
        finally:
            context.detach(token)
            span.end()
