"""Structured outputs in the frontend: a request's constraint, found and checked before it is sent.

Four spellings lead to one ``protocol.messages.Constraint``: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (json, regex, choice, grammar,
json_object) and the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. A request gives at most one; two are a 400 naming both.

``ConstraintChecker`` compiles each new constraint with the engine's own code
(``engine_core.grammar.compile_matcher``, llguidance) against this model's tokenizer, so a bad
schema, regex or grammar is a 400 naming its parameter and never reaches the engine; it also takes
the first token (``take_first_token``), where a constraint too complex for llguidance's lexer
shows. One that fails further on still ends in the engine (``constraint_dead_end``). It compiles on
its own worker threads, never on the event loop, within a time limit (``--grammar-timeout``;
llguidance drops the GIL while it compiles, and its own work bounds, engine_core/grammar.py, keep
a compile from growing without end), and remembers the last ``max_cached`` verdicts.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine_core.grammar import compile_matcher, take_first_token, token_table
from frontend.errors import bad_request
from frontend.openai_schemas import SamplingFields
from protocol.messages import Constraint, ConstraintKind

DEFAULT_TIMEOUT_S = 10.0
MAX_CACHED = 1024  # verdicts kept: a constraint is a key, the verdict a short string or None
MAX_CACHED_BYTES = 32 << 20  # and the constraints' text they are keyed by, in all
CHECK_THREADS = 2
MAX_REASON = 1000  # characters of a compile error that a 400 carries
# The fields whose grammar the server writes around the client's schemas (tool calls): a compile
# error's first line names the schema's fault; the grammar listing and its line:column after it
# are the server's own text.
SERVER_WRITTEN = frozenset({"tools", "tool_choice"})
GRAMMAR_POSITION = re.compile(r"^at \d+\(\d+\): ")


def constraint_of(req: SamplingFields) -> tuple[Constraint, str] | None:
    """The request's constraint and the parameter it came from, or None; 400 if it gives two."""
    found = [c for c in _spellings(req) if c is not None]
    if len(found) > 1:
        names = " and ".join(param for _, param in found)
        raise bad_request(f"give one structured-output constraint, not {names}", found[1][1])
    return found[0] if found else None


def check_end_not_held_off(
    req: SamplingFields, param: str, fields: tuple[str, ...] = ("min_tokens", "ignore_eos")
) -> None:
    """A constraint (from ``param``) ends the output once it is complete, so ``fields`` of
    min_tokens and ignore_eos, which would hold that end off, cannot be honoured beside it:
    400 naming them."""
    asked = {"min_tokens": req.min_tokens > 0, "ignore_eos": req.ignore_eos}
    for name in fields:
        if asked[name]:
            raise bad_request(
                f"{name} cannot be honoured with {param}: the constraint ends the output once "
                "it is complete",
                name,
                "unsupported_parameter",
            )


def _spellings(req: SamplingFields) -> list[tuple[Constraint, str] | None]:
    return [
        _from_response_format(req),
        _from_structured_outputs(req),
        _json(req.guided_json, "guided_json"),
        _text(ConstraintKind.REGEX, req.guided_regex, "guided_regex"),
        _choice(req.guided_choice, "guided_choice"),
        _text(ConstraintKind.GRAMMAR, req.guided_grammar, "guided_grammar"),
    ]


def _from_response_format(req: SamplingFields) -> tuple[Constraint, str] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT), "response_format"
    assert fmt.json_schema is not None  # the schema checked it
    return _json(fmt.json_schema.json_schema, "response_format.json_schema.schema")


def _from_structured_outputs(req: SamplingFields) -> tuple[Constraint, str] | None:
    so = req.structured_outputs
    if so is None:
        return None
    if so.json_object:
        return Constraint(ConstraintKind.JSON_OBJECT), "structured_outputs.json_object"
    return (
        _json(so.json_, "structured_outputs.json")
        or _text(ConstraintKind.REGEX, so.regex, "structured_outputs.regex")
        or _choice(so.choice, "structured_outputs.choice")
        or _text(ConstraintKind.GRAMMAR, so.grammar, "structured_outputs.grammar")
    )


