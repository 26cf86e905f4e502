"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) compiled into a
matcher that says, before each token, which tokens keep the output valid.

The grammar engine is llguidance (the Rust core of Microsoft's guidance, vLLM's "guidance"
backend): its matcher parses lazily (an Earley parser over a lexer), so there is no token-mask
precomputation per grammar, and a mask costs tens of microseconds per row. It is a maintained
library, not our own automaton; this module only adapts it:

- ``grammar_for(constraint)``: the llguidance grammar of a constraint (ValueError if malformed);
- ``GrammarCompiler``: the tokenizer's token table, built once per model; compiles constraints on
  worker threads (llguidance drops the GIL while it builds a matcher, which can take 100 ms for a
  large schema), never on the caller's thread, and keeps the last ``max_cached`` validated
  grammars (keyed by the constraint);
- ``RequestGrammar``: one constrained request's matcher; it advances with every sampled token
  and fills that request's row of a step's bitmask (1 bit per token id, int32 words).

The frontend compiles with the same code to answer a bad constraint with a 400 before anything
reaches the engine (``check``); the engine compiles again, for its own matchers, since a compiled
matcher does not travel between processes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from protocol.messages import Constraint, ConstraintKind

if TYPE_CHECKING:
    # The API process compiles grammars with this module and has no other use for torch: the
    # two functions that compute with it import it themselves.
    import torch


MAX_CACHED_GRAMMARS = 256
MAX_CACHED_BYTES = 64 << 20  # the cached constraints and grammars' text, in all
COMPILE_THREADS = 2
# Work bounds of one grammar (llguidance's own limits, explicit here): a grammar that needs more
# is refused as invalid instead of taking unbounded time or memory.
MAX_GRAMMAR_SIZE = 1_000_000  # symbols and rules after conversion
MAX_LEXER_STATES = 250_000
STEP_LEXER_FUEL = 1_000_000  # lexer work per token
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model cannot pad forever


def grammar_for(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; ValueError when it is malformed."""
    import llguidance

    kind, spec = constraint.kind, constraint.spec
    if kind == ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_OPTIONS)
    if kind == ConstraintKind.JSON_SCHEMA:
        schema = json.loads(spec)  # ValueError (JSONDecodeError) when it is not JSON
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
    if kind == ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == ConstraintKind.CHOICE:
        return llguidance.grammar_from("choice", json.dumps(choices_of(spec)))
    if kind == ConstraintKind.LLGUIDANCE:
        return top_level_grammar(spec)
    return llguidance.grammar_from("grammar", spec)  # GBNF/EBNF, converted; or Lark as it is


def top_level_grammar(spec: str) -> str:
    """An LLGUIDANCE constraint's grammar: a JSON object with a non-empty "grammars" list (what
    each grammar holds, llguidance checks when it compiles)."""
    value = json.loads(spec)  # ValueError (JSONDecodeError) when it is not JSON
    grammars = value.get("grammars") if isinstance(value, dict) else None
    if not isinstance(grammars, list) or not grammars:
        raise ValueError('an llguidance grammar is a JSON object with a non-empty "grammars" list')
    return spec


def named_grammar(constraint: Constraint, name: str) -> dict[str, Any]:
    """The constraint's grammar as one entry of a top-level grammar, under ``name``, for another
    grammar to reference as ``@name`` (frontend/reasoning.py composes them)."""
    grammar = grammar_for(constraint)
    if not grammar.lstrip().startswith("{"):
        return {"name": name, "lark_grammar": grammar}  # a Lark text
    entries = json.loads(grammar)["grammars"]
    if len(entries) != 1:
        raise ValueError("a grammar of several grammars cannot be nested in another")
    return {**entries[0], "name": name}


def choices_of(spec: str) -> list[str]:
    """The choices of a CHOICE constraint: a non-empty JSON list of non-empty strings."""
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices:
        raise ValueError("choice needs a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("every choice must be a non-empty string")
    return choices


def parser_limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SIZE,
        max_lexer_states=MAX_LEXER_STATES,
        step_lexer_fuel=STEP_LEXER_FUEL,
    )


def token_table(hf_tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the tokenizer, padded to the model's vocabulary (a mask covers every
    logit; ids the tokenizer does not know are never allowed)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def compile_matcher(constraint: Constraint, tokenizer: Any) -> Any:
    """A fresh matcher for ``constraint``; ValueError naming what is wrong with it."""
    return new_matcher(checked_grammar(constraint, tokenizer), tokenizer)


def take_first_token(matcher: Any) -> None:
    """Compute a fresh matcher's first mask and take one token it allows; ValueError with
    llguidance's reason where that fails. llguidance builds its lexer as it goes, so a
    constraint too complex to serve (a regex bounded at a million repeats) may show only at its
    first token, in the engine, after the request was accepted. Ordinary constraints take a
    few milliseconds; the matcher is spent."""
    allowed = matcher.compute_logit_bias()  # a byte a token, 0 where it is not allowed
    first = len(allowed) - len(allowed.lstrip(b"\x00"))
    if not matcher.is_error() and first == len(allowed):
        raise ValueError("the constraint allows no token at its start")
    if not matcher.is_error():
        matcher.consume_token(first)
    if matcher.is_error():
        reason = (matcher.get_error() or "").split("\n<state>")[0]  # not its parser's dump
        raise ValueError(reason or "the constraint failed at its first token")


def checked_grammar(constraint: Constraint, tokenizer: Any) -> str:
    """The constraint's grammar, validated against the tokenizer (ValueError if invalid)."""
    import llguidance

    grammar = grammar_for(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=parser_limits()
    )
    if is_error:
        raise ValueError(messages[0] if messages else "invalid grammar")
    return grammar


