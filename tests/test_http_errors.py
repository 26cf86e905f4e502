"""Every error answers its HTTP status with the OpenAI body {"error": {message, type, param,
code}} and no traceback: 400 (invalid fields, over-long prompts), 404 (unknown model or route),
401 (API key), 503 (engine core down, including requests in flight when it dies)."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.processes import die_with_parent
from protocol.address import EngineAddress
from tests.server_fixture import (  # noqa: F401
    API_KEY,
    MAX_MODEL_LEN,
    Server,
    keyed_server,
    pid_alive,
    server,
    start_server,
    stop_server,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in r.text
    return err


def post(server: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kw)


# ---- 400 --------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "and then"}, "suffix"),  # echo with logprobs used to be here: now served
    ({"seed": -(2**63) - 1}, "seed"),  # past int64 (OpenAI's and vLLM's seeds are signed)
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"top_k": 10**12}, "top_k"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    *(({"logit_bias": {k: 1}}, "logit_bias") for k in ("--5", "-5", "²", "١٢", " 12", "9" * 5000)),
    # vLLM's continuous_usage_stats is not served: refused rather than ignored.
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options"),
    ({"prompt": [[49152]]}, "prompt"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    # JSON of the wrong type is refused (pydantic's lax mode read these as 5, 1, true, [1]).
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"echo": "on"}, "echo"),
    ({"prompt": [True]}, "prompt"),
    ({"n": True}, "n"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"prompt": [[1, True]]}, "prompt"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS)
def test_invalid_completion_fields_are_400(
    server: Server, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": "default", "prompt": "Hello", "max_tokens": 2, **fields}
    err = assert_openai_error(post(server, "/v1/completions", body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param


def same_error_streamed(server: Server, path: str, body: dict[str, Any]) -> None:
    """A bad request that asks to stream is answered as the same request that does not: the
    streaming lane (frontend/middleware.py) hands what it cannot serve to the app, or answers
    the handler's error as the app's handlers do."""
    plain = post(server, path, {**body, "stream": False})
    streamed = post(server, path, {**body, "stream": True})
    assert_openai_error(plain, plain.status_code)
    assert (streamed.status_code, streamed.json()) == (plain.status_code, plain.json())


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS)
def test_streamed_invalid_completions_get_the_same_error(
    server: Server, fields: dict[str, Any], param: str | None
) -> None:
    if "stream_options" in fields:
        pytest.skip("stream_options are valid when streaming")
    body = {"model": "default", "prompt": "Hello", "max_tokens": 2, **fields}
    same_error_streamed(server, "/v1/completions", body)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": "hi"}, "messages"),
    # Rules across fields name the field at fault.
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"echo": True}, "echo"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # A schema beside json_object would be ignored.
    (
        {"response_format": {"type": "json_object", "schema": {"required": ["x"]}}},
        "response_format",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {}, "x": 1},
            }
        },
        "response_format",
    ),
    # An unknown content part names its type, not the string a content may also be.
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages",
    ),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    # A field inside a content part is named once (pydantic's union tag left out).
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content.0.image_url.url",
    ),
    # A message other than the assistant's holds content, as OpenAI requires.
    ({"messages": [{"role": "user"}]}, "messages"),
    (
        {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]},
        "messages",
    ),
    ({"max_tokens": MAX_MODEL_LEN}, "messages"),  # prompt + max_tokens over the context
    ({"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, "messages"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS)
def test_streamed_invalid_chats_get_the_same_error(
    server: Server, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], **fields}
    same_error_streamed(server, "/v1/chat/completions", body)


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS)
def test_invalid_chat_fields_are_400(
    server: Server, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], **fields}
    err = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param.split(".")[0]
        assert "." not in param or err["param"] == param, err


def test_prompt_longer_than_the_context_is_400(server: Server) -> None:
    body = {"model": "default", "prompt": [1] * (MAX_MODEL_LEN - 8), "max_tokens": 16}
    err = assert_openai_error(post(server, "/v1/completions", body), 400)
    assert err["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in err["message"]
    body = {"model": "default", "prompt": [1] * (MAX_MODEL_LEN + 1), "max_tokens": 1}
    assert assert_openai_error(post(server, "/v1/completions", body), 400)["param"] == "prompt"


def test_openais_nullable_fields_take_null_as_their_default(server: Server) -> None:
    """Clients that send every field, the unset ones as null, get what they get without them."""
    base = {"model": "default", "max_tokens": 4, "temperature": 0}
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None}
    chat = {**base, "messages": [{"role": "user", "content": "Hi"}]}
    plain = post(server, "/v1/chat/completions", chat)
    nulled = post(server, "/v1/chat/completions", {**chat, **nulls, "logprobs": None})
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert [c["message"] for c in nulled.json()["choices"]] == [
        c["message"] for c in plain.json()["choices"]
    ]
    completion = {**base, "prompt": "Hello"}
    plain = post(server, "/v1/completions", completion)
    nulled = post(server, "/v1/completions", {**completion, **nulls, "echo": None})
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_sampling_checks_name_their_param(server: Server) -> None:
    """The range checks behind the schema (the wire's) still say which field broke them."""
    body = b'{"model": "default", "prompt": "Hi", "max_tokens": 2, "temperature": Infinity}'
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert assert_openai_error(r, 400)["param"] == "temperature"


def test_an_unparsable_or_missing_body_says_so(server: Server) -> None:
    for content, words in ((b'{"prompt": "x",', "not valid JSON"), (b"", "needs a JSON body")):
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        err = assert_openai_error(r, 400)
        assert words in err["message"] and err["param"] is None, err
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends
    r = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": "x"}', headers=form)
    err = assert_openai_error(r, 400)
    assert "Content-Type: application/json" in err["message"] and err["param"] is None, err


def test_responses_errors_use_the_responses_names(server: Server) -> None:
    """/v1/responses runs as a chat request: its errors name the Responses API's fields."""
    body = {"model": "default", "input": "Hi", "max_output_tokens": 4}
    bad_format = {"format": {"type": "json_object", "schema": {"required": ["x"]}}}
    err = assert_openai_error(post(server, "/v1/responses", {**body, "text": bad_format}), 400)
    assert err["param"].startswith("text"), err
    # The default model's template reads no effort, so it is refused, by the Responses name.
    r = post(server, "/v1/responses", {**body, "reasoning": {"effort": "high"}})
    err = assert_openai_error(r, 400)
    assert err["param"] == "reasoning.effort", err
    assert "so reasoning.effort could not" in err["message"], err
    r = post(server, "/v1/responses", {**body, "max_output_tokens": 10**6})
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded", err
    assert "or max_output_tokens." in err["message"] and "max_tokens" not in err["message"], err


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2, 3]", b'"just a string"', b""], ids=repr)
def test_malformed_bodies_are_400(server: Server, content: bytes) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert_openai_error(r, 400)


