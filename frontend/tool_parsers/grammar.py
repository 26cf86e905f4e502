"""Grammars of tool calls: an llguidance Lark grammar whose calls, in a convention's syntax, are to
the request's functions, with arguments that match each function's ``parameters`` schema
(``%json`` sub-grammars). Each convention describes its syntax with a ``CallSyntax``;
``build_grammar`` puts the pieces together, for outputs that are only calls (``tool_choice``
"required" or a named function) or for outputs where calls are optional (strict tools under
``tool_choice`` "auto"): content, then possibly calls. There, the text that starts the calls (the
``trigger``, ``<tool_call>`` in Hermes') commits the output to well-formed calls: free text is one
lazy lexeme that ends at the trigger (llguidance's ``lazy``), since a greedy one could not give
the trigger back once it had taken it. A convention without a trigger (Llama 3's JSON, pythonic
lists) decides at the output's first character, as its parser does.

A marker that the tokenizer has as one added token (``<tool_call>`` in Qwen's, harmony's
``<|channel|>``) is written as that token (``<[id]>``): llguidance treats every added token as
special, so a quoted marker could only be spelled out of ordinary tokens, which the model was
never trained to do."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The JSON layout the grammar allows: fixed separators as the models were trained (", " and ": ")
# and no free whitespace, which a small model can pad with forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAMETERS_DEF = "tandem_parameters"  # where a property's schema finds its function's schema


class LarkWriter:
    """Lark pieces for one tokenizer: literal text, with ``markers`` that are added tokens of
    the tokenizer written as those tokens; ``kept``: the added tokens decoding keeps in the text
    (all but ``special_tokens``), which free text may hold."""

    def __init__(
        self,
        markers: Iterable[str],
        added_tokens: Mapping[str, int],
        special_tokens: Collection[str] = (),
    ) -> None:
        self.kept = {t: i for t, i in added_tokens.items() if t not in special_tokens}
        self.tokens = {m: added_tokens[m] for m in markers if m in added_tokens}
        longest_first = sorted(self.tokens, key=len, reverse=True)
        self.splitter = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def text(self, text: str) -> str:
        """A Lark expression for exactly ``text``; nothing for no text."""
        parts = self.splitter.split(text) if self.tokens else [text]
        return lark_sequence(*(self.piece(p) for p in parts if p))

    def piece(self, part: str) -> str:
        return f"<[{self.tokens[part]}]>" if part in self.tokens else literal(part)

    def token(self, marker: str) -> str:
        """``marker`` as the special token it must be; ValueError when the tokenizer lacks it."""
        if marker not in self.tokens:
            raise ValueError(f"the model's tokenizer has no {marker} token to force a call with")
        return f"<[{self.tokens[marker]}]>"

    @staticmethod
    def json(schema: dict[str, Any]) -> str:
        """A ``%json`` sub-grammar for ``schema`` in the models' compact layout."""
        return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


class CallSyntax(ABC):
    """How one convention writes calls: ``frame`` gives the text before the first call, between
    two calls and after the last; ``call`` the rules of one call to a function; ``prelude`` a
    Lark expression the output may open with before either calls or content (harmony's analysis
    message). ``markers``: the texts that may be added tokens; ``single_call``: the call ends
    generation (its end marker is a stop token), so there is never more than one; ``trigger``:
    the marker that opens the calls after any content (``frame``'s first text starts with it),
    or None when an output is either calls or ``content`` from its first character."""

    markers: tuple[str, ...] = ()
    single_call: bool = False
    trigger: str | None = None
    reserved: tuple[str, ...] = ()  # texts the parser reads as calls wherever they are
    content_start: str = ""  # with no trigger: what calls start with, which content cannot

    def frame(self) -> tuple[str, str, str]:
        return "", "", ""

    def prelude(self, lark: LarkWriter) -> str:
        return ""

    def opens_calls(self, text: str) -> bool | None:
        """For an output the grammar made either an answer or calls (``optional_calls`` with an
        answer, no prelude): whether ``text``, its start after any whitespace, opens the calls
        (True), cannot (False) or may yet (None). The calls open with ``frame``'s first text,
        which no JSON answer starts with."""
        opening = self.frame()[0]
        if text.startswith(opening):
            return True
        return None if opening.startswith(text) else False

    def content(self, lark: LarkWriter, answer: str | None) -> str:
        """With no trigger: a Lark expression for an output that is no call, ``answer`` (the
        request's answer format) where given, else the text its parser reads as content
        (``content_rules``)."""
        return answer or "content_text"

    def rules(self, lark: LarkWriter) -> list[str]:
        """Rules the calls share."""
        return []

    @abstractmethod
    def call(self, lark: LarkWriter, function: dict[str, Any], rule: str) -> list[str]:
        """Lark rules defining ``rule`` as one call to ``function`` (helpers named ``rule_*``)."""


