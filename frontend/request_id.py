"""``X-Request-Id``: taken from the request (or made here), returned on the response, and put on
every log line written while the request is served.

A client's id is checked before anything else runs: at most ``MAX_REQUEST_ID_LEN`` printable
ASCII characters, whatever a proxy or gateway makes (Kong's ``uuid#counter``, ids with spaces).
A bad one is refused with a 400 naming the header rather than replaced, so that a client never
correlates its logs on an id the server silently did not use; and the check keeps control
characters, other scripts and unbounded text out of the log lines it is written into. The id is
the client's correlation id, not the engine's: engine request ids stay the server's own unique
ones (two clients may send the same X-Request-Id), and the debug line ``engine requests
cmpl-...-*`` written under the client's id maps one to the other.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import OpenAIError, error_response

HEADER = b"x-request-id"
MAX_REQUEST_ID_LEN = 256
REQUEST_ID_CHARS = "printable ASCII (space to ~)"
_VALID = re.compile(rf"[ -~]{{1,{MAX_REQUEST_ID_LEN}}}")
PLAIN_ID = re.compile(r"[A-Za-z0-9._:\-/+=@]+")  # written into log lines as it is

# The id of the request the current task serves; tasks it starts inherit it (asyncio copies
# the context), so a handler's helpers log under the same id.
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "current_request_id", default=None
)


class RequestIdMiddleware:
    """Outermost ASGI layer: every HTTP response, errors included, carries ``x-request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER)
        if given is not None and not valid_request_id(given):
            await error_response(bad_request_id())(scope, receive, send)
            return
        request_id = given.decode() if given is not None else uuid.uuid4().hex
        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, with_request_id(send, request_id.encode()))
        finally:
            current_request_id.reset(token)


def valid_request_id(raw: bytes) -> bool:
    try:
        return _VALID.fullmatch(raw.decode("ascii")) is not None
    except UnicodeDecodeError:
        return False


def bad_request_id() -> OpenAIError:
    message = f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LEN} characters of {REQUEST_ID_CHARS}"
    return OpenAIError(400, message, param="X-Request-Id", code="invalid_request_id")


def with_request_id(send: Send, request_id: bytes) -> Send:
    """``send`` that adds the header to the response's start."""

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
            message = {**message, "headers": [*headers, (HEADER, request_id)]}
        await send(message)

    return send_with_id


class RequestIdLogFilter(logging.Filter):
    """Gives every record a ``request_tag``: `` [x-request-id ID]`` while a request is being
    served, else empty (the formats in frontend/serve.py and frontend/api_processes.py use it).
    An id holding more than letters, digits and ``. _ : - / + = @`` is written as a JSON string,
    so that no id can end the tag and write a line of its own (``x]: engine core lost``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = current_request_id.get()
        if request_id is not None and not PLAIN_ID.fullmatch(request_id):
            request_id = json.dumps(request_id)
        record.request_tag = "" if request_id is None else f" [x-request-id {request_id}]"
        return True


def tag_log_records() -> None:
    """Put the filter on the root logger's handlers (call after logging.basicConfig)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdLogFilter())
