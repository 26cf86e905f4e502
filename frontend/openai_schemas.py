"""Pydantic schemas for the OpenAI-compatible API: requests (validated) and responses (built).

Requests accept the OpenAI fields plus the vLLM-style extras the engine supports (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, structured_outputs and the guided_*
spellings, prompt_logprobs). Nothing is accepted and ignored when it would change the output: an
unknown top-level field is a 400 naming it ("Unrecognized request argument supplied", as OpenAI
answers), and so is an OpenAI field this server does not implement (``UNSUPPORTED``); only fields
that change nothing here (user, metadata, store, service_tier, prompt_cache_key,
safety_identifier) are taken and left unused. Unknown
fields inside a chat message are ignored (clients send back the messages they received, with
fields like ``refusal``); known fields with the
wrong type are a 400: a number takes a JSON number, not a string or a boolean, nor does a list of
token ids take booleans (``RequestBody.json_numbers``; only 2.0 -> 2 is converted), and a
boolean takes only a boolean (``StrictBool``).
Strings must be valid Unicode: a JSON escape of a lone surrogate ("\\udc80"), which no tokenizer
or UTF-8 encoder accepts, is a 400 for the whole request (``valid_unicode``). Range checks live
here so a bad field is a 400 naming its param; the limits: n <= MAX_N,
logprobs and top_logprobs <= MAX_LOGPROBS, at most MAX_STOP_STRINGS stop strings, and prompt +
max_tokens within the context (checked in serving.py, after tokenization).
"""

from __future__ import annotations

import functools
import json
import re
import time
import types
import typing
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from frontend.openapi_rules import (
    LIMIT_KEY,
    NON_EMPTY_TEXT,
    NULL,
    TOKEN_IDS,
    any_of,
    or_null,
    present,
    rules,
    when,
)
from protocol.messages import PRIORITY_MAX, PRIORITY_MIN

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64  # each is searched for after every token: keep the per-token work bounded
_SURROGATE = re.compile("[\ud800-\udfff]")
# A logit_bias key: int() takes more ("--5", " 1", "١") and refuses past 4,300 digits.
TOKEN_ID_KEY = re.compile("[0-9]{1,10}")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- requests ---------------------------------------------------------------------------------


def reject_lone_surrogates(data: Any) -> None:
    """ValueError if any string (value or key) anywhere in ``data`` holds a lone surrogate."""
    stack = [data]
    while stack:  # iterative: deep nesting cannot overflow the Python stack here
        value = stack.pop()
        if isinstance(value, str):
            # isascii() reads a flag of the string (O(1)); the search scans it, which for an
            # image's data URL is megabytes on the event loop.
            if not value.isascii() and _SURROGATE.search(value):
                raise ValueError("strings must be valid Unicode, not lone surrogate escapes")
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


# OpenAI fields that would change the output and that this server does not implement: each is a
# 400 naming it when given a value that is not its default.
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "functions is deprecated and not supported: use tools",
    "function_call": "function_call is deprecated and not supported: use tool_choice",
}


class FieldError(ValueError):
    """A model validator's refusal that names the field at fault (validation_error takes it as
    the error's ``param``, below the model's own location): a rule across fields otherwise has
    no location, and the client would get no param."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class RequestBody(BaseModel):
    """A top-level request: unknown fields refused, every string valid Unicode, and null taken
    as the default where OpenAI documents a field as nullable (``NULL_IS_DEFAULT``: clients that
    send every field, unset ones as null, must not get a 400)."""

    # Infinity and NaN (which Python's JSON reads) are no number a field means: refused here,
    # naming the field, not by the engine's wire check.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def valid_unicode(cls, data: Any) -> Any:
        reject_lone_surrogates(data)
        return data

    @field_validator("*", mode="before")
    @classmethod
    def json_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A number field takes a JSON number, and a list or map of numbers numbers: pydantic's
        lax mode would read ``true`` as 1, ``"5"`` as 5 and ``[true]`` as token id 1, where
        OpenAI answers 400. Checked here rather than by a stricter type, which would move
        the fields' bounds out of their schema in the OpenAPI document."""
        if info.field_name is None:
            return value
        numbers = field_number_shapes(cls, info.field_name)
        if "scalar" in numbers and isinstance(value, bool | str):
            raise ValueError(f"Input should be a number, not {json.dumps(value)}")
        if "list" in numbers and isinstance(value, list) and holds_bool(value):
            raise ValueError("Input should hold numbers (token ids), not booleans")
        if "map" in numbers and isinstance(value, dict):
            wrong = [v for v in value.values() if isinstance(v, bool | str)]
            if wrong:
                raise ValueError(f"Input's values should be numbers, not {json.dumps(wrong[0])}")
        return value

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(
            data.get(name, 0) is None for name in cls.NULL_IS_DEFAULT
        ):
            return {k: v for k, v in data.items() if not (v is None and k in cls.NULL_IS_DEFAULT)}
        return data


