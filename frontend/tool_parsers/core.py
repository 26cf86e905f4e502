"""What every tool-call convention shares: the call and message records, the stream's delta shape,
JSON helpers that never raise, and the streamer machinery (frontend/tool_parsers/__init__.py
explains the design)."""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from frontend.tool_parsers.grammar import CallSyntax

ARGUMENT_KEYS = ("arguments", "parameters")  # models trained on either
Tools = list[dict[str, Any]]  # the request's tools, as OpenAI sends them


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
    """What one streamed step adds: content to send now, and tool calls in OpenAI's streaming
    shape, each whole in one fragment (``{"index", "id", "type", "function": {"name",
    "arguments"}}``: calls are sent once they have closed, and a client that reads one fragment
    a call, LlamaIndex's, would lose arguments sent in a second). ``reasoning``: text a convention
    marks as the model's thinking (harmony's analysis channel), never part of the content."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""
    # The end of ``content`` that came after the step's first call (a Responses output puts it
    # in an item after the calls'; chat messages keep content and calls apart).
    after_calls: str = ""


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


def arguments_object(arguments: Any) -> dict[str, Any] | None:
    """Arguments as a dict: a JSON object, or a JSON string holding one; None otherwise."""
    if isinstance(arguments, str):
        arguments = loads(arguments)
    return arguments if isinstance(arguments, dict) else None


def make_call(name: str, arguments: Any) -> ToolCall | None:
    """A call to ``name`` (non-empty) with ``arguments`` (see ``arguments_object``), or None."""
    arguments = arguments_object(arguments)
    if not name or arguments is None:
        return None
    return ToolCall(new_call_id(), name, compact(arguments))


def call_of(value: Any) -> ToolCall | None:
    """The call a decoded ``{"name", "arguments"}`` object describes, None when it is not one.
    Missing arguments are ``{}``; arguments sent as a JSON string are decoded."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in ARGUMENT_KEYS if k in value), {})
    return make_call(value["name"], arguments)


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


def partial_markers(text: str, markers: Iterable[str]) -> int:
    """``partial_marker`` for whichever of ``markers`` holds back the longest tail."""
    return max((partial_marker(text, m) for m in markers), default=0)


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
        if self.out.tool_calls:
            self.out.after_calls += text

    def emit_call(self, call: ToolCall) -> None:
        index, self.calls = self.calls, self.calls + 1
        self.held, self.in_gap = "", True
        function = {"name": call.name, "arguments": call.arguments}
        self.out.tool_calls.append(
            {"index": index, "id": call.id, "type": "function", "function": function}
        )


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


class BlockStreamer(MarkerStreamer):
    """Calls in blocks between an opening marker and an end marker (hermes, Qwen3-Coder): a
    block is read once its end arrives, or when the output ends after it (cut off by a stop
    string or max_tokens); ``block_calls`` says what calls its text holds."""

    end: ClassVar[str]

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
        self.resolve(raw, self.block_calls(self.block_body(raw)))
        return True

    def block_body(self, raw: str) -> str:
        """The text between the markers; a block cut off in its end marker loses that part."""
        body = raw[len(self.marker) :].removesuffix(self.end)
        return body[: len(body) - partial_marker(body, self.end)]

    @abstractmethod
    def block_calls(self, body: str) -> list[ToolCall] | None:
        """The calls in one block's text, None when it is not a well-formed block."""


class ToolParser(ABC):
    """A named tool-call convention: ``extract`` reads a whole output, ``streamer`` a stream,
    ``syntax`` writes a grammar of its calls (None: calls cannot be forced in it). ``tools``:
    the request's tools, for conventions whose arguments need their schemas to be read."""

    name: ClassVar[str]
    syntax: ClassVar[CallSyntax | None] = None
    # Whether its markers are special tokens that the text must keep (decoded without
    # skip_special_tokens): only then can the parser see them.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Tools | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh parser state for one streamed output."""

    def extract(self, text: str) -> ParsedMessage:
        """The content and calls of a whole output; never raises."""
        streamer = self.streamer()
        return assemble([streamer.push(text), streamer.finish()])
