"""What the published OpenAPI document says beyond pydantic's types, so that a request the
document admits is one the handlers serve.

Two kinds. Rules every server keeps, given to the request models as ``json_schema_extra``:
fields that go together (JSON Schema ``if``/``then``: ``stream_options`` only with ``stream``, a
``tool`` message with its ``tool_call_id``), non-empty strings and lists where an empty one is
refused, fields of which only the default is taken (``"type": "null"``). And this server's own
limits, marked here with ``LIMIT_KEY`` and written into the document when it is first asked for
(frontend/openapi_document.py): its vocabulary (token ids), its context (token counts), its
admission bound (``n``), its scheduling policy (``priority``), whether it has a reasoning
parser, and which routes it serves at all (an embedding model serves no generation, a server
without LoRA no adapter routes).

Refusals that JSON Schema cannot express stay unstated: ``best_of`` must equal ``n``,
``min_tokens`` must not pass ``max_tokens``, two tools may not share a name, a named
``tool_choice`` must name one of ``tools``, ``echo`` and ``continue_final_message`` need the last
message to be the assistant's, a prompt must fit the context with ``max_tokens`` (the document
bounds ``max_tokens`` alone), ``n`` times the prompts must fit the admission bound (it bounds
``n`` alone), a constraint must compile, ``chat_template_kwargs`` must be read by the template,
a ``model`` must be served, a ``previous_response_id`` stored, and images need a vision model.
One is expressible but left out: at most one structured-output constraint per request; beside
the chat request's other rules it made a schema that schemathesis, which tests/test_bad_input.py
fuzzes the document with, refuses to generate from.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

JsonSchema = dict[str, Any]
LIMIT_KEY = "x-tandem-limit"  # marks a schema node that this server's limits narrow

NULL: JsonSchema = {"type": "null"}
NON_EMPTY_TEXT: JsonSchema = {"type": "string", "minLength": 1}
TOKEN_ID: JsonSchema = {"type": "integer", "minimum": 0, LIMIT_KEY: "token_id"}
TOKEN_IDS: JsonSchema = {"type": "array", "items": TOKEN_ID, "minItems": 1}


def any_of(*options: JsonSchema) -> Callable[[JsonSchema], None]:
    """A field's schema replaced by ``options`` (its title and description kept)."""

    def replace(schema: JsonSchema) -> None:
        for key in ("anyOf", "type", "items", "minimum", "maximum", "minItems", "maxItems"):
            schema.pop(key, None)
        schema["anyOf"] = copy.deepcopy(list(options))  # each place marked on its own

    return replace


def or_null(**extra: Any) -> Callable[[JsonSchema], None]:
    """A field's schema (with ``extra`` added) or null: OpenAI's nullable fields, where null
    means the default (``RequestBody.NULL_IS_DEFAULT``)."""

    def wrap(schema: JsonSchema) -> None:
        schema.update(copy.deepcopy(extra))
        kept = ("title", "description", "default")
        option = {key: schema.pop(key) for key in list(schema) if key not in kept}
        schema["anyOf"] = [option, copy.deepcopy(NULL)]

    return wrap


def present(name: str, schema: JsonSchema) -> JsonSchema:
    """The condition that field ``name`` is given and matches ``schema``."""
    return {"required": [name], "properties": {name: schema}}


def when(
    condition: JsonSchema, then: JsonSchema, otherwise: JsonSchema | None = None
) -> JsonSchema:
    rule = {"if": condition, "then": then}
    if otherwise is not None:
        rule["else"] = otherwise
    return rule


def rules(
    *checks: JsonSchema, exactly_one_of: tuple[str, ...] = ()
) -> Callable[[JsonSchema], None]:
    """A model's ``json_schema_extra``: each check must hold (``allOf``); with
    ``exactly_one_of``, exactly one of those fields is given, not null."""

    def add(schema: JsonSchema) -> None:
        if checks:
            schema.setdefault("allOf", []).extend(copy.deepcopy(list(checks)))
        if exactly_one_of:
            schema["oneOf"] = [
                {"required": [name], "properties": {name: {"not": NULL}}} for name in exactly_one_of
            ]

    return add