def new_matcher(grammar: str, tokenizer: Any) -> Any:
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


class GrammarCompiler:
    """Compiles constraints for one model on worker threads, with a bounded cache.

    ``tokenizer_source`` builds the HF tokenizer; the token table is built from it on a worker
    thread at construction, so neither the engine's start nor its loop waits for it. The cache
    keeps the last ``max_cached`` constraints' validated grammars (conversion and validation are
    most of a compile); each request still builds its own matcher from it, on a worker. Why not
    copy one compiled matcher: copies share their lexer's lazily built state behind a lock, and
    the parallel mask fill of a batch of copies then runs no faster than one thread (4.4 ms for 64
    copies on 12 threads against 1.7 ms for 64 own matchers; docs/design/structured-outputs.md,
    "Compiled off every loop, twice").
    """

    def __init__(
        self,
        tokenizer_source: Callable[[], Any],
        vocab_size: int,
        max_cached: int = MAX_CACHED_GRAMMARS,
        threads: int = COMPILE_THREADS,
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._tokenizer = self._pool.submit(lambda: token_table(tokenizer_source(), vocab_size))
        self._cache: OrderedDict[Constraint, str] = OrderedDict()  # validated grammars, LRU
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache is shared by the workers
        self.max_cached = max_cached
        self.num_compiled = 0  # constraints validated (cache misses)

    def start(self, constraint: Constraint, prefix: list[int] | None = None) -> RequestGrammar:
        """The grammar of one request, compiling on a worker; ``prefix``: output it already has
        (a resumed request), which the matcher takes before anything is sampled."""
        return RequestGrammar(self._pool.submit(self._compile, constraint, prefix or []))

    def check(self, constraint: Constraint) -> None:
        """Validate now, on this thread: ValueError naming what is wrong (the offline API checks
        every prompt's constraint before it runs any)."""
        self._grammar(constraint)

    def _compile(self, constraint: Constraint, prefix: list[int]) -> Any:
        matcher = new_matcher(self._grammar(constraint), self._tokenizer.result())
        if prefix and not matcher.consume_tokens(prefix):
            raise ValueError(
                f"the output so far does not match the constraint: {matcher.get_error()}"
            )
        return matcher

    def _grammar(self, constraint: Constraint) -> str:
        with self._lock:
            grammar = self._cache.get(constraint)
            if grammar is not None:
                self._cache.move_to_end(constraint)
                return grammar
        grammar = checked_grammar(constraint, self._tokenizer.result())  # outside the lock
        with self._lock:
            self.num_compiled += 1
            if constraint not in self._cache:
                self._cache[constraint] = grammar
                self._cached_bytes += len(constraint.spec) + len(grammar)
            while len(self._cache) > self.max_cached or self._cached_bytes > MAX_CACHED_BYTES:
                oldest, text = self._cache.popitem(last=False)
                self._cached_bytes -= len(oldest.spec) + len(text)
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One constrained request's matcher (once compiled): advanced by every token the request
    samples, asked for the tokens allowed next."""

    def __init__(self, compiled: Future[Any]) -> None:
        self.future = compiled  # the request's matcher, once compiled
        self.matcher: Any = None
        self.consumed: tuple[int, bool] | None = None  # a token advance() already fed it
        self.error: str | None = None  # why it could not compile, or why it stopped accepting
        self.dead_end = False  # no token was allowed at the last mask: the request must end

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the request may be scheduled, or must be failed."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = self.future.result()
        except Exception as exc:  # ValueError from the grammar; anything else is ours
            self.error = str(exc) or type(exc).__name__
        return True

    @property
    def terminated(self) -> bool:
        """The output is complete: the grammar admits no token but EOS now."""
        return self.matcher.is_stopped()

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (with ``error`` set) if the grammar rejects it."""
        consumed, self.consumed = self.consumed, None
        ok = consumed[1] if consumed and consumed[0] == token else self.matcher.consume_token(token)
        if ok:
            return True
        self.error = self.matcher.get_error() or f"token {token} is not allowed here"
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, CPU)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def fill_drafted(self, drafts: tuple[int, ...], masks: torch.Tensor) -> None:
        """Write the allowed tokens before each draft into ``masks[j]`` ([K + 1, W], CPU) and
        after the last into ``masks[K]``: the matcher takes the drafts one by one, as far as it
        allows them, and gives them back. Rows past a draft it refuses are left as they are:
        the target's token there cannot be that draft, so nothing after it is kept."""
        self.fill(masks, 0)
        taken = 0
        for token in drafts:
            if self.matcher.try_consume_tokens([token]) != 1:
                break
            taken += 1
            self.fill(masks, taken)
        if taken:
            self.matcher.rollback(taken)


