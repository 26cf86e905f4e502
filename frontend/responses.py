"""/v1/responses: OpenAI's Responses API on the chat pipeline, whole or streamed as its typed
events, with stored responses that a later request continues (``previous_response_id``).

A request is translated into a chat request (frontend/responses_schemas.py) and prepared and run
by frontend/chat.py as any chat request is; only the output's shape differs. Its output items:
a ``reasoning`` item where a reasoning parser split the model's thinking off, a ``message`` with
the answer's text, and a ``function_call`` item per tool call. Streamed, the same items are
opened, filled and closed by events in OpenAI's order (``response.created``, ``.in_progress``,
``.output_item.added``, ``.content_part.added``, ``.output_text.delta``, ... ``.completed``, or
``.incomplete`` when ``max_output_tokens`` cut it), each numbered by ``sequence_number``.

Stored responses (``store``, the default) live in this API process's memory
(frontend/response_store.py): they are lost when the server restarts, and with
``--api-servers N`` each API process keeps its own, so a ``previous_response_id`` made by another
process is not found (404).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from frontend.chat import ChatGeneration, ChoiceStream, prepare_chat
from frontend.errors import OpenAIError, bad_request, field_path, most_specific
from frontend.openai_schemas import ChatCompletionRequest
from frontend.response_store import StoredResponse
from frontend.responses_schemas import (
    ItemError,
    ResponsesRequest,
    chat_messages,
    chat_request_body,
)
from frontend.serving_context import ServingContext
from frontend.sse import sse_error, to_json

logger = logging.getLogger("tandem.frontend")

# Chat parameter names as the Responses API calls them, for the errors of the chat pipeline.
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "reasoning_effort": "reasoning.effort",
}


OUTPUT_BUDGET = re.compile(r"(?<!')\bmax_(completion_)?tokens\b(?!')")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"no stored response {response_id!r} (responses are kept in the memory of the API "
        "process that made them, until the server restarts)",
        param="previous_response_id",
        code="not_found",
    )


# ---- a request's run ---------------------------------------------------------------------------


@dataclass
class ResponseRun:
    """One Responses request on the chat pipeline: the chat request and Generation that run it,
    and the conversation it continues (without the instructions, which do not carry over)."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    gen: ChatGeneration
    conversation: list[dict[str, Any]]
    # The ids of every item of the stored conversation it continues (previous_response_id's).
    chain_ids: frozenset[str] = frozenset()
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    async def send(self) -> None:
        await self.gen.send()

    def close(self) -> None:
        self.gen.close()


async def prepare_response(ctx: ServingContext, req: ResponsesRequest) -> ResponseRun:
    """Check, translate and prepare; nothing reaches the engine until the Generation runs."""
    refused = req.refused()
    if refused is not None:
        raise bad_request(refused[1], refused[0], "unsupported_parameter")
    history: list[dict[str, Any]] = []
    chain_ids: frozenset[str] = frozenset()
    if req.previous_response_id is not None:
        stored = ctx.responses.get(req.previous_response_id)
        if stored is None:
            raise not_found(req.previous_response_id)
        history, chain_ids = stored.history, stored.item_ids
    origins: list[str] = []  # where each new message came from, for errors about its parts
    try:
        new = input_messages(req, ctx.vision is not None, origins)
        chat = ChatCompletionRequest.model_validate(chat_request_body(req, history + new))
    except ItemError as exc:
        raise bad_request(str(exc), exc.param) from None
    except ValidationError as exc:
        raise chat_validation_error(exc, message_sources(req, history, origins)) from None
    check_call_outputs(history, new, origins)
    check_item_ids(req.input, chain_ids)
    if req.user is not None:
        logger.info("response request for user %r", req.user)
    try:
        gen = await prepare_chat(ctx, chat)
    except OpenAIError as exc:
        chat_param = exc.info.param
        exc.info.param = response_param(chat_param, message_sources(req, history, origins))
        if chat_param and exc.info.param and exc.info.param != chat_param:
            # The chat field's name where the message names it as the field (not quoted, as
            # a template variable of the same name is).
            named = re.compile(rf"(?<!')\b{re.escape(chat_param)}\b(?!')")
            exc.info.message = named.sub(exc.info.param, exc.info.message)
        # The output budget, whatever field of another it is named by ("... or max_tokens").
        exc.info.message = OUTPUT_BUDGET.sub("max_output_tokens", exc.info.message)
        raise
    return ResponseRun(req, chat, gen, history + new, chain_ids)


