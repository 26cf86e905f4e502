"""Bad input to the tiny server never gets a 5xx and never hurts it: hand-written cases beyond
those in test_http_errors.py (invalid UTF-8, lone surrogates, NaN and Infinity, deep nesting,
wrong types, huge numbers, empty and over-long prompts, token ids outside the vocabulary, body
and stop-string limits, unknown fields), then schemathesis fuzzing of our own OpenAPI schema,
valid and invalid bodies, with the server healthy and holding no state afterwards."""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest

from tests.server_fixture import (  # noqa: F401
    TINY_MAX_BODY_BYTES,
    TINY_MAX_NUM_SEQS,
    TINY_MAX_WAITING,
    Server,
    tiny_server,
    wait_engine_idle,
    wait_frontend_idle,
)

pytestmark = pytest.mark.slow

VOCAB = 49152
BASE = {"prompt": "Hi", "max_tokens": 2}


def post_raw(srv: Server, raw: bytes, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{srv.base_url}{path}", content=raw, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if code is not None:
        assert err["code"] == code, err
    return err


RAW_BODIES = [
    b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}',  # not UTF-8 at all
    b'{"prompt": "\\udc80", "max_tokens": 1}',  # valid JSON, but a lone surrogate
    b'{"prompt": "hi", "stop": ["\\ud800"]}',
    b'{"model": "\\ud800", "prompt": "a"}',  # would be quoted back in a 404
    b'{"prompt": "a", "\\udfff": 1}',  # even in an ignored key
    b'{"prompt": "hi", "temperature": NaN}',  # Python's json reads these; the ranges refuse them
    b'{"prompt": "hi", "top_p": NaN}',
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "repetition_penalty": Infinity}',
    b'{"prompt": "hi", "presence_penalty": -Infinity}',
    b"[" * 20_000,  # nesting deeper than the JSON parser's recursion limit
    b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": "hi"',
    b"\x00\x01\x02",
]


@pytest.mark.parametrize("raw", RAW_BODIES, ids=lambda b: repr(b[:24]))
def test_raw_bodies_are_400(tiny_server: Server, raw: bytes) -> None:
    assert_error(post_raw(tiny_server, raw), 400)


