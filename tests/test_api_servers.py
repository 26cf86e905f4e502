"""--stream-interval and --api-servers against real `tandem serve` processes on the tiny model,
through the official `openai` client.

Independent expectations: the streamed text concatenated equals the non-streamed text of the same
greedy request; the flush rule counted by hand from the tokens each chunk carries (completion
logprobs name every token); greedy outputs of two API processes equal those of the single-process
tiny server; each process's /metrics counts exactly the requests whose responses carry its index;
and the process table (/proc), not the server's word, says that SIGTERM left no process behind.
"""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_fixture import (  # noqa: F401
    Server,
    descendants,
    pid_alive,
    start_server,
    stop_server,
    tiny_server,
)

pytestmark = pytest.mark.slow

INTERVAL = 4
MAX_TOKENS = 24
HEADER = "x-tandem-api-server"
MULTI_ARGS = [
    "--api-servers", "2", "--stream-interval", str(INTERVAL),
    "--max-num-seqs", "16", "--num-kv-blocks", "256",
]  # fmt: skip
PROMPTS = ["The sky is", "Once upon a time", "Numbers: 1, 2,", "Dear diary, today"]
GREEDY: dict[str, Any] = {
    "temperature": 0,
    "max_tokens": MAX_TOKENS,
    "extra_body": {"ignore_eos": True},
}
SERVING_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Server]:
    """`tandem serve --api-servers 2 --stream-interval 4` on the tiny model; the last test of
    the module stops it itself."""
    log_dir = tmp_path_factory.mktemp("serve-multi")
    srv = start_server(log_dir, model=str(tiny_model_dir), args=MULTI_ARGS)
    try:
        serving_pids(srv)  # both API processes answer before any test starts
        yield srv
    finally:
        if srv.process.poll() is None:
            stop_server(srv)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=120)  # fmt: skip


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def serving_pids(
    server: Server, replaced: dict[int, int] | None = None, old_engine: int | None = None
) -> dict[int, int]:
    """API process index -> pid, once both answer healthy; with ``replaced``, only processes
    other than those, and with ``old_engine``, only processes connected to another engine. Each
    probe is a new connection, which the kernel routes to a process by a hash of its source
    port, so both are reached."""
    stale = set((replaced or {}).values())
    seen: dict[int, int] = {}
    deadline = time.monotonic() + SERVING_TIMEOUT_S
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"API processes seen: {seen}\n{server.log_tail()}"
        with contextlib.suppress(httpx.HTTPError):
            info = httpx.get(f"{server.base_url}/v1/engine", timeout=10).json()
            fresh = info["api_server_pid"] not in stale and info["pid"] != old_engine
            if info["healthy"] and fresh:
                seen[info["api_server"]] = info["api_server_pid"]
        time.sleep(0.05)
    return seen


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


# ---- --stream-interval ------------------------------------------------------------------------


@pytest.fixture(params=[1, INTERVAL], ids=["interval1", f"interval{INTERVAL}"])
def streamed(request: pytest.FixtureRequest) -> tuple[Server, int]:
    """(server, its --stream-interval): the single-process tiny server runs the default, 1."""
    name = "tiny_server" if request.param == 1 else "multi"
    return request.getfixturevalue(name), request.param


def check_flush_rule(tokens_per_chunk: list[int], interval: int, total: int) -> None:
    """Its first token at once, then chunks of at least ``interval`` tokens, then the rest."""
    assert sum(tokens_per_chunk) == total
    assert tokens_per_chunk[0] >= 1
    assert all(n >= interval for n in tokens_per_chunk[1:-1]), tokens_per_chunk
    assert len(tokens_per_chunk) <= math.ceil(total / interval) + 1
    assert len(tokens_per_chunk) > 1


def test_streamed_completion_equals_whole_and_flushes_by_interval(
    streamed: tuple[Server, int],
) -> None:
    server, interval = streamed
    client = client_of(server)
    kwargs: dict[str, Any] = {"model": model_of(client), "prompt": PROMPTS[0], **GREEDY}
    whole, chunks = parallel(
        lambda: client.completions.create(**kwargs),
        lambda: list(client.completions.create(**kwargs, stream=True, logprobs=0,
                                               stream_options={"include_usage": True})),
    )  # fmt: skip
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == MAX_TOKENS
    check_flush_rule([len(c.choices[0].logprobs.tokens) for c in content], interval, MAX_TOKENS)