def check_call_outputs(
    history: list[dict[str, Any]], new: list[dict[str, Any]], origins: list[str]
) -> None:
    """A 400 for a function_call_output that answers no function_call before it in the
    conversation (stored or sent), as OpenAI's Responses API refuses one."""
    called = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    for message, origin in zip(new, origins, strict=True):
        called.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise bad_request(
                f"no function_call before this function_call_output has call_id "
                f"{message['tool_call_id']!r}",
                f"{origin}.call_id",
            )


def input_messages(
    req: ResponsesRequest, images: bool = False, origins: list[str] | None = None
) -> list[dict[str, Any]]:
    """The request's input as chat messages (a string is one user message)."""
    if isinstance(req.input, str):
        if origins is not None:
            origins.append("input")
        return [{"role": "user", "content": req.input}]
    return chat_messages(req.input, images, origins)


# A chat message's part, as the chat handlers name it ("messages[2].content[1].image_url.detail").
CHAT_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\](?:\.image_url)?(.*)")


def response_param(param: str | None, sources: list[str]) -> str | None:
    """A chat handler's parameter name in the Responses API's: the chat field's own name, or
    the input item (``sources``: each chat message's origin) and part a message's part was."""
    if param is None:
        return None
    match = CHAT_PART.fullmatch(param)
    if match is None or int(match[1]) >= len(sources):
        return PARAMS.get(param, param)
    return f"{sources[int(match[1])]}.content.{match[2]}{match[3]}"


def message_sources(
    req: ResponsesRequest, history: list[dict[str, Any]], origins: list[str]
) -> list[str]:
    """Where each message of the chat request came from, in the Responses API's names."""
    sources = ["instructions"] * (req.instructions is not None)
    return sources + ["previous_response_id"] * len(history) + origins


def chat_validation_error(exc: ValidationError, sources: list[str]) -> OpenAIError:
    """A check of the chat request it became, in the Responses API's names: the most specific
    of its errors (as the chat route picks it), a message part's field named by the input
    item and part it came from."""
    first = most_specific(list(exc.errors()))
    loc = field_path(first.get("loc", ()))
    if len(loc) >= 4 and loc[0] == "messages" and loc[2] == "content":
        rest = "".join(f".{part}" for part in loc[4:])
        param = response_param(f"messages[{loc[1]}].content[{loc[3]}]{rest}", sources)
    else:
        param = PARAMS.get(loc[0], loc[0]) if loc else None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param)


# ---- output -------------------------------------------------------------------------------------


def whole_output_items(run: ResponseRun, status: str) -> list[dict[str, Any]]:
    """The output items of the finished response: those its stream makes from the whole text,
    so both forms hold the same items in the order the model wrote them (text after a call is
    an item after it; text between two calls, rare, goes after both); the last is marked
    incomplete where max_output_tokens cut it."""
    output = OutputStream(EventWriter(), run.req.max_tool_calls)
    stream = ChoiceStream(run.gen.tools, run.chat, run.gen.reasoning)
    output.feed(stream.delta(run.gen.choices[0].text.text, True), stream.after_calls)
    output.close(status)
    return output.items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def content_part(kind: str, text: str) -> dict[str, Any]:
    """The one content part of a streamed message or reasoning item."""
    return {"type": "reasoning_text", "text": text} if kind == "reasoning" else text_part(text)


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {
        "type": "message", "id": item_id, "status": status, "role": "assistant",
        "content": content,
    }  # fmt: skip


def ended_item(item: dict[str, Any], text: str, status: str) -> dict[str, Any]:
    """An item of the stream as it ends (``item`` as it was added), holding ``text``."""
    if item["type"] == "reasoning":
        return reasoning_item(item["id"], text, status)
    if item["type"] == "message":
        return message_item(item["id"], text, status)
    return call_item(item["id"], item["call_id"], item["name"], text, status)


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call", "id": item_id, "call_id": call_id, "name": name,
        "arguments": arguments, "status": status,
    }  # fmt: skip


