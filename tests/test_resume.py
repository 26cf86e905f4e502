"""Requests survive their engine's death: SIGKILL the engine core mid-generation and every request
in flight completes, streamed or not, with the text the same request gets on an undisturbed
server (greedy, and seeded at temperature 1), its usage as if nothing happened.

The reference for each request is the same server's answer before the kill. On the default model
(one engine) the requests are 48 tokens long to keep CI's CPU time in bounds
(TANDEM_RESUME_TEST_TOKENS=200 runs the issue's 200); on the tiny model (data parallelism, API
processes, the resume limit) they are 200 tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.client import AsyncEngineClient
from protocol.messages import SamplingParams
from tests.server_fixture import (
    SERVE_ARGS,
    Server,
    pid_alive,
    start_server,
    stop_server,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow

RESTART_TIMEOUT_S = 180.0
# Output tokens of the default model's requests: 48 in CI; the 200 with
# TANDEM_RESUME_TEST_TOKENS=200 (about three minutes a test on two cores).
DEFAULT_MODEL_TOKENS = int(os.environ.get("TANDEM_RESUME_TEST_TOKENS", "48"))
# Room for all 16 requests on each engine core and in each API process's admission gate.
TINY_RESUME_ARGS = ["--max-num-seqs", "8", "--max-waiting-requests", "32", "--num-kv-blocks", "512"]


def bodies(model: str, count: int, max_tokens: int, seeded: bool | None) -> list[dict[str, Any]]:
    """``count`` distinct prompts, every other one streamed, on both routes; all seeded at
    temperature 1 (True), all greedy (False), or (None) greedy and seeded by turns of four, so
    that eight requests hold every combination of route, streaming and sampling."""
    out = []
    for i in range(count):
        sampled = seeded if seeded is not None else i % 8 >= 4
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0 if sampled else 0.0,
            "stream": i % 2 == 1,
        }
        if sampled:
            body["seed"] = 100 + i
        if i % 4 < 2:
            body["prompt"] = f"Story {i}: once upon a time"
        else:
            body["messages"] = [{"role": "user", "content": f"Tell story number {i}."}]
        out.append(body)
    return out


class Load:
    """The requests in threads; ``progress`` is set once a stream has seen ``threshold``
    tokens, which is when a test kills the engine: surely mid-generation."""

    def __init__(self, base_url: str, load: list[dict[str, Any]], threshold: int = 8) -> None:
        self.base_url = base_url
        self.load = load
        self.threshold = threshold
        self.progress = threading.Event()
        self.results: list[tuple[int, str, int] | None] = [None] * len(load)
        self.errors: list[dict[str, Any] | None] = [None] * len(load)  # a stream's error event
        self.threads = [threading.Thread(target=self.send, args=(i,)) for i in range(len(load))]

    def run(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float = 600) -> list[tuple[int, str, int]]:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a request hung"
        assert all(r is not None for r in self.results)
        return self.results  # type: ignore[return-value]

    def send(self, i: int) -> None:
        body = self.load[i]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        url = self.base_url + path
        if not body["stream"]:
            r = httpx.post(url, json=body, timeout=600)
            text = ""
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
            used = r.json().get("usage", {}).get("completion_tokens", -1) if r.is_success else -1
            self.results[i] = (r.status_code, text, used)
            return
        body = body | {"stream_options": {"include_usage": True}}
        text, used, seen = "", -1, 0
        with httpx.stream("POST", url, json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors[i] = event["error"]
                    self.results[i] = (event["error"]["status"], text, -1)
                    return
                for choice in event["choices"]:
                    piece = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    text += piece
                    seen += 1 if piece else 0
                if seen >= self.threshold:
                    self.progress.set()
                if event.get("usage"):
                    used = event["usage"]["completion_tokens"]
            self.results[i] = (r.status_code, text, used)


def run_undisturbed(srv: Server, load: list[dict[str, Any]]) -> list[tuple[int, str, int]]:
    results = Load(srv.base_url, load).run().join()
    failed = [(i, r) for i, r in enumerate(results) if r[0] != 200]
    assert not failed, failed
    return results


def kill_mid_generation(srv: Server, load: list[dict[str, Any]], pid: int) -> Load:
    """Start the load, SIGKILL ``pid`` once a stream is well under way."""
    running = Load(srv.base_url, load).run()
    assert running.progress.wait(300), "no stream made progress"
    os.kill(pid, signal.SIGKILL)
    return running


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def wait_restarted(srv: Server, old_pid: int, key: Any = None) -> None:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        info = srv.engine_info()
        pid = info["pid"] if key is None else info["engines"][key]["pid"]
        if info["healthy"] and pid != old_pid and pid_alive(pid):
            return
        time.sleep(0.2)
    raise TimeoutError("the engine did not come back")


# ---- one engine, the default model --------------------------------------------------------------


@pytest.fixture(scope="module")
def resume_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own on the default model: these tests kill its engine."""
    srv = start_server(tmp_path_factory.mktemp("serve-resume"), args=SERVE_ARGS)
    try:
        yield srv
    finally:
        stop_server(srv)


def test_requests_survive_a_killed_engine(resume_server: Server) -> None:
    """Greedy and seeded requests side by side, killed together: one restart of the default
    model covers both (a restart is most of what this test costs)."""
    srv = resume_server
    load = bodies("default", 16, DEFAULT_MODEL_TOKENS, seeded=None)
    reference = run_undisturbed(srv, load)
    resumed_before = metric(srv, "tandem_requests_resumed_total")
    old_pid = srv.engine_info()["pid"]
    results = kill_mid_generation(srv, load, old_pid).join()
    assert results == reference  # status 200, the same text, the same usage
    assert metric(srv, "tandem_requests_resumed_total") > resumed_before
    assert metric(srv, "tandem_request_resume_seconds_count") >= 1
    wait_restarted(srv, old_pid)
    wait_engine_idle(srv)