class BitmaskFiller:
    """Builds each step's bitmask for the rows that sample: the constrained rows' matchers fill
    theirs in parallel (llguidance's executor, outside the GIL), every other row allows all.

    The masks land in persistent host buffers (pinned on CUDA, so the sampler's copy to the GPU
    does not block the host; allocating pinned memory each step cost milliseconds). Two buffers
    take turns: a step's mask is filled only after the previous step's sampled ids reached the
    host, so the copy that read the other buffer two steps ago has long completed.
    """

    RING = 2

    def __init__(self, vocab_size: int, pin_memory: bool, max_rows: int = 256) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self._executor = llguidance.LLExecutor()
        self._buffers = [self._allocate(max_rows) for _ in range(self.RING)]
        self._next = 0

    def _allocate(self, rows: int) -> torch.Tensor:
        buffer = allocate_bitmask(rows, self.vocab_size)
        return buffer.pin_memory() if self.pin_memory else buffer

    def fill(self, grammars: list[RequestGrammar | None]) -> torch.Tensor | None:
        """The bitmask [len(grammars), W] for one step's sampling rows, or None when no row is
        constrained. A matcher that allows nothing makes its row empty: the token sampled
        there is then refused by ``accept``, which ends the request (a dead end)."""
        import llguidance.torch

        rows = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None and g.matcher]
        if not rows:
            return None
        self._next = (self._next + 1) % self.RING
        if self._buffers[self._next].shape[0] < len(grammars):
            self._buffers[self._next] = self._allocate(len(grammars))
        bitmask = self._buffers[self._next][: len(grammars)]
        bitmask.fill_(-1)  # every row allows every token until its matcher says otherwise
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        return bitmask

    def fill_drafted(
        self,
        rows: list[tuple[RequestGrammar | None, tuple[int, ...], int]],
        bitmask: torch.Tensor,
    ) -> torch.Tensor | None:
        """The masks [D, W] of a step's drafted positions (each drafted row's K positions, in
        order), given each drafted row's grammar, drafts and sampling row: a constrained row
        also gets its sampling row of ``bitmask`` (the step's, from ``fill``) replaced by the
        mask after its last draft. None when no drafted row is constrained."""
        if not any(g is not None and g.matcher is not None for g, _, _ in rows):
            return None
        masks = allocate_bitmask(sum(len(d) for _, d, _ in rows), self.vocab_size)
        at = 0
        for grammar, drafts, row in rows:
            if grammar is not None and grammar.matcher is not None:
                own = allocate_bitmask(len(drafts) + 1, self.vocab_size)
                grammar.fill_drafted(drafts, own)
                masks[at : at + len(drafts)] = own[:-1]
                bitmask[row] = own[-1]
            at += len(drafts)
        return masks

    def advance(self, pairs: list[tuple[RequestGrammar, int]]) -> None:
        """Let each matcher take its sampled token, in parallel; ``accept`` then reads the
        verdict instead of consuming on the loop's thread, one request at a time."""
        import llguidance.torch

        if not pairs:
            return
        verdicts = llguidance.torch.consume_token_par(
            self._executor, [(g.matcher, token) for g, token in pairs]
        )
        for (grammar, token), ok in zip(pairs, verdicts, strict=True):
            grammar.consumed = (token, ok)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every bit set (every token allowed)."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens whose bit is clear in ``bitmask`` [B, W] at -inf."""
    import torch

    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))
