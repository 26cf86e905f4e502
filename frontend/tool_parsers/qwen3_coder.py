"""Qwen3-Coder's XML calls (``qwen3_coder``; format: frontend/tool_parsers/__init__.py).

A parameter's value is text; it becomes the JSON type the function's schema declares for that
parameter (integer, number, boolean, object, array, null), and stays a string when the schema
declares a string, declares nothing the text can be, or does not know the parameter."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from frontend.tool_parsers.core import (
    BlockStreamer,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    Tools,
    make_call,
    reject_constant,
)
from frontend.tool_parsers.grammar import (
    CallSyntax,
    LarkWriter,
    lark_sequence,
    literal,
    parameters_of,
    property_schema,
    takes_no_arguments,
)

FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
FUNCTION_CLOSE = re.compile(r"\s*</function>")
PARAMETER_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>")
PARAMETER_CLOSE = "</parameter>"
VALUE_END = "\n</parameter>\n"  # how the template closes a value, as the grammar writes it
MAX_REF_HOPS = 8
MISSING = object()  # a value that is not of the type tried


class Qwen3CoderStreamer(BlockStreamer):
    marker = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.schemas = schemas  # each function's parameters schema, by name

    def block_calls(self, body: str) -> list[ToolCall] | None:
        return xml_calls(body, self.schemas)


def xml_calls(body: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """The calls of one block: one or more ``<function=...>`` elements and nothing else."""
    calls, pos = [], 0
    while opened := FUNCTION_OPEN.match(body, pos):
        name = opened[1].strip()
        parsed = xml_arguments(body, opened.end(), schemas.get(name, {}))
        call = make_call(name, parsed[0]) if parsed else None
        if call is None:
            return None
        calls.append(call)
        pos = parsed[1]
    return calls if calls and not body[pos:].strip() else None


def xml_arguments(body: str, pos: int, schema: dict[str, Any]) -> tuple[dict, int] | None:
    """The parameters from ``pos`` to ``</function>``, and where that ends; None if malformed.
    A value ends at the first ``</parameter>``, so a value may hold ``</function>``."""
    arguments: dict[str, Any] = {}
    while not (closed := FUNCTION_CLOSE.match(body, pos)):
        opened = PARAMETER_OPEN.match(body, pos)
        end = body.find(PARAMETER_CLOSE, opened.end()) if opened else -1
        if end < 0 or not opened[1].strip():
            return None
        key = opened[1].strip()
        arguments[key] = typed_value(template_value(body[opened.end() : end]), schema, key)
        pos = end + len(PARAMETER_CLOSE)
    return arguments, closed.end()


def template_value(text: str) -> str:
    """The value as written: the template puts it on lines of its own (one newline after the
    opening tag, one before the closing one)."""
    return text.removeprefix("\n").removesuffix("\n")


def typed_value(text: str, schema: dict[str, Any], key: str) -> Any:
    """``text`` as the first of the parameter's declared types it can be; the text itself
    otherwise."""
    for kind in declared_types(parameter_schema(schema, key)):
        value = as_type(text, kind)
        if value is not MISSING:
            return value
    return text


def parameter_schema(schema: dict[str, Any], key: str) -> dict[str, Any]:
    """The schema of parameter ``key``, following local ``$ref``s into the function's schema."""
    properties = schema.get("properties")
    found = properties.get(key) if isinstance(properties, dict) else None
    for _ in range(MAX_REF_HOPS):
        if not isinstance(found, dict) or not isinstance(found.get("$ref"), str):
            break
        found = resolve_pointer(schema, found["$ref"])
    return found if isinstance(found, dict) else {}