def test_openai_client_sees_bad_request(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default", prompt="Hi", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


# ---- 404 --------------------------------------------------------------------------------------


def test_unknown_model_is_404(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    err = assert_openai_error(post(server, "/v1/completions", {"model": "x", "prompt": "a"}), 404)
    assert err["param"] == "model"
    assert_openai_error(post(server, "/tokenize", {"model": "x", "prompt": "a"}), 404)


def test_the_openai_client_retrieves_the_served_model_and_not_another(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    listed = client.models.list().data[0]
    time.sleep(1.1)  # a second later: the card, ``created`` included, is the same
    retrieved = client.models.retrieve(listed.id)
    assert retrieved.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


def test_openais_hints_that_change_nothing_are_taken_and_a_bad_tier_is_not(server: Server) -> None:
    chat = {
        "model": "default", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}],
    }  # fmt: skip
    hints = {"prompt_cache_key": "k", "safety_identifier": "u1", "service_tier": "auto"}
    plain = post(server, "/v1/chat/completions", chat)
    hinted = post(server, "/v1/chat/completions", {**chat, **hints})
    assert plain.status_code == hinted.status_code == 200, hinted.text
    assert hinted.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    bad = post(server, "/v1/chat/completions", {**chat, "service_tier": "bogus"})
    assert assert_openai_error(bad, 400)["param"] == "service_tier"
    # A response says the tier that served it, as OpenAI's does: there is one here.
    asked = {"input": "Hi", "max_output_tokens": 4, "service_tier": "flex"}
    assert post(server, "/v1/responses", asked).json()["service_tier"] == "default"


def test_retrieval_documents_are_refused_as_unsupported(server: Server) -> None:
    body = {
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
        "chat_template_kwargs": {"documents": [{"title": "a", "text": "b"}]},
    }  # fmt: skip
    err = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    assert err["param"] == "chat_template_kwargs" and "not supported" in err["message"], err


def test_unknown_route_and_method_answer_in_the_openai_shape(server: Server) -> None:
    assert_openai_error(httpx.get(f"{server.base_url}/v1/nothing", timeout=10), 404)
    assert_openai_error(httpx.get(f"{server.base_url}/v1/completions", timeout=10), 405)


# ---- 401 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"X-Api-Key": API_KEY}],
    ids=["missing", "wrong", "no-bearer", "other-header"],
)
def test_wrong_or_missing_key_is_401(keyed_server: Server, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/engine")]:
        r = httpx.request(
            method,
            f"{keyed_server.base_url}{path}",
            json={"model": "default", "prompt": "a"},
            headers=headers,
            timeout=10,
        )
        err = assert_openai_error(r, 401)
        assert err["code"] == "invalid_api_key"


def test_right_key_passes_and_health_and_metrics_are_open(keyed_server: Server) -> None:
    base = keyed_server.base_url
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in right.models.list().data] == ["default"]
    resp = right.completions.create(model="default", prompt="Hi", max_tokens=2, temperature=0)
    assert resp.usage.completion_tokens >= 1
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200


