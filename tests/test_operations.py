"""Operations through a real `tandem serve` on the tiny model: CORS, X-Request-Id, vLLM metric
names and OpenTelemetry traces (received by an OTLP/HTTP collector in this process, decoded with
the opentelemetry-proto classes).

``ops_server`` runs with every operations flag on; ``tiny_server`` (none of them) shows that
each is off unless asked for.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import VLLM_NAMES
from tests.server_fixture import (
    API_KEY,
    Server,
    free_port,
    start_server,
    stop_server,
    tiny_server,
)

__all__ = ["tiny_server"]  # the fixture, imported for pytest

ORIGIN = "https://app.example"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            collector.spans.extend(scope.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_port}/v1/traces"

    def spans_of_trace(self, trace_id: str, count: int, timeout: float = 60.0) -> list:
        """The spans of ``trace_id``, once ``count`` of them have come (batches are exported
        every OTEL_BSP_SCHEDULE_DELAY ms)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def ops_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, collector: Collector
) -> Iterator[Server]:
    extra = [
        "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
        "--allow-credentials", "--otlp-traces-endpoint", collector.url,
        "--metrics-name-alias", "vllm", "--log-level", "DEBUG",
    ]  # fmt: skip
    # The SDK's batch processor reads its export period here; the child inherits it.
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        log_dir = tmp_path_factory.mktemp("serve-ops")
        srv = start_server(
            log_dir, api_key=API_KEY, model=str(tiny_model_dir), args=(), extra=extra
        )
    finally:
        if old is None:
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old
    try:
        yield srv
    finally:
        stop_server(srv)


def client_of(server: Server) -> openai.OpenAI:
    key = server.api_key or "unused"
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def chat(server: Server, headers: dict[str, str]) -> openai.APIResponse:
    return client_of(server).chat.completions.with_raw_response.create(
        model=client_of(server).models.list().data[0].id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0.0,
        extra_headers=headers,
    )


# ---- CORS -------------------------------------------------------------------------------------


