"""Tool calls in a model's output: the parsers that read them back (whole or streamed) and the
grammar that makes a model write them.

Three output conventions, chosen by ``--tool-call-parser`` (vLLM's names; our own code):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): any number of blocks
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; text outside them is content.
- ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls joined by ``; ``; an output that does not
  start with ``{`` is content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.

One state machine per convention does both jobs: ``extract`` runs the streamer over the whole text
at once, so the calls and content a client reassembles from a stream are, by construction, the
ones a non-streamed response carries, for every way the text may be chunked. The streamer sends a
call (id and name, then its arguments in one fragment) once the call's JSON has closed and proved
to be a call; until then the candidate text is held back, as is any tail of content that could be
the start of a marker (``<tool_c``). Incremental argument streaming would have to send text that a
later malformed or truncated call cannot take back, so it is not done.

Rules both paths share: a candidate that is not a well-formed call (bad JSON, no name, arguments
not an object) stays in the content verbatim; text before, between or after calls that is only
whitespace is dropped; arguments are re-serialized compactly (``{"a":1}``, non-ASCII kept), the
form OpenAI sends.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

ARGUMENT_KEYS = ("arguments", "parameters")  # models trained on either
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedMessage:
    """A whole output split into content (None when there is none) and calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class StreamDelta:
    """What one streamed step adds: content to send now, and tool-call fragments in OpenAI's
    streaming shape (``{"index", "id", "type", "function": {"name", "arguments": ""}}`` first,
    then ``{"index", "function": {"arguments": piece}}``)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    """A fresh call id in OpenAI's form: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """The JSON value of ``text``, None when it is not JSON (NaN and Infinity are not: a client
    could not read them back); never raises, even on absurd nesting."""
    try:
        return json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return None


def call_of(value: Any) -> ToolCall | None:
    """The call a decoded ``{"name", "arguments"}`` object describes, None when it is not one.
    Missing arguments are ``{}``; arguments sent as a JSON string are decoded."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = next((value[k] for k in ARGUMENT_KEYS if k in value), {})
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], compact(arguments))


def assemble(deltas: Iterable[StreamDelta]) -> ParsedMessage:
    """The message a client rebuilds from streamed deltas."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        for fragment in delta.tool_calls:
            if "id" in fragment:
                calls.append(ToolCall(fragment["id"], fragment["function"]["name"], ""))
            calls[fragment["index"]].arguments += fragment["function"]["arguments"]
    return ParsedMessage("".join(content) or None, calls)


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``: text that
    may turn out to be the marker, so it cannot be sent as content yet."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class JsonEnd:
    """Finds where a JSON object or array, arriving piece by piece, closes: counts brackets
    outside strings and resumes where it stopped (no rescans). Whether the text in between is
    valid JSON is ``loads``'s business."""

    STRUCTURE = re.compile(r'["{}\[\]]')
    IN_STRING = re.compile(r'["\\]')

    def __init__(self, start: int = 0) -> None:
        self.pos = start  # the value's opening bracket
        self.depth = 0
        self.in_string = False

    def find(self, text: str) -> int:
        """Index in ``text`` just past the closing bracket, -1 while the value is open."""
        while True:
            pattern = self.IN_STRING if self.in_string else self.STRUCTURE
            match = pattern.search(text, self.pos)
            if match is None:
                self.pos = len(text)
                return -1
            if match[0] == "\\":
                if match.end() == len(text):  # the escaped character has not arrived yet
                    self.pos = match.start()
                    return -1
                self.pos = match.end() + 1
                continue
            self.pos = match.end()
            if self.step(match[0]):
                return self.pos

    def step(self, char: str) -> bool:
        """Account for one quote or bracket; True when it closed the value."""
        if char == '"':
            self.in_string = not self.in_string
        elif char in "{[":
            self.depth += 1
        else:
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallStreamer(ABC):
    """One output's parser state: ``push`` each new piece of text, then ``finish`` once.

    Subclasses consume ``self.buffer`` in ``scan`` and report through ``emit_text`` and
    ``emit_call``; this class keeps the shared rule on whitespace around calls: whitespace at the
    start and after each call is held, and dropped if a call comes next or the output ends after
    a call, sent otherwise."""

    def __init__(self) -> None:
        self.buffer = ""  # text received but not yet resolved
        self.calls = 0
        self.held = ""  # whitespace in a gap before a call or after one
        self.in_gap = True
        self.out = StreamDelta()

    def push(self, delta: str) -> StreamDelta:
        self.out = StreamDelta()
        self.buffer += delta
        self.scan(final=False)
        return self.out

    def finish(self) -> StreamDelta:
        self.out = StreamDelta()
        self.scan(final=True)
        if self.calls == 0:
            self.out.content += self.held
        self.held = self.buffer = ""
        return self.out

    @abstractmethod
    def scan(self, final: bool) -> None:
        """Resolve as much of ``self.buffer`` as can be; with ``final``, all of it."""

    def emit_text(self, text: str) -> None:
        if self.in_gap:
            if not text.strip():
                self.held += text
                return
            text, self.held, self.in_gap = self.held + text, "", False
        self.out.content += text

    def emit_call(self, call: ToolCall) -> None:
        index, self.calls = self.calls, self.calls + 1
        self.held, self.in_gap = "", True
        function = {"name": call.name, "arguments": ""}
        self.out.tool_calls.append(
            {"index": index, "id": call.id, "type": "function", "function": function}
        )
        self.out.tool_calls.append({"index": index, "function": {"arguments": call.arguments}})


