"""The FastAPI app: OpenAI routes, health, metrics, tokenize, and errors in the OpenAI shape.

``build_app(state)`` wires routes to the handlers (frontend/completions.py, frontend/chat.py).
Every error, including FastAPI's own validation errors (422 in FastAPI, 400 here) and unknown
routes, answers ``{"error": {"message", "type", "param", "code"}}``; an unexpected exception is
logged here and answered 500 without a traceback. With an API key set, every route but /health
and /metrics needs ``Authorization: Bearer KEY``. Bodies over ``max_body_bytes`` are refused with
413 before they are parsed (frontend/middleware.py). Completions and chat take a lease from the
admission gate (frontend/admission.py) before any work and return it when the response ends,
however it ends; when the gate is full they answer 503 with Retry-After. An embedding engine's
server answers /v1/embeddings (frontend/embeddings.py) and refuses completions and chat with a
400 that says why; a generative one the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from frontend.chat import (
    chat,
    checked_template_kwargs,
    image_text,
    load_images,
    place_images,
    prepare_chat,
    stream_chat,
)
from frontend.completions import complete, prepare_completion, stream_completion
from frontend.embeddings import check_embedding_request, embed, embedding_wave
from frontend.errors import (
    OpenAIError,
    as_openai_error,
    bad_request,
    error_response,
    field_path,
    http_exception_error,
    most_specific,
    server_stopping,
)
from frontend.metrics import CONTENT_TYPE
from frontend.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    StreamingLane,
    StreamRoute,
    UnexpectedErrors,
)
from frontend.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    FieldError,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from frontend.openapi_document import server_openapi
from frontend.operations import CorsSettings
from frontend.request_id import RequestIdMiddleware
from frontend.responses import (
    EventWriter,
    failed_event,
    input_items_page,
    not_found,
    prepare_response,
    respond,
    stream_response,
)
from frontend.responses_schemas import ResponsesRequest
from frontend.serving_context import ServingContext
from frontend.sse import DONE, sse_error
from frontend.tokenizer import ChatRender
from frontend.tracing import TracingMiddleware
from protocol.messages import ControlKind

if TYPE_CHECKING:
    from frontend.lora import LoraRegistry

logger = logging.getLogger("tandem.frontend")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_BYTES = DONE.encode()
CUT = server_stopping()
CUT_EVENTS = sse_error(CUT) + DONE  # how completions and chat streams end when cut short
STATS_TIMEOUT_S = 10.0  # the engine answers between steps, and a CPU prefill step can be slow
PROFILE_START_TIMEOUT_S = 30.0
# Stopping writes the whole trace before the engine answers: minutes for a long one on a GPU.
PROFILE_STOP_TIMEOUT_S = 600.0


@dataclass
class ServerState:
    serving: ServingContext
    model_root: str
    max_body_bytes: int
    api_key: str | None = None
    engine_info: Callable[[], dict[str, Any]] = dict  # GET /v1/engine: address, pid, ...
    stats_interval_s: float = 1.0
    cors: CorsSettings | None = None  # --allowed-origins and its companions; None: no CORS
    # An API process that does not supervise the engine cores (one of --api-servers N, or a
    # remote engine's) counts their restarts as the new runs its polls see.
    restarts_from_polls: bool = False


def build_app(state: ServerState) -> FastAPI:
    """The app; the engine connections must already be up. It has no start-up or shutdown of
    its own (no lifespan): whoever serves it runs ``poll_engine_stats`` beside it."""
    app = FastAPI(title="Tandem")
    app.state.tandem = state
    add_error_handlers(app)
    # Added innermost first: the lane runs after the key check and within the body limit, and
    # the routes' unexpected errors are answered inside it (the lane answers its own).
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(StreamingLane, routes=streaming_routes(state.serving))
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_body_bytes)
    if state.cors is not None:  # a preflight needs no API key: browsers send it without one
        app.add_middleware(CORSMiddleware, **dataclasses.asdict(state.cors))
    if state.serving.tracer is not None:
        app.add_middleware(TracingMiddleware, tracer=state.serving.tracer)
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries the id
    add_routes(app, state)
    server_openapi(app, state.serving)
    watch_frontend_state(state.serving)
    return app


def watch_frontend_state(ctx: ServingContext) -> None:
    gate = ctx.admission
    ctx.metrics.watch_frontend(
        admitted=lambda: gate.in_use,
        peak=lambda: gate.peak,
        limit=lambda: gate.limit,
        in_flight=lambda: ctx.engine.num_requests,
    )


# ---- errors -----------------------------------------------------------------------------------


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def on_openai_error(_req: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(req: Request, exc: RequestValidationError) -> Response:
        error = validation_error(exc)
        kind = req.headers.get("content-type", "").split(";")[0].strip().lower()
        json_kind = kind == "application/json" or re.fullmatch(r"application/.+\+json", kind)
        if kind and not json_kind and error.info.param is None:
            # FastAPI reads no JSON under another type (curl -d sends a form's): say why.
            error.info.message = (
                f"the body was sent as {kind}: send JSON with Content-Type: application/json "
                f"({error.info.message})"
            )
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_req: Request, exc: StarletteHTTPException) -> Response:
        return error_response(http_exception_error(exc.status_code, str(exc.detail)))

    # An error the routes raise is answered by UnexpectedErrors; this one meets only the outer
    # middleware's, which Starlette re-raises after the response, for the server to log.
    @app.exception_handler(Exception)
    async def on_unexpected(_req: Request, exc: Exception) -> Response:
        return error_response(as_openai_error(exc))


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as an OpenAI 400 naming the bad field."""
    first = most_specific(list(exc.errors()))
    if first.get("type") == "json_invalid":  # its location is a byte offset, not a field
        detail = (first.get("ctx") or {}).get("error", "")
        return OpenAIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    loc = field_path(first.get("loc", ()))
    if not loc and first.get("type") == "missing":
        return OpenAIError(400, "the request needs a JSON body")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a rule across fields, naming the one at fault
        loc = [*loc, cause.field]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return unknown_key_error(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    return OpenAIError(400, message, param=param, code="invalid_value")


def unknown_key_error(loc: tuple[Any, ...]) -> OpenAIError:
    """An unknown key, named as sent (field_path keeps only names a field could have): at the
    top level in OpenAI's words for it, inside an object (a tool's definition) with where."""
    key = str(loc[-1]) if loc else ""
    parent = field_path(loc[:-1])
    param = ".".join([*parent, key])
    if not parent:
        message = f"Unrecognized request argument supplied: {key}"
    else:
        message = f"Unrecognized argument {key!r} in {'.'.join(parent)}"
    return OpenAIError(400, message, param=param, code="unknown_parameter")


# ---- routes -----------------------------------------------------------------------------------


def add_routes(app: FastAPI, state: ServerState) -> None:
    ctx = state.serving

    @app.get("/health")
    async def health() -> Response:
        if (down := ctx.engine.degraded()) is not None:  # the other engine cores serve
            return JSONResponse({"status": "degraded", "message": down})
        if not ctx.engine.healthy:
            reason = ctx.engine.dead_reason or "the engine core's process is not running"
            return error_response(
                OpenAIError(503, reason, "service_unavailable", code="engine_down")
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem_version()}

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=ctx.served_model,
            created=ctx.started_at,
            root=state.model_root,
            max_model_len=ctx.max_model_len,
        )
        return ModelList(data=[card, *lora_cards(ctx)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        """One entry of /v1/models (the openai client's ``models.retrieve``); 404 otherwise."""
        for card in (await models()).data:
            if card.id == model_id:
                return card
        raise OpenAIError(
            404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
        )

    @app.get("/v1/engine")
    async def engine() -> dict[str, Any]:
        """Where the engine core listens, so a raw ZMQ client can reach the same engine."""
        return {**state.engine_info(), "healthy": ctx.engine.healthy}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(ctx, body, request, prepare_completion, stream_completion, complete)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(ctx, body, request, prepare_chat, stream_chat, chat)

    add_response_routes(app, ctx)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        pooling = check_embedding_request(ctx, body)
        admission = ctx.admit(embedding_wave(ctx, len(body.inputs)))
        try:
            work = embed(ctx, body, pooling, admission.count)
            return JSONResponse(await until_disconnect(request, work))
        finally:
            admission.release()

    add_token_routes(app, ctx)
    add_lora_routes(app, ctx)
    add_profile_routes(app, ctx)


def lora_cards(ctx: ServingContext) -> list[ModelCard]:
    """/v1/models' entries of the LoRA adapters: each with its folder and its base model."""
    if ctx.loras is None:
        return []
    loras = ctx.loras
    return [
        ModelCard(
            id=name,
            created=ctx.started_at,
            root=loras.sources.get(name, ref.path),
            parent=ctx.served_model,
            max_model_len=ctx.max_model_len,
        )  # fmt: skip
        for name, ref in loras.adapters.items()
    ]


def add_profile_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's /start_profile and /stop_profile: torch.profiler in every engine core between
    them (engine_core/profiler.py); 400 with the engine's reason where it cannot (no
    --profile-dir, already running, not running)."""

    async def control(kind: ControlKind, timeout: float) -> list[str]:
        replies = await ctx.engine.control_all(kind, timeout)
        refused = [reply.message for reply in replies if not reply.ok]
        if refused:
            raise bad_request(refused[0])
        return [reply.message for reply in replies]

    # A development tool, like vLLM's: left out of the published document.
    @app.post("/start_profile", include_in_schema=False)
    async def start_profile() -> dict[str, Any]:
        directories = await control(ControlKind.START_PROFILE, PROFILE_START_TIMEOUT_S)
        return {"profiling": True, "directories": directories}

    @app.post("/stop_profile", include_in_schema=False)
    async def stop_profile() -> dict[str, Any]:
        written = await control(ControlKind.STOP_PROFILE, PROFILE_STOP_TIMEOUT_S)
        return {"profiling": False, "files": [path for m in written for path in m.splitlines()]}


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's routes for adapters at run time (frontend/lora.py): 403 unless
    --allow-runtime-lora-updates, 400 where LoRA is off."""

    def registry() -> LoraRegistry:
        if ctx.loras is None:
            raise bad_request("LoRA is not enabled on this server (--enable-lora)")
        return ctx.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        message = await registry().load(body.lora_name, body.lora_path)
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        return PlainTextResponse(registry().unload(body.lora_name))


def add_response_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The Responses API (frontend/responses.py): create; read, list the input of, or delete a
    stored one (cancel: nothing runs in the background to cancel)."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await generate(ctx, body, request, prepare_response, stream_response, respond)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> dict[str, Any]:
        stored = ctx.responses.get(response_id)
        if stored is None:
            raise stored_not_found(response_id)
        # OpenAI's stream, starting_after, include and include_obfuscation: nothing here can
        # replay a response's events or add to what was stored, so each is refused by name.
        for key, value in request.query_params.multi_items():
            if key == "stream" and value.lower() == "false":
                continue
            name = key.removesuffix("[]")
            raise bad_request(
                f"{name} is not supported when retrieving a response: it is returned whole, "
                "as stored",
                name,
            )
        return stored.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not ctx.responses.delete(response_id):
            raise stored_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        request: Request,
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        stored = ctx.responses.get(response_id)
        if stored is None:
            raise stored_not_found(response_id)
        # The openai client sends include[]=...; no extra item data is kept to include.
        if any(key in ("include", "include[]") for key in request.query_params):
            raise bad_request("include is not supported: items are listed as sent", "include")
        return input_items_page(stored, limit, order, after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        if ctx.responses.get(response_id) is None:
            raise stored_not_found(response_id)
        raise bad_request(
            "only a background response can be cancelled, and this server runs none in the "
            "background (background is not supported): this one has finished",
            "response_id",
        )


def stored_not_found(response_id: str) -> OpenAIError:
    error = not_found(response_id)
    error.info.param = "response_id"
    return error


def add_token_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        tok = ctx.tokenizer
        if body.messages is not None:
            render = ChatRender(
                messages=[m.as_template_dict() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=checked_template_kwargs(ctx, body.chat_template_kwargs or {}),
            )
            images = await load_images(ctx, body.messages)
            render = dataclasses.replace(render, image_text=image_text(ctx, images))
            ids = (await tok.run(tok.render_chat, render)).token_ids
            ids, _ = place_images(ctx, ids, images)  # each image's tokens counted
        else:
            ids = (await tok.run(tok.encode_all, [body.prompt], body.add_special_tokens))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        # Special tokens kept, as vLLM and HF's decode give them: the text tokenizes back to
        # the same ids (a chat prompt's turn markers included).
        tok = ctx.tokenizer
        return {"prompt": await tok.run(tok.decode_keeping_special_tokens, body.tokens)}


def tandem_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


async def generate(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest | ResponsesRequest,
    request: Request,
    prepare: Callable[..., Awaitable[Any]],
    stream: Callable[..., AsyncGenerator[str, None]],
    whole: Callable[..., Awaitable[dict]],
) -> Response:
    """Admit, prepare (tokenize, check), then stream or answer once; the lease goes back when
    the response is over (the streaming response returns it itself)."""
    if body.stream:
        return await start_stream(ctx, body, prepare, stream)
    ctx.check_generates()
    admission = ctx.admit(body.num_sequences)
    try:
        gen = await prepare(ctx, body)
        return JSONResponse(await until_disconnect(request, whole(ctx, body, gen)))
    finally:
        admission.release()


async def start_stream(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest | ResponsesRequest,
    prepare: Callable[..., Awaitable[Any]],
    stream: Callable[..., AsyncGenerator[str, None]],
) -> Response:
    """Admit, prepare and send a streaming request to the engine; its response returns the
    lease (and aborts the engine requests if it never streamed) when it ends.

    The engine requests go out before the response is set up, and the task then lets every
    other ready request go first: in a burst, the requests whose prompts one encode call
    tokenized all reach the engine before any of them sets up its response (about half of what
    a request costs the event loop before it waits for tokens), so the engine starts on all of
    them sooner."""
    ctx.check_generates()
    admission = ctx.admit(body.num_sequences)
    gen = None
    try:
        gen = await prepare(ctx, body)
        await gen.send()
        await asyncio.sleep(0)
    except BaseException:
        if gen is not None:
            gen.close()
        admission.release()
        raise

    def release() -> None:
        gen.close()
        admission.release()

    if isinstance(body, ResponsesRequest):  # numbered events: the cut's is the next one
        events = EventWriter()
        content = stream(ctx, body, gen, events)
        return AdmittedStreamingResponse(content, release, lambda: failed_event(events, CUT))
    return AdmittedStreamingResponse(stream(ctx, body, gen), release, lambda: CUT_EVENTS)


def streaming_routes(ctx: ServingContext) -> dict[str, StreamRoute]:
    """The routes the streaming lane serves (frontend/middleware.py), as the app's own
    completions and chat routes serve a streaming body."""

    async def completion(body: CompletionRequest) -> Response:
        return await start_stream(ctx, body, prepare_completion, stream_completion)

    async def chat_completion(body: ChatCompletionRequest) -> Response:
        return await start_stream(ctx, body, prepare_chat, stream_chat)

    return {
        "/v1/completions": (CompletionRequest, completion),
        "/v1/chat/completions": (ChatCompletionRequest, chat_completion),
    }


class AdmittedStreamingResponse(StreamingResponse):
    """An SSE response that returns its admission lease when it ends, however it ends: streamed
    to the end, cancelled by a disconnect, or never started because the client had gone.

    It streams in the request's own task while one plain asyncio task waits for the client to
    go away and cancels the stream if it does (the stream's generator then aborts its engine
    requests). Starlette's own ``__call__``, under the ASGI 2.3 that uvicorn speaks, opens an
    anyio task group per response for that watch: 55-61 us a response against 12-17 us here on
    the 2-core CPU machine, about 3% of what the API process spends on a one-token streamed
    request there (docs/design/output-intervals-and-streaming.md, "SSE and the streaming
    lane")."""

    def __init__(
        self,
        content: AsyncGenerator[str, None],
        release: Callable[[], None],
        cut_short: Callable[[], str],
    ) -> None:
        """``cut_short``: the stream's last event where the server stops it midway."""
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.content = content
        self.release = release
        self.cut_short = cut_short
        self.started = False  # the response's start went out
        self.exhausted = False  # the content ended: only the empty last body may be left

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but the chunk that ends with ``[DONE]`` (our streams end with one chunk
        holding the last deltas, the usage and ``[DONE]``) also ends the response: one write
        instead of three, when a burst of streams ends together."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        self.started = True
        async for chunk in self.content:
            body = chunk.encode()
            if body.endswith(DONE_BYTES):
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send({"type": "http.response.body", "body": body, "more_body": True})
        self.exhausted = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.current_task()
        assert stream is not None  # an ASGI app always runs in a task
        watcher = asyncio.ensure_future(cancel_on_disconnect(receive, stream))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():
                stream.uncancel()  # the client left: the response is over, not the server
            elif not self.started or not stream.cancelling():
                raise  # before the response began (uvicorn answers 500), or not a cancel of us
            else:  # the server is stopping this task: tell the client why its stream ends
                watcher.cancel()  # a disconnect during the send below must not cancel it
                stream.uncancel()
                end = b""
                if not self.exhausted:
                    logger.warning("the server is stopping: a stream was cut short")
                    end = self.cut_short().encode()
                await send({"type": "http.response.body", "body": end, "more_body": False})
        finally:
            watcher.cancel()
            try:
                await self.content.aclose()  # a generator stopped at a yield runs its cleanup
            finally:
                self.release()


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` once the client has gone (uvicorn also answers the disconnect message
    once the response is complete, by when the stream has cancelled this watcher)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler's work, cancelling it (and so aborting its engine requests)
    if the client goes away first. Streaming responses get this from Starlette already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # Only the server cancels a handler's task (a disconnect cancels ``task``): its graceful
        # shutdown ran out. The client is told why, as a stream is, not with uvicorn's bare 500.
        this = asyncio.current_task()
        if this is None or not this.cancelling():
            raise
        this.uncancel()
        logger.warning("the server is stopping: a request was cut short")
        raise server_stopping("request") from None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # only a request: wait until the work has really stopped
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise OpenAIError(499, "client disconnected", code="client_disconnected")
    return task.result()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def poll_engine_stats(state: ServerState) -> None:
    """Keep the engine gauges of /metrics fresh with a periodic STATS call (its replies also
    let a client the engine forgot be heard again: engine_core/server.py _welcome_back)."""
    while True:
        try:
            await refresh_engine_gauges(state.serving)
            if state.restarts_from_polls:
                state.serving.metrics.record_new_runs(state.serving.engine.totals.new_runs)
        except Exception:  # the gauges go stale for one interval, never for good
            logger.warning("could not refresh the engine gauges", exc_info=True)
        await asyncio.sleep(state.stats_interval_s)


async def refresh_engine_gauges(ctx: ServingContext) -> None:
    healthy = ctx.engine.healthy
    if ctx.engine.dead_reason is not None:  # none polled: each engine's gauges say down
        ctx.engine.record_dead_engines()
    else:
        try:
            stats = await ctx.engine.stats(timeout=STATS_TIMEOUT_S)
        except Exception as exc:  # slow or gone: the health gauge says so
            logger.debug("engine stats unavailable: %s", exc)
        else:
            if stats is not None:
                ctx.metrics.record_engine_stats(stats, healthy)
    ctx.metrics.record_health(healthy)
