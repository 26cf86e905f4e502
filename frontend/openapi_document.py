"""The OpenAPI document this server publishes: FastAPI's, narrowed to this server's limits
where the request models mark a field with ``LIMIT_KEY`` (frontend/openapi_rules.py says which
rules and limits the document states, and which refusals it cannot)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from frontend.openai_schemas import SEED_MAX, SEED_MIN
from frontend.openapi_rules import LIMIT_KEY, NULL, JsonSchema
from frontend.serving_context import ServingContext
from protocol.messages import PRIORITY_MAX, PRIORITY_MIN, SchedulingPolicy


def server_openapi(app: FastAPI, ctx: ServingContext) -> None:
    """Make ``app.openapi()`` publish the document narrowed to this server (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = narrowed(document, ctx)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def narrowed(document: dict[str, Any], ctx: ServingContext) -> dict[str, Any]:
    """``document`` with the routes this server does not serve left out and each marked node
    bounded by this server's limits."""
    paths = document.get("paths", {})
    for path in unserved_paths(ctx):
        paths.pop(path, None)
    for node in marked_nodes(document):
        bound(node, node.pop(LIMIT_KEY), ctx)
    return document


def unserved_paths(ctx: ServingContext) -> list[str]:
    gone = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] if ctx.loras is None else []
    if ctx.embedding is None:
        return [*gone, "/v1/embeddings"]
    return [*gone, "/v1/completions", "/v1/chat/completions", "/v1/responses"]


def bound(node: JsonSchema, limit: str, ctx: ServingContext) -> None:
    if limit == "token_id":
        node["maximum"] = ctx.vocab_size - 1
    elif limit == "token_id_key":  # a token id as an object key: fewer digits than the vocab's
        node["pattern"] = f"^[0-9]{{1,{max(len(str(ctx.vocab_size)) - 1, 1)}}}$"
    elif limit == "context":  # a count of tokens: the context bounds it (not its sum)
        node["maximum"] = ctx.max_model_len - 1
    elif limit == "sequences":
        node["maximum"] = max(
            int(min(node.get("maximum", ctx.admission.limit), ctx.admission.limit)), 1
        )
    elif limit == "priority":  # exact: FastAPI's document model holds bounds as floats
        ranks = ctx.scheduling_policy == SchedulingPolicy.PRIORITY
        node.update(minimum=PRIORITY_MIN if ranks else 0, maximum=PRIORITY_MAX if ranks else 0)
    elif limit == "seed":
        node.update(minimum=SEED_MIN, maximum=SEED_MAX)  # exact, as above
    elif limit == "reasoning" and ctx.reasoning is None:
        node.clear()
        node.update(NULL)


def marked_nodes(value: Any) -> Iterator[JsonSchema]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if LIMIT_KEY in item:
                yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