# ---- 503: the engine stalls or dies under load (keyed_server; these run last, in order) ------


def running(srv: Server) -> int:
    from protocol.client import EngineClient
    from protocol.messages import ControlKind

    with EngineClient(srv.engine_address) as raw:
        raw.connect(timeout=10)
        return raw.control(ControlKind.STATS).stats.num_running


def wait_until(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_stalled_engine_fails_requests_then_is_taken_back(keyed_server: Server) -> None:
    srv = keyed_server
    long = {"model": "default", "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.update(r=post(srv, "/v1/completions", long, headers=srv.headers))
    )
    worker.start()
    wait_until(lambda: running(srv) == 1)
    os.kill(srv.engine_pid, signal.SIGSTOP)  # alive but silent: no heartbeats, no outputs
    try:
        worker.join(timeout=30)
        assert not worker.is_alive(), "a request hung on a stalled engine"
        assert assert_openai_error(result["r"], 503)["code"] == "engine_down"
        assert_openai_error(httpx.get(f"{srv.base_url}/health", timeout=10), 503)
        r = post(srv, "/v1/completions", {**long, "max_tokens": 2}, headers=srv.headers)
        assert_openai_error(r, 503)
    finally:
        os.kill(srv.engine_pid, signal.SIGCONT)
    health = f"{srv.base_url}/health"
    wait_until(lambda: httpx.get(health, timeout=10).status_code == 200)
    wait_engine_idle(srv)  # the request given up on was aborted once the engine woke
    r = post(srv, "/v1/completions", {**long, "max_tokens": 2}, headers=srv.headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_engine_death_fails_requests_in_flight_and_new_ones_with_503(keyed_server: Server) -> None:
    srv = keyed_server
    long = {"model": "default", "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}
    results: dict[str, Any] = {}

    def non_streamed() -> None:
        results["whole"] = post(srv, "/v1/completions", long, headers=srv.headers)

    def streamed() -> None:
        url = f"{srv.base_url}/v1/completions"
        body = {**long, "stream": True}
        with httpx.stream("POST", url, json=body, headers=srv.headers, timeout=60) as r:
            results["events"] = [line for line in r.iter_lines() if line]

    def responses_streamed() -> None:
        url = f"{srv.base_url}/v1/responses"
        story = "Tell me a long story."
        body = {"model": "default", "input": story, "max_output_tokens": 1500, "stream": True}
        with httpx.stream("POST", url, json=body, headers=srv.headers, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            results["responses"] = [json.loads(line[6:]) for line in lines]

    targets = (non_streamed, streamed, responses_streamed)
    threads = [threading.Thread(target=target) for target in targets]
    for t in threads:
        t.start()
    wait_until(lambda: running(srv) == 3)
    os.kill(srv.engine_pid, signal.SIGKILL)  # a crash, not a polite shutdown
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a request hung after the engine died"

    assert assert_openai_error(results["whole"], 503)["code"] == "engine_down"
    events = results["events"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "engine_down"
    last = results["responses"][-1]  # the Responses stream: response.failed, as OpenAI's ends
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["message"].startswith("engine_down: ")
    assert last["sequence_number"] == len(results["responses"]) - 1

    assert_openai_error(httpx.get(f"{srv.base_url}/health", timeout=10), 503)
    body = {"model": "default", "prompt": "Hi", "max_tokens": 2}
    for stream in (False, True):
        r = post(srv, "/v1/completions", {**body, "stream": stream}, headers=srv.headers)
        assert assert_openai_error(r, 503)["code"] == "engine_down"
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
    assert_openai_error(post(srv, "/v1/chat/completions", chat, headers=srv.headers), 503)


def test_sigterm_stops_the_server_and_cleans_up(keyed_server: Server) -> None:
    """Even after its engine crashed, the server exits 0 and removes its private ipc dir. (With
    a live engine, stop_server checks at teardown that SIGTERM takes the engine down too.)
    With --no-restart-engine the crashed engine stayed down: /health 503, the same dead pid."""
    info = keyed_server.engine_info()
    assert info["pid"] == keyed_server.engine_pid and not info["healthy"]
    assert httpx.get(f"{keyed_server.base_url}/health", timeout=10).status_code == 503
    address = EngineAddress.parse(keyed_server.engine_address)
    keyed_server.process.send_signal(signal.SIGTERM)
    assert keyed_server.process.wait(timeout=30) == 0
    assert not pid_alive(keyed_server.engine_pid)
    assert not any(Path(p).parent.exists() for p in address.ipc_paths)  # private dir removed


def test_modules_in_the_working_folder_do_not_shadow_the_project(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`tandem serve` started from a folder holding a common.py and a protocol.py (generic
    names, as our packages'): its engine core and API processes import ours, not those."""
    for name in ("common", "protocol", "engine_core", "frontend"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the folder's {name}.py')\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    args = ["--api-servers", "2", "--num-kv-blocks", "64"]
    srv = start_server(logs, model=str(tiny_model_dir), args=args, cwd=tmp_path)
    try:
        body = {"model": str(tiny_model_dir), "prompt": "Hi", "max_tokens": 2}
        assert post(srv, "/v1/completions", body).status_code == 200
    finally:
        stop_server(srv)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its engine core), from /proc."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _wait_for_line(proc: subprocess.Popen[str], log: Path, line: str) -> None:
    """Until ``line`` shows in the server's log file, or on its stdout for the banner (read
    the moment it is printed, as a supervisor would)."""
    if line == BANNER:
        assert proc.stdout is not None
        assert any(line in out for out in proc.stdout), log.read_text()
        return
    deadline = time.monotonic() + 120
    while line not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


BANNER = "OpenAI API:"


@pytest.mark.parametrize("line", ["starting the engine core", BANNER, BANNER])
def test_sigterm_during_start_up_stops_the_server(tmp_path: Path, line: str) -> None:
    """SIGTERM while the engine loads, or right after the banner (where the start-up's last
    collection runs thousands of weakref callbacks, in which a SystemExit raised by a signal
    handler is printed and dropped): the server exits 0 and its engine core goes with it. Where
    the signal lands after the banner is a race: without the fix one try in two or three stayed
    up, hence two tries."""
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--port", "0", "--log-level", "INFO"]
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=die_with_parent()
        )
    try:
        _wait_for_line(proc, log, line)
        engines = _children(proc.pid)
        assert engines or line != BANNER, "no engine core under a server that is up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert "Exception ignored" not in log.read_text(), log.read_text()
    for engine in engines:
        assert not pid_alive(engine), "the engine core outlived tandem serve"


# ---- the engine never outlives its frontend ---------------------------------------------------

_PARENT = """
import subprocess, sys, time
from common.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


def test_child_dies_when_the_frontend_is_killed() -> None:
    if die_with_parent() is None:
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert pid_alive(child_pid)
    parent.kill()  # SIGKILL: no cleanup code runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(child_pid):
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
