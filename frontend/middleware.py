"""Plain ASGI middleware of the HTTP app: the API key check and the request-body limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which gets in the way of streaming and of
disconnect detection.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import OpenAIError, error_response

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
