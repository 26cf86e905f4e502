"""Ctrl-C (SIGINT) on `tandem serve` while streams run: uvicorn waits for them for its graceful
shutdown (frontend/http_server.py GRACEFUL_SHUTDOWN_S), then cancels them; a stream cut so ends
with the route's error event, a 503 ``shutting_down`` (the official openai client raises it from
a completions stream; a Responses stream ends in ``response.failed`` with the cause in its
error's message), a request not streamed gets that 503 as its JSON error (uvicorn's own answer
is a plain-text 500), the log holds no traceback, and serve exits 0 with its engine."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_fixture import pid_alive, start_server, stop_process

pytestmark = pytest.mark.slow

# SmolLM2-135M on the CPU: 1,900 tokens take far longer than the graceful shutdown waits.
LONG = 1900
# Greedy, SmolLM2-135M writes past 600 tokens for this (its "Tell me a long story." at random
# was now and then a few sentences, which ended inside the graceful shutdown: completed).
ESSAY = "Write a 2000-word essay about the history of Rome, with many sections."


def test_sigint_ends_running_streams_with_their_error_events(tmp_path: Path) -> None:
    srv = start_server(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        plain: list[Any] = []
        sender = threading.Thread(target=send_plain, args=(client, plain), daemon=True)
        sender.start()
        wait_running(srv.base_url, 1)  # the plain request runs before the streams start
        completion = client.completions.create(
            model="default", prompt="Tell me a long story.", max_tokens=LONG, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        response = client.responses.create(
            model="default", input=ESSAY, max_output_tokens=LONG, temperature=0, stream=True
        )  # the Responses API has no ignore_eos: a prompt the model answers at length, greedily
        first = next(iter(completion))
        assert first.choices[0].finish_reason is None
        events: list[Any] = [next(iter(response))]
        reader = threading.Thread(target=lambda: events.extend(response), daemon=True)
        reader.start()
        srv.process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for chunk in completion:
                assert chunk.choices[0].finish_reason is None  # cut, never finished
        reader.join(timeout=120)
        sender.join(timeout=120)
        (error,) = plain
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
        assert error.response.headers["content-type"] == "application/json"
        assert error.body["code"] == "shutting_down" and "request was cut short" in error.message
        last = events[-1]  # a Responses stream ends in response.failed, as OpenAI's does
        assert last.type == "response.failed" and last.response.status == "failed"
        assert last.response.error.code == "server_error"
        assert last.response.error.message.startswith("shutting_down: ")
        assert last.sequence_number == events[-2].sequence_number + 1
        assert srv.process.wait(timeout=120) == 0
        log = srv.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "a stream was cut short" in log
        assert not pid_alive(srv.engine_pid), "the engine core outlived tandem serve"
    finally:
        stop_process(srv.process)


def send_plain(client: openai.OpenAI, out: list[Any]) -> None:
    """A completion not streamed, long enough to outlast the graceful shutdown: its error."""
    try:
        client.completions.create(
            model="default", prompt="Tell me a long story.", max_tokens=LONG,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    except openai.APIError as exc:
        out.append(exc)


def wait_running(base_url: str, count: int) -> None:
    """Until the engine reports ``count`` requests running (/metrics, polled from the engine)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith("tandem_num_requests_running") and float(line.split()[-1]) >= count:
                return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} requests running after 60 s")


def test_a_second_sigint_stops_at_once_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C twice: uvicorn stops at once, without its graceful wait and without the app's
    shutdown event (the app has none: no lifespan task is left to be cancelled as the loop
    closes, whose traceback was logged at ERROR); the stream still ends with its error event,
    and serve exits 0 with its engine."""
    srv = start_server(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        completion = client.completions.create(
            model="default", prompt="Tell me a long story.", max_tokens=LONG, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert next(iter(completion)).choices[0].finish_reason is None
        srv.process.send_signal(signal.SIGINT)
        time.sleep(1.0)  # in uvicorn's graceful wait
        srv.process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for chunk in completion:
                assert chunk.choices[0].finish_reason is None
        assert srv.process.wait(timeout=120) == 0
        log = srv.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
        assert not pid_alive(srv.engine_pid), "the engine core outlived tandem serve"
    finally:
        stop_process(srv.process)
