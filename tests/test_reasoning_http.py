"""Reasoning through a real `tandem serve --reasoning-parser qwen3` on a tiny random Qwen3 whose
chat template thinks (tests/factories.py ``write_thinking_model``), with the official openai
client: the reasoning split from the answer whole and streamed, the usage's reasoning tokens,
a thinking budget, a JSON schema that holds after the reasoning, chat_template_kwargs changing
the prompt (seen through /tokenize), and the fields refused where they cannot be honoured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server_fixture import Server, server, start_server, stop_server  # noqa: F401

pytestmark = pytest.mark.slow

BUDGET = 3
MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
SCHEMA = {
    "type": "object",
    "properties": {"blue": {"type": "boolean"}},
    "required": ["blue"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_server(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[Server]:
    from tests.factories import write_thinking_model

    model = write_thinking_model(tmp_path_factory.mktemp("thinking"), default_model_dir)
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--reasoning-parser", "qwen3"]
    args += ["--served-model-name", "default"]
    srv = start_server(tmp_path_factory.mktemp("serve-thinking"), model=str(model), args=args)
    try:
        yield srv
    finally:
        stop_server(srv)


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def budgeted(**extra: Any) -> dict[str, Any]:
    """A greedy chat of MAX_TOKENS tokens whose thinking is cut after BUDGET tokens (min_tokens
    holds the end off: ignore_eos is refused beside the budget's grammar, which EOS ends)."""
    body = {
        "thinking_token_budget": BUDGET,
        "min_tokens": MAX_TOKENS,
        **extra.pop("extra_body", {}),
    }
    return {
        "model": "default", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
        "extra_body": body, **extra,
    }  # fmt: skip


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_the_reasoning_and_the_answer_come_apart(thinking_server: Server) -> None:
    resp = client_of(thinking_server).chat.completions.create(**budgeted())
    message = resp.choices[0].message
    reasoning = reasoning_of(message)
    assert reasoning is not None and message.content
    assert message.model_extra["reasoning"] == reasoning  # the newer spelling, the same text
    assert "<think>" not in message.content and "</think>" not in message.content
    assert "</think>" not in reasoning
    # The budget's tokens of thinking at most, and the end marker: the rest is the answer.
    details = resp.usage.completion_tokens_details
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert 1 <= details.reasoning_tokens <= BUDGET + 1
    # Without the reasoning: the same answer, no reasoning field.
    bare = client_of(thinking_server).chat.completions.create(
        **budgeted(extra_body={"include_reasoning": False})
    )
    assert bare.choices[0].message.content == message.content
    assert reasoning_of(bare.choices[0].message) is None


def test_a_stream_sends_the_reasoning_then_the_answer(thinking_server: Server) -> None:
    client = client_of(thinking_server)
    whole = client.chat.completions.create(**budgeted()).choices[0].message
    parts: list[tuple[str, str]] = []
    for chunk in client.chat.completions.create(**budgeted(stream=True)):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            parts.append(("reasoning", extra["reasoning_content"]))
        if delta.content:
            parts.append(("content", delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # no reasoning after the answer
    assert "".join(t for k, t in parts if k == "reasoning") == reasoning_of(whole)
    assert "".join(t for k, t in parts if k == "content") == whole.content


def test_a_json_schema_holds_after_the_reasoning(thinking_server: Server) -> None:
    resp = client_of(thinking_server).chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": BUDGET},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert reasoning_of(choice.message) is not None  # it reasoned first...
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)  # ...then answered in JSON


def tokenize(srv: Server, **extra: Any) -> list[int]:
    body = {"messages": MESSAGES, **extra}
    resp = httpx.post(f"{srv.base_url}/tokenize", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def test_chat_template_kwargs_change_the_prompt(thinking_server: Server) -> None:
    thinking = tokenize(thinking_server)
    plain = tokenize(thinking_server, chat_template_kwargs={"enable_thinking": False})
    assert thinking != plain
    detok = httpx.post(f"{thinking_server.base_url}/detokenize", json={"tokens": plain}).json()
    assert detok["prompt"].endswith("<think>\n\n</think>\n\n")
    # The template closed the block: the output is all answer.
    resp = client_of(thinking_server).chat.completions.create(
        **budgeted(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    )
    message = resp.choices[0].message
    assert reasoning_of(message) is None and message.content
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_continued_message_is_in_reasoning_only_where_it_opened_a_think_block(
    thinking_server: Server,
) -> None:
    """With continue_final_message the output continues the last message: inside reasoning
    where that message opened a <think> block, not where an earlier message wrote one."""
    client = client_of(thinking_server)
    asked = {"role": "user", "content": "What is the <think> tag?"}
    body: dict[str, Any] = {"model": "default", "max_tokens": 6, "temperature": 0}
    body["extra_body"] = {
        "continue_final_message": True, "add_generation_prompt": False, "min_tokens": 6,
    }  # fmt: skip
    answer = {"role": "assistant", "content": "It is"}
    message = client.chat.completions.create(messages=[asked, answer], **body).choices[0].message
    assert message.content and reasoning_of(message) is None, message
    thinking = {"role": "assistant", "content": "<think>\nLet me see"}
    message = client.chat.completions.create(messages=[asked, thinking], **body).choices[0].message
    assert reasoning_of(message), message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template_kwargs": {"not_in_the_template": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ],
)
def test_what_the_template_cannot_take_is_refused(
    thinking_server: Server, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **extra}
    resp = httpx.post(f"{thinking_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_reasoning_effort_goes_to_a_template_that_reads_it(thinking_server: Server) -> None:
    def prompt_tokens(**extra: Any) -> int:
        resp = client_of(thinking_server).chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=1, **extra
        )
        return resp.usage.prompt_tokens

    plain, effort = prompt_tokens(), prompt_tokens(reasoning_effort="high")
    assert effort > plain  # the template's "Reasoning effort: high" line


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking_token_budget": 4},
        {"include_reasoning": False},
        {"reasoning_effort": "low"},  # the default model's template does not read it
    ],
)
def test_reasoning_fields_need_a_reasoning_parser(server: Server, extra: dict[str, Any]) -> None:  # noqa: F811
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **extra}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == next(iter(extra))


