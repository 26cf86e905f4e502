"""Tool calling on /v1/chat/completions: which template renders the tools, which parser reads the
calls back, and the grammar that forces a call when the request demands one.

Tools reach the model through a chat template (transformers' ``apply_chat_template(tools=...)``).
At start-up ``tool_support`` looks at the served template: if it renders tools, the parser is
``--tool-call-parser`` or the one its syntax names (frontend/tool_parsers ``detect_parser``);
if it ignores them (SmolLM2's does) but speaks ChatML, requests with tools are rendered with the
packaged ChatML template in the Hermes convention (frontend/chat_templates/chatml_tools.jinja) and
read with the hermes parser; otherwise a request with tools is a 400, never a silent drop. A
parser whose markers are special tokens (harmony's) has the output decoded keeping them.

Per request (``plan_tools``): ``tool_choice`` "none" leaves the tools out of the prompt and the
output unparsed; "auto" renders them and parses whatever calls come; "required" and a named
function also constrain generation by a grammar (``tool_call_grammar``), so the output is always
one or more well-formed calls whose arguments match the function's ``parameters`` schema; a call
the parser's syntax cannot write (a pythonic parameter name that is no Python identifier) is a
400 on ``tool_choice``, never a fall back to "auto". Under "auto", a tool with ``strict: true``
(OpenAI's promise that a call's arguments match its schema) makes the grammar optional-calls:
content, then possibly calls, where whatever the parser would read as a call is a well-formed
one, to a strict tool with arguments its schema takes (to another tool with any object).
Beside a JSON answer format (strict tools or not) the grammar makes the output that answer or
calls, and its opening tells the parser which (frontend/tool_parsers/answer.py): the parser
alone would cut call text out of an answer's strings. Another kind of format beside tools the
model may call is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_core.grammar import JSON_OPTIONS
from frontend.errors import bad_request
from frontend.openai_schemas import ChatCompletionRequest, NamedToolChoice
from frontend.tool_parsers import (
    AnswerOrCallsParser,
    ToolParser,
    detect_parser,
    get_parser,
    tool_call_grammar,
)
from frontend.tool_parsers.grammar import any_parameters, no_parameters
from protocol.messages import Constraint, ConstraintKind

CHATML_TOOLS_TEMPLATE = Path(__file__).parent / "chat_templates" / "chatml_tools.jinja"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "tandem_probe", "parameters": {"type": "object", "properties": {}}},
}


@dataclass(frozen=True)
class ToolSupport:
    """How this server does tools: the parser's name; when the model's own template ignores
    tools, the template that renders requests with tools instead; the tokenizer's added tokens
    (text to id), which a grammar writes markers as, and which of them are special (decoding
    skips them, so a grammar's free text may not hold them: the parser would not see them)."""

    parser: str
    template: str | None = None
    added_tokens: Mapping[str, int] = field(default_factory=dict, compare=False)
    special_tokens: frozenset[str] = field(default_factory=frozenset, compare=False)
    # The server's template writes image parts (as the model's own template does); False for a
    # vision model whose own template's image marker could not be read.
    writes_images: bool = True


def tool_support(
    hf_tokenizer: Any, parser_flag: str | None, takes_images: bool = False
) -> tuple[ToolSupport | None, str]:
    """The served model's tool support, and a sentence saying what was chosen (or why none).
    ``takes_images``: a vision-language model, whose image parts the packaged template writes
    as its own template does."""
    template = hf_tokenizer.chat_template or ""
    added = hf_tokenizer.get_added_vocab()
    special = frozenset(t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special)
    if renders_tools(hf_tokenizer):
        name = parser_flag or detect_parser(template)
        if name is None:
            return None, (
                "the chat template renders tools but names no known call syntax: start with "
                "--tool-call-parser"
            )
        get_parser(name)  # ValueError for an unknown name
        return ToolSupport(name, None, added, special), f"the model's chat template, parser {name}"
    if "<|im_start|>" in template and parser_flag in (None, "hermes"):
        packaged = CHATML_TOOLS_TEMPLATE.read_text()
        marker = image_marker_text(hf_tokenizer) if takes_images else None
        if marker is not None:  # a JSON string is a Jinja string literal
            packaged = f"{{%- set image_marker = {json.dumps(marker)} -%}}\n{packaged}"
        writes_images = marker is not None or not takes_images
        support = ToolSupport("hermes", packaged, added, special, writes_images=writes_images)
        how = "the packaged ChatML tool template, parser hermes"
        if not writes_images:
            how += " (images beside tools refused: the model's image marker could not be read)"
        return support, how
    return None, "the chat template does not render tools"


def image_marker_text(hf_tokenizer: Any) -> str | None:
    """What the model's own template writes for an image part: the text between two text
    parts around one image. None where it writes nothing there or fails."""
    before, after = "\ue000tandem-before\ue000", "\ue000tandem-after\ue000"
    parts = [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]
    try:
        text = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False
        )
    except Exception:  # a template that takes no parts
        return None
    start, end = text.find(before), text.find(after)
    if start < 0 or end < 0:
        return None
    return text[start + len(before) : end] or None


