"""Tool calls in a model's output: the parsers that read them back (whole or streamed) and the
grammar that makes a model write them.

Output conventions, chosen by ``--tool-call-parser`` (vLLM's names; our own code) or detected
from the chat template (``detect_parser``); each format as the model's published chat template
or format guide writes it:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): any number of blocks
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; text outside them is content.
- ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls joined by ``; ``; an output that does not
  start with ``{`` is content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.
- ``qwen3_coder`` (also ``qwen3_xml``; Qwen3-Coder's template): content, then blocks
  ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n
  </tool_call>``. A value is text, read as the JSON type the request's tool schema declares for
  that parameter (frontend/tool_parsers/qwen3_coder.py), so this parser needs the tools.
- ``pythonic`` (Llama 3.2's pythonic template) and ``llama4_pythonic`` (Llama 4's, which may
  wrap the list in ``<|python_start|>``/``<|python_end|>``): the output is a Python list of
  calls with literal keyword arguments, ``[get_weather(city="Paris"), noop()]``, parsed by
  ``ast`` and never evaluated; an output that does not start with one is content (Llama 4 may
  also put text before ``<|python_start|>``).
- ``deepseek_v3`` (DeepSeek-V3, R1-0528): content, then ``<｜tool▁calls▁begin｜>`` and blocks
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` a
  line apart, then ``<｜tool▁calls▁end｜>`` (full-width bars, "▁" for spaces, as in DeepSeek's
  tokenizer). ``deepseek_v31`` (DeepSeek-V3.1): blocks
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` with nothing between them.
- ``openai`` (gpt-oss, the harmony format): messages ``<|start|>assistant<|channel|>C<|message|>
  ...<|end|>`` (the first one starts at ``<|channel|>``); a message to ``functions.NAME``
  (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``) is a
  call, the ``final`` channel and commentary preambles are content, the ``analysis`` channel is
  the model's thinking (``StreamDelta.reasoning``; ``split_harmony`` splits a whole output).
  Its markers are special tokens, so the text keeps them (``needs_special_tokens``: the chat
  route decodes with special tokens for it).

One state machine per convention does both jobs: ``extract`` runs the streamer over the whole text
at once, so the calls and content a client reassembles from a stream are, by construction, the
ones a non-streamed response carries, for every way the text may be chunked. The streamer sends a
call (id, name and arguments in one fragment) once the call's text has closed and proved
to be a call; until then the candidate text is held back, as is any tail of content that could be
the start of a marker (``<tool_c``). Incremental argument streaming would have to send text that a
later malformed or truncated call cannot take back, so it is not done.

Rules every convention shares: a candidate that is not a well-formed call (bad JSON, no name,
arguments not an object, Python that is not literal) stays in the content verbatim; text
before, between or after calls that is only whitespace is dropped; a call cut off after its
arguments (a stop string, max_tokens) still counts; arguments are re-serialized compactly
(``{"a":1}``, non-ASCII kept), the form OpenAI sends.

Each convention also writes a grammar of its calls (``tool_call_grammar``, frontend/tools.py uses
it for ``tool_choice`` "required" or a named function, and for strict tools under "auto";
frontend/tool_parsers/grammar.py and each convention's ``CallSyntax``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from frontend.tool_parsers.answer import AnswerOrCallsParser
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
from frontend.tool_parsers.deepseek import (
    CALLS_BEGIN,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
)
from frontend.tool_parsers.grammar import LarkWriter, build_grammar
from frontend.tool_parsers.harmony import HarmonyParts, HarmonyToolParser, split_harmony
from frontend.tool_parsers.json_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)
from frontend.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from frontend.tool_parsers.qwen3_coder import Qwen3CoderToolParser, Qwen3XmlToolParser

__all__ = [
    "PARSERS",
    "AnswerOrCallsParser",
    "HarmonyParts",
    "ParsedMessage",
    "StreamDelta",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "assemble",
    "detect_parser",
    "get_parser",
    "new_call_id",
    "split_harmony",
    "tool_call_grammar",
]

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        Qwen3CoderToolParser,
        Qwen3XmlToolParser,
        PythonicToolParser,
        Llama4PythonicToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        HarmonyToolParser,
    )
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
    if "<|channel|>" in template:  # gpt-oss: harmony messages
        return "openai"
    if CALLS_BEGIN in template:  # V3 fences the arguments in ```json; V3.1 does not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template:  # the instruction of Llama 3.2's and Llama 4's templates
        return "llama4_pythonic" if "<|header_start|>" in template else "pythonic"
    if LLAMA3_SIGNS.search(template):
        return "llama3_json"
    return None


def tool_call_grammar(
    parser: str,
    tools: Tools,
    forced: str | None,
    parallel: bool,
    added_tokens: Mapping[str, int] | None = None,
    optional: bool = False,
    answer: str | None = None,
    special_tokens: Collection[str] = (),
) -> str:
    """An llguidance Lark grammar whose only outputs are one call (``parallel``: one or more) in
    ``parser``'s syntax, each to one of ``tools`` (only ``forced``, when given) with arguments
    matching that function's ``parameters`` schema; ``optional``: content, then possibly such
    calls (what the parser would read as a call is one), or with ``answer`` (a Lark expression
    of the request's answer format) that answer or calls. ``added_tokens``: the tokenizer's added
    tokens (text to id), so markers are written as the tokens they are; ``special_tokens``: those
    that decoding skips, which free text may not hold. ValueError for a parser
    without a grammar, when no tool can be called, or when the syntax cannot write the call."""
    syntax = PARSERS[parser].syntax if parser in PARSERS else None
    if syntax is None:
        known = ", ".join(name for name, p in PARSERS.items() if p.syntax is not None)
        raise ValueError(f"no tool-call grammar for parser {parser!r}; known: {known}")
    lark = LarkWriter(syntax.markers, added_tokens or {}, special_tokens)
    return build_grammar(syntax, lark, tools, forced, parallel, optional, answer)