def test_the_responses_api_gives_a_reasoning_item_then_the_answer(thinking_server: Server) -> None:
    client = client_of(thinking_server)
    resp = client.responses.create(
        model="default",
        input="Is the sky blue?",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "sky", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": BUDGET},
    )
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text  # the reasoning text itself
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert 1 <= resp.usage.output_tokens_details.reasoning_tokens <= BUDGET + 1
    kinds = []
    with client.responses.stream(
        model="default", input="Is the sky blue?", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "sky", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": BUDGET},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    # The reasoning item's one part is announced before its deltas and closed with its text.
    parts = [(e.type, e.part.type) for e in events if e.type.startswith("response.content_part")]
    assert parts[:2] == [
        ("response.content_part.added", "reasoning_text"),
        ("response.content_part.done", "reasoning_text"),
    ]
    assert kinds.index("response.content_part.added") < kinds.index("response.reasoning_text.delta")
    assert final.output_text == resp.output_text
    assert final.output[0].content[0].text == resp.output[0].content[0].text


# ---- harmony (gpt-oss's format), on a tiny model whose tokenizer and template speak it -------


@pytest.fixture(scope="module")
def harmony_server(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[Server]:
    from tests.factories import write_harmony_model

    model = write_harmony_model(tmp_path_factory.mktemp("harmony"), default_model_dir)
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "default"]
    args += ["--reasoning-parser", "openai_gptoss"]
    srv = start_server(tmp_path_factory.mktemp("serve-harmony"), model=str(model), args=args)
    try:
        yield srv
    finally:
        stop_server(srv)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_harmony_answer_in_the_final_channel_holds_the_schema(harmony_server: Server) -> None:
    resp = client_of(harmony_server).chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": BUDGET},
    )
    message = resp.choices[0].message
    assert "<|" not in message.content  # the harmony markers are framing, not the answer
    jsonschema.validate(json.loads(message.content), SCHEMA)
    reasoning = reasoning_of(message)
    assert reasoning is None or "<|" not in reasoning