class MarkerStreamer(ToolCallStreamer):
    """Content in which a marker opens a call (hermes, mistral): content is sent up to the
    marker, holding back a tail that may be its start; ``scan_call`` takes over at the marker."""

    marker: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.in_call = False

    def scan(self, final: bool) -> None:
        while self.buffer:
            moved = self.scan_call(final) if self.in_call else self.scan_content(final)
            if not moved:
                return

    def scan_content(self, final: bool) -> bool:
        at = self.buffer.find(self.marker)
        if at < 0:
            at = len(self.buffer) - (0 if final else partial_marker(self.buffer, self.marker))
        self.emit_text(self.buffer[:at])
        self.buffer = self.buffer[at:]
        self.in_call = self.buffer.startswith(self.marker)
        return self.in_call

    @abstractmethod
    def scan_call(self, final: bool) -> bool:
        """With the buffer at the marker: resolve the call(s) once complete (True), or wait."""

    def resolve(self, raw: str, calls: list[ToolCall] | None) -> None:
        """``raw`` (from the marker on) was read: its calls, or, when it holds none, content."""
        for call in calls or []:
            self.emit_call(call)
        if not calls:
            self.emit_text(raw)
        self.in_call = False


class HermesStreamer(MarkerStreamer):
    marker = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.searched = len(self.marker)  # where to look for the end marker next

    def scan_call(self, final: bool) -> bool:
        at = self.buffer.find(self.end, self.searched)
        if at < 0 and not final:
            self.searched = max(len(self.marker), len(self.buffer) - len(self.end) + 1)
            return False
        self.searched = len(self.marker)
        again = self.buffer.rfind(self.marker, len(self.marker), len(self.buffer) if at < 0 else at)
        if again > 0:  # the first marker was only text ("use <tool_call> tags"): start over
            self.resolve(self.buffer[:again], None)
            self.buffer = self.buffer[again:]
            return True
        stop = len(self.buffer) if at < 0 else at + len(self.end)
        raw, self.buffer = self.buffer[:stop], self.buffer[stop:]
        self.resolve(raw, hermes_calls(raw, self.marker, self.end))
        return True


def hermes_calls(raw: str, marker: str, end: str) -> list[ToolCall] | None:
    """The call in one block, closed or cut off (a stop string, max_tokens) after its JSON."""
    body = raw[len(marker) :].removesuffix(end)
    body = body[: len(body) - partial_marker(body, end)]
    call = call_of(loads(body))
    return [call] if call else None