def build_grammar(
    syntax: CallSyntax,
    lark: LarkWriter,
    tools: list[dict[str, Any]],
    forced: str | None,
    parallel: bool,
    optional: bool = False,
    answer: str | None = None,
) -> str:
    """The grammar whose outputs are one call (``parallel``: one or more) written in
    ``syntax``, each to one of ``tools`` (only ``forced``, when given); ``optional``: content,
    then possibly such calls, or with ``answer`` (a Lark expression of the request's answer
    format) either that answer or calls. ValueError when no tool can be called or the syntax
    cannot write a call to one."""
    functions = callable_functions(tools, forced)
    before, between, after = syntax.frame()
    more = f"({lark_sequence(lark.text(between), 'call')})*"
    calls = lark_sequence("call", more if parallel and not syntax.single_call else "")
    calls = lark_sequence(calls, lark.text(after))
    if optional:
        lines = optional_calls(syntax, lark, before, calls, answer)
    else:
        lines = ["start: " + lark_sequence(syntax.prelude(lark), lark.text(before), calls)]
    lines.append("call: " + " | ".join(f"tool_{i}" for i in range(len(functions))))
    lines += syntax.rules(lark)
    for i, function in enumerate(functions):
        lines += syntax.call(lark, function, f"tool_{i}")
    return "\n".join(lines) + "\n"


def optional_calls(
    syntax: CallSyntax, lark: LarkWriter, before: str, calls: str, answer: str | None
) -> list[str]:
    """The start rule (and its helpers) of an output that is content, then possibly calls; with
    ``answer``, either that answer or calls (an answer format leaves no text before calls)."""
    prelude = syntax.prelude(lark)
    trigger = syntax.trigger
    if trigger is None:
        if answer is not None and syntax.content_start == "{":
            raise ValueError("a JSON answer cannot be told from a call in this convention's JSON")
        block = lark_sequence(lark.text(before), calls)
        either = f"({block} | {syntax.content(lark, answer)})"
        return [f"start: {lark_sequence(prelude, either)}", *content_rules(syntax, lark)]
    if not before.startswith(trigger):
        raise AssertionError(f"the calls of {type(syntax).__name__} do not start with its trigger")
    opening = lark.token(trigger) if trigger in lark.tokens else literal(trigger)
    rest = lark_sequence(lark.text(before[len(trigger) :]), calls)
    if answer is not None:
        return [f"start: {lark_sequence(prelude, f'({answer} | {opening} {rest})')}"]
    if trigger in lark.tokens:  # a token that free text cannot hold: text, then the token
        either = f"(free_text | free_text {opening} {rest})"
        return [f"start: {lark_sequence(prelude, either)}", *free_text_rules(syntax, lark)]
    # Text, then the trigger, in one lazy lexeme: it ends where the trigger does (a greedy one
    # would have taken the trigger's first characters as text, and a lexer gives nothing back).
    others = other_tokens(syntax, lark)
    before_trigger = f"(FREE_TEXT {others})* text_and_trigger" if others else "text_and_trigger"
    return [
        f"start: {lark_sequence(prelude, f'(free_text | text_to_trigger {rest})')}",
        *free_text_rules(syntax, lark),
        f"text_to_trigger: {before_trigger}",
        f"text_and_trigger[lazy]: /(?s:.*)/ {literal(trigger)}",
    ]


# Python's \s (the parsers') also takes these separators; llguidance's (Rust's) does not.
SPACE = "\\s\\x1c-\\x1f"


def free_text_rules(syntax: CallSyntax, lark: LarkWriter) -> list[str]:
    """``free_text``: any text and added tokens, none of them a text the parser would read as a
    call (``syntax.trigger`` and ``reserved``, as text or as the token it is)."""
    return [f"free_text: {then_free_text('FREE_TEXT', syntax, lark)}", free_text_terminal(syntax)]


