"""The conventions whose calls are JSON ``{"name", "arguments"}`` objects: hermes, mistral and
llama3_json (formats: frontend/tool_parsers/__init__.py)."""

from __future__ import annotations

import re

from frontend.tool_parsers.core import (
    BlockStreamer,
    JsonEnd,
    MarkerStreamer,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    call_of,
    loads,
)
from frontend.tool_parsers.grammar import JsonEnvelope

PYTHON_TAG = "<|python_tag|>"


class HermesStreamer(BlockStreamer):
    marker = "<tool_call>"
    end = "</tool_call>"

    def block_calls(self, body: str) -> list[ToolCall] | None:
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


class HermesToolParser(ToolParser):
    name = "hermes"
    syntax = JsonEnvelope(
        "arguments", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>",
        markers=(HermesStreamer.marker, HermesStreamer.end), trigger=HermesStreamer.marker,
    )  # fmt: skip

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    syntax = JsonEnvelope(
        "parameters", "", "; ", "", reserved=(PYTHON_TAG,), content_start="{"
    )  # a tagged output is a call (the tag may lead it)

    def streamer(self) -> ToolCallStreamer:
        return Llama3JsonStreamer()


class MistralToolParser(ToolParser):
    name = "mistral"
    syntax = JsonEnvelope(
        "arguments", "[TOOL_CALLS][", ", ", "]", markers=(MistralStreamer.marker,),
        trigger=MistralStreamer.marker,
    )  # fmt: skip

    def streamer(self) -> ToolCallStreamer:
        return MistralStreamer()
