"""The Responses stream's last event when it fails midway (frontend/responses.py
``failed_event``): ``response.failed``, whose response validates as the official openai client's
``ResponseFailedEvent``, its error OpenAI's ``server_error`` with our cause leading the message
where there is one; before the stream began, a bare ``error`` event."""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

from frontend.errors import OpenAIError, engine_unavailable
from frontend.responses import EventWriter, failed_event


def event_body(sse: str) -> dict[str, Any]:
    kind, data = sse.strip().split("\n")
    body = json.loads(data.removeprefix("data: "))
    assert kind == f"event: {body['type']}"
    return body


def response_so_far() -> dict[str, Any]:
    return {
        "id": "resp_1", "object": "response", "created_at": 1, "status": "failed",
        "error": None, "incomplete_details": None, "model": "m", "instructions": None,
        "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "temperature": 1.0, "top_p": 1.0,
    }  # fmt: skip


def test_a_failure_with_a_cause_leads_the_message_with_it() -> None:
    events = EventWriter()
    events.response_so_far = response_so_far
    events.event("response.created")
    body = event_body(failed_event(events, engine_unavailable("the engine core stopped")))
    failed = ResponseFailedEvent.model_validate(body)
    assert failed.sequence_number == 1 and failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    assert failed.response.error.message == (
        "engine_down: the engine core is unavailable: the engine core stopped"
    )


def test_a_failure_without_a_code_is_its_message_alone() -> None:
    events = EventWriter()
    events.response_so_far = response_so_far
    body = event_body(failed_event(events, OpenAIError(500, "internal server error")))
    error = ResponseFailedEvent.model_validate(body).response.error
    assert error is not None and error.message == "internal server error"


def test_before_the_stream_began_it_is_an_error_event() -> None:
    body = event_body(failed_event(EventWriter(), OpenAIError(400, "bad", param="input")))
    error = ResponseErrorEvent.model_validate(body)
    assert (error.message, error.param, error.sequence_number) == ("bad", "input", 0)


def test_text_after_a_call_in_one_delta_is_an_item_after_it() -> None:
    """A whole output (or a stream's one delta) holding text, a call and text after it: the
    items follow the order written, whatever the line breaks."""
    from frontend.responses import OutputStream
    from frontend.tool_parsers import get_parser

    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for text in (f"Checking. {call} Done.", f"{call} Done.", f"Checking.\n{call}\nDone."):
        streamer = get_parser("hermes").streamer()
        step = streamer.push(text)
        end = streamer.finish()
        after = step.after_calls + end.content
        delta = {"content": step.content + end.content, "tool_calls": step.tool_calls}
        output = OutputStream(EventWriter(), None)
        output.feed(delta, after)
        output.close()
        kinds = [item["type"] for item in output.items]
        texts = [item["content"][0]["text"] for item in output.items if item["type"] == "message"]
        assert kinds[-2:] == ["function_call", "message"] and texts[-1].strip() == "Done.", text
        assert "".join(texts) == delta["content"], text


def test_a_failure_midway_keeps_the_open_item_as_it_stands() -> None:
    """The items a failed stream's response holds: the finished ones and the one open when it
    failed, with the text its deltas carried, "incomplete" (it held only finished items, so a
    failure inside the first message gave an output of none); valid as the client's type."""
    from frontend.responses import OutputStream

    events = EventWriter()
    output = OutputStream(events, None)
    output.feed({"reasoning_content": "Think."})
    output.feed({"content": "The answer "})
    output.feed({"content": "is"})
    events.response_so_far = lambda: {**response_so_far(), "output": output.so_far()}
    body = event_body(failed_event(events, engine_unavailable("the engine core stopped")))
    items = ResponseFailedEvent.model_validate(body).response.output
    assert [(item.type, item.status) for item in items] == [
        ("reasoning", "completed"), ("message", "incomplete")
    ]  # fmt: skip
    assert items[1].content[0].text == "The answer is"