def _json(schema: dict[str, Any] | str | None, param: str) -> tuple[Constraint, str] | None:
    if schema is None:
        return None
    text = schema if isinstance(schema, str) else json.dumps(schema)  # property order matters
    return Constraint(ConstraintKind.JSON_SCHEMA, text), param


def _text(kind: ConstraintKind, text: str | None, param: str) -> tuple[Constraint, str] | None:
    if text is None:
        return None
    if not text:
        raise bad_request(f"{param} must not be empty", param)
    return Constraint(kind, text), param


def _choice(choices: list[str] | None, param: str) -> tuple[Constraint, str] | None:
    if choices is None:
        return None
    if not choices or not all(choices):
        raise bad_request(f"{param} needs a non-empty list of non-empty strings", param)
    return Constraint(ConstraintKind.CHOICE, json.dumps(choices)), param


class ConstraintChecker:
    """Compiles constraints against the served model's tokenizer, off the event loop, within a
    time limit; a verdict is kept (bounded), so a repeated constraint costs a dict lookup."""

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="constraint")
        self._table: Future[Any] = self._pool.submit(token_table, hf_tokenizer, vocab_size)
        self._verdicts: OrderedDict[Constraint, str | None] = OrderedDict()  # None: it compiles
        self._pending: dict[Constraint, asyncio.Future[str | None]] = {}
        self.num_compiles = 0  # compiles started (one per constraint not cached)
        self._cached_bytes = 0

    async def check(self, constraint: Constraint, param: str) -> None:
        """400 naming ``param`` when the constraint does not compile (or not in time)."""
        verdict = await self._verdict(constraint)
        if verdict is not None:
            if param in SERVER_WRITTEN:  # the listing is of our grammar, not the client's
                verdict = GRAMMAR_POSITION.sub("", verdict.split("\n", 1)[0])
            raise bad_request(f"invalid {param}: {verdict}", param, "invalid_constraint")

    async def _verdict(self, constraint: Constraint) -> str | None:
        if constraint in self._verdicts:
            self._verdicts.move_to_end(constraint)
            return self._verdicts[constraint]
        pending = self._pending.get(constraint)
        if pending is None:  # one compile per constraint, however many requests wait for it
            self.num_compiles += 1
            work = asyncio.wrap_future(self._pool.submit(self._compile, constraint))
            pending = self._pending[constraint] = asyncio.ensure_future(self._timed(work))
            pending.add_done_callback(lambda _: self._pending.pop(constraint, None))
        verdict = await asyncio.shield(pending)
        self._remember(constraint, verdict)
        return verdict

    async def _timed(self, work: asyncio.Future[str | None]) -> str | None:
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except TimeoutError:
            # The thread cannot be stopped; it finishes in the background (llguidance's bounds
            # keep that finite) and its late verdict is dropped.
            return f"it did not compile within the {self.timeout_s:g} s limit"

    def _compile(self, constraint: Constraint) -> str | None:
        try:
            take_first_token(compile_matcher(constraint, self._table.result()))
        except ValueError as exc:
            reason = str(exc) or type(exc).__name__
            # llguidance's reasons may carry its whole state: the start says what is wrong.
            return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON] + " ..."
        return None

    @property
    def num_cached(self) -> int:
        return len(self._verdicts)

    def _remember(self, constraint: Constraint, verdict: str | None) -> None:
        if constraint in self._verdicts:
            return
        self._verdicts[constraint] = verdict
        self._cached_bytes += len(constraint.spec)
        while len(self._verdicts) > MAX_CACHED or self._cached_bytes > MAX_CACHED_BYTES:
            oldest, _ = self._verdicts.popitem(last=False)
            self._cached_bytes -= len(oldest.spec)