def resolve_pointer(schema: dict[str, Any], ref: str) -> Any:
    """The part of ``schema`` a local ref ("#/$defs/x") names; None when there is none."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def declared_types(schema: dict[str, Any]) -> list[str]:
    """The JSON types a schema names ("type": a name or a list), strings last: a text is
    always a string, so the other types are tried first."""
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    return sorted((k for k in kinds if isinstance(k, str)), key=lambda k: k == "string")


# What a parsed JSON value must be to count as each type (bool is an int in Python).
JSON_KINDS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
# The template writes values with Jinja's ``string`` filter: Python's True, False and None.
WORDS = {"boolean": {"true": True, "false": False}, "null": {"null": None, "none": None}}


def as_type(text: str, kind: str) -> Any:
    """``text`` as a value of JSON type ``kind``; MISSING when it is not one."""
    if kind == "string":
        return text
    if kind in WORDS:
        return WORDS[kind].get(text.strip().lower(), MISSING)
    value = json_value(text.strip())
    fits = JSON_KINDS.get(kind)
    return value if value is not MISSING and fits is not None and fits(value) else MISSING


def json_value(text: str) -> Any:
    """The JSON value of ``text``, MISSING when it is not one (``loads`` cannot tell null
    apart)."""
    try:
        return json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return MISSING


class XmlSyntax(CallSyntax):
    """``<tool_call>\\n<function=NAME>\\n``, each parameter as ``<parameter=KEY>\\nVALUE\\n
    </parameter>\\n`` in the schema's order (required ones always, others optionally), then
    ``</function>\\n</tool_call>``; calls one per line. A value is JSON (``%json``) for a
    parameter of a non-string type, one of the literals for a string enum, and otherwise any
    text up to the closing tag."""

    markers = ("<tool_call>", "</tool_call>")
    trigger = "<tool_call>"

    def frame(self) -> tuple[str, str, str]:
        return "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"

    def rules(self, lark: LarkWriter) -> list[str]:
        return [
            # A value ends at the first closing tag, for the parser as for the grammar.
            f"xml_text[stop={literal(VALUE_END)}]: XML_VALUE",
            "XML_VALUE: /(?s:.*)/ & ~/(?s:.*)<\\/parameter>(?s:.*)/",
            "xml_any: " + literal("<parameter=") + ' /[^<>=\\n]+/ ">\\n" xml_text',
        ]

    def call(self, lark: LarkWriter, function: dict[str, Any], rule: str) -> list[str]:
        parameters = parameters_of(function)
        properties = parameters.get("properties")
        head = lark.text(f"<function={function['name']}>\n")
        tail = literal("</function>")
        if takes_no_arguments(parameters):
            return [f"{rule}: {lark_sequence(head, tail)}"]
        if not isinstance(properties, dict) or not properties:  # any parameters, as text
            return [f"{rule}: {lark_sequence(head, 'xml_any*', tail)}"]
        required = set(parameters.get("required") or [])
        lines, parts = [], []
        for j, key in enumerate(properties):
            if not isinstance(key, str) or not key or any(c in key for c in "<>\n"):
                raise ValueError(f"parameter name {key!r} cannot be written as an XML tag")
            opening = literal(f"<parameter={key}>\n")
            lines.append(f"{rule}_{j}: {opening} {xml_value_rule(parameters, key)}")
            parts.append(f"{rule}_{j}" + ("" if key in required else "?"))
        return [f"{rule}: {lark_sequence(head, *parts, tail)}", *lines]


def xml_value_rule(parameters: dict[str, Any], key: str) -> str:
    """The Lark expression of one parameter's value and its closing tag."""
    schema = parameter_schema(parameters, key)
    kinds = declared_types(schema)
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if kinds and "string" not in kinds:
        return f"{LarkWriter.json(property_schema(parameters, key))} {literal(VALUE_END)}"
    if isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices):
        return f"({' | '.join(map(literal, choices))}) {literal(VALUE_END)}"
    return "xml_text"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    syntax = XmlSyntax()

    def __init__(self, tools: Tools | None = None) -> None:
        super().__init__(tools)
        functions = [t.get("function") or {} for t in self.tools]
        self.schemas = {f["name"]: parameters_of(f) for f in functions if "name" in f}

    def streamer(self) -> ToolCallStreamer:
        return Qwen3CoderStreamer(self.schemas)


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    """vLLM's other name for the same format."""

    name = "qwen3_xml"
