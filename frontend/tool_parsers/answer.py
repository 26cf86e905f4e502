"""Reading an output that a grammar made either the request's JSON answer or calls: strict tools
beside an answer format (``response_format``, ``text.format``; ``build_grammar`` with an answer).

The grammar checks only the branch it took, and a JSON answer's strings may hold any text,
a convention's call text included (Qwen3-Coder's XML block, Llama 4's ``<|python_start|>[...]``).
The convention's own parser looks for calls anywhere, so it would read such text as calls no
grammar checked, and cut them out of the answer. Here the output's opening decides, as it
decided the grammar's branch (``CallSyntax.opens_calls``): an answer is content, whole and
untouched; calls go to the convention's parser. Harmony needs none of this: its answer sits in
the final channel, which its parser reads as content."""

from __future__ import annotations

from frontend.tool_parsers.core import StreamDelta, ToolCallStreamer, ToolParser
from frontend.tool_parsers.grammar import CallSyntax


class AnswerOrCallsParser(ToolParser):
    """``calls``' convention, for outputs that are an answer or calls, never both."""

    name = "answer_or_calls"

    def __init__(self, calls: ToolParser) -> None:
        if calls.syntax is None or calls.needs_special_tokens:
            raise ValueError(f"parser {calls.name!r} writes no answer-or-calls grammar")
        super().__init__(calls.tools)
        self.calls = calls

    def streamer(self) -> ToolCallStreamer:
        assert self.calls.syntax is not None  # checked at construction
        return AnswerOrCallsStreamer(self.calls.streamer(), self.calls.syntax)


class AnswerOrCallsStreamer(ToolCallStreamer):
    """Holds the output's start until it shows which branch it is, then passes the answer on as
    content and the calls to the convention's streamer."""

    def __init__(self, calls: ToolCallStreamer, syntax: CallSyntax) -> None:
        super().__init__()
        self.call_streamer = calls
        self.syntax = syntax
        self.is_calls: bool | None = None  # None: not known yet

    def scan(self, final: bool) -> None:
        if self.is_calls is None:
            self.is_calls = self.syntax.opens_calls(self.buffer.lstrip())
            if self.is_calls is None and not final:
                return
        text, self.buffer = self.buffer, ""
        if not self.is_calls:
            self.out.content += text
            return
        self.take(self.call_streamer.push(text))
        if final:
            self.take(self.call_streamer.finish())

    def take(self, step: StreamDelta) -> None:
        self.out.after_calls += step.content if self.out.tool_calls else step.after_calls
        self.out.content += step.content
        self.out.tool_calls += step.tool_calls
