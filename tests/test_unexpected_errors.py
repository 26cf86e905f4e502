"""A route's unexpected error (frontend/middleware.py: UnexpectedErrors), through FastAPI's real
middleware stack with the app's error handlers: answered as the OpenAI-shaped 500 without a
trace, logged once, and not re-raised to the server (Starlette's handler for Exception re-raises,
and the server then logs the same traceback again); after a response has started the error goes
on to the server, which closes the connection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from frontend.app import add_error_handlers
from frontend.middleware import UnexpectedErrors


def make_app(last_resort: bool) -> FastAPI:
    app = FastAPI()
    add_error_handlers(app)
    if last_resort:
        app.add_middleware(UnexpectedErrors)

    @app.get("/broken")
    async def broken() -> None:
        raise RuntimeError("a bug in a route")

    @app.get("/broken-midway")
    async def broken_midway() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            yield b"data: one\n\n"
            raise RuntimeError("a bug after the first part")

        return StreamingResponse(parts(), media_type="text/event-stream")

    return app


async def get(app: FastAPI, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # raises what the app raises to its server
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path)


def test_a_routes_bug_is_one_500_and_one_logged_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        response = asyncio.run(get(make_app(last_resort=True), "/broken"))
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "internal server error",
            "type": "internal_error",
            "param": None,
            "code": None,
        }
    }
    assert "a bug" not in response.text and "Traceback" not in response.text
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "a bug in a route" in str(logged[0].exc_info[1])


def test_without_it_starlette_answers_then_raises_to_the_server() -> None:
    """Why the middleware exists: the app's own handler answers, then the error reaches the
    server, which logs it again."""
    with pytest.raises(RuntimeError, match="a bug in a route"):
        asyncio.run(get(make_app(last_resort=False), "/broken"))


def test_an_error_after_the_response_started_goes_on_to_the_server() -> None:
    with pytest.raises(RuntimeError, match="after the first part"):
        asyncio.run(get(make_app(last_resort=True), "/broken-midway"))


def test_the_served_app_answers_a_routes_bug_itself(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The app `tandem serve` builds (build_app, its middleware in their order): a route's bug
    is the OpenAI 500 with the request id, logged once, not raised to the server."""
    from frontend.app import ServerState, build_app
    from frontend.engine_pool import EnginePool
    from frontend.metrics import Metrics
    from frontend.serving_context import ServingContext
    from frontend.tokenizer import Tokenizer, load_hf_tokenizer

    ctx = ServingContext(
        engine=EnginePool([]),
        tokenizer=Tokenizer(load_hf_tokenizer(tiny_model_dir)),
        served_model="default",
        max_model_len=64,
        vocab_size=384,
        metrics=Metrics("default"),
    )
    app = build_app(ServerState(ctx, str(tiny_model_dir), max_body_bytes=1 << 20))

    @app.get("/broken")
    async def broken() -> None:
        raise RuntimeError("a bug in a route")

    with caplog.at_level(logging.ERROR):
        response = asyncio.run(get(app, "/broken"))
    assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
    assert response.headers["x-request-id"]
    assert len([r for r in caplog.records if r.exc_info]) == 1


def test_the_engines_refusals_keep_their_status_and_say_what_kind() -> None:
    """A 400 from the engine's own checks is an invalid value (as the schema's are); any other
    status it sends keeps its own kind."""
    from frontend.errors import as_openai_error
    from protocol.client import EngineRequestError

    refused = as_openai_error(EngineRequestError("r-1", "stop_token_ids must lie in [0, 9)", 400))
    assert (refused.status, refused.info.type, refused.info.code) == (
        400, "invalid_request_error", "invalid_value"
    )  # fmt: skip
    failed = as_openai_error(EngineRequestError("r-2", "the step failed", 500))
    assert (failed.status, failed.info.type, failed.info.code) == (500, "internal_error", None)