@functools.cache
def field_number_shapes(model: type[BaseModel], name: str) -> frozenset[str]:
    """``number_shapes`` of a model's field, worked out once: it runs on every field of every
    request."""
    return frozenset(number_shapes(model.model_fields[name].annotation))


def number_shapes(annotation: Any) -> set[str]:
    """Where a field's type takes numbers only: "scalar" where every member of its union is an
    int, a float or None; "list" where a member is a list (of lists) of ints; "map" where one
    is a dict whose values are numbers. Empty where other members take strings or booleans."""
    members = typing.get_args(annotation) if is_union(annotation) else (annotation,)
    shapes = set()
    given = [m for m in members if m is not type(None)]
    if given and all(m in (int, float) for m in given):
        shapes.add("scalar")
    for member in members:
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin is list and args and (args[0] is int or typing.get_args(args[0]) == (int,)):
            shapes.add("list")
        if origin is dict and len(args) == 2 and args[1] in (int, float):
            shapes.add("map")
    return shapes


def is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def holds_bool(value: list[Any]) -> bool:
    """Whether a list, or a list in it, holds a boolean."""
    return any(isinstance(v, bool) or (isinstance(v, list) and holds_bool(v)) for v in value)


# OpenAI's seeds are signed 64-bit (vLLM's too), the engine's unsigned: a negative seed is taken
# as the same 64 bits read unsigned (generation.py engine_seed), as torch's manual_seed takes it.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def seed_field() -> Any:
    """The ``seed`` field of completions, chat and responses: nullable, SEED_MIN..SEED_MAX."""
    schema = {"type": "integer", LIMIT_KEY: "seed"}
    return Field(default=None, ge=SEED_MIN, le=SEED_MAX, json_schema_extra=any_of(schema, NULL))


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]  # OpenAI's values
CHOICES = {"type": "array", "items": NON_EMPTY_TEXT, "minItems": 1}
STOP = (NON_EMPTY_TEXT, {"type": "array", "items": NON_EMPTY_TEXT, "maxItems": MAX_STOP_STRINGS})


class StreamOptions(BaseModel):
    # Unknown options (vLLM's continuous_usage_stats among them) are refused, not ignored.
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    model_config = ConfigDict(
        extra="forbid",  # a schema beside json_object would be ignored: refused instead
        json_schema_extra=rules(
            when(
                present("type", {"const": "json_schema"}),
                present("json_schema", {"type": "object", **present("schema", {"type": "object"})}),
                {"properties": {"json_schema": NULL}},
            )
        ),
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        schema = self.json_schema
        if self.type == "json_schema" and (schema is None or schema.json_schema is None):
            raise FieldError("json_schema", "type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise FieldError(
                "json_schema", f"json_schema goes with type json_schema, not {self.type}"
            )
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of its fields."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=rules(
            exactly_one_of=("json", "regex", "choice", "grammar", "json_object")
        ),
    )

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, json_schema_extra=any_of(NON_EMPTY_TEXT, NULL))
    choice: list[str] | None = Field(default=None, json_schema_extra=any_of(CHOICES, NULL))
    grammar: str | None = Field(default=None, json_schema_extra=any_of(NON_EMPTY_TEXT, NULL))
    json_object: StrictBool | None = Field(
        default=None, json_schema_extra=any_of({"const": True}, NULL)
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name, value in self.given().items() if value not in (None, False)]
        if len(given) != 1:
            names = "json, regex, choice, grammar, json_object"
            raise ValueError(f"give exactly one of {names}; got {given or 'none'}")
        return self

    def given(self) -> dict[str, Any]:
        return {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
        }


