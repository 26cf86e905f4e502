"""The FastAPI app: OpenAI routes, health, metrics, tokenize, and errors in the OpenAI shape.

``build_app(state)`` wires routes to frontend/serving.py. Every error, including FastAPI's own
validation errors (422 in FastAPI, 400 here) and unknown routes, answers
``{"error": {"message", "type", "param", "code"}}``; an unexpected exception is logged here and
answered 500 without a traceback. With an API key set, every route but /health and /metrics needs
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from frontend.serving import (
    OpenAIError,
    ServingContext,
    as_openai_error,
    chat,
    complete,
    prepare_chat,
    prepare_completion,
    stream_chat,
    stream_completion,
)

logger = logging.getLogger("tandem.frontend")

_OPEN_PATHS = frozenset({"/health", "/metrics"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STATS_TIMEOUT_S = 10.0  # the engine answers between steps, and a CPU prefill step can be slow


@dataclass
class ServerState:
    serving: ServingContext
    model_root: str
    api_key: str | None = None
    engine_info: dict[str, Any] = field(default_factory=dict)  # address, pid: for raw clients
    stats_interval_s: float = 1.0


def build_app(state: ServerState) -> FastAPI:
    """The app for one engine; the engine connection must already be started."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.ensure_future(poll_engine_stats(state))
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.tandem = state
    add_error_handlers(app)
    if state.api_key:
        add_api_key_check(app, state.api_key)
    add_routes(app, state)
    return app


# ---- errors -----------------------------------------------------------------------------------


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse({"error": err.info.model_dump()}, status_code=err.status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def on_openai_error(_req: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def on_unexpected(_req: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(as_openai_error(exc))


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as an OpenAI 400 naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    message = f"{param}: {msg}" if param else msg
    return OpenAIError(400, message, param=param, code="invalid_value")


def add_api_key_check(app: FastAPI, api_key: str) -> None:
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)


class ApiKeyMiddleware:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which gets in the way of streaming and of
    disconnect detection): 401 unless ``Authorization: Bearer KEY`` matches, in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = OpenAIError(401, "Incorrect or missing API key.", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- routes -----------------------------------------------------------------------------------


def add_routes(app: FastAPI, state: ServerState) -> None:
    ctx = state.serving

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.healthy:
            reason = ctx.engine.dead_reason or "no heartbeat from the engine core"
            return error_response(
                OpenAIError(503, reason, "service_unavailable", code="engine_down")
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        from frontend.metrics import CONTENT_TYPE

        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=ctx.served_model, root=state.model_root, max_model_len=ctx.max_model_len
        )
        return ModelList(data=[card])

    @app.get("/v1/engine")
    async def engine() -> dict[str, Any]:
        """Where the engine core listens, so a raw ZMQ client can reach the same engine."""
        return {**state.engine_info, "healthy": ctx.engine.healthy}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gen = await prepare_completion(ctx, body)
        if body.stream:
            return StreamingResponse(
                stream_completion(ctx, body, gen),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        return JSONResponse(await until_disconnect(request, complete(ctx, body, gen)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gen = await prepare_chat(ctx, body)
        if body.stream:
            return StreamingResponse(
                stream_chat(ctx, body, gen), media_type="text/event-stream", headers=_SSE_HEADERS
            )
        return JSONResponse(await until_disconnect(request, chat(ctx, body, gen)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        tok = ctx.tokenizer
        if body.messages is not None:
            messages = [m.as_template_dict() for m in body.messages]
            ids = await tok.run(tok.render_chat, messages, body.add_generation_prompt)
        else:
            ids = (await tok.run(tok.encode_all, [body.prompt], body.add_special_tokens))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": await ctx.tokenizer.run(ctx.tokenizer.decode, body.tokens)}


class ClientDisconnected(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler's work, cancelling it (and so aborting its engine requests)
    if the client goes away first. Streaming responses get this from Starlette already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise OpenAIError(499, "client disconnected", code="client_disconnected")
    return task.result()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def poll_engine_stats(state: ServerState) -> None:
    """Keep the engine gauges of /metrics fresh with a periodic STATS call."""
    ctx = state.serving
    while True:
        healthy = ctx.engine.healthy
        if ctx.engine.dead_reason is None:
            try:
                stats = await ctx.engine.stats(timeout=STATS_TIMEOUT_S)
            except Exception as exc:  # slow or gone: the health gauge says so
                logger.debug("engine stats unavailable: %s", exc)
            else:
                if stats is not None:
                    ctx.metrics.record_engine_stats(stats, healthy)
        ctx.metrics.record_health(healthy)
        await asyncio.sleep(state.stats_interval_s)