class MistralStreamer(MarkerStreamer):
    marker = "[TOOL_CALLS]"
    WHITESPACE = re.compile(r"\s*")

    def __init__(self) -> None:
        super().__init__()
        self.array: JsonEnd | None = None

    def scan_call(self, final: bool) -> bool:
        start = self.WHITESPACE.match(self.buffer, len(self.marker)).end()
        if start == len(self.buffer) and not final:
            return False
        if not self.buffer.startswith("[", start):  # no array: the marker was only text
            self.resolve(self.buffer[: len(self.marker)], None)
            self.buffer = self.buffer[len(self.marker) :]
            return True
        self.array = self.array or JsonEnd(start)
        end = self.array.find(self.buffer)
        if end < 0 and not final:
            return False
        stop = len(self.buffer) if end < 0 else end
        raw, self.buffer = self.buffer[:stop], self.buffer[stop:]
        self.array = None
        self.resolve(raw, mistral_calls(raw[start:]) if end >= 0 else None)
        return True


def mistral_calls(array: str) -> list[ToolCall] | None:
    """Every element's call, or None unless the array is non-empty and all of it calls."""
    items = loads(array)
    if not isinstance(items, list) or not items:
        return None
    calls = [call for call in map(call_of, items) if call]
    return calls if len(calls) == len(items) else None


class Llama3JsonStreamer(ToolCallStreamer):
    """Llama 3 JSON calls: the output's first character (after whitespace and an optional
    ``<|python_tag|>``) decides: ``{`` opens a call, anything else makes it all content. After a
    call, ``;`` and whitespace may lead to the next ``{``; any other text is content. A candidate
    that is not a call is content, and so is everything after it."""

    LEAD = re.compile(r"\s*(?:<\|python_tag\|>)?\s*")
    SEPARATOR = re.compile(r"\s*;?\s*")

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | call | separator | text
        self.lead = ""  # text before the candidate call: dropped if it is one
        self.object = JsonEnd()

    def scan(self, final: bool) -> None:
        while self.buffer:
            if self.state == "start":
                moved = self.scan_gap(self.LEAD, final)
            elif self.state == "separator":
                moved = self.scan_gap(self.SEPARATOR, final)
            elif self.state == "call":
                moved = self.scan_call(final)
            else:
                moved = self.scan_text()
            if not moved:
                return

    def scan_gap(self, gap: re.Pattern[str], final: bool) -> bool:
        """Before a call: wait while the text may still be a gap (or the tag's start), then
        go on to the call (``{``) or to content."""
        size = gap.match(self.buffer).end()
        rest = self.buffer[size:]
        if not final and (not rest or (self.state == "start" and PYTHON_TAG.startswith(rest))):
            return False
        if rest.startswith("{"):
            self.lead, self.buffer, self.state = self.buffer[:size], rest, "call"
        elif rest or self.calls == 0:
            self.state = "text"
        else:
            self.buffer = ""  # only a gap after the last call
        return True

    def scan_call(self, final: bool) -> bool:
        end = self.object.find(self.buffer)
        if end < 0 and not final:
            return False
        stop = len(self.buffer) if end < 0 else end
        raw, self.buffer = self.buffer[:stop], self.buffer[stop:]
        self.object = JsonEnd()
        call = call_of(loads(raw)) if end >= 0 else None
        if call:
            self.emit_call(call)
            self.state = "separator"
        else:
            self.emit_text(self.lead + raw)
            self.state = "text"
        self.lead = ""
        return True

    def scan_text(self) -> bool:
        self.emit_text(self.buffer)
        self.buffer = ""
        return False