def response_body(
    ctx: ServingContext, run: ResponseRun, output: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    """The response object: the request's settings echoed, its output, usage and status."""
    req = run.req
    usage = run.gen.usage()
    details = usage.completion_tokens_details
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": run.id,
        "object": "response",
        "created_at": run.created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": run.gen.model,
        "instructions": req.instructions,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": tool_choice_echo(req),
        # parameters is in OpenAI's echo even where null (a function of no arguments)
        "tools": [
            t.model_dump(exclude_none=True) | {"parameters": t.parameters} for t in req.tools or []
        ],
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "text": {"format": text_format_echo(req)},
        "truncation": "disabled",
        "store": req.store,
        "background": False,
        "service_tier": "default",  # the tier that served it, whichever was asked: there is one
        "metadata": req.metadata or {},
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
        # OpenAI sets it once a response has completed (Unix seconds), null otherwise.
        "completed_at": int(time.time()) if status == "completed" else None,
        "usage": {
            "input_tokens": usage.prompt_tokens,
            # The engine reports no prompt-cache use per request (the client's type needs both).
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": details.reasoning_tokens if details else 0
            },
            "total_tokens": usage.total_tokens,
        },
    }


def tool_choice_echo(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def text_format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                    "reasoning": "rs"}  # fmt: skip