def preflight(server: Server, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    return httpx.options(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=10)


def test_cors_preflight_answers_an_allowed_origin(ops_server: Server) -> None:
    reply = preflight(ops_server, ORIGIN)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    assert reply.headers["access-control-allow-credentials"] == "true"
    assert set(reply.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    # The preflight needed no API key; the request itself does, and its answers, the 401 too
    # (so that the page can read why), carry the header.
    url = f"{ops_server.base_url}/v1/models"
    refused = httpx.get(url, headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    models = httpx.get(url, headers={"Origin": ORIGIN, **ops_server.headers})
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == ORIGIN


def test_cors_preflight_refuses_another_origin(ops_server: Server) -> None:
    reply = preflight(ops_server, "https://evil.example")
    assert reply.status_code == 400
    assert "access-control-allow-origin" not in reply.headers


def test_cors_is_off_unless_asked_for(tiny_server: Server) -> None:
    reply = preflight(tiny_server, ORIGIN)
    assert "access-control-allow-origin" not in reply.headers
    assert reply.status_code == 405  # no route answers OPTIONS


def test_cors_flag_without_origins_is_refused(tiny_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir),
           "--allowed-methods", '["GET"]']  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--allowed-methods: CORS is off without --allowed-origins" in done.stderr


def test_a_port_in_use_stops_the_server_before_the_engine_starts(tiny_model_dir: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir),
               "--port", port]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1 port {port}" in done.stderr
    assert "engine" not in done.stdout  # no banner: nothing started


def test_port_0_serves_on_the_port_its_banner_shows(tiny_model_dir: Path) -> None:
    import re

    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir),
           "--port", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        banner = next(line for line in proc.stdout if "OpenAI API:" in line)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)[1])
        assert port != 0
        for _ in range(60):  # the banner comes as uvicorn starts to listen
            with contextlib.suppress(httpx.ConnectError):
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"nothing answers on port {port}")
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_bad_operations_flags_are_refused_by_name(tiny_model_dir: Path) -> None:
    base = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir)]
    for flags, said in (
        (["--allowed-origins", "https://a.example"], "a JSON list of strings is expected"),
        (["--otlp-traces-endpoint", "grpc://collector:4317"], "--otlp-traces-endpoint"),
    ):
        done = subprocess.run(base + flags, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, flags
        assert said in done.stderr, done.stderr


# ---- X-Request-Id -----------------------------------------------------------------------------


def test_request_id_is_returned_and_logged(ops_server: Server) -> None:
    reply = chat(ops_server, {"X-Request-Id": "client-id.42:abc"})
    assert reply.headers["x-request-id"] == "client-id.42:abc"
    response_id = reply.parse().id
    # The debug line that maps the client's id to the engine requests, under the client's id.
    wanted = f"[x-request-id client-id.42:abc]: engine requests {response_id}-*"
    deadline = time.monotonic() + 10
    while wanted not in ops_server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, ops_server.log_tail()
        time.sleep(0.1)


def test_a_stream_carries_the_request_id(ops_server: Server) -> None:
    body = {
        "model": client_of(ops_server).models.list().data[0].id,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    url = f"{ops_server.base_url}/v1/chat/completions"
    headers = {"X-Request-Id": "stream-7", **ops_server.headers}
    with httpx.stream("POST", url, json=body, headers=headers) as reply:
        assert reply.status_code == 200
        assert reply.headers["x-request-id"] == "stream-7"
        assert reply.read().endswith(b"data: [DONE]\n\n")


def test_request_id_is_made_when_none_is_sent(tiny_server: Server) -> None:
    first = httpx.get(f"{tiny_server.base_url}/v1/models").headers["x-request-id"]
    second = httpx.get(f"{tiny_server.base_url}/v1/models").headers["x-request-id"]
    assert len(first) == 32 and int(first, 16) >= 0
    assert first != second


@pytest.mark.parametrize("given", ["kong-uuid#17", "two words", "semi;colon", "x" * 256])
def test_a_proxys_request_id_is_taken_as_it_is(tiny_server: Server, given: str) -> None:
    reply = httpx.get(f"{tiny_server.base_url}/v1/models", headers={"X-Request-Id": given})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == given


def test_a_request_id_cannot_end_its_log_tag() -> None:
    import logging

    from frontend.request_id import RequestIdLogFilter, current_request_id

    record = logging.LogRecord("tandem", logging.INFO, "", 0, "served", None, None)
    token = current_request_id.set("x]: engine core lost [x-request-id y")
    try:
        RequestIdLogFilter().filter(record)
    finally:
        current_request_id.reset(token)
    assert record.request_tag == ' [x-request-id "x]: engine core lost [x-request-id y"]'


@pytest.mark.parametrize("bad", ["x" * 257, "é", "tab\tinside"])
def test_a_bad_request_id_is_refused(tiny_server: Server, bad: str) -> None:
    reply = httpx.get(
        f"{tiny_server.base_url}/v1/models", headers=[(b"X-Request-Id", bad.encode())]
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "X-Request-Id" and error["code"] == "invalid_request_id"


def test_errors_carry_the_request_id(tiny_server: Server) -> None:
    reply = httpx.post(
        f"{tiny_server.base_url}/v1/completions", json={}, headers={"X-Request-Id": "err-1"}
    )
    assert reply.status_code == 400
    assert reply.headers["x-request-id"] == "err-1"


# ---- vLLM's metric names ----------------------------------------------------------------------


def scrape(server: Server) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


def without_prefix(samples: list[tuple[str, dict[str, str], float]], prefix: str) -> list:
    return sorted(
        (name.removeprefix(prefix), sorted(labels.items()), value)
        for name, labels, value in samples
        if not name.endswith("_created")  # when the family was made: read twice, may differ
    )


def test_vllm_metric_names_mirror_ours(ops_server: Server) -> None:
    chat(ops_server, {})
    families = scrape(ops_server)
    assert families["tandem_request_success"], "no request counted"
    checked = 0
    for ours, aliases in VLLM_NAMES.items():
        if not families.get(ours):
            continue  # a gauge not set yet has no sample, under either name
        for alias in aliases:
            assert alias in families, alias
            expected = without_prefix(families[ours], ours)
            assert without_prefix(families[alias], alias) == expected, alias
            checked += 1
    assert checked >= 15
    success = {
        dict(labels)["finished_reason"]: value
        for name, labels, value in families["vllm:request_success"]
        if name == "vllm:request_success_total"
    }
    assert success["length"] >= 1  # max_tokens 4 on a random model: cut by length


def test_vllm_metric_names_are_off_unless_asked_for(tiny_server: Server) -> None:
    assert not [name for name in scrape(tiny_server) if name.startswith("vllm:")]


# ---- tracing ----------------------------------------------------------------------------------


def test_a_request_is_traced_under_the_clients_parent(
    ops_server: Server, collector: Collector
) -> None:
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    chat(ops_server, {"traceparent": traceparent, "X-Request-Id": "traced-1"})
    spans = {s.name: s for s in collector.spans_of_trace(TRACE_ID, 4)}
    assert set(spans) == {"llm_request", "engine_queue", "prefill", "decode"}
    api = spans["llm_request"]
    assert api.parent_span_id.hex() == PARENT_SPAN_ID
    attributes = {a.key: a.value for a in api.attributes}
    assert attributes["http.request.header.x-request-id"].string_value == "traced-1"
    assert attributes["http.response.status_code"].int_value == 200
    queue, prefill, decode = spans["engine_queue"], spans["prefill"], spans["decode"]
    for child in (queue, prefill, decode):
        assert child.parent_span_id == api.span_id
    # One after the other, inside the API's span.
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert api.start_time_unix_nano <= queue.start_time_unix_nano
    assert decode.end_time_unix_nano <= api.end_time_unix_nano
    assert prefill.end_time_unix_nano > prefill.start_time_unix_nano  # a prefill took time


def test_probes_are_not_traced(ops_server: Server, collector: Collector) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    httpx.get(f"{ops_server.base_url}/health", headers=headers)
    models = f"{ops_server.base_url}/v1/models"
    httpx.get(models, headers={**headers, **ops_server.headers})  # traced: a marker
    spans = collector.spans_of_trace(trace_id, 1)
    assert [s.name for s in spans] == ["llm_request"]
    path = {a.key: a.value.string_value for a in spans[0].attributes}["url.path"]
    assert path == "/v1/models"
