"""The Responses API's request (``POST /v1/responses``), validated, and its translation into the
chat request that frontend/chat.py runs: the Responses API is another door onto the same
pipeline (template, reasoning, tools, constraints, Generation), not a second one.

Input items become chat messages: text and message items by role, ``function_call`` items an
assistant turn's tool calls, ``function_call_output`` items tool turns, ``reasoning`` items the
next assistant turn's ``reasoning_content``. What this server cannot honour is a 400 naming it
(images and files, ``background``, reasoning summaries, ``include`` entries, logprobs,
``truncation: auto``, ``text.verbosity``, tools other than functions); fields that change
nothing (``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``user``) are taken.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from frontend.openai_schemas import (
    FUNCTION_NAME,
    MAX_LOGPROBS,
    RequestBody,
    ServiceTier,
    check_parameters_schema,
    seed_field,
)
from frontend.openapi_rules import (
    LIMIT_KEY,
    NON_EMPTY_TEXT,
    NULL,
    any_of,
    or_null,
    present,
    rules,
    when,
)
from protocol.messages import PRIORITY_MAX, PRIORITY_MIN

MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64, values of 512
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    _parameters_schema = field_validator("parameters")(check_parameters_schema)
    # The Responses API's default, unlike chat's (a call matches its schema)
    strict: StrictBool = True
    # What the tool returns: OpenAI's metadata for its callers, which the model's calls to it
    # do not depend on (the Agents SDK sends it for any tool with an output type).
    output_schema: dict[str, Any] | None = None
    # Tool search and callers other than the model: refused where asked for (refused()).
    defer_loading: StrictBool | None = None
    allowed_callers: list[str] | None = None

    @field_validator("strict", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any) -> Any:
        return True if value is None else value


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON that matches a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.json_schema is None or not self.name):
            raise ValueError("a json_schema format needs its name and schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"a schema goes with type json_schema, not {self.type}")
        return self


class ResponseText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    # Refused: no model here reads it.
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, json_schema_extra=any_of(NULL)
    )


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    # Refused: no summaries here.
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, json_schema_extra=any_of(NULL)
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, json_schema_extra=any_of(NULL)
    )


# The input items chat_messages takes, as the document states them.
TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"enum": ["input_text", "output_text", "text", "reasoning_text"]},
        "text": {"type": "string"},
    },
}
ITEM_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}
INPUT_ITEMS = (
    {  # a message (an item without a type is one)
        "type": "object",
        "required": ["role"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": ITEM_CONTENT,
        },
    },
    {
        "type": "object",
        "required": ["type", "call_id", "name", "arguments"],
        "properties": {
            "type": {"const": "function_call"},
            "call_id": NON_EMPTY_TEXT,
            "name": NON_EMPTY_TEXT,
            "arguments": {"type": "string"},
        },
    },
    {
        "type": "object",
        "required": ["type", "call_id", "output"],
        "properties": {
            "type": {"const": "function_call_output"},
            "call_id": NON_EMPTY_TEXT,
            "output": ITEM_CONTENT,
        },
    },
    {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"const": "reasoning"},
            "content": {"anyOf": [{"type": "array", "items": TEXT_PART}, NULL]},
            "encrypted_content": NULL,
        },
    },
)
INPUT = {
    "type": "array",
    "items": {"oneOf": list(INPUT_ITEMS)},
    "minItems": 1,
    # Reasoning items alone make no conversation: it needs some other item.
    "contains": {"not": present("type", {"const": "reasoning"})},
}


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(
        json_schema_extra=rules(
            when(present("tool_choice", {"const": "required"}), present("tools", {"minItems": 1}))
        )
    )
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("stream", "store")  # nullable in OpenAI's

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(json_schema_extra=any_of(NON_EMPTY_TEXT, INPUT))
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: ResponseText | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(
        default=None, ge=1, json_schema_extra={LIMIT_KEY: "context"}
    )
    temperature: float | None = Field(default=None, ge=0.0)  # as chat's: no top, as vLLM's
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Refused past 0 (no logprobs here), as are background, include and truncation "auto".
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, json_schema_extra=any_of({"const": 0}, NULL)
    )
    stream: StrictBool = Field(default=False, json_schema_extra=or_null())
    stream_options: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=any_of(
            {
                "type": "object",
                "properties": {"include_obfuscation": {"type": "boolean"}},
                "additionalProperties": False,
            },
            NULL,
        ),
    )
    store: StrictBool = Field(default=True, json_schema_extra=or_null())
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    background: StrictBool | None = Field(
        default=None, json_schema_extra=any_of({"const": False}, NULL)
    )
    include: list[str] | None = Field(
        default=None, json_schema_extra=any_of({"type": "array", "maxItems": 0}, NULL)
    )
    truncation: Literal["disabled", "auto"] | None = Field(
        default=None, json_schema_extra=any_of({"const": "disabled"}, NULL)
    )
    # Taken, changing nothing here.
    user: str | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's sampling and template extras, as on chat.
    top_k: int | None = Field(default=None, ge=-1, json_schema_extra={"maximum": 2**31 - 1})
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = seed_field()
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = Field(
        default=None, ge=0, json_schema_extra={LIMIT_KEY: "reasoning"}
    )
    priority: int = Field(  # as on chat
        default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX, json_schema_extra={LIMIT_KEY: "priority"}
    )

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if not v:  # an empty text as an empty list, as the OpenAPI document says
            raise ValueError("input must not be empty")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_within_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata pairs")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"metadata keys are at most {MAX_METADATA_KEY} characters, values "
                    f"{MAX_METADATA_VALUE}"
                )
        return v

    @field_validator("stream_options")
    @classmethod
    def _known_stream_options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = set(v or {}) - {"include_obfuscation"}  # padding only: changes no output
        if unknown:
            raise ValueError(f"unsupported stream_options: {sorted(unknown)}")
        return v

    @property
    def num_sequences(self) -> int:
        """Engine requests behind this request: one (the Responses API has no n)."""
        return 1

    def refused(self) -> tuple[str, str] | None:
        """The first field given that this server cannot honour: (param, why)."""
        checks = [
            ("background", bool(self.background), "background responses are not supported"),
            ("include", bool(self.include), "include is not supported (no logprobs, "
             "encrypted reasoning or tool sources to include)"),
            ("top_logprobs", bool(self.top_logprobs), "logprobs are not supported here"),
            ("truncation", self.truncation == "auto", "truncation 'auto' is not supported: "
             "an input longer than the context is refused"),
            ("text.verbosity", self.text is not None and self.text.verbosity is not None,
             "text.verbosity is not supported"),
            ("reasoning.summary", self.reasoning is not None
             and (self.reasoning.summary or self.reasoning.generate_summary) is not None,
             "reasoning summaries are not supported (the reasoning text itself comes as a "
             "reasoning item)"),
        ]  # fmt: skip
        for param, given, why in checks + self._refused_in_tools():
            if given:
                return param, why
        return None

    def _refused_in_tools(self) -> list[tuple[str, bool, str]]:
        checks = []
        for i, tool in enumerate(self.tools or []):
            callers = tool.allowed_callers
            checks += [
                (f"tools.{i}.defer_loading", bool(tool.defer_loading),
                 "deferred tool loading (tool search) is not supported"),
                (f"tools.{i}.allowed_callers", callers is not None and "direct" not in callers,
                 "only the model calls tools here: allowed_callers must include 'direct'"),
            ]  # fmt: skip
        return checks


# ---- input items -> chat messages ---------------------------------------------------------------


class ItemError(ValueError):
    """An input item this server cannot take: ``param`` names where it is."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def item_text(content: Any, param: str) -> str:
    """A message item's content as one string: text parts joined; images and files refused."""
    parts = item_parts(content, param, images=False)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