def listed_input(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as ``GET /v1/responses/{id}/input_items`` lists it: items with ids
    (the client's where it gave them), a message's content as parts."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        listed = {**item, "type": kind, "id": item.get("id") or new_id(ITEM_ID_PREFIXES[kind])}
        if kind == "message":
            listed["content"] = listed_parts(item["role"], item.get("content", ""))
            listed.setdefault("status", "completed")
        items.append(listed)
    return items


def listed_parts(role: str, content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's content as the openai client's item types have it: text parts typed
    input_text (output_text, with its annotations, in the assistant's); others as sent."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return [listed_part(role, part) for part in parts]


def listed_part(role: str, part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") not in ("text", "input_text", "output_text"):
        return part
    if role == "assistant":
        return {"type": "output_text", "text": part["text"], "annotations": []}
    return {"type": "input_text", "text": part["text"]}


def check_item_ids(given: str | list[dict[str, Any]], chain_ids: frozenset[str]) -> None:
    """400 where two input items give the same id, or one gives the id of an item the
    continued conversation already holds (OpenAI refuses both: the item would be in the prompt
    twice; and a page would find the first when asked for what follows the second)."""
    seen: set[Any] = set()
    for i, item in enumerate(given if isinstance(given, list) else []):
        item_id = item.get("id") if isinstance(item, dict) else None
        if item_id is not None and not isinstance(item_id, str):
            raise bad_request("an item's id is a string", f"input.{i}.id")
        if item_id is not None and item_id in chain_ids:
            raise bad_request(
                f"duplicate item id {item_id!r}: the conversation of previous_response_id "
                "already holds it",
                f"input.{i}.id",
            )
        if item_id is not None and item_id in seen:
            raise bad_request(f"duplicate item id {item_id!r}", f"input.{i}.id")
        seen.add(item_id)


def input_items_page(
    stored: StoredResponse, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """One page of a stored response's input items, OpenAI's list object."""
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"no input item {after!r} in response {stored.body['id']!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def status_of(run: ResponseRun) -> str:
    return "incomplete" if run.gen.choices[0].finish_reason == "length" else "completed"


def remember(ctx: ServingContext, run: ResponseRun, body: dict[str, Any]) -> None:
    """Store the response and its conversation, its answer as the assistant's turn."""
    if not run.req.store:
        return
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in body["output"]:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = "".join(c["text"] for c in item["content"])
        elif item["type"] == "message":
            turn["content"] = "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            call = {"name": item["name"], "arguments": item["arguments"]}
            tool_call = {"id": item["call_id"], "type": "function", "function": call}
            turn.setdefault("tool_calls", []).append(tool_call)
    listed = listed_input(run.req.input)
    ids = (item.get("id") for item in [*listed, *body["output"]])
    item_ids = run.chain_ids | {item_id for item_id in ids if item_id}
    if not ctx.responses.put(body, [*run.conversation, turn], listed, item_ids):
        body["store"] = False  # the client learns it cannot continue from it
        logger.warning("response %s is past the store's bytes bound: not stored", body["id"])


async def respond(ctx: ServingContext, req: ResponsesRequest, run: ResponseRun) -> dict[str, Any]:
    """The whole response, once the model has finished."""
    async for _ in run.gen.run():
        pass
    status = status_of(run)
    body = response_body(ctx, run, whole_output_items(run, status), status)
    remember(ctx, run, body)
    return body


CUT_KINDS = ("message", "reasoning")  # the items whose text max_output_tokens can cut


# ---- streaming ---------------------------------------------------------------------------------


class EventWriter:
    """The response's events, numbered, in SSE form (``event:`` and ``data:`` lines).
    ``response_so_far``: the response as its stream stands (set once the stream begins), for
    the ``response.failed`` that ends a stream cut short."""

    def __init__(self) -> None:
        self.sequence = 0
        self.response_so_far: Callable[[], dict[str, Any]] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {to_json(body)}\n\n"


@dataclass
class OpenItem:
    """The output item being filled: its index, its item as it stands, the pieces of its text
    so far (joined once, when it closes: a long output's thousands of pieces added to one
    string would copy it each time)."""

    index: int
    item: dict[str, Any]
    pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class OutputStream:
    """Turns a streamed choice's deltas (reasoning, content, tool-call fragments) into the
    events that open, fill and close output items, one at a time, in order."""

    def __init__(self, events: EventWriter, max_tool_calls: int | None) -> None:
        self.events = events
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: OpenItem | None = None
        self.max_tool_calls = max_tool_calls
        self.calls = 0
        self.call_of_index: dict[int, OpenItem] = {}

    def feed(self, delta: dict[str, Any], after_calls: str = "") -> str:
        """The events of one delta; ``after_calls``: the end of its content that the model
        wrote after its calls (ChoiceStream.after_calls), which goes in an item after theirs."""
        out = ""
        if delta.get("reasoning_content"):
            out += self.text("reasoning", delta["reasoning_content"])
        content = delta.get("content", "")
        before = content[: len(content) - len(after_calls)]
        if before:
            out += self.text("message", before)
        for fragment in delta.get("tool_calls", ()):
            out += self.call_fragment(fragment)
        if after_calls:
            out += self.text("message", after_calls)
        return out

    def text(self, kind: str, text: str) -> str:
        out = ""
        if self.open is None or self.open.item["type"] != kind:
            out += self.close()
            out += self.start(kind)
        assert self.open is not None
        self.open.pieces.append(text)
        item_id, index = self.open.item["id"], self.open.index
        if kind == "reasoning":
            return out + self.events.event(
                "response.reasoning_text.delta", item_id=item_id, output_index=index,
                content_index=0, delta=text,
            )  # fmt: skip
        return out + self.events.event(
            "response.output_text.delta", item_id=item_id, output_index=index,
            content_index=0, delta=text, logprobs=[],
        )  # fmt: skip

    def start(self, kind: str) -> str:
        index = len(self.items)
        if kind == "reasoning":
            item = reasoning_item(new_id("rs"), "", status="in_progress")
        else:
            item = message_item(new_id("msg"), None, status="in_progress")
        self.open = OpenItem(index, item)
        out = self.events.event("response.output_item.added", output_index=index, item=item)
        return out + self.events.event(
            "response.content_part.added", item_id=item["id"], output_index=index,
            content_index=0, part=content_part(kind, ""),
        )  # fmt: skip

    def call_fragment(self, fragment: dict[str, Any]) -> str:
        out = ""
        if "id" in fragment:  # a new call: its item opens with its name
            out += self.close()
            if self.max_tool_calls is not None and self.calls >= self.max_tool_calls:
                return out
            self.calls += 1
            item = call_item(
                new_id("fc"), fragment["id"], fragment["function"]["name"], "", "in_progress"
            )
            self.open = OpenItem(len(self.items), item)
            self.call_of_index[fragment["index"]] = self.open
            out += self.events.event(
                "response.output_item.added", output_index=self.open.index, item=item
            )
        piece = fragment.get("function", {}).get("arguments", "")
        target = self.call_of_index.get(fragment["index"])
        if piece and target is not None and target is self.open:
            target.pieces.append(piece)
            out += self.events.event(
                "response.function_call_arguments.delta", item_id=target.item["id"],
                output_index=target.index, delta=piece,
            )  # fmt: skip
        return out

    def so_far(self) -> list[dict[str, Any]]:
        """The output as the stream stands, for a response that fails midway: the finished
        items, then the open one with what it has, "incomplete" (its deltas went out)."""
        opened = self.open
        if opened is None:
            return list(self.items)
        return [*self.items, ended_item(opened.item, opened.text, "incomplete")]

    def close(self, status: str = "completed") -> str:
        """Finish the open item, if any: its done events, then it joins the output. ``status``:
        the response's, at its end ("incomplete": max_output_tokens cut the item's text)."""
        opened, self.open = self.open, None
        if opened is None:
            return ""
        item, index, text = opened.item, opened.index, opened.text
        item_id = item["id"]
        kind = item["type"]
        done = ended_item(item, text, status if kind in CUT_KINDS else "completed")
        out = ""
        if kind == "reasoning":
            out += self.events.event(
                "response.reasoning_text.done", item_id=item_id, output_index=index,
                content_index=0, text=text,
            )  # fmt: skip
            out += self.events.event(
                "response.content_part.done", item_id=item_id, output_index=index,
                content_index=0, part=content_part(kind, text),
            )  # fmt: skip
        elif kind == "message":
            out += self.events.event(
                "response.output_text.done", item_id=item_id, output_index=index,
                content_index=0, text=text, logprobs=[],
            )  # fmt: skip
            out += self.events.event(
                "response.content_part.done", item_id=item_id, output_index=index,
                content_index=0, part=text_part(text),
            )  # fmt: skip
        else:
            out += self.events.event(
                "response.function_call_arguments.done", item_id=item_id, output_index=index,
                name=item["name"], arguments=text,
            )  # fmt: skip
        self.items.append(done)
        return out + self.events.event("response.output_item.done", output_index=index, item=done)


async def stream_response(
    ctx: ServingContext, req: ResponsesRequest, run: ResponseRun, events: EventWriter
) -> AsyncIterator[str]:
    start = response_body(ctx, run, [], "in_progress")
    start["usage"] = None
    output = OutputStream(events, req.max_tool_calls)
    events.response_so_far = lambda: response_body(ctx, run, output.so_far(), "failed")
    yield events.event("response.created", response=start)
    yield events.event("response.in_progress", response=start)
    stream = ChoiceStream(run.gen.tools, run.chat, run.gen.reasoning)
    try:
        async for deltas in run.gen.run():
            text = ""
            for d in deltas:
                delta = stream.delta(d.text, d.finish_reason is not None)
                text += output.feed(delta, stream.after_calls)
            if text:
                yield text
        status = status_of(run)
        last = output.close(status)
        body = response_body(ctx, run, output.items, status)
        remember(ctx, run, body)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield last + events.event(kind, response=body)
    except Exception as exc:
        yield failed_event(events, exc)


def failed_event(events: EventWriter, exc: Exception) -> str:
    """The end of a stream that fails after it began (the engine lost, the server stopping):
    ``response.failed``, its response holding the items so far (the open one "incomplete")
    and the error, as OpenAI's ends a response that fails midway (not stored: nothing could
    continue it)."""
    payload = json.loads(sse_error(exc).removeprefix("data: "))["error"]
    code, message = payload.get("code"), payload.get("message")
    if events.response_so_far is None:
        return events.event("error", code=code, message=message, param=payload.get("param"))
    body = events.response_so_far()
    # OpenAI's codes for a response's error name no cause of ours: ours leads the message.
    body["error"] = {"code": "server_error", "message": f"{code}: {message}" if code else message}
    return events.event("response.failed", response=body)
