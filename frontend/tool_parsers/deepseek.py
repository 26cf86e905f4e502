"""DeepSeek's calls between its tool tokens (``deepseek_v3``, ``deepseek_v31``; formats:
frontend/tool_parsers/__init__.py). The tokens are written with full-width bars and "▁" (U+2581)
as in DeepSeek's tokenizer; they are ordinary added tokens there, so the text keeps them."""

from __future__ import annotations

import re
from typing import Any

from frontend.tool_parsers.core import (
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    loads,
    make_call,
    partial_marker,
    partial_markers,
)
from frontend.tool_parsers.grammar import CallSyntax, LarkWriter, lark_sequence, parameters_of

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
# V3 (and R1-0528): the type, the name on its own line, the arguments in a json code fence.
V3_CALL = re.compile(rf"\s*function{SEP}([^\n]+?)\s*```json\s*(.*?)\s*```\s*", re.S)
# V3.1: the name, then the arguments as they are.
V31_CALL = re.compile(rf"\s*([^\n<]+?){SEP}\s*(.*?)\s*", re.S)


class DeepSeekStreamer(ToolCallStreamer):
    """Content up to ``<｜tool▁calls▁begin｜>``; then, in that section, each
    ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` block is a call, sent once it closes (or
    the output ends after it), until ``<｜tool▁calls▁end｜>`` or any other text ends the
    section. A block that is not a call is content, and so are the section's markers unless the
    section holds a call (then they are dropped)."""

    def __init__(self, call: re.Pattern[str]) -> None:
        super().__init__()
        self.call = call
        self.state = "content"  # content | section
        self.section_calls = 0
        self.markers_shown = False  # the section's marker went out as content
        self.searched = 0  # where to look for the open block's end next

    def scan(self, final: bool) -> None:
        while self.buffer:
            step = self.scan_section if self.state == "section" else self.scan_content
            if not step(final):
                break
        if final and self.state == "section":  # the output ended in the section
            self.leave_section()

    def scan_content(self, final: bool) -> bool:
        at = self.buffer.find(CALLS_BEGIN)
        if at < 0:
            at = len(self.buffer) - (0 if final else partial_marker(self.buffer, CALLS_BEGIN))
        self.emit_text(self.buffer[:at])
        self.buffer = self.buffer[at:]
        if not self.buffer.startswith(CALLS_BEGIN):
            return False
        self.buffer = self.buffer[len(CALLS_BEGIN) :]
        self.state, self.section_calls, self.markers_shown = "section", 0, False
        return True

    def scan_section(self, final: bool) -> bool:
        rest = self.buffer.lstrip()
        gap = len(self.buffer) - len(rest)
        if rest.startswith(CALL_BEGIN):
            return self.scan_block(gap + len(CALL_BEGIN), final)
        if rest.startswith(CALLS_END):
            self.close_section(self.buffer[: gap + len(CALLS_END)])
            return True
        if not final and len(rest) == partial_markers(rest, (CALL_BEGIN, CALLS_END)):
            return False  # nothing yet, or the start of a marker
        self.leave_section()
        return True

    def scan_block(self, body: int, final: bool) -> bool:
        """With the buffer at a block (after whitespace): resolve it once it closes."""
        at = self.buffer.find(CALL_END, max(body, self.searched))
        if at < 0 and not final:
            self.searched = max(body, len(self.buffer) - len(CALL_END) + 1)
            return False
        self.searched = 0
        stop = len(self.buffer) if at < 0 else at + len(CALL_END)
        raw, self.buffer = self.buffer[:stop], self.buffer[stop:]
        text = raw[body:] if at < 0 else raw[body:at]
        call = self.block_call(text[: len(text) - partial_marker(text, CALL_END)])
        if call is None:
            self.show(raw)
        else:
            self.section_calls += 1
            self.emit_call(call)
        return True

    def block_call(self, body: str) -> ToolCall | None:
        match = self.call.fullmatch(body)
        return make_call(match[1].strip(), loads(match[2])) if match else None

    def show(self, text: str) -> None:
        """Section text that is content: after the section's marker, unless a call went."""
        if not self.markers_shown and not self.section_calls:
            self.emit_text(CALLS_BEGIN)
            self.markers_shown = True
        self.emit_text(text)

    def close_section(self, raw: str) -> None:
        self.buffer = self.buffer[len(raw) :]
        if self.markers_shown:
            self.emit_text(raw)
        elif not self.section_calls:  # an empty section: it was only text
            self.emit_text(CALLS_BEGIN + raw)
        self.state = "content"

    def leave_section(self) -> None:
        """Text that is no block ends the section: it is content, as is the section's marker
        if nothing came of it."""
        if not self.markers_shown and not self.section_calls:
            self.emit_text(CALLS_BEGIN)
        self.state = "content"


class DeepSeekSyntax(CallSyntax):
    """The section markers around the calls, each call in its block: V3's with the type, the
    name and a fenced ``%json``; V3.1's with the name and the ``%json`` alone."""

    markers = MARKERS
    trigger = CALLS_BEGIN

    def __init__(self, fenced: bool) -> None:
        self.fenced = fenced

    def frame(self) -> tuple[str, str, str]:
        return CALLS_BEGIN, "\n" if self.fenced else "", CALLS_END

    def call(self, lark: LarkWriter, function: dict[str, Any], rule: str) -> list[str]:
        name, arguments = function["name"], lark.json(parameters_of(function))
        if self.fenced:
            head = lark.text(f"{CALL_BEGIN}function{SEP}{name}\n```json\n")
            tail = lark.text(f"\n```{CALL_END}")
        else:
            head, tail = lark.text(f"{CALL_BEGIN}{name}{SEP}"), lark.text(CALL_END)
        return [f"{rule}: {lark_sequence(head, arguments, tail)}"]


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    syntax = DeepSeekSyntax(fenced=True)

    def streamer(self) -> ToolCallStreamer:
        return DeepSeekStreamer(V3_CALL)


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"
    syntax = DeepSeekSyntax(fenced=False)

    def streamer(self) -> ToolCallStreamer:
        return DeepSeekStreamer(V31_CALL)
