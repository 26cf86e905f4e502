"""Plain ASGI middleware of the HTTP app: the API key check, the request-body limit, the
streaming lane, and the last resort for a route's unexpected error.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which gets in the way of streaming and of
disconnect detection.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import OpenAIError, as_openai_error, error_response, http_exception_error

logger = logging.getLogger("tandem.frontend")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer KEY`` matches, compared in constant time; /health
    and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = OpenAIError(401, "Incorrect or missing API key.", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: at once when Content-Length says so, else as soon as
    the bytes read pass the limit (chunked bodies), before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self.too_large())(scope, receive, send)
            return
        await self.app(scope, self.limited(receive), send)

    def limited(self, receive: Receive) -> Receive:
        seen = 0

        async def receive_within_limit() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions from body reading; the handler answers.
                    raise HTTPException(413, self.too_large().info.message)
            return message

        return receive_within_limit

    def too_large(self) -> OpenAIError:
        message = f"the request body is larger than {self.max_bytes} bytes"
        return OpenAIError(413, message, code="request_too_large")


# A streaming route of the lane: the request's model, and what answers a valid, streaming body.
StreamRoute = tuple[type[BaseModel], Callable[[Any], Awaitable[Response]]]


class StreamingLane:
    """POST bodies that ask to stream, on the routes given, served without FastAPI's routing.

    At 256 concurrent streams one API process spends most of its CPU admitting requests, and
    about a fifth of that went to the framework around the handler: FastAPI's and Starlette's
    middleware layers (each wrapping every message the response sends), routing, and solving the
    handler's dependencies (docs/design/output-intervals-and-streaming.md, "SSE and the streaming
    lane"). The lane reads the body and parses it as
    FastAPI does (``json.loads``, then the route's pydantic model), then hands the model to the
    route's handler, whose response it sends.

    Everything else goes to the app unchanged: another path or method, a body that is not
    JSON, does not parse or does not validate, or does not stream. The body it already read is
    replayed, so each of those errors is still answered by the one code path that answers it.
    The handler's own errors are answered as the app's exception handlers answer them.
    """

    def __init__(self, app: ASGIApp, routes: Mapping[str, StreamRoute]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST" and is_json(scope):
            route = self.routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(receive)
        except HTTPException as exc:  # BodyLimitMiddleware's 413, answered as the app does
            await error_response(http_exception_error(exc.status_code, str(exc.detail)))(
                scope, receive, send
            )
            return
        if raw is None:
            return  # the client left while sending its body: nobody to answer
        model, respond = route
        body = parse_streaming(model, raw)
        if body is None:
            await self.app(scope, replayed(raw, receive), send)
            return
        try:
            response = await respond(body)
        except OpenAIError as exc:
            response = error_response(exc)
        except Exception as exc:  # as UnexpectedErrors answers the app's routes' bugs
            response = unexpected_error_response(exc)
        await response(scope, receive, send)


def is_json(scope: Scope) -> bool:
    """A JSON content type, as FastAPI reads a body as JSON (application/json or */*+json)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return False


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_streaming(model: type[BaseModel], raw: bytes) -> Any | None:
    """The body as ``model`` if it is valid JSON, validates, and asks to stream; else None."""
    try:
        body = model.model_validate(json.loads(raw))
    except Exception:  # noqa: BLE001 - whatever fails here, the app answers it as it always has
        return None
    return body if getattr(body, "stream", False) else None


def replayed(raw: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first."""
    pending = True

    async def receive_again() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return receive_again


class UnexpectedErrors:
    """A route's unexpected error (a bug): logged once with its traceback and answered as the
    OpenAI-shaped 500, with no trace in the body. Starlette's handler for ``Exception`` would
    answer the same but then re-raise, so that the server logs the traceback a second time
    ("Exception in ASGI application"). An error after the response started is re-raised: the
    response cannot change, and the server closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            await unexpected_error_response(exc)(scope, receive, send)


def unexpected_error_response(exc: Exception) -> Response:
    """A bug's answer: its traceback logged once, and the OpenAI-shaped 500 without it."""
    logger.exception("unexpected error while serving a request")
    return error_response(as_openai_error(exc))
