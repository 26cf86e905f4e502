"""The streaming lane (frontend/middleware.py: StreamingLane) over hand-driven ASGI calls: a
valid body that asks to stream goes to its route's handler and never to the app; everything else
reaches the app with its body intact (another route or method, a body that is not JSON, does not
parse or validate, or does not stream); the handler's errors are answered in the OpenAI shape;
and a body over the limit is refused with 413 as the app refuses it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse, Response

from frontend.errors import OpenAIError
from frontend.middleware import BodyLimitMiddleware, StreamingLane


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    stream: bool = False


class Recorder:
    """The app behind the lane: records what reached it and the body it could read."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.calls.append((scope["path"], body))
        await PlainTextResponse("from the app")(scope, receive, send)


def call(
    app: Any,
    body: bytes,
    path: str = "/v1/completions",
    method: str = "POST",
    content_type: bytes | None = b"application/json",
    chunk: int = 0,
) -> tuple[int, bytes]:
    """One request through ``app``; the body arrives in pieces of ``chunk`` bytes (0: whole)."""
    headers = [(b"content-type", content_type)] if content_type is not None else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    pieces = pieces or [b""]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def lane(handler: Any = None) -> tuple[StreamingLane, Recorder, list[Body]]:
    served: list[Body] = []

    async def respond(body: Body) -> Response:
        served.append(body)
        if handler is not None:
            handler(body)
        return PlainTextResponse(f"streamed {body.prompt}")

    app = Recorder()
    return StreamingLane(app, {"/v1/completions": (Body, respond)}), app, served


def test_a_valid_streaming_body_is_served_by_its_route_alone() -> None:
    streaming, app, served = lane()
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    assert call(streaming, body, chunk=5) == (200, b"streamed hi")
    assert served == [Body(prompt="hi", stream=True)]
    assert app.calls == []


@pytest.mark.parametrize(
    ("body", "kwargs"),
    [
        (b'{"prompt": "hi"}', {}),  # does not stream
        (b'{"prompt": "hi", "stream": false}', {}),
        (b'{"prompt": "hi", "stream": true, "extra": 1}', {}),  # does not validate
        (b'{"prompt": 5, "stream": true}', {}),
        (b'{"prompt": "hi", "stream": true', {}),  # not JSON
        (b"\xff\xfe", {}),  # not UTF-8
        (b"", {}),
        (b'{"prompt": "hi", "stream": true}', {"content_type": b"text/plain"}),
        (b'{"prompt": "hi", "stream": true}', {"content_type": None}),
        (b'{"prompt": "hi", "stream": true}', {"method": "PUT"}),
        (b'{"prompt": "hi", "stream": true}', {"path": "/v1/other"}),
    ],
)
def test_everything_else_reaches_the_app_with_its_body(body: bytes, kwargs: dict) -> None:
    streaming, app, served = lane()
    assert call(streaming, body, chunk=3, **kwargs) == (200, b"from the app")
    assert app.calls == [(kwargs.get("path", "/v1/completions"), body)]
    assert served == []


def test_json_media_types_with_parameters_or_suffixes_take_the_lane() -> None:
    for content_type in (
        b"application/json; charset=utf-8",
        b"Application/JSON",
        b"application/x+json",
    ):
        streaming, app, served = lane()
        body = b'{"prompt": "a", "stream": true}'
        assert call(streaming, body, content_type=content_type) == (200, b"streamed a")
        assert app.calls == []


def test_the_handlers_errors_are_answered_in_the_openai_shape() -> None:
    def refuse(_body: Body) -> None:
        raise OpenAIError(400, "no such thing", param="prompt", code="invalid_value")

    streaming, app, _ = lane(refuse)
    status, raw = call(streaming, b'{"prompt": "x", "stream": true}')
    assert status == 400 and app.calls == []
    assert json.loads(raw) == {
        "error": {
            "message": "no such thing",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_value",
        }
    }

    def crash(_body: Body) -> None:
        raise RuntimeError("a bug")

    streaming, _, _ = lane(crash)
    status, raw = call(streaming, b'{"prompt": "x", "stream": true}')
    assert status == 500 and b"a bug" not in raw and b"Traceback" not in raw
    assert json.loads(raw)["error"]["type"] == "internal_error"


def test_a_body_over_the_limit_is_413_without_reaching_the_handler() -> None:
    streaming, app, served = lane()
    limited = BodyLimitMiddleware(streaming, max_bytes=20)
    body = json.dumps({"prompt": "x" * 50, "stream": True}).encode()
    status, raw = call(limited, body, chunk=8)  # no Content-Length: counted as it arrives
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
    assert served == [] and app.calls == []
