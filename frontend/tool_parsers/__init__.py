"""Tool calls in a model's output: the parsers that read them back (whole or streamed) and the
grammar that makes a model write them.

Output conventions, chosen by ``--tool-call-parser`` (vLLM's names; our own code):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): any number of blocks
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; text outside them is content.
- ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls joined by ``; ``; an output that does not
  start with ``{`` is content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.

One state machine per convention does both jobs: ``extract`` runs the streamer over the whole text
at once, so the calls and content a client reassembles from a stream are, by construction, the
ones a non-streamed response carries, for every way the text may be chunked. The streamer sends a
call (id and name, then its arguments in one fragment) once the call's text has closed and proved
to be a call; until then the candidate text is held back, as is any tail of content that could be
the start of a marker (``<tool_c``). Incremental argument streaming would have to send text that a
later malformed or truncated call cannot take back, so it is not done.

Rules every convention shares: a candidate that is not a well-formed call (bad JSON, no name,
arguments not an object) stays in the content verbatim; text before, between or after calls that
is only whitespace is dropped; arguments are re-serialized compactly (``{"a":1}``, non-ASCII
kept), the form OpenAI sends.

Each convention also writes a grammar of its calls (``tool_call_grammar``, frontend/tools.py uses
it for ``tool_choice`` "required" or a named function; frontend/tool_parsers/grammar.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from frontend.tool_parsers.core import (
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    Tools,
    assemble,
    new_call_id,
)
from frontend.tool_parsers.grammar import build_grammar
from frontend.tool_parsers.json_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)

__all__ = [
    "PARSERS",
    "ParsedMessage",
    "StreamDelta",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "assemble",
    "detect_parser",
    "get_parser",
    "new_call_id",
    "tool_call_grammar",
]

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_parser(name: str, tools: Tools | None = None) -> ToolParser:
    """The parser named ``name`` for a request with ``tools``; ValueError listing the known
    names otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name](tools)


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


def tool_call_grammar(
    parser: str,
    tools: Tools,
    forced: str | None,
    parallel: bool,
    added_tokens: Mapping[str, int] | None = None,
) -> str:
    """An llguidance Lark grammar whose only outputs are one call (``parallel``: one or more) in
    ``parser``'s syntax, each to one of ``tools`` (only ``forced``, when given) with arguments
    matching that function's ``parameters`` schema. ``added_tokens``: the tokenizer's added
    tokens (text to id), so markers are written as the tokens they are. ValueError for a parser
    without a grammar, when no tool can be called, or when the syntax cannot write the call."""
    syntax = PARSERS[parser].syntax if parser in PARSERS else None
    if syntax is None:
        known = ", ".join(name for name, p in PARSERS.items() if p.syntax is not None)
        raise ValueError(f"no tool-call grammar for parser {parser!r}; known: {known}")
    return build_grammar(syntax, tools, forced, parallel, added_tokens)