def renders_tools(hf_tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts tools into the prompt."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = hf_tokenizer.apply_chat_template(messages, tokenize=False)
        with_tool = hf_tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False)
    except Exception:  # no template, or one that fails on tools
        return False
    return plain != with_tool


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools: what the template gets, the parser for the output (None: leave the
    output as text) and the grammar that forces a call (None: the model chooses)."""

    tools: list[dict[str, Any]] | None
    template: str | None
    parser: ToolParser | None
    constraint: Constraint | None


NO_TOOLS = ToolPlan(None, None, None, None)


def plan_tools(
    req: ChatCompletionRequest, support: ToolSupport | None, answer: Constraint | None = None
) -> ToolPlan:
    """The request's ToolPlan; a 400 when it asks for tools this server cannot do. ``answer``:
    the request's structured-output constraint, which a grammar of the calls must take in."""
    if not req.tools:
        return history_plan(req, support)
    if support is None:
        raise bad_request("tools are not supported by this model's chat template", "tools")
    choice = req.tool_choice or "auto"
    if choice == "none":
        return history_plan(req, support)
    tools = [with_parameters_stated(t.model_dump(exclude_none=True)) for t in req.tools]
    parser = get_parser(support.parser, tools)
    constraint = None
    if choice == "required" or isinstance(choice, NamedToolChoice):
        if answer is not None:
            raise bad_request(
                "tool_choice forces a tool call: it cannot go with another structured-output "
                "constraint",
                "tool_choice",
            )
        constraint = forcing_constraint(req, support, tools)
    elif answer is not None or any(t.function.strict for t in req.tools):
        constraint = optional_calls_constraint(req, support, tools, answer)
        if answer is not None and not parser.needs_special_tokens:  # harmony's answer: a channel
            parser = AnswerOrCallsParser(parser)
    return ToolPlan(tools, support.template, parser, constraint)


def history_plan(req: ChatCompletionRequest, support: ToolSupport | None) -> ToolPlan:
    """A turn with no tools to call: the model's own template, unless earlier turns called tools
    and only the server's tool template renders those calls and their results (an agent's last
    turn, sent without tools to get an answer, lost them: the model's template drops them)."""
    if support is None or support.template is None:
        return NO_TOOLS
    if not any(m.tool_calls or m.role == "tool" for m in req.messages):
        return NO_TOOLS
    return ToolPlan(None, support.template, None, None)


def forcing_constraint(
    req: ChatCompletionRequest, support: ToolSupport, tools: list[dict[str, Any]]
) -> Constraint:
    """The grammar constraint of ``tool_choice`` "required" or a named function; a 400 when the
    parser's syntax cannot write such a call (never a silent fall back to "auto")."""
    choice = req.tool_choice
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
    parallel = req.parallel_tool_calls is not False and forced is None
    try:
        grammar = tool_call_grammar(support.parser, tools, forced, parallel, support.added_tokens)
    except ValueError as exc:
        raise bad_request(f"tool_choice cannot be honoured: {exc}", "tool_choice") from None
    return Constraint(ConstraintKind.GRAMMAR, grammar)


def optional_calls_constraint(
    req: ChatCompletionRequest,
    support: ToolSupport,
    tools: list[dict[str, Any]],
    answer: Constraint | None,
) -> Constraint:
    """The grammar of ``tool_choice`` "auto" with strict tools: content, then possibly calls;
    with an ``answer`` format (strict tools or not): that answer, or calls. A non-strict tool's
    arguments are any object. A 400 on ``tools`` when the parser's syntax cannot write such
    calls."""
    parallel = req.parallel_tool_calls is not False
    loose = [t if t["function"].get("strict") else with_any_arguments(t) for t in tools]
    try:
        answer_lark = None if answer is None else answer_expression(answer)
        grammar = tool_call_grammar(
            support.parser, loose, None, parallel, support.added_tokens, True, answer_lark,
            support.special_tokens,
        )  # fmt: skip
    except ValueError as exc:
        raise bad_request(f"these tools cannot be honoured: {exc}", "tools") from None
    return Constraint(ConstraintKind.GRAMMAR, grammar)


def answer_expression(answer: Constraint) -> str:
    """The Lark expression of an answer format beside tools: a JSON schema or any JSON object
    (what OpenAI's response_format and text.format give), laid out as the engine lays out a
    format alone; ValueError for another kind of constraint."""
    if answer.kind == ConstraintKind.JSON_OBJECT:
        schema: Any = {"type": "object"}
    elif answer.kind == ConstraintKind.JSON_SCHEMA:
        schema = json.loads(answer.spec)  # an object: the format's own check refused others
    else:
        raise ValueError(
            "beside tools the model may call, an answer format is a JSON schema or "
            'json_object (send tool_choice "none" to use another)'
        )
    own = schema.get("x-guidance")
    layout = {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
    return "%json " + json.dumps({**schema, "x-guidance": layout})


def with_any_arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """``tool`` with an arguments schema of any object (a tool that is not strict)."""
    return {**tool, "function": {**tool["function"], "parameters": any_parameters()}}


def with_parameters_stated(tool: dict[str, Any]) -> dict[str, Any]:
    """``tool`` with its arguments schema written out where it gave none (or null): the chat
    template shows the model a function of no arguments, and a template that renders
    ``parameters | tojson`` does not fail on a missing key (DeepSeek-V3.1's)."""
    function = tool["function"]
    if function.get("parameters") is not None:
        return tool
    return {**tool, "function": {**function, "parameters": no_parameters()}}