def test_the_raw_client_resumes_too(resume_server: Server) -> None:
    """The raw ZMQ client's generate(max_resumes=...) goes on past the engine's death with the
    tokens an undisturbed run draws (seeded at temperature 1)."""
    srv = resume_server
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=11, ignore_eos=True)
    prompt = list(range(200, 230))

    async def tokens(kill_after: int | None) -> list[int]:
        # Death is seen as 2 s of silence: the restarted engine does not know this client.
        async with AsyncEngineClient(srv.engine_address, dead_after_s=2.0) as client:
            await client.connect()
            out: list[int] = []
            outputs = client.generate(f"raw-{kill_after}", prompt, params, max_resumes=1,
                                      resume_timeout=RESTART_TIMEOUT_S)  # fmt: skip
            async for o in outputs:
                before, out = len(out), out + list(o.new_token_ids)
                if kill_after is not None and before < kill_after <= len(out):
                    os.kill(srv.engine_info()["pid"], signal.SIGKILL)
            return out

    reference = asyncio.run(tokens(None))
    old_pid = srv.engine_info()["pid"]
    assert asyncio.run(tokens(8)) == reference
    wait_restarted(srv, old_pid)
    wait_engine_idle(srv)


def test_a_request_arriving_while_the_engine_restarts_waits_for_it(resume_server: Server) -> None:
    """Not a 503: once /health says the engine is down, a new request is held until the new
    engine serves, then answered in full."""
    srv = resume_server
    old_pid = srv.engine_info()["pid"]
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "the death was not seen"
        time.sleep(0.02)
    body = {"model": "default", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=RESTART_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert srv.engine_info()["pid"] != old_pid
    wait_engine_idle(srv)


# ---- data parallelism and API processes, the tiny model -----------------------------------------


@pytest.fixture(scope="module")
def dp_resume_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    extra = ["--data-parallel-size", "2", *TINY_RESUME_ARGS]
    srv = start_server(tmp_path_factory.mktemp("serve-dp-resume"), model=str(tiny_model_dir),
                       args=(), extra=extra)  # fmt: skip
    try:
        yield srv
    finally:
        stop_server(srv)


def test_the_other_data_parallel_engine_takes_the_requests_at_once(
    dp_resume_server: Server, tiny_model_dir: Path
) -> None:
    """Kill one of two engine cores: its requests resume on the other without waiting for the
    restart (each resume's wait is far below what a restart takes)."""
    srv = dp_resume_server
    load = bodies(str(tiny_model_dir), 16, 200, seeded=False)
    reference = run_undisturbed(srv, load)
    old_pid = srv.engine_info()["engines"][0]["pid"]
    started = time.monotonic()
    results = kill_mid_generation(srv, load, old_pid).join()
    done_after = time.monotonic() - started
    assert results == reference
    assert metric(srv, "tandem_requests_resumed_total") >= 1
    wait_restarted(srv, old_pid, key=0)
    restart_took = time.monotonic() - started
    assert done_after < restart_took, (done_after, restart_took)
    wait_engine_idle(srv)


def test_each_api_process_resumes_its_requests(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    extra = ["--api-servers", "2", *TINY_RESUME_ARGS]
    srv = start_server(tmp_path_factory.mktemp("serve-api-resume"), model=str(tiny_model_dir),
                       args=(), extra=extra)  # fmt: skip
    try:
        load = bodies(str(tiny_model_dir), 16, 200, seeded=True)
        reference = run_undisturbed(srv, load)
        old_pid = srv.engine_info()["pid"]
        results = kill_mid_generation(srv, load, old_pid).join()
        assert results == reference
        wait_restarted(srv, old_pid)
    finally:
        stop_server(srv)


def test_a_request_killed_past_the_limit_fails_with_the_documented_error(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--max-request-resumes 1: the first death is survived, the second fails the request with
    503 engine_down, saying how many times it was resumed."""
    extra = ["--max-request-resumes", "1", *TINY_RESUME_ARGS]
    srv = start_server(tmp_path_factory.mktemp("serve-limit"), model=str(tiny_model_dir),
                       args=(), extra=extra)  # fmt: skip
    try:
        body = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "temperature": 0,
                "stream": True}  # fmt: skip
        running = Load(srv.base_url, [body], threshold=20).run()
        assert running.progress.wait(120)
        first = srv.engine_info()["pid"]
        os.kill(first, signal.SIGKILL)
        wait_restarted(srv, first)
        running.threshold = 10**9  # then kill again as soon as the resumed stream moves
        deadline = time.monotonic() + 60
        while metric(srv, "tandem_request_resume_seconds_count") < 1:
            assert time.monotonic() < deadline, "the request was not resumed"
            time.sleep(0.05)
        os.kill(srv.engine_info()["pid"], signal.SIGKILL)
        [(status, _, _)] = running.join()
        [error] = running.errors
        assert status == 503 and error is not None and error["code"] == "engine_down"
        assert "resumed 1 of at most 1 times" in error["message"], error
    finally:
        stop_server(srv)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-request-resumes", "-1"), ("--resume-timeout", "0"), ("--resume-timeout", "nan")],
)
def test_bad_resume_flags_are_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused at parse time with the flag named, not clamped to something else."""
    from frontend.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err
