"""Constraints the structured-output tests share: JSON schemas of every kind a client sends, and
a regex, choices and a grammar with an independent check of each output.

Strings carry maxLength and arrays maxItems, so that a sampled output always completes within
the tests' token budget (an unbounded string could run to max_tokens and be cut); numbers are
integers for the same reason (a float's digits are unbounded: "1.000000..." until max_tokens).
"""

from __future__ import annotations

import re
from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat object": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array with bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {
            "percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "delta": {"type": "integer", "minimum": -5, "maximum": 5},
            "big": {"type": "integer", "minimum": 1000, "maximum": 2000},
        },
        "required": ["percent", "delta", "big"],
        "additionalProperties": False,
    },
    "required and optional": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": NAME},
        "required": ["id"],
        "additionalProperties": False,
    },
    "defs and ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, NAME, {"type": "null"}]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "array of objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "booleans and const": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "kind": {"const": "report"}},
        "required": ["ok", "kind"],
        "additionalProperties": False,
    },
    "string formats": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}

REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
# GBNF: a small arithmetic expression; ``parse_expression`` below is its independent check.
GRAMMAR = """root ::= expr
expr ::= term (op term){0,3}
op ::= "+" | "-"
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""
MAX_OPS = 3  # per parenthesised level
SAMPLES = 5
MAX_TOKENS = 160


def matches_regex(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


def parse_expression(text: str) -> bool:
    """A recursive-descent parser of GRAMMAR (True when the whole text is an expression)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.match(r"[1-9][0-9]?", text[pos:])
        if m is None:
            return False
        pos += m.end()
        return True

    def term() -> bool:
        nonlocal pos
        if text[pos : pos + 1] == "(":
            pos += 1
            if not expr() or text[pos : pos + 1] != ")":
                return False
            pos += 1
            return True
        return num()

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        ops = 0
        while text[pos : pos + 1] in ("+", "-") and pos < len(text):
            pos += 1
            ops += 1
            if ops > MAX_OPS or not term():
                return False
        return True

    return expr() and pos == len(text)