def not_analysis(srv: Server) -> dict[str, float]:
    """A logit bias that keeps the model from opening an analysis message (the tiny random
    model would think until max_tokens): against every token that starts "analysis"."""
    from transformers import AutoTokenizer

    model_dir = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["root"]
    vocab = AutoTokenizer.from_pretrained(model_dir).get_vocab()
    prefixes = [t for t in vocab if t and "analysis".startswith(t.lstrip("Ġ"))]
    return {str(vocab[t]): -100.0 for t in prefixes}


def test_harmony_tool_call_is_read_from_its_commentary_message(harmony_server: Server) -> None:
    body = {
        "model": "default", "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
        "tools": [WEATHER], "tool_choice": "required", "logit_bias": not_analysis(harmony_server),
    }  # fmt: skip
    resp = client_of(harmony_server).chat.completions.create(**body)
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = [
        c.choices[0].delta
        for c in client_of(harmony_server).chat.completions.create(**body, stream=True)
        if c.choices
    ]
    fragments = [tc for d in streamed for tc in (d.tool_calls or [])]
    assert fragments[0].function.name == "get_weather"
    assert "".join(f.function.arguments or "" for f in fragments) == call.function.arguments


def test_a_budget_cannot_bound_a_forced_harmony_call(harmony_server: Server) -> None:
    body = {
        "model": "default", "messages": MESSAGES, "max_tokens": 8, "tools": [WEATHER],
        "tool_choice": "required", "thinking_token_budget": 4,
    }  # fmt: skip
    resp = httpx.post(f"{harmony_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "thinking_token_budget"


def test_ignore_eos_beside_a_thinking_budget_is_refused(thinking_server: Server) -> None:
    """The budget's grammar ends the output at the first EOS, so ignore_eos would be passed
    over: a 400 naming it (min_tokens, which keeps EOS from being sampled, is honoured)."""
    body = budgeted()
    body["extra_body"] = {**body["extra_body"], "ignore_eos": True, "min_tokens": 0}
    with pytest.raises(openai.BadRequestError) as caught:
        client_of(thinking_server).chat.completions.create(**body)
    assert caught.value.body["param"] == "ignore_eos", caught.value.body


def test_a_tokenizer_without_think_tokens_refuses_what_needs_them_and_says_so(
    tmp_path: Path,
) -> None:
    """--reasoning-parser qwen3 over the default model, whose tokenizer has no single <think>
    and </think> tokens: start-up warns, plain chats still answer, and a request whose grammar
    must start after the reasoning is a 400 naming its field and why (it was a 500)."""
    srv = start_server(tmp_path, args=["--num-kv-blocks", "256", "--reasoning-parser", "qwen3"])
    try:
        client = client_of(srv)
        plain = {"model": "default", "messages": MESSAGES, "max_tokens": 4}
        assert client.chat.completions.create(**plain).choices[0].message.content
        # A <think> in the client's messages opens no reasoning (the template's generation
        # prompt opens none): the answer is content, with the reasoning kept or dropped.
        about = [{"role": "system", "content": "Never write <think>."}, *MESSAGES]
        for extra in ({}, {"extra_body": {"include_reasoning": False}}):
            body = {**plain, "messages": about, "temperature": 0, **extra}
            message = client.chat.completions.create(**body).choices[0].message
            assert message.content and reasoning_of(message) is None, message
        refusals = [
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
            ({"extra_body": {"thinking_token_budget": 2}}, "thinking_token_budget"),
            ({"tools": [WEATHER], "tool_choice": "required"}, "tools"),
        ]
        for extra, param in refusals:
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(**plain, **extra)
            error = caught.value.body
            assert error["param"] == param, error
            assert "no single <think> and </think> tokens" in error["message"], error
            assert "--reasoning-parser qwen3" in error["message"], error
    finally:
        stop_server(srv)
    log = "".join(p.read_text() for p in tmp_path.glob("serve-*.log"))
    assert "--reasoning-parser qwen3: the tokenizer has no single <think> and </think>" in log
