"""Pythonic calls, a Python list of calls with literal keyword arguments (``pythonic``,
``llama4_pythonic``; format: frontend/tool_parsers/__init__.py).

The list is parsed by ``ast`` and each keyword's value read by ``ast.literal_eval``: nothing the
model wrote is ever evaluated. JSON's ``true``, ``false`` and ``null`` are read as Python's
``True``, ``False`` and ``None`` (models trained on JSON write them, and the grammar does)."""

from __future__ import annotations

import ast
import math
import re
import warnings
from typing import Any

from frontend.tool_parsers.core import (
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    make_call,
    partial_marker,
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

PYTHON_START = "<|python_start|>"  # Llama 4 wraps its calls in these (special tokens)
PYTHON_END = "<|python_end|>"
CALLS_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # text that can only go on as calls
MAY_BE_CALLS = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")  # text that may still become that
JSON_NAMES = {"true": True, "false": False, "null": None}
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
CALLS_OPENING = re.compile(r"\[[A-Za-z_]\w*\(")  # how the grammar's list of calls opens
OPENING_SO_FAR = re.compile(r"(\[([A-Za-z_]\w*)?)?")


class PythonEnd:
    """Where a Python list, arriving piece by piece, closes: counts brackets outside string
    literals (either quote, tripled or not, with backslash escapes) and resumes where it
    stopped. Whether the text is valid Python is ``ast``'s business."""

    OUTSIDE = re.compile(r"""[\[\](){}'"]""")

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.quote = ""  # the open string's delimiter: ' " ''' or \"\"\"

    def find(self, text: str) -> int:
        """Index in ``text`` just past the closing bracket, -1 while the list is open."""
        while True:
            moved = self.in_string(text) if self.quote else self.outside(text)
            if moved is not None:
                return moved

    def in_string(self, text: str) -> int | None:
        at = min(
            (i for i in (text.find("\\", self.pos), text.find(self.quote, self.pos)) if i >= 0),
            default=-1,
        )
        if at < 0:  # a closing triple quote may have begun in the last characters
            self.pos = max(self.pos, len(text) - len(self.quote) + 1)
            return -1
        if text[at] == "\\" and at + 1 == len(text):  # the escaped character is yet to come
            self.pos = at
            return -1
        self.pos = at + 2 if text[at] == "\\" else at + len(self.quote)
        self.quote = "" if text[at] != "\\" else self.quote
        return None

    def outside(self, text: str) -> int | None:
        match = self.OUTSIDE.search(text, self.pos)
        if match is None:
            self.pos = len(text)
            return -1
        char, at = match[0], match.start()
        if char in "'\"":
            if len(text) < at + 3:  # '' or a tripled quote: wait to see which
                self.pos = at
                return -1
            self.quote = char * 3 if text.startswith(char * 3, at) else char
            self.pos = at + len(self.quote)
            return None
        self.pos = at + 1
        self.depth += 1 if char in "[({" else -1
        return self.pos if self.depth == 0 else None


def pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls of a Python list of calls, None unless it is a non-empty list in which every
    element is ``name(key=literal, ...)``."""
    try:
        with warnings.catch_warnings():  # an invalid escape ("\d") is a SyntaxWarning
            warnings.simplefilter("ignore")
            tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [python_call(node) for node in tree.body.elts]
    return calls if all(calls) else None


def python_call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(k.arg is None for k in node.keywords):  # **kwargs
        return None
    try:
        arguments = {k.arg: literal_value(k.value) for k in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    return make_call(node.func.id, arguments)


def literal_value(node: ast.expr) -> Any:
    """The JSON value of a literal expression; ValueError for anything else (names, calls,
    operators other than a sign, sets, bytes, complex numbers, NaN and infinities)."""
    return json_compatible(ast.literal_eval(JsonNames().visit(node)))


class JsonNames(ast.NodeTransformer):
    """``true``, ``false`` and ``null`` as the constants they mean; other names stay (and then
    fail ``literal_eval``)."""

    def visit_Name(self, node: ast.Name) -> ast.expr:  # noqa: N802 (ast's visitor naming)
        if node.id in JSON_NAMES:
            return ast.copy_location(ast.Constant(JSON_NAMES[node.id]), node)
        return node


def json_compatible(value: Any) -> Any:
    """``value`` with tuples as lists; ValueError if it holds what JSON cannot say."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, list | tuple):
        return [json_compatible(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: json_compatible(v) for k, v in value.items()}
    raise ValueError(f"not a JSON value: {type(value).__name__}")


class PythonicStreamer(ToolCallStreamer):
    """The output's start (after whitespace, and ``<|python_start|>`` for Llama 4) or a
    ``<|python_start|>`` anywhere decides: ``[`` followed by a name and ``(`` opens a list of
    calls, held until its ``]``; anything else is content, sent as it comes. After the list,
    ``<|python_end|>`` is dropped and what follows is content."""

    START_GAP = re.compile(r"\s*(?:<\|python_start\|>)?\s*")
    MARKER_GAP = re.compile(r"<\|python_start\|>\s*")
    END_GAP = re.compile(r"\s*<\|python_end\|>")

    def __init__(self) -> None:
        super().__init__()
        self.state = "lead"  # lead | list | tail | text
        self.gap = self.START_GAP  # what may come before the list
        self.lead = ""  # the text before the candidate list: dropped if it is one
        self.end = PythonEnd()

    def scan(self, final: bool) -> None:
        steps = {"lead": self.scan_lead, "list": self.scan_list, "tail": self.scan_tail}
        while self.buffer:
            step = steps.get(self.state, self.scan_text)
            if not step(final):
                return

    def scan_lead(self, final: bool) -> bool:
        size = self.gap.match(self.buffer).end()
        rest = self.buffer[size:]
        may_be_marker = self.gap is self.START_GAP and PYTHON_START.startswith(rest)
        if not final and (not rest or may_be_marker):
            return False
        self.lead, self.buffer = self.buffer[:size], rest
        self.state = "list" if rest.startswith("[") else "text"
        if self.state == "text":
            self.emit_text(self.lead)
        return True

    def scan_list(self, final: bool) -> bool:
        if not CALLS_START.match(self.buffer):
            if not final and MAY_BE_CALLS.fullmatch(self.buffer):
                return False
            return self.not_calls()
        end = self.end.find(self.buffer)
        if end < 0:
            return self.not_calls() if final else False
        calls = pythonic_calls(self.buffer[:end])
        if not calls:
            return self.not_calls()
        for call in calls:
            self.emit_call(call)
        self.buffer, self.state, self.end = self.buffer[end:], "tail", PythonEnd()
        return True

    def not_calls(self) -> bool:
        """The candidate is content after all, from its lead on."""
        self.emit_text(self.lead)
        self.state, self.end = "text", PythonEnd()
        return True

    def scan_tail(self, final: bool) -> bool:
        """After the list: drop ``<|python_end|>`` (and whitespace before it) if it comes."""
        rest = self.buffer.lstrip()
        if not final and PYTHON_END.startswith(rest):
            return False
        if match := self.END_GAP.match(self.buffer):
            self.buffer = self.buffer[match.end() :]
        self.state = "text"
        return True

    def scan_text(self, final: bool) -> bool:
        at = self.buffer.find(PYTHON_START)
        if at < 0:
            at = len(self.buffer) - (0 if final else partial_marker(self.buffer, PYTHON_START))
        self.emit_text(self.buffer[:at])
        self.buffer = self.buffer[at:]
        if not self.buffer.startswith(PYTHON_START):
            return False
        self.state, self.gap = "lead", self.MARKER_GAP
        return True


class PythonicSyntax(CallSyntax):
    """``[name(key=value, ...), ...]``: keyword arguments in the schema's order (required ones
    always, others optionally), each value a ``%json`` of its schema; JSON's literals are read
    back as Python's."""

    content_start = "["
    reserved = (PYTHON_START,)  # opens a list of calls wherever it is (Llama 4)

    def frame(self) -> tuple[str, str, str]:
        return "[", ", ", "]"

    def opens_calls(self, text: str) -> bool | None:
        """A JSON answer may open with "[" too, but never with "[" and a name before "("."""
        if CALLS_OPENING.match(text):
            return True
        return None if OPENING_SO_FAR.fullmatch(text) else False

    def call(self, lark: LarkWriter, function: dict[str, Any], rule: str) -> list[str]:
        name = function["name"]
        if not IDENTIFIER.fullmatch(name):
            raise ValueError(f"function name {name!r} is not a Python identifier")
        parameters = parameters_of(function)
        properties = parameters.get("properties")
        if takes_no_arguments(parameters):
            return [f"{rule}: {literal(name + '()')}"]
        if not isinstance(properties, dict) or not properties:  # any keyword arguments
            item = '/[A-Za-z_][A-Za-z0-9_]*/ "=" ' + LarkWriter.json({})
            arguments = f'({item} (", " {item})*)?'
            return [f"{rule}: {literal(name + '(')} {arguments} {literal(')')}"]
        lines = keyword_rules(parameters, properties, rule)
        return [f"{rule}: {literal(name + '(')} {rule}_from_0 {literal(')')}", *lines]


def keyword_rules(parameters: dict[str, Any], properties: dict[str, Any], rule: str) -> list[str]:
    """Rules for the keyword list: ``rule_from_j`` is the keywords from the j-th on with none
    written before, ``rule_after_j`` the same after one was (so each needs ", " first)."""
    required = set(parameters.get("required") or [])
    keys = list(properties)
    lines: list[str] = []
    for j in reversed(range(len(keys))):
        key = keys[j]
        if not isinstance(key, str) or not IDENTIFIER.fullmatch(key):
            raise ValueError(f"parameter name {key!r} is not a Python identifier")
        item = f"{literal(key + '=')} {LarkWriter.json(property_schema(parameters, key))}"
        after_next = f"{rule}_after_{j + 1}" if j + 1 < len(keys) else ""
        from_next = f"{rule}_from_{j + 1}" if j + 1 < len(keys) else ""
        if key in required:
            first = lark_sequence(item, after_next)
            after = lark_sequence(literal(", "), item, after_next)
        else:  # written or not; the rules after it stay the same
            first = (
                f"{lark_sequence(item, after_next)} | {from_next}" if from_next else f"({item})?"
            )
            after = lark_sequence(f"({literal(', ')} {item})?", after_next)
        lines += [f"{rule}_from_{j}: {first}", f"{rule}_after_{j}: {after}"]
    return lines


class PythonicToolParser(ToolParser):
    name = "pythonic"
    syntax = PythonicSyntax()

    def streamer(self) -> ToolCallStreamer:
        return PythonicStreamer()


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's name for Llama 4's use of it (``<|python_start|>`` around the list)."""

    name = "llama4_pythonic"
