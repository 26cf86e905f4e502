"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Everything that goes wrong while serving a request becomes an ``OpenAIError`` before it reaches
the client (``as_openai_error``): a bad field is a 400 naming it, an engine that is down a 503
with Retry-After, an unexpected exception a 500 without a traceback.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from frontend.admission import OverloadedError, TooManySequencesError
from frontend.openai_schemas import ErrorInfo
from protocol.client import EngineDeadError, EngineRequestError

ENGINE_DOWN_RETRY_AFTER_S = 5  # about what an engine restart takes on a small model


class OpenAIError(Exception):
    """An error answered in the OpenAI shape with an HTTP status (and headers, if any)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def engine_unavailable(reason: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"the engine core is unavailable: {reason}",
        "service_unavailable",
        code="engine_down",
        headers={"Retry-After": str(ENGINE_DOWN_RETRY_AFTER_S)},
    )


def server_stopping(what: str = "stream") -> OpenAIError:
    """A stream or request the server cut short as it stopped (its graceful shutdown ran out)."""
    return OpenAIError(
        503,
        f"the server is shutting down: this {what} was cut short",
        "service_unavailable",
        code="shutting_down",
        headers={"Retry-After": str(ENGINE_DOWN_RETRY_AFTER_S)},
    )


def overloaded(exc: OverloadedError) -> OpenAIError:
    return OpenAIError(
        503,
        str(exc),
        "service_unavailable",
        code="overloaded",
        headers={"Retry-After": str(exc.retry_after_s)},
    )


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, OverloadedError):
        return overloaded(exc)
    if isinstance(exc, TooManySequencesError):
        return bad_request(str(exc), "n", "too_many_sequences")
    if isinstance(exc, EngineRequestError):
        if exc.code == 400:  # the engine's own check of a value
            return OpenAIError(400, exc.message, code="invalid_value")
        kind = "invalid_request_error" if exc.code < 500 else "internal_error"
        return OpenAIError(exc.code, exc.message, kind)
    return OpenAIError(500, "internal server error", "internal_error")


def http_exception_error(status: int, detail: str) -> OpenAIError:
    """Starlette's HTTPException (an unknown route, a body over the limit) in the OpenAI shape."""
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    code = "request_too_large" if status == 413 else None  # BodyLimitMiddleware
    return OpenAIError(status, detail, kind, code=code)


def is_expected(exc: Exception) -> bool:
    """Whether ``exc`` is one of the failures a request may meet (not a bug to log loudly)."""
    return isinstance(exc, OpenAIError | EngineDeadError | EngineRequestError)


def error_response(err: OpenAIError) -> Response:
    # ensure_ascii: a message that quotes client input can never fail to encode.
    body = json.dumps({"error": err.info.model_dump()}, ensure_ascii=True).encode()
    return Response(body, err.status, err.headers, media_type="application/json")


# How pydantic names a union's members in an error's location: its own names, not the client's.
PYDANTIC_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def field_path(loc: tuple[Any, ...]) -> list[str]:
    """An error's location as the request's field names and indices, without "body" and the
    union members pydantic tried (``str``, ``list[int]``, ``literal['none','auto']``,
    ``tagged-union[...]``, a model's class name), nor the tag pydantic puts after a tagged
    union (``image_url`` in ``content.0.image_url.image_url.url``: the member, then the
    field)."""
    path: list[str] = []
    tag_next = False
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
        elif "tagged-union[" in str(part):
            tag_next = True
        elif tag_next:
            tag_next = False
        elif is_field_name(str(part)):
            path.append(str(part))
    return path


def is_field_name(part: str) -> bool:
    return (
        part != "body"
        and part.isidentifier()
        and not part[0].isupper()
        and part not in PYDANTIC_MEMBER_NAMES
    )


def most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: a value that matched none of a union's members fails once per
    member, and the one that reached deepest into the value says what is wrong (an unknown
    content part's type, rather than "Input should be a valid string")."""
    return max(errors, key=lambda e: len(field_path(e.get("loc", ()))), default={})