def content_rules(syntax: CallSyntax, lark: LarkWriter) -> list[str]:
    """For a syntax without a trigger, whose parser reads an output as calls when its first
    character after whitespace is ``content_start``: ``content_text``, text that does not so
    start, then free text."""
    if not syntax.content_start:
        return []
    head = f"/[{SPACE}]*([^{SPACE}{re.escape(syntax.content_start)}](?s:.*))?/"
    return [
        f"content_text: {then_free_text('CONTENT_HEAD', syntax, lark)}",
        f"CONTENT_HEAD: {without_reserved(head, syntax)}",
        free_text_terminal(syntax),
    ]


def then_free_text(first: str, syntax: CallSyntax, lark: LarkWriter) -> str:
    """``first``, then free text on either side of each added token it may hold."""
    others = other_tokens(syntax, lark)
    return f"{first} ({others} FREE_TEXT)*" if others else first


def free_text_terminal(syntax: CallSyntax) -> str:
    return f"FREE_TEXT: {without_reserved('/(?s:.*)/', syntax)}"


def without_reserved(regex: str, syntax: CallSyntax) -> str:
    """A terminal: ``regex`` holding none of the texts the parser reads as calls."""
    reserved = [t for t in (syntax.trigger, *syntax.reserved) if t]
    if not reserved:
        return regex
    return f"{regex} & ~/(?s:.*)({'|'.join(map(re.escape, reserved))})(?s:.*)/"


def other_tokens(syntax: CallSyntax, lark: LarkWriter) -> str:
    """The tokenizer's added tokens that free text may hold (a model's ``<think>``): those that
    decoding keeps (a skipped one would vanish between two texts the parser then reads as one),
    but the syntax's markers and reserved texts; nothing where there are none."""
    taken = {*syntax.markers, *syntax.reserved, syntax.trigger}
    ids = sorted(i for text, i in lark.kept.items() if text not in taken)
    return f"<[{','.join(map(str, ids))}]>" if ids else ""


@dataclass(frozen=True)
class JsonEnvelope(CallSyntax):
    """Calls as ``{"name": ..., "<arguments_key>": {...}}`` objects, framed by fixed text."""

    arguments_key: str
    before: str  # before the first call
    between: str  # between two calls
    after: str  # after the last call
    markers: tuple[str, ...] = ()
    trigger: str | None = None
    reserved: tuple[str, ...] = ()
    content_start: str = ""

    def frame(self) -> tuple[str, str, str]:
        return self.before, self.between, self.after

    def call(self, lark: LarkWriter, function: dict[str, Any], rule: str) -> list[str]:
        return [f"{rule}: {lark.json(call_schema(function, self.arguments_key))}"]


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


def no_parameters() -> dict[str, Any]:
    """The arguments schema of a function without ``parameters`` (or null): OpenAI's "Omitting
    parameters defines a function with an empty parameter list"; a fresh dict each call."""
    return {"type": "object", "properties": {}, "additionalProperties": False}


def any_parameters() -> dict[str, Any]:
    """An arguments schema of any object (JSON Schema's ``{}`` for an object)."""
    return {"type": "object"}


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    """The function's arguments schema: none at all where it gives no ``parameters`` (or null),
    an object of anything for ``{}`` (JSON Schema's "anything")."""
    parameters = function.get("parameters")
    if parameters is None:
        return no_parameters()
    return parameters if isinstance(parameters, dict) and parameters else any_parameters()


def takes_no_arguments(parameters: dict[str, Any]) -> bool:
    """Whether an arguments schema admits only the empty object: no properties, none by
    pattern, and no others (``additionalProperties`` false), as a function without
    ``parameters`` has."""
    if parameters.get("properties") or parameters.get("patternProperties"):
        return False
    return parameters.get("additionalProperties") is False


def call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """A JSON schema for a call to ``function``: its name as a constant, so that the name and the
    arguments' schema agree."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments_key: rebase_refs(parameters_of(function), f"#/properties/{arguments_key}"),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def property_schema(parameters: dict[str, Any], name: str) -> dict[str, Any]:
    """The schema of one argument, standing alone: where it refers into the function's schema
    ("#/$defs/x", "#"), that schema comes along under ``$defs``."""
    schema = parameters.get("properties", {}).get(name)
    schema = schema if isinstance(schema, dict) else {}
    if not has_ref(schema):
        return schema
    base = f"#/$defs/{PARAMETERS_DEF}"
    return {**rebase_refs(schema, base), "$defs": {PARAMETERS_DEF: rebase_refs(parameters, base)}}


def has_ref(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(map(has_ref, schema))
    return isinstance(schema, dict) and ("$ref" in schema or any(map(has_ref, schema.values())))


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