def test_streamed_chat_equals_whole_within_the_chunk_bound(streamed: tuple[Server, int]) -> None:
    server, interval = streamed
    client = client_of(server)
    messages = [{"role": "user", "content": "Tell me a story."}]
    kwargs: dict[str, Any] = {"model": model_of(client), "messages": messages, **GREEDY}
    whole, chunks = parallel(
        lambda: client.chat.completions.create(**kwargs),
        lambda: list(client.chat.completions.create(**kwargs, stream=True)),
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert 1 < len(content) <= math.ceil(MAX_TOKENS / interval) + 1


def test_stop_string_cuts_streamed_and_whole_alike(multi: Server) -> None:
    client = client_of(multi)
    kwargs: dict[str, Any] = {"model": model_of(client), "prompt": PROMPTS[1], **GREEDY}
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # from the middle of the unstopped text
    want = free[: free.index(stop)]
    whole, chunks = parallel(
        lambda: client.completions.create(**kwargs, stop=[stop]),
        lambda: list(client.completions.create(**kwargs, stop=[stop], stream=True)),
    )
    assert whole.choices[0].text == want
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"


# ---- --api-servers ----------------------------------------------------------------------------


def chat_text(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(the answer's text, the index of the API process that served it, "" for none)."""
    messages = [{"role": "user", "content": prompt}]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, stream=stream, **GREEDY
    )
    body = raw.parse()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
    else:
        text = body.choices[0].message.content
    return text, raw.headers.get(HEADER, "")


def test_two_api_servers_serve_concurrent_requests_alike(
    multi: Server, tiny_server: Server
) -> None:
    ref_client = client_of(tiny_server)
    ref_model = model_of(ref_client)
    want = parallel(*(lambda p=p: chat_text(ref_client, ref_model, p, False) for p in PROMPTS))
    client = client_of(multi)
    model = model_of(client)
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True) for _ in range(2)]
    got = parallel(*(lambda p=p, s=s: chat_text(client, model, p, s) for p, s in jobs))
    assert len(got) == 16
    for (prompt, _), (text, _) in zip(jobs, got, strict=True):
        assert text == want[PROMPTS.index(prompt)][0], prompt
    # 16 connections, each sent to one of two sockets by a hash: both serve (all on one: 2^-15).
    assert {index for _, index in got} == {"0", "1"}


def metrics_by_server(server: Server) -> dict[str, dict[str, float]]:
    """Each API process's /metrics (the finished-request count and the admission bound), by the
    header of the response that carried it; new connections until both answered."""
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + SERVING_TIMEOUT_S
    while len(seen) < 2:
        assert time.monotonic() < deadline, seen
        r = httpx.get(f"{server.base_url}/metrics", timeout=10)
        samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
        seen[r.headers[HEADER]] = {
            "finished": sum(s.value for s in samples if s.name == "tandem_request_success_total"),
            "limit": next(
                s.value for s in samples if s.name == "tandem_frontend_sequences_admitted_limit"
            ),
        }
    return seen


def test_each_api_server_counts_its_own_requests_and_admits_half(multi: Server) -> None:
    before = metrics_by_server(multi)
    client = client_of(multi)
    model = model_of(client)
    served = parallel(*(lambda p=p: chat_text(client, model, p, False)[1] for p in PROMPTS * 2))
    after = metrics_by_server(multi)
    for index in ("0", "1"):
        assert after[index]["finished"] - before[index]["finished"] == served.count(index)
        # 16 running + the default 3 x 16 waiting, split in two.
        assert after[index]["limit"] == (16 + 3 * 16) / 2