@pytest.mark.parametrize(
    ("raw", "field"),
    [(b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
     (b'{"prompt": "hi", "repetition_penalty": Infinity}', "repetition_penalty")],
)  # fmt: skip
def test_infinity_and_nan_are_refused_naming_their_field(
    tiny_server: Server, raw: bytes, field: str
) -> None:
    """Fields bounded on one side only: NaN and Infinity reached the engine's wire check."""
    err = assert_error(post_raw(tiny_server, raw), 400, "invalid_value")
    assert err["param"] == field, err


def test_a_value_the_engine_refuses_is_an_invalid_value(tiny_server: Server) -> None:
    """top_k past int32 passes the schema; the wire's bounds refuse it, naming it, with the
    schema's code."""
    err = assert_error(post_raw(tiny_server, b'{"prompt": "hi", "top_k": 1099511627776}'), 400)
    assert (err["code"], err["param"]) == ("invalid_value", "top_k"), err


def test_lone_surrogates_are_400_on_every_route(tiny_server: Server) -> None:
    chat = b'{"messages": [{"role": "user", "content": "\\udc80"}]}'
    assert_error(post_raw(tiny_server, chat, "/v1/chat/completions"), 400)
    assert_error(post_raw(tiny_server, b'{"prompt": "\\udc80"}', "/tokenize"), 400)
    # A surrogate PAIR is a valid character (here U+1F600) and is served.
    r = post_raw(tiny_server, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text


BAD_FIELDS = [
    ({"n": "two"}, "n"),
    ({"n": 10**9}, "n"),
    ({"n": 2**64}, "n"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 10**12}, "prompt"),  # over the context: context_length_exceeded
    ({"max_tokens": 2**80}, "prompt"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 2**64}, "seed"),  # past uint64
    ({"seed": -(2**63) - 1}, "seed"),  # past int64
    ({"top_k": 2**40}, None),  # past int32
    ({"stop": 5}, "stop"),
    ({"stop": ["x"] * 65}, "stop"),  # more than MAX_STOP_STRINGS
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),  # tokenizes to nothing
    ({"prompt": [""]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [[1, "a"]]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": [2**31]}, "prompt"),
    ({"prompt": [2**63]}, "prompt"),
    ({"prompt": [2**70]}, "prompt"),
    ({"prompt": "hello " * 2000}, "prompt"),  # over the 256-token context
    ({"prompt": [5] * 300}, "prompt"),
    ({"logprobs": 10**6}, "logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS, ids=lambda v: repr(v)[:40])
def test_bad_fields_are_400_naming_the_param(
    tiny_server: Server, fields: dict[str, Any], param: str | None
) -> None:
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", json=BASE | fields, timeout=60)
    err = assert_error(r, 400)
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param


def test_chat_wrong_types_and_limits(tiny_server: Server) -> None:
    url = f"{tiny_server.base_url}/v1/chat/completions"
    user = {"role": "user", "content": "Hi"}
    for bad in (
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [user], "top_logprobs": 21, "logprobs": True},
        {"messages": [user], "max_tokens": 10**12},
        {"messages": [user], "n": 10**9},
    ):
        assert_error(httpx.post(url, json=bad, timeout=60), 400)


def test_a_prompt_that_fills_the_context_says_what_it_needs(tiny_server: Server) -> None:
    """A prompt of the whole context leaves no room for an output token; with echo and
    max_tokens 0 the error says that one token is still run (not that it was asked for)."""
    context = httpx.post(f"{tiny_server.base_url}/tokenize", json={"prompt": "a"}).json()
    full = [1] * context["max_model_len"]
    url = f"{tiny_server.base_url}/v1/completions"
    echoed = {"prompt": full, "max_tokens": 0, "echo": True}
    err = assert_error(httpx.post(url, json=echoed, timeout=60), 400, "context_length_exceeded")
    assert "1 that max_tokens 0 runs and drops" in err["message"], err
    err = assert_error(httpx.post(url, json={"prompt": full, "max_tokens": 1}, timeout=60), 400)
    assert "1 for the completion" in err["message"], err
    ok = httpx.post(url, json={**echoed, "prompt": full[1:]}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_the_context_error_names_echos_token_only_where_max_tokens_0_was_asked() -> None:
    """check_context's wording: a chat prompt that fills the context with max_tokens unset
    (its budget comes to 0) needs "1 for the completion", not echo's run-and-drop."""
    from types import SimpleNamespace

    from frontend.errors import OpenAIError
    from frontend.generation import check_context

    ctx: Any = SimpleNamespace(max_model_len=8)
    for asked, words in ((None, "1 for the completion"), (0, "1 that max_tokens 0 runs")):
        with pytest.raises(OpenAIError) as caught:
            check_context(ctx, 8, asked, "messages")
        assert words in str(caught.value), caught.value
    assert check_context(ctx, 7, None, "messages") == 1


def test_detokenize_ids_outside_the_vocabulary_are_400(tiny_server: Server) -> None:
    for tokens in ([-1], [VOCAB], [2**70], ["a"]):
        r = httpx.post(f"{tiny_server.base_url}/detokenize", json={"tokens": tokens}, timeout=30)
        assert_error(r, 400)


def test_bodies_over_the_limit_are_413(tiny_server: Server) -> None:
    big = b'{"prompt": "' + b"a" * TINY_MAX_BODY_BYTES + b'"}'
    assert_error(post_raw(tiny_server, big), 413, "request_too_large")  # Content-Length says so

    def chunked() -> Any:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(TINY_MAX_BODY_BYTES // 4096 + 1):
            yield b"a" * 4096
        yield b'"}'

    r = httpx.post(f"{tiny_server.base_url}/v1/completions", content=chunked(), timeout=60)
    assert_error(r, 413, "request_too_large")
    # Just under the limit is parsed as usual (here: too many tokens, a 400 not a 413).
    near = b'{"prompt": "' + b"a " * (TINY_MAX_BODY_BYTES // 2 - 16) + b'"}'
    assert_error(post_raw(tiny_server, near), 400, "context_length_exceeded")


def test_unknown_fields_are_refused_like_openai(tiny_server: Server) -> None:
    """OpenAI answers an unknown request field with a 400 naming it; so do we (a field that was
    silently ignored could change nothing, or everything). Unknown fields inside a message are
    ignored: clients send back the messages they were given, with fields like ``refusal``."""
    url = f"{tiny_server.base_url}/v1/completions"
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    extra = httpx.post(url, json=body | {"frobnicate": 1}, timeout=60)
    assert extra.status_code == 400
    assert extra.json()["error"] == {
        "message": "Unrecognized request argument supplied: frobnicate",
        "type": "invalid_request_error",
        "param": "frobnicate",
        "code": "unknown_parameter",
    }
    message = {"role": "user", "content": "Hi", "tool_calls": [], "refusal": None}
    chat = {"messages": [message], "max_tokens": 2}
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # A misspelt "parameters" would leave a function that takes no arguments.
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "paramters": {"type": "object"}}}]},
         "tools.0.function.paramters"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
            {"type": "function", "function": {"name": "f"}, "strict": True}]}, "tools.0.strict"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
            {"type": "function", "function": {"name": "f"}}], "tool_choice": {
            "type": "function", "function": {"name": "f", "arguments": "{}"}}},
         "tool_choice.function.arguments"),
        ("/v1/responses", {"input": "Hi", "tools": [
            {"type": "function", "name": "f", "parameters": None, "strcit": False}]},
         "tools.0.strcit"),
        # Keys no field could have are named as sent, at the top level and inside a tool.
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
         "Temperature": 1}, "Temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "Parameters": {}}}]},
         "tools.0.function.Parameters"),
    ],
    ids=["chat function", "chat tool", "chat tool_choice", "responses tool", "top level",
         "capitalised"],
)  # fmt: skip
def test_unknown_keys_are_refused_naming_them(
    tiny_server: Server, path: str, body: dict[str, Any], param: str
) -> None:
    """As OpenAI does ("Additional properties are not allowed"): a key a tool's definition
    does not have is a 400 naming it, never a tool quietly defined without it; so is any
    unknown key, named as sent."""
    limit = {"max_output_tokens": 16} if path == "/v1/responses" else {"max_tokens": 2}
    r = httpx.post(f"{tiny_server.base_url}{path}", json=body | limit, timeout=60)
    err = assert_error(r, 400, "unknown_parameter")
    assert err["param"] == param, err


