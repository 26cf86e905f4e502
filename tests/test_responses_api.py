"""The Responses API (/v1/responses) through a real server on the default model with the official
openai client: a text answer, a function tool forced and fed its output in a second turn, the
same streamed (the client's own event accumulator builds the response), a stored response
continued by previous_response_id, GET and DELETE of a stored response, structured output by
text.format, and the refusals. Where a Responses request has a chat equivalent, the greedy answer
must be the chat answer: the Responses API is a door onto the same pipeline."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server_fixture import Server, server  # noqa: F401

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER_SCHEMA,
}
ASK = "What is the weather in Paris?"
GREEDY = {"model": "default", "temperature": 0, "max_output_tokens": 48}


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def chat_text(srv: Server, messages: list[dict[str, Any]], **extra: Any) -> str:
    resp = client_of(srv).chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=48, **extra
    )
    return resp.choices[0].message.content or ""


def test_a_text_answer_is_the_chat_answer(server: Server) -> None:  # noqa: F811
    resp = client_of(server).responses.create(
        input="Name a color.", instructions="Answer in one word.", **GREEDY
    )
    assert resp.object == "response" and resp.status in ("completed", "incomplete")
    assert [item.type for item in resp.output] == ["message"]
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a color."},
    ]
    assert resp.output_text == chat_text(server, messages)
    assert resp.usage.output_tokens >= 1 and resp.usage.input_tokens > 10
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


FORCED = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}


def forced_call(srv: Server, **extra: Any) -> Any:
    """One call of the weather function, forced (a grammar of the call syntax)."""
    return client_of(srv).responses.create(input=ASK, **FORCED, **GREEDY, **extra)


def the_call(resp: Any) -> Any:
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) >= 1, resp.output
    return calls[0]


def test_a_function_call_then_its_output_in_a_second_turn(server: Server) -> None:  # noqa: F811
    first = forced_call(server)
    call = the_call(first)
    assert call.name == "get_weather" and call.call_id.startswith("call")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = client_of(server).responses.create(
        input=[{"role": "user", "content": ASK}, call.model_dump(), result],
        tools=[WEATHER],
        **GREEDY,
    )
    # The same conversation over chat completions: the tool call and its result as messages.
    tool_call = {
        "id": call.call_id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }  # fmt: skip
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    chat_tools = [{"type": "function", "function": {**function, "strict": True}}]
    assert second.output_text == chat_text(server, messages, tools=chat_tools)
    # And continued from the stored first response instead of resending it: the same answer.
    third = client_of(server).responses.create(
        input=[result], previous_response_id=first.id, tools=[WEATHER], **GREEDY
    )
    assert third.output_text == second.output_text


def test_a_stream_builds_the_same_response(server: Server) -> None:  # noqa: F811
    whole = forced_call(server, store=False)
    events = []
    with client_of(server).responses.stream(input=ASK, **FORCED, **GREEDY) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    streamed, plain = the_call(final), the_call(whole)
    assert (streamed.name, streamed.arguments) == (plain.name, plain.arguments)
    assert final.status == "completed"


def test_text_output_streams_its_deltas(server: Server) -> None:  # noqa: F811
    whole = client_of(server).responses.create(input="Say hello.", store=False, **GREEDY)
    deltas = []
    with client_of(server).responses.stream(input="Say hello.", **GREEDY) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text


def test_a_stored_response_is_read_continued_and_deleted(server: Server) -> None:  # noqa: F811
    client = client_of(server)
    first = client.responses.create(input="My name is Ada.", metadata={"session": "42"}, **GREEDY)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert got.metadata == {"session": "42"}
    follow = client.responses.create(
        input="What is my name?", previous_response_id=first.id, **GREEDY
    )
    explicit = client.responses.create(
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        **GREEDY,
    )
    assert follow.output_text == explicit.output_text
    assert follow.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(input="Hi.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Again.", previous_response_id=unstored.id, **GREEDY)


def test_text_format_json_schema(server: Server) -> None:  # noqa: F811
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    resp = client_of(server).responses.create(
        input="Pick a color as JSON.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
        **GREEDY,
    )
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


def test_max_output_tokens_leaves_the_response_incomplete(server: Server) -> None:  # noqa: F811
    """The response and the message whose text was cut are incomplete, streamed or not; the
    bodies validate as the openai client's own Response type (every required field)."""
    from openai.types.responses import Response

    body = {"model": "default", "input": "Tell me a long story.", "max_output_tokens": 3}
    raw = httpx.post(f"{server.base_url}/v1/responses", json={**body, "temperature": 0}, timeout=60)
    resp = Response.model_validate(raw.json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3
    assert [item.status for item in resp.output] == ["incomplete"]
    with client_of(server).responses.stream(**body, temperature=0) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    [final] = [e.response for e in events if e.type == "response.incomplete"]
    assert [item.status for item in done] == ["incomplete"]
    assert final.status == "incomplete" and final.output[0].status == "incomplete"
    Response.model_validate(final.model_dump())


def test_max_tool_calls_caps_the_calls(server: Server) -> None:  # noqa: F811
    """Forced calls in parallel: the grammar lets the model write several; at most one is
    returned with max_tool_calls 1."""
    body = {"input": ASK, "tools": [WEATHER], "tool_choice": "required", **GREEDY}
    body["max_output_tokens"] = 90
    many = client_of(server).responses.create(**body)
    capped = client_of(server).responses.create(**body, max_tool_calls=1)
    calls = [i for i in capped.output if i.type == "function_call"]
    assert len(calls) == 1
    assert len([i for i in many.output if i.type == "function_call"]) >= len(calls)


# No arguments (parameters null: OpenAI's "empty parameter list"); what it returns, for callers.
PING = {"type": "function", "name": "ping", "description": "Check that the service is up.",
        "parameters": None, "strict": True, "output_schema": {"type": "object"}}  # fmt: skip


def test_a_function_of_no_parameters_is_called_with_none(server: Server) -> None:  # noqa: F811
    """A forced call of a function whose parameters are null has the arguments {}; its
    output_schema and allowed_callers ["direct"] (fields the Agents SDK sends) are taken, and
    the echo keeps parameters null, as OpenAI's does."""
    tool = {**PING, "allowed_callers": ["direct"]}
    resp = client_of(server).responses.create(
        input="Is the service up?", tools=[tool], tool_choice="required",
        parallel_tool_calls=False, **GREEDY,
    )  # fmt: skip
    call = the_call(resp)
    assert (call.name, json.loads(call.arguments)) == ("ping", {})
    echo = resp.model_dump()["tools"][0]
    assert echo["parameters"] is None and echo["output_schema"] == {"type": "object"}


def test_function_tools_are_strict_by_default(server: Server) -> None:  # noqa: F811
    """As in OpenAI's Responses API: a function tool without ``strict`` is strict, so a call's
    arguments match its schema, under tool_choice auto too (the chat route's strict tools);
    beside a text.format the output is that format's JSON or calls."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tool = {**WEATHER, "parameters": schema}
    resp = client_of(server).responses.create(input=ASK, tools=[tool], **GREEDY)
    assert resp.tools[0].strict is True
    for call in (item for item in resp.output if item.type == "function_call"):
        jsonschema.validate(json.loads(call.arguments), schema)
    json_format = {"format": {"type": "json_object"}}
    body = {"model": "default", "input": "Answer in JSON.", "max_output_tokens": 24}
    both = httpx.post(
        f"{server.base_url}/v1/responses", json={**body, "text": json_format, "tools": [tool]}
    )
    assert both.status_code == 200, both.text
    items = both.json()["output"]
    assert all(item["type"] in ("message", "function_call") for item in items)
    loose = {**tool, "strict": False}
    taken = httpx.post(f"{server.base_url}/v1/responses", json={**body, "tools": [loose]})
    assert taken.status_code == 200, taken.text
    assert taken.json()["tools"][0]["strict"] is False


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"background": True}, 400, "background"),
        ({"include": ["message.output_text.logprobs"]}, 400, "include"),
        ({"reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"tools": [{**PING, "defer_loading": True}]}, 400, "tools.0.defer_loading"),
        (
            {"tools": [{**PING, "allowed_callers": ["code_execution"]}]},
            400,
            "tools.0.allowed_callers",
        ),
        ({"tools": [{**PING, "strcit": True}]}, 400, "tools.0.strcit"),
        ({"conversation": "conv_1"}, 400, "conversation"),
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content.0",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0.type"),
        # A key OpenAI's items do not have was dropped (a message's text sent as "text" was an
        # empty turn the model answered): refused by name, as OpenAI refuses it.
        ({"input": [{"role": "user", "text": "Hi."}]}, 400, "input.0.text"),
        ({"input": [{"type": "message", "role": "user"}]}, 400, "input.0.content"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Hi.", "x": 1}]}
                ]
            },
            400,
            "input.0.content.0.x",
        ),
        ({"tools": [{**PING, "parameters": {"type": "string"}}]}, 400, "tools.0.parameters"),
        (
            {
                "input": [
                    {"role": "user", "content": "Hi."},
                    {"type": "function_call_output", "call_id": "call_x", "output": "1"},
                ]
            },
            400,
            "input.1.call_id",
        ),  # fmt: skip
    ],
)
def test_what_cannot_be_honoured_is_refused(
    server: Server,  # noqa: F811
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    request = {"model": "default", "input": "Hi.", "max_output_tokens": 4, **body}
    resp = httpx.post(f"{server.base_url}/v1/responses", json=request, timeout=30)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_an_unknown_stored_response_is_a_404(server: Server) -> None:  # noqa: F811
    url = f"{server.base_url}/v1/responses/resp_missing"
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
        resp = httpx.request(method, url + path, timeout=30)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"


def test_a_stored_responses_input_items_are_listed_and_cancel_says_why_not(
    server: Server,  # noqa: F811
) -> None:
    client = client_of(server)
    given = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    resp = client.responses.create(input=given, **GREEDY)
    page = client.responses.input_items.list(resp.id, order="asc", limit=2)
    assert page.has_more and [item.role for item in page.data] == ["user", "assistant"]
    items = list(client.responses.input_items.list(resp.id, order="asc", limit=2))  # all pages
    listed = [(item.role, item.content[0].text) for item in items]
    assert listed == [(m["role"], m["content"]) for m in given]
    assert [i.content[0].type for i in items] == ["input_text", "output_text", "input_text"]
    assert len({item.id for item in items}) == 3
    newest_first = client.responses.input_items.list(resp.id).data
    assert [item.id for item in newest_first] == [item.id for item in reversed(items)]
    follow = client.responses.create(input="Hi.", previous_response_id=resp.id, **GREEDY)
    (item,) = client.responses.input_items.list(follow.id).data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", "Hi.")
    bad = httpx.get(
        f"{server.base_url}/v1/responses/{resp.id}/input_items", params={"after": "msg_x"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(resp.id)
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.input_items.list(resp.id, include=["message.input_image.image_url"])
    assert items[1].content[0].annotations == []  # the assistant's text, as the client types it
    twice = [{**given[0], "id": "msg_1"}, {**given[2], "id": "msg_1"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input=twice, **GREEDY)
    assert info.value.body["param"] == "input.1.id"


def test_temperature_has_chats_bounds(server: Server) -> None:  # noqa: F811
    """A temperature past 2 samples here as on chat (and in vLLM); below 0 or not a finite
    number is a 400 naming it on both."""
    for path, body in (
        ("/v1/responses", {"input": "Hi.", "max_output_tokens": 4}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4},
        ),
    ):
        hot = httpx.post(
            f"{server.base_url}{path}", json={"model": "default", **body, "temperature": 2.5},
            timeout=60,
        )  # fmt: skip
        assert hot.status_code == 200, (path, hot.text)
        for bad in (b"-0.5", b"Infinity", b"NaN"):
            raw = json.dumps({"model": "default", **body, "temperature": 0}).encode()
            raw = raw.replace(b'"temperature": 0', b'"temperature": ' + bad)
            resp = httpx.post(
                f"{server.base_url}{path}", content=raw, timeout=30,
                headers={"content-type": "application/json"},
            )  # fmt: skip
            assert resp.status_code == 400, (path, bad, resp.text)
            assert resp.json()["error"]["param"] == "temperature", (path, bad, resp.text)


def test_null_store_and_stream_are_their_defaults(server: Server) -> None:  # noqa: F811
    """The openai client types store and stream as nullable: null stores, and does not stream."""
    body = {"model": "default", "input": "Hi.", "max_output_tokens": 2, "store": None}
    resp = httpx.post(f"{server.base_url}/v1/responses", json={**body, "stream": None}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["store"] is True and resp.json()["object"] == "response"
    stored = httpx.get(f"{server.base_url}/v1/responses/{resp.json()['id']}", timeout=30)
    assert stored.status_code == 200 and stored.json()["id"] == resp.json()["id"]


def test_a_response_holds_its_items_in_the_order_written_streamed_or_not(
    server: Server,  # noqa: F811
) -> None:
    """Forced calls in parallel, cut by max_output_tokens in a later call: its text is a
    message after the first call, incomplete, in both forms (not a message before the call)."""
    body = {"input": ASK, "tools": [WEATHER], "tool_choice": "required", **GREEDY}
    body["max_output_tokens"] = 40
    whole = client_of(server).responses.create(**body)
    with client_of(server).responses.stream(**body) as stream:
        [final] = [e.response for e in stream if e.type == "response.incomplete"]

    def shape(resp: Any) -> list[tuple[str, str]]:
        return [(item.type, item.status) for item in resp.output]

    assert whole.status == final.status == "incomplete"
    assert (
        shape(whole) == shape(final) == [("function_call", "completed"), ("message", "incomplete")]
    )
    assert whole.output[1].content[0].text == final.output[1].content[0].text
    assert whole.output[0].arguments == final.output[0].arguments


def test_retrieving_takes_no_option_it_cannot_honour(server: Server) -> None:  # noqa: F811
    """A stored response is returned whole: stream (its events replayed), starting_after and
    include are refused by name (they were taken and ignored: retrieve(stream=True) gave an
    empty stream)."""
    client = client_of(server)
    stored = client.responses.create(input="Hi.", **GREEDY)
    url = f"{server.base_url}/v1/responses/{stored.id}"
    for query, param in (
        ({"stream": "true"}, "stream"),
        ({"starting_after": "3"}, "starting_after"),
        ({"include[]": "message.output_text.logprobs"}, "include"),
    ):
        resp = httpx.get(url, params=query, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.BadRequestError):
        client.responses.retrieve(stored.id, stream=True)
    assert httpx.get(url, params={"stream": "false"}, timeout=30).json()["id"] == stored.id


def test_a_response_echoes_its_identifiers_and_says_when_it_completed(
    server: Server,  # noqa: F811
) -> None:
    before = time.time()
    done = client_of(server).responses.create(
        input="Hi.", prompt_cache_key="chat-7", safety_identifier="user-hash", **GREEDY
    )
    assert done.prompt_cache_key == "chat-7" and done.safety_identifier == "user-hash"
    assert done.status == "completed" and before - 1 <= done.completed_at <= time.time() + 1
    cut = client_of(server).responses.create(**{**GREEDY, "max_output_tokens": 2}, input="Story.")
    assert cut.status == "incomplete" and cut.completed_at is None


def test_an_item_the_continued_conversation_holds_cannot_be_sent_again(
    server: Server,  # noqa: F811
) -> None:
    """OpenAI refuses an input item whose id the previous_response_id chain already holds
    (its output's, or its input's): it would stand twice in the prompt. Resent with no id, the
    same content is a new item, and taken."""
    client = client_of(server)
    first = client.responses.create(
        input=[{"role": "user", "content": "Hi.", "id": "msg_1"}], **GREEDY
    )
    second = client.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    for item in (
        first.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "Hi.", "id": "msg_1"},
    ):
        resp = httpx.post(
            f"{server.base_url}/v1/responses",
            json={**GREEDY, "previous_response_id": second.id, "input": [item]},
            timeout=60,
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "input.0.id" and "already holds it" in error["message"], error
    again = {"role": "user", "content": "Hi."}
    assert client.responses.create(input=[again], previous_response_id=second.id, **GREEDY).id
