"""gpt-oss's harmony messages (``openai``; format: frontend/tool_parsers/__init__.py), read from
text that keeps the special tokens. ``split_harmony`` gives a whole output's three parts
(thinking, answer, calls) for whoever separates the thinking."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from frontend.tool_parsers.core import (
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    assemble,
    loads,
    make_call,
    partial_markers,
)
from frontend.tool_parsers.grammar import CallSyntax, LarkWriter, lark_sequence, parameters_of

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"  # a stop token: usually not in the text
CALL = "<|call|>"  # likewise
HEADER_STARTS = (START, CHANNEL)  # the output's first message starts at its channel
BODY_ENDS = (END, RETURN, CALL)
BODY_STOPS = (*BODY_ENDS, START)  # a missing end: the next message's start ends the body
LONGEST_STOP = max(map(len, BODY_STOPS))
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
FUNCTIONS = "functions."


@dataclass
class HarmonyParts:
    """A harmony output split: ``analysis`` (the analysis channel and calls to built-in
    tools: the thinking), ``final`` (the final channel and commentary preambles: what the user
    reads; text outside any message too) and the function calls."""

    analysis: str
    final: str
    calls: list[ToolCall]


def split_harmony(text: str) -> HarmonyParts:
    """The parts of a whole output, as the streamed deltas add up to them."""
    streamer = HarmonyStreamer()
    deltas = [streamer.push(text), streamer.finish()]
    message = assemble(deltas)
    analysis = "".join(d.reasoning for d in deltas)
    return HarmonyParts(analysis, message.content or "", message.tool_calls)


class HarmonyStreamer(ToolCallStreamer):
    """Messages one after another: a header up to ``<|message|>`` (role, ``to=`` recipient,
    channel, content type), then a body up to ``<|end|>``, ``<|call|>`` or ``<|return|>``.
    A body to ``functions.NAME`` is a call, held until it ends and sent if it is a JSON object
    (else the message is content verbatim); analysis bodies (and those to other recipients,
    built-in tools) are reasoning; others are content; both are sent as they come."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "between"  # between | header | body
        self.header = ""  # the open message's header, as written
        self.kind = "content"  # the open body's: content | reasoning | call
        self.recipient = ""
        self.searched = 0  # where the held call body's end is looked for next

    def scan(self, final: bool) -> None:
        steps = {"between": self.scan_between, "header": self.scan_header}
        while self.buffer:
            if not steps.get(self.state, self.scan_body)(final):
                return

    def scan_between(self, final: bool) -> bool:
        """Between messages: text that starts none is content."""
        if self.buffer.startswith(HEADER_STARTS):
            self.state = "header"
            return True
        at = min((i for i in map(self.buffer.find, HEADER_STARTS) if i >= 0), default=-1)
        if at < 0:
            at = len(self.buffer) - (0 if final else partial_markers(self.buffer, HEADER_STARTS))
        self.emit_text(self.buffer[:at])
        self.buffer = self.buffer[at:]
        return bool(self.buffer) and self.buffer.startswith(HEADER_STARTS)

    def scan_header(self, final: bool) -> bool:
        at = self.buffer.find(MESSAGE)
        if at < 0:
            if final:  # a header that never opened its body: content as written
                self.emit_text(self.buffer)
                self.buffer = ""
            return False
        self.header = self.buffer[: at + len(MESSAGE)]
        self.buffer = self.buffer[at + len(MESSAGE) :]
        self.kind, self.recipient = message_kind(self.header)
        self.state = "body"
        return True

    def scan_body(self, final: bool) -> bool:
        # A held call body is searched from where the last search could not have matched.
        ends = [(i, m) for m in BODY_STOPS if (i := self.buffer.find(m, self.searched)) >= 0]
        at, marker = min(ends, default=(-1, ""))
        if self.kind == "call":
            return self.scan_call(at, marker, final)
        if at < 0:
            at = len(self.buffer) - (0 if final else partial_markers(self.buffer, BODY_STOPS))
        self.send(self.buffer[:at])
        self.buffer = self.buffer[at:]
        if not marker:
            return False
        self.close(marker)
        return True

    def scan_call(self, at: int, marker: str, final: bool) -> bool:
        """A call's body goes once its end (or the output's) has come."""
        if at < 0 and not final:
            self.searched = max(0, len(self.buffer) - LONGEST_STOP + 1)
            return False
        self.searched = 0
        body = self.buffer if at < 0 else self.buffer[:at]
        self.buffer = self.buffer[len(body) :]
        call = make_call(self.recipient.removeprefix(FUNCTIONS), loads(body))
        if call is None:
            self.emit_text(self.header + body + (marker if marker != START else ""))
        else:
            self.emit_call(call)
        if marker:
            self.close(marker)
        return True

    def send(self, text: str) -> None:
        if self.kind == "reasoning":
            self.out.reasoning += text
        elif text:
            self.emit_text(text)

    def close(self, marker: str) -> None:
        """The body ended at ``marker``: consumed, unless it starts the next message."""
        if marker != START:
            self.buffer = self.buffer[len(marker) :]
        self.state = "between"


def message_kind(header: str) -> tuple[str, str]:
    """What a message's body is (content, reasoning or call) and its recipient."""
    recipient = RECIPIENT.search(header)
    channel = CHANNEL_NAME.search(header)
    to = recipient[1] if recipient else ""
    if to.startswith(FUNCTIONS):
        return "call", to
    if to or (channel and channel[1] == "analysis"):
        return "reasoning", to
    return "content", to


class HarmonySyntax(CallSyntax):
    """An optional analysis message, then one call in the commentary channel:
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.
    ``<|call|>`` is a stop token, so an output holds one call. The markers must be the
    tokenizer's special tokens."""

    markers = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
    single_call = True

    def prelude(self, lark: LarkWriter) -> str:
        analysis = lark_sequence(
            lark.token(CHANNEL), '"analysis"', lark.token(MESSAGE), "harmony_text",
            lark.token(END), lark.token(START), '"assistant"',
        )  # fmt: skip
        return f"({analysis})?"

    def content(self, lark: LarkWriter, answer: str | None) -> str:
        """The answer in the final channel."""
        final = lark_sequence(lark.token(CHANNEL), '"final"', lark.token(MESSAGE))
        return lark_sequence(final, answer or "harmony_text")

    def rules(self, lark: LarkWriter) -> list[str]:
        return ["harmony_text: /(.|\\n)*/"]

    def call(self, lark: LarkWriter, function: dict[str, Any], rule: str) -> list[str]:
        text = lark_sequence(
            lark.token(CHANNEL), lark.text(f"commentary to={FUNCTIONS}{function['name']} "),
            lark.token(CONSTRAIN), '"json"', lark.token(MESSAGE),
            lark.json(parameters_of(function)), lark.token(CALL),
        )  # fmt: skip
        return [f"{rule}: {text}"]


class HarmonyToolParser(ToolParser):
    name = "openai"
    syntax = HarmonySyntax()
    needs_special_tokens = True

    def streamer(self) -> ToolCallStreamer:
        return HarmonyStreamer()