@pytest.mark.parametrize(
    ("path", "tool", "param"),
    [
        ("/v1/chat/completions", {"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}, "tools.0.function.parameters"),
        ("/v1/responses", {"type": "function", "name": "f", "parameters": {"type": "array"}},
         "tools.0.parameters"),
    ],
    ids=["chat", "responses"],
)  # fmt: skip
def test_a_function_whose_arguments_are_not_an_object_is_refused(
    tiny_server: Server, path: str, tool: dict[str, Any], param: str
) -> None:
    """A call's arguments are a JSON object: a schema of another type could never be met, and
    a forced call came back as raw markup in a completed message."""
    body = {"tools": [tool], "tool_choice": "required"}
    if path == "/v1/responses":
        body |= {"input": "Hi", "max_output_tokens": 16}
    else:
        body |= {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{tiny_server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and 'a JSON schema of type "object"' in err["message"], err


# ---- the published document -------------------------------------------------------------------


def document(srv: Server) -> dict[str, Any]:
    return httpx.get(f"{srv.base_url}/openapi.json", timeout=30).json()


def test_the_document_states_this_servers_limits(tiny_server: Server) -> None:
    """Routes it does not serve are left out; token ids, n, output lengths, priority and the
    reasoning budget carry this server's bounds; no marker of ours is left in the document."""
    doc = document(tiny_server)
    assert not {"/v1/embeddings", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"} & set(
        doc["paths"]
    )
    assert "x-tandem-limit" not in str(doc)
    context = httpx.post(f"{tiny_server.base_url}/tokenize", json={"prompt": "a"}).json()
    schemas = doc["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]
    assert completion["prompt"]["anyOf"][2]["items"]["maximum"] == VOCAB - 1
    assert completion["n"]["anyOf"][0]["maximum"] == TINY_MAX_NUM_SEQS + TINY_MAX_WAITING
    assert completion["max_tokens"]["maximum"] == context["max_model_len"] - 1
    assert completion["priority"]["minimum"] == completion["priority"]["maximum"] == 0
    assert chat["properties"]["thinking_token_budget"] == {"type": "null"}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["anyOf"][0]["items"]["maximum"] == (
        VOCAB - 1
    )


def schema_of(doc: dict[str, Any], name: str) -> Any:
    import jsonschema

    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(root)


# Bodies that break a rule the document states, each with the route that refuses it: the
# document must refuse it too, and the handler must serve it once the rule is kept.
STATED_RULES = [
    ("/v1/completions", {"prompt": ""}, {"prompt": "Hi"}),
    ("/v1/completions", {"prompt": [[]]}, {"prompt": [[5]]}),
    ("/v1/completions", {"prompt": [VOCAB]}, {"prompt": [VOCAB - 1]}),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, {"prompt": "Hi", "stop": ["x"]}),
    ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, {"prompt": "Hi", "suffix": ""}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, {"prompt": "Hi", "max_tokens": 0,
     "echo": True}),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {}}, {"prompt": "Hi", "stream": True,
     "stream_options": {}}),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, {"prompt": "Hi",
     "logit_bias": {"5": 1}}),
    ("/v1/completions", {"prompt": "Hi", "seed": -(2**63) - 1}, {"prompt": "Hi", "seed": -1}),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**64}, {"prompt": "Hi", "seed": 2**64 - 1}),
    ("/v1/completions", {"prompt": "Hi", "priority": 1}, {"prompt": "Hi", "priority": 0}),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 25}, {"prompt": "Hi", "logprobs": 5}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/completions", {"prompt": [True]}, {"prompt": [5]}),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, {"prompt": "Hi", "stream": False}),
    ("/v1/completions", {"prompt": "Hi", "spaces_between_special_tokens": True}, {"prompt": "Hi",
     "spaces_between_special_tokens": False}),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "a", "grammar": "b"}},
     {"prompt": "Hi", "structured_outputs": {"regex": "a"}}),
    ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_schema"}},
     {"prompt": "Hi", "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1"}]},
     {"messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
     {"messages": [{"role": "user", "content": "Hi", "tool_calls": []}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "audio": {}},
     {"messages": [{"role": "user", "content": "Hi"}], "audio": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
     {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2, "logprobs": True}),
    ("/v1/responses", {"input": [{"content": "Hi"}]}, {"input": [{"role": "user",
     "content": "Hi"}]}),
    ("/v1/responses", {"input": "Hi", "include": ["x"]}, {"input": "Hi", "include": []}),
    ("/v1/responses", {"input": "Hi", "truncation": "auto"}, {"input": "Hi",
     "truncation": "disabled"}),
    ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]},
     {"prompt": "Hi"}),
]  # fmt: skip
SCHEMA_NAMES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/tokenize": "TokenizeRequest",
}