# What the document states of the fields SamplingFields share (see frontend/openapi_rules.py).
SAMPLING_RULES = (
    when(present("stream_options", {"type": "object"}), present("stream", {"const": True})),
)
LOGIT_BIAS: dict[str, Any] = {
    "type": "object",
    "propertyNames": {"pattern": f"^{TOKEN_ID_KEY.pattern}$", LIMIT_KEY: "token_id_key"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "maxProperties": 1024,
}


class SamplingFields(RequestBody):
    """The fields completions and chat share."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (
        "n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "echo",
    )  # fmt: skip

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # -1 and 0 both disable top-k; past int32 the engine refuses it.
    top_k: int | None = Field(default=None, ge=-1, json_schema_extra={"maximum": 2**31 - 1})
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = seed_field()
    n: int = Field(default=1, ge=1, le=MAX_N, json_schema_extra=or_null(**{LIMIT_KEY: "sequences"}))
    stop: str | list[str] | None = Field(default=None, json_schema_extra=any_of(*STOP, NULL))
    stop_token_ids: list[int] | None = Field(
        default=None, json_schema_extra=any_of({**TOKEN_IDS, "minItems": 0}, NULL)
    )
    ignore_eos: StrictBool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, json_schema_extra=or_null())
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, json_schema_extra=or_null())
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0, json_schema_extra={LIMIT_KEY: "context"})
    stream: StrictBool = Field(default=False, json_schema_extra=or_null())
    stream_options: StreamOptions | None = None
    # token id (as a string) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = Field(
        default=None, json_schema_extra=any_of(LOGIT_BIAS, NULL)
    )
    # Structured outputs: at most one of these (frontend/constraints.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, json_schema_extra=any_of(NON_EMPTY_TEXT, NULL))
    guided_choice: list[str] | None = Field(default=None, json_schema_extra=any_of(CHOICES, NULL))
    guided_grammar: str | None = Field(default=None, json_schema_extra=any_of(NON_EMPTY_TEXT, NULL))
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # How the output's tokens become text (vLLM's fields).
    skip_special_tokens: StrictBool = True
    # The fast tokenizers this server loads join special tokens without spaces (as vLLM does
    # with them): false is what they do; true is refused (generation.py).
    spaces_between_special_tokens: StrictBool | None = Field(
        default=None, json_schema_extra=any_of({"const": False}, NULL)
    )
    include_stop_str_in_output: StrictBool = False  # the stop string or token stays in the text
    # vLLM's: lower is scheduled sooner (--scheduling-policy priority); others refuse all but 0.
    priority: int = Field(
        default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX, json_schema_extra={LIMIT_KEY: "priority"}
    )
    # Accepted and unused: they change nothing in the output (user is logged with the request).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: ServiceTier | None = None
    # OpenAI's prompt-cache routing hint (this server's prefix cache finds shared prefixes by
    # their tokens) and its abuse-monitoring id: neither changes the output.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_non_negative(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]
PROMPTS = (
    NON_EMPTY_TEXT,
    {"type": "array", "items": NON_EMPTY_TEXT, "minItems": 1},
    TOKEN_IDS,
    {"type": "array", "items": TOKEN_IDS, "minItems": 1},
)


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra=rules(
            *SAMPLING_RULES,
            when(present("max_tokens", {"const": 0}), present("echo", {"const": True})),
        )
    )

    prompt: Prompt = Field(json_schema_extra=any_of(*PROMPTS))
    # 0 only makes sense with echo (the prompt's own logprobs, as evaluation tools ask for).
    max_tokens: int | None = Field(default=16, ge=0, json_schema_extra={LIMIT_KEY: "context"})
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = Field(default=False, json_schema_extra=or_null())
    suffix: str | None = Field(default=None, json_schema_extra=any_of({"const": ""}, NULL))
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported (it would rank n choices)")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in v):
            raise ValueError("a token-id prompt must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def num_sequences(self) -> int:
        """Engine requests behind this request: one per prompt per choice."""
        if isinstance(self.prompt, str) or all(isinstance(t, int) for t in self.prompt):
            return self.n  # one prompt, as text or as token ids
        return len(self.prompt) * self.n  # a batch of prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    """An earlier assistant turn's refusal, as OpenAI's assistant messages may carry one: its
    text is the turn's text."""

    type: Literal["refusal"]
    refusal: str


class ImageURL(BaseModel):
    url: str
    # OpenAI's resolution hint. The model's processor has one resolution rule (its pixel
    # bounds), so only "auto" is honoured; "low" and "high" are refused by name (frontend/chat.py).
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | RefusalPart | ImagePart, Field(discriminator="type")]


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionCallIn(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


def part_text(part: TextPart | RefusalPart) -> str:
    return part.text if isinstance(part, TextPart) else part.refusal


def template_part(part: TextPart | RefusalPart | ImagePart) -> dict[str, str]:
    """A part as the vision models' chat templates take it (an image: their marker)."""
    return (
        {"type": "image"}
        if isinstance(part, ImagePart)
        else {"type": "text", "text": part_text(part)}
    )


# The roles whose messages must hold content, as OpenAI requires (an assistant's may be null).
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=rules(
            when(present("role", {"const": "tool"}), present("tool_call_id", NON_EMPTY_TEXT)),
            when(
                present("tool_calls", {"type": "array", "minItems": 1}),
                present("role", {"const": "assistant"}),
            ),
            when(
                present("role", {"enum": list(CONTENT_REQUIRED)}),
                present("content", {"not": NULL}),
            ),
        ),
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool turn: the result of that call
    # An earlier assistant turn's reasoning, as this server sent it (templates that render it)
    reasoning_content: str | None = None
    refusal: str | None = None  # an assistant turn that refused: its text, where it has none

    @model_validator(mode="before")
    @classmethod
    def _no_video_parts(cls, data: Any) -> Any:
        """A ``video_url`` part (vLLM's extension for video models) refused by name: no model
        here takes videos, and a part skipped would change the answer."""
        content = data.get("content") if isinstance(data, dict) else None
        for i, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "video_url":
                raise ValueError(
                    f"content[{i}] is a video_url part: videos are not supported; send images "
                    "as image_url parts"
                )
        return data

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        refused = self.refusal is not None or any(isinstance(p, RefusalPart) for p in self.parts)
        if self.role != "assistant" and refused:
            raise ValueError("only assistant messages carry a refusal")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role in CONTENT_REQUIRED and self.content is None:
            raise ValueError(
                f"a {self.role} message needs its content (only an assistant's may "
                "go without, where it calls tools or refuses)"
            )
        return self

    @property
    def parts(self) -> list[TextPart | RefusalPart | ImagePart]:
        return self.content if isinstance(self.content, list) else []

    def text(self) -> str:
        """The content's text flattened to one string (image parts hold none)."""
        content = self.content
        if isinstance(content, list):
            return "".join(part_text(p) for p in content if not isinstance(p, ImagePart))
        return content or self.refusal or ""

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """The content's image parts, with their index in it."""
        if not isinstance(self.content, list):
            return []
        return [(i, p) for i, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def template_content(self) -> str | list[dict[str, Any]]:
        """The content as the chat template takes it: one string, or where the message holds
        images, its parts in order, each image as ``{"type": "image"}`` (the vision models'
        templates write their image marker for it)."""
        if not self.image_parts():
            return self.text()
        assert isinstance(self.content, list)
        return [template_part(p) for p in self.content]

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to one string, tool-call
        arguments as objects (templates write them with ``tojson``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.template_content()}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


def template_tool_call(call: ToolCallIn) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # not JSON: the template gets the text as it is
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def check_parameters_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's ``parameters`` describe its arguments, which are a JSON object: a schema
    that states another type is refused, as OpenAI refuses it (a call could never match it,
    and the tool parsers would leave the model's call as text)."""
    kind = (schema or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f'parameters must be a JSON schema of type "object", got type {kind!r}')
    return schema


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is a 400, not a default

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None

    _parameters_schema = field_validator("parameters")(check_parameters_schema)


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra=rules(
            *SAMPLING_RULES,
            when(present("top_logprobs", {"minimum": 1}), present("logprobs", {"const": True})),
            when(
                present("continue_final_message", {"const": True}),
                present("add_generation_prompt", {"const": False}),
            ),
            when(present("tool_choice", {"const": "required"}), present("tools", {"minItems": 1})),
        )
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, json_schema_extra={LIMIT_KEY: "context"})
    max_completion_tokens: int | None = Field(
        default=None, ge=1, json_schema_extra={LIMIT_KEY: "context"}
    )
    logprobs: StrictBool = Field(default=False, json_schema_extra=or_null())
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the output continues the last (assistant) message
    # The response's text starts with that message's (vLLM's echo).
    echo: StrictBool = Field(default=False, json_schema_extra=or_null())
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    # Reasoning models (--reasoning-parser): whether the reasoning is sent, at most how many
    # tokens it may take, and OpenAI's effort, for templates that read it.
    include_reasoning: StrictBool = True
    thinking_token_budget: int | None = Field(
        default=None, ge=0, json_schema_extra={LIMIT_KEY: "reasoning"}
    )
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    modalities: list[Literal["text"]] | None = None  # ["text"], the only one here
    # UNSUPPORTED, as are the fields below: the document says only null is taken.
    audio: Any = Field(default=None, json_schema_extra=NULL)
    prediction: Any = Field(default=None, json_schema_extra=NULL)
    web_search_options: Any = Field(default=None, json_schema_extra=NULL)
    functions: Any = Field(default=None, json_schema_extra=NULL)
    function_call: Any = Field(default=None, json_schema_extra=NULL)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _continue_an_assistant_message(self) -> ChatCompletionRequest:
        check_continuation(self.messages, self.add_generation_prompt, self.continue_final_message)
        if self.echo and self.messages[-1].role != "assistant":
            raise FieldError("echo", "echo repeats the last message, which must be the assistant's")
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("two functions of the same name")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, v: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"names the function {v.function.name!r}, which is not in tools")
        if v == "required" and not names:
            raise ValueError("'required' needs tools")
        return v

    @property
    def unsupported(self) -> list[str]:
        """The UNSUPPORTED fields this request gives."""
        return [name for name in UNSUPPORTED if getattr(self, name) is not None]

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_sequences(self) -> int:
        """Engine requests behind this request: one per choice."""
        return self.n


def check_continuation(
    messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool
) -> None:
    """continue_final_message continues an assistant message, so no new turn may open."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise FieldError(
            "continue_final_message", "continue_final_message needs add_generation_prompt false"
        )
    if messages[-1].role != "assistant":
        raise FieldError(
            "continue_final_message",
            "continue_final_message continues a last message of the assistant",
        )


class LoadLoraAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter, vLLM's body (its load_inplace is not served: refused)."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter, vLLM's body (lora_int_id is vLLM's own id: refused)."""

    lora_name: str


class TokenizeRequest(RequestBody):
    model_config = ConfigDict(
        json_schema_extra=rules(
            when(
                present("continue_final_message", {"const": True}),
                present("add_generation_prompt", {"const": False}),
            ),
            exactly_one_of=("prompt", "messages"),
        )
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, json_schema_extra={"minItems": 1})
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None:
            check_continuation(
                self.messages, self.add_generation_prompt, self.continue_final_message
            )
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra=any_of({**TOKEN_IDS, "minItems": 0}))


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request
EmbeddingInput = str | list[str] | list[int] | list[list[int]]
EMBEDDING_INPUTS = (
    NON_EMPTY_TEXT,
    {"type": "array", "items": NON_EMPTY_TEXT, "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS},
    TOKEN_IDS,
    {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS},
)


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings request: one input or a batch, as text or token ids."""

    input: EmbeddingInput = Field(json_schema_extra=any_of(*EMBEDDING_INPUTS))
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # Matryoshka: the first N values
    user: str | None = None  # accepted and unused: it changes nothing in the output

    @field_validator("input")
    @classmethod
    def _inputs_not_empty(cls, v: EmbeddingInput) -> EmbeddingInput:
        items = [v] if isinstance(v, str) else v
        if not items or any(isinstance(item, str | list) and not item for item in items):
            raise ValueError("input must not be empty, nor hold an empty string or token list")
        if len(items) > MAX_EMBEDDING_INPUTS and not all(isinstance(t, int) for t in items):
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return v

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input: a text, or one input's token ids."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(t, int) for t in v):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]


# ---- responses --------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None  # with reasoning

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


PromptLogprobs = list[dict[str, dict[str, Any]] | None]  # vLLM's: None, then {id: {logprob, ...}}


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    # The model's reasoning, under both its spellings (vLLM's and the newer one), where a
    # reasoning parser split it from the answer.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when asked for


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