# The keys OpenAI's input items and content parts may carry (what its client sends back from an
# earlier response's output included): any other is refused, not dropped, as OpenAI refuses it,
# unless null (the openai client's model_dump writes every field its types know, newer ones
# too, as null where unset: a null asks for nothing).
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
    "function_call_output": {"type", "id", "call_id", "output", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
PART_KEYS = {
    "input_text": {"type", "text"},
    "output_text": {"type", "text", "annotations", "logprobs"},
    "text": {"type", "text"},
    "reasoning_text": {"type", "text"},
    "summary_text": {"type", "text"},
    "refusal": {"type", "refusal"},
    "input_image": {"type", "image_url", "file_id", "detail"},
}


def check_keys(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    """ItemError naming the first key of ``obj`` outside ``allowed`` that is not null."""
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise ItemError(f"unknown parameter {key!r}", f"{param}.{key}")


def item_parts(content: Any, param: str, images: bool) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: one string, or (where it holds an image and
    ``images`` says the model takes them) chat parts in the item's order, so that a part's
    index is the same in both. Files and audio are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ItemError("content must be a string or a list of parts", param)
    parts = [content_part(part, f"{param}.{i}", images) for i, part in enumerate(content)]
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def content_part(part: Any, param: str, images: bool) -> dict[str, Any]:
    """One content part as a chat part: text, or an image by its URL."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in PART_KEYS:
        check_keys(part, PART_KEYS[kind], param)
    if kind in ("input_text", "output_text", "text", "reasoning_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise ItemError("a text part needs its text", f"{param}.text")
        return {"type": "text", "text": text}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal", ""))}
    if kind == "input_image":
        return image_part_of(part, param, images)
    if kind in ("input_file", "input_audio"):
        raise ItemError(f"{kind} is not supported: this server takes text and images", param)
    raise ItemError(f"unknown content part type {kind!r}", f"{param}.type")


def image_part_of(part: dict[str, Any], param: str, images: bool) -> dict[str, Any]:
    if not images:
        raise ItemError(
            "input_image is not supported here: images go in user messages to a model that "
            "takes them",
            param,
        )
    if part.get("file_id") is not None:
        raise ItemError("images by file_id are not supported: send image_url", f"{param}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise ItemError("an input_image part needs its image_url", f"{param}.image_url")
    return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}}


def chat_messages(
    items: list[dict[str, Any]], images: bool = False, origins: list[str] | None = None
) -> list[dict[str, Any]]:
    """Input items as chat messages (the shape of ChatMessage); image parts kept where
    ``images`` (a vision model). ``origins`` gets, for each message, the item it came from."""
    messages: list[dict[str, Any]] = []
    origins = [] if origins is None else origins
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise ItemError("an input item is an object", param)
        kind = item.get("type", "message")
        if kind in ITEM_KEYS:
            check_keys(item, ITEM_KEYS[kind], param)
        if kind == "message":
            message = message_of(item, param, images)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
            origins.append(param)
        elif kind == "function_call":
            call = function_call_of(item, param)
            opened = len(messages)
            assistant = open_assistant_turn(messages, reasoning)
            origins.extend([param] * (len(messages) - opened))
            reasoning = None
            assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(tool_message_of(item, param))
            origins.append(param)
        elif kind == "reasoning":
            reasoning = reasoning_text_of(item, param)
        else:
            raise ItemError(f"input items of type {kind!r} are not supported", f"{param}.type")
    return messages


def message_of(item: dict[str, Any], param: str, images: bool = False) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ItemError(f"unknown role {role!r}", f"{param}.role")
    if "content" not in item:
        raise ItemError("a message item needs its content", f"{param}.content")
    content = item_parts(item["content"], f"{param}.content", images and role == "user")
    return {"role": role, "content": content}


def function_call_of(item: dict[str, Any], param: str) -> dict[str, Any]:
    fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
    for key, value in fields.items():
        if not isinstance(value, str) or (key != "arguments" and not value):
            raise ItemError(f"a function_call item needs its {key}", f"{param}.{key}")
    return {
        "id": fields["call_id"],
        "type": "function",
        "function": {"name": fields["name"], "arguments": fields["arguments"]},
    }


def open_assistant_turn(messages: list[dict[str, Any]], reasoning: str | None) -> dict[str, Any]:
    """The assistant turn a function call belongs to: the last message if it is the assistant's
    own (its text, or calls before this one), else a new one."""
    if messages and messages[-1]["role"] == "assistant" and reasoning is None:
        return messages[-1]
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    messages.append(turn)
    return turn


def tool_message_of(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ItemError("a function_call_output item needs its call_id", f"{param}.call_id")
    output = item.get("output")
    text = output if isinstance(output, str) else item_text(output, f"{param}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def reasoning_text_of(item: dict[str, Any], param: str) -> str:
    if item.get("encrypted_content"):
        raise ItemError("encrypted reasoning is not supported", f"{param}.encrypted_content")
    return item_text(item.get("content") or [], f"{param}.content")


def chat_request_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that runs ``req`` on ``messages`` (a stored response's conversation
    and the new input), after the instructions."""
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "repetition_penalty": req.repetition_penalty,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        "chat_template_kwargs": req.chat_template_kwargs,
        "thinking_token_budget": req.thinking_token_budget,
        "user": req.user,
        "priority": req.priority,
    }
    if req.tools:
        body["tools"] = [chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        named = isinstance(choice, NamedFunction)
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if named else choice
        )
    if req.text is not None and req.text.format is not None:
        body["response_format"] = response_format(req.text.format)
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return {k: v for k, v in body.items() if v is not None}


CHAT_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """The chat request's tool: what the model sees and its calls must match (the fields of
    the Responses tool for its callers stay behind)."""
    function = tool.model_dump(include=CHAT_FUNCTION_FIELDS, exclude_none=True)
    return {"type": "function", "function": function}


def response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.json_schema}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}