@pytest.mark.parametrize(("path", "broken", "kept"), STATED_RULES, ids=lambda v: repr(v)[:50])
def test_the_document_and_the_handler_agree(
    tiny_server: Server, path: str, broken: dict[str, Any], kept: dict[str, Any]
) -> None:
    validator = schema_of(document(tiny_server), SCHEMA_NAMES[path])
    short = {"max_tokens": 2} if path in ("/v1/completions", "/v1/chat/completions") else {}
    broken, kept = short | broken, short | kept
    assert not validator.is_valid(broken)
    assert_error(httpx.post(f"{tiny_server.base_url}{path}", json=broken, timeout=60), 400)
    assert validator.is_valid(kept), list(validator.iter_errors(kept))
    r = httpx.post(f"{tiny_server.base_url}{path}", json=kept, timeout=60)
    assert r.status_code == 200, r.text


# ---- schemathesis -----------------------------------------------------------------------------

EXAMPLES_PER_POST = 50  # valid and invalid each, per POST route: about 20 s in all on 2 cores
EXAMPLES_PER_GET = 3
SHORT = 8  # generations are capped at this many tokens: the fuzz is about input, not output
MIN_SERVED = 0.5  # of the schema-valid cases, at least this share is served


# The field that bounds each generating route's output, which the fuzz keeps short.
OUTPUT_CAPS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