def test_a_killed_api_server_and_a_killed_engine_are_both_replaced(multi: Server) -> None:
    """Both at once, so the two restarts overlap (the suite's time): the parent starts a new API
    process 0 and a new engine, and both API processes take the new engine back."""
    before = serving_pids(multi)
    old_engine = multi.engine_info()["pid"]
    os.kill(before[0], signal.SIGKILL)
    os.kill(old_engine, signal.SIGKILL)
    after = serving_pids(multi, replaced={0: before[0]}, old_engine=old_engine)
    assert after[1] == before[1] and after[0] != before[0]
    assert not pid_alive(before[0]) and not pid_alive(old_engine)
    client = client_of(multi)
    model = model_of(client)
    outs = parallel(*(lambda p=p: client.completions.create(model=model, prompt=p, **GREEDY)
                      for p in PROMPTS))  # fmt: skip
    assert all(out.usage.completion_tokens == MAX_TOKENS for out in outs)


def stream_tokens(
    server: Server, started: threading.Event, signalled: list[float]
) -> tuple[str | None, int]:
    """One long greedy stream, ``started`` set at its first tokens: (its finish reason, None if
    the drain cut it; the tokens that came at least half a second after the time in
    ``signalled``, once there is one)."""
    body = {"model": model_of(client_of(server)), "prompt": "Once upon a time",
            "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0}  # fmt: skip
    reason, late = None, 0
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=SERVING_TIMEOUT_S) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                break
            choice = chunk["choices"][0]
            started.set()
            reason = choice["finish_reason"] or reason
            if signalled and time.monotonic() > signalled[0] + 0.5:
                late += len(choice["logprobs"]["tokens"])
    return reason, late


@pytest.mark.parametrize(
    ("api_servers", "tensor_parallel"), [(1, 1), (2, 1), (1, 2)],
    ids=["one API process", "two API processes", "tensor parallel"],
)  # fmt: skip
def test_sigterm_to_the_process_group_drains_and_refuses_new_connections(
    tmp_path: Path, tiny_model_dir: Path, api_servers: int, tensor_parallel: int
) -> None:
    """systemd's stop: SIGTERM to every process of the group at once. The engine goes on
    serving the API processes' drain (each stream ends whole, or still gets tokens well after
    the signal: the engine took SIGTERM as a death and no token came, before), a connection
    made after the signal is refused rather than held through the drain and reset, and every
    process exits. (One API process: its engine's supervisor restarted the engine mid-drain;
    tensor parallel: the worker died at the signal, and the engine with it.)"""
    args = [*MULTI_ARGS[:1], str(api_servers), *MULTI_ARGS[2:]]
    args += ["--tensor-parallel-size", str(tensor_parallel)]
    srv = start_server(tmp_path, model=str(tiny_model_dir), args=args, new_session=True)
    try:
        family = descendants(srv.process.pid)
        signalled: list[float] = []
        with ThreadPoolExecutor(4) as pool:
            started = [threading.Event() for _ in range(4)]
            streams = [pool.submit(stream_tokens, srv, flag, signalled) for flag in started]
            assert all(flag.wait(SERVING_TIMEOUT_S) for flag in started)
            signalled.append(time.monotonic())
            os.killpg(srv.process.pid, signal.SIGTERM)
            time.sleep(1.0)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{srv.base_url}/health", timeout=30)
            results = [stream.result(timeout=SERVING_TIMEOUT_S) for stream in streams]
        assert all(reason == "length" or late >= 8 for reason, late in results), results
        assert srv.process.wait(timeout=60) == 0, srv.log_tail()
        assert "restarting" not in srv.log_path.read_text(), srv.log_tail()
        deadline = time.monotonic() + 15
        while left := [pid for pid in family if pid_alive(pid)]:
            assert time.monotonic() < deadline, f"left behind: {left}"
            time.sleep(0.1)
    finally:
        if srv.process.poll() is None:
            stop_server(srv)


def test_sigterm_stops_the_api_servers_and_the_engine(multi: Server) -> None:
    engine = multi.engine_info()["pid"]
    api = set(serving_pids(multi).values())
    family = descendants(multi.process.pid)
    assert {engine, *api} <= family
    multi.process.send_signal(signal.SIGTERM)
    assert multi.process.wait(timeout=60) == 0, multi.log_tail()
    deadline = time.monotonic() + 15
    while left := [pid for pid in family if pid_alive(pid)]:
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.1)