class ToolParser(ABC):
    """A named tool-call convention: ``extract`` reads a whole output, ``streamer`` a stream."""

    name: ClassVar[str]

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh parser state for one streamed output."""

    def extract(self, text: str) -> ParsedMessage:
        """The content and calls of a whole output; never raises."""
        streamer = self.streamer()
        return assemble([streamer.push(text), streamer.finish()])


class HermesToolParser(ToolParser):
    name = "hermes"

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def streamer(self) -> ToolCallStreamer:
        return Llama3JsonStreamer()


class MistralToolParser(ToolParser):
    name = "mistral"

    def streamer(self) -> ToolCallStreamer:
        return MistralStreamer()


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_parser(name: str) -> ToolParser:
    """The parser named ``name``; ValueError listing the known names otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]()


LLAMA3_SIGNS = re.compile(
    r'<\|python_tag\|>|Environment: ipython|"name": function name, "parameters"'
)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool syntax names, None when it shows none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if LLAMA3_SIGNS.search(template):
        return "llama3_json"
    return None


# The JSON layout the grammar allows: fixed separators as the models were trained (", " and ": ")
# and no free whitespace, which a small model can pad with forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallSyntax:
    """How one convention frames its calls in a grammar: the text around and between them."""

    arguments_key: str
    before: str  # before the first call
    between: str  # between two calls
    after: str  # after the last call
    call_before: str = ""  # around every call
    call_after: str = ""


SYNTAX = {
    "hermes": CallSyntax("arguments", "", "\n", "", "<tool_call>\n", "\n</tool_call>"),
    "llama3_json": CallSyntax("parameters", "", "; ", ""),
    "mistral": CallSyntax("arguments", "[TOOL_CALLS][", ", ", "]"),
}


def tool_call_grammar(
    parser: str, tools: list[dict[str, Any]], forced: str | None, parallel: bool
) -> str:
    """An llguidance Lark grammar whose only outputs are one call (``parallel``: one or more) in
    ``parser``'s syntax, each to one of ``tools`` (only ``forced``, when given) with arguments
    matching that function's ``parameters`` schema. ValueError for an unknown parser or when no
    tool can be called."""
    if parser not in SYNTAX:
        raise ValueError(f"no tool-call grammar for parser {parser!r}; known: {', '.join(SYNTAX)}")
    syntax = SYNTAX[parser]
    functions = callable_functions(tools, forced)
    lines = [start_rule(syntax, parallel), call_rule(syntax)]
    lines.append("body: " + " | ".join(f"tool_{i}" for i in range(len(functions))))
    for i, function in enumerate(functions):
        lines.append(f"tool_{i}: %json {json.dumps(call_schema(function, syntax.arguments_key))}")
    return "\n".join(lines) + "\n"


def start_rule(syntax: CallSyntax, parallel: bool) -> str:
    more = f"({lark_sequence(literal(syntax.between), 'call')})*" if parallel else ""
    return "start: " + lark_sequence(literal(syntax.before), "call", more, literal(syntax.after))


def call_rule(syntax: CallSyntax) -> str:
    return "call: " + lark_sequence(literal(syntax.call_before), "body", literal(syntax.call_after))


def lark_sequence(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def literal(text: str) -> str:
    """``text`` as a Lark string literal (a JSON string is one); nothing for no text."""
    return json.dumps(text) if text else ""


def callable_functions(tools: list[dict[str, Any]], forced: str | None) -> list[dict[str, Any]]:
    """The function objects of ``tools`` the output may call."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    if forced is not None:
        functions = [f for f in functions if f.get("name") == forced]
        if not functions:
            raise ValueError(f"tool_choice names {forced!r}, which is not among the tools")
    if not functions:
        raise ValueError("a tool call is required but there are no function tools")
    return functions


def call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """A JSON schema for a call to ``function``: its name as a constant, so that the name and the
    arguments' schema agree."""
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments_key: rebase_refs(parameters, f"#/properties/{arguments_key}"),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": JSON_LAYOUT,
    }


def rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s ("#/$defs/x", "#") pointing to where it now sits."""
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out