def cap_generation(path: str, body: Any) -> None:
    """Keep valid requests short: a missing or modest output bound of the route becomes SHORT
    (huge values are left alone: they are errors to find), and a min_tokens past it comes down
    to it (the cap, not the case, would make it a refusal)."""
    if not isinstance(body, dict):
        return
    for key in OUTPUT_CAPS.get(path, ()):
        value = body.get(key)
        if value is None or (type(value) is int and SHORT < value < 10**6):
            body[key] = SHORT
    if path in OUTPUT_CAPS and type(body.get("min_tokens")) is int:
        body["min_tokens"] = min(body["min_tokens"], SHORT)


FIRST_REFUSALS: list[str] = []  # a few 400s with their requests, for the failure message


def fuzz_operation(base_url: str, operation: Any, mode: Any, examples: int) -> Counter[int]:
    """Send ``examples`` schemathesis cases for one operation; any 5xx fails at once."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: CI stays reproducible
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def send(case: Any) -> None:
        cap_generation(operation.path, case.body)
        r = case.call(base_url=base_url, timeout=120)
        statuses[r.status_code] += 1
        assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}\n{case.as_curl_command()}"
        if r.status_code == 400 and mode is GenerationMode.POSITIVE and len(FIRST_REFUSALS) < 3:
            FIRST_REFUSALS.append(f"{r.text[:200]}\n{case.as_curl_command()[:400]}")

    send()
    return statuses


def test_schemathesis_fuzz_finds_no_5xx(tiny_server: Server) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{tiny_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /health"} <= paths
    valid: Counter[int] = Counter()  # the statuses of the valid cases
    for op in operations:
        if op.method == "post" and op.get_request_payload_content_types():
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                statuses = fuzz_operation(tiny_server.base_url, op, mode, EXAMPLES_PER_POST)
                valid += statuses if mode is GenerationMode.POSITIVE else Counter()
        else:  # no body to vary (a GET; a POST of an id alone, which any text is): a few calls
            fuzz_operation(tiny_server.base_url, op, GenerationMode.POSITIVE, EXAMPLES_PER_GET)
    # The document states what the handlers refuse (frontend/openapi_rules.py), so most of the
    # schema-valid cases are served; the rest are refusals it cannot state (its docstring lists
    # them) or a `model` that is not served (404). None is an auth or routing refusal, and the
    # server still serves a plain request after the fuzz.
    assert set(valid) <= {200, 400, 404}, f"{valid}; e.g. {FIRST_REFUSALS}"
    assert valid[200] >= MIN_SERVED * valid.total(), f"{valid}; e.g. {FIRST_REFUSALS}"
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", json=BASE, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert httpx.get(f"{tiny_server.base_url}/health", timeout=10).status_code == 200
    gauges = wait_frontend_idle(tiny_server)
    assert gauges["tandem_frontend_sequences_admitted_limit"] == (
        TINY_MAX_NUM_SEQS + TINY_MAX_WAITING
    )
    wait_engine_idle(tiny_server)
