"""Reasoning output: a thinking model's reasoning split from its answer, whole or streamed, and
the grammar that makes structured output (or a thinking budget) start where the reasoning ends.

Chosen by ``--reasoning-parser`` (vLLM's names; our own code):

- ``deepseek_r1`` (DeepSeek-R1, QwQ): the output is reasoning until ``</think>``, then the
  answer; the chat template opens ``<think>`` in the prompt, and a leading ``<think>`` the model
  writes itself is dropped. An output with no ``</think>`` is all reasoning.
- ``qwen3`` (Qwen3, and templates that think the same way): the output reasons only if it opens
  with ``<think>`` or the prompt left a ``<think>`` block open (a thinking-only template); an
  output that does neither is all answer (``enable_thinking: false`` closes an empty block in
  the prompt).
- ``openai_gptoss`` (gpt-oss, the harmony format): the ``analysis`` channel is the reasoning,
  the ``final`` channel (and commentary preambles) the answer, and messages to
  ``functions.NAME`` tool calls: the harmony tool-call parser's state machine
  (frontend/tool_parsers/harmony.py) reads all three, so this parser also carries the calls.
  Its markers are special tokens, which the text then keeps.

Both share one state machine (``ThinkSplitter``), so a streamed split reassembles to the whole
text's split for every way the text may be chunked: text that could still be the start of a
marker is held back until it proves to be one or not. Whitespace between ``</think>`` and the
answer is dropped; the reasoning is kept as the model wrote it.

Structured outputs, tool-call grammars and ``thinking_token_budget`` go through
``after_reasoning``: one llguidance grammar whose reasoning part takes any text (at most the
budget's tokens of it) up to the end marker, and whose answer part is the request's own
constraint (or any text), so a constraint starts after the reasoning, never before. The markers
must be single tokens of the tokenizer (they are, for the models these parsers are for).
"""

from __future__ import annotations

import enum
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from frontend.tool_parsers import StreamDelta, ToolCall, assemble
from frontend.tool_parsers.harmony import (
    CHANNEL,
    END,
    MESSAGE,
    START,
    HarmonyStreamer,
)
from protocol.messages import Constraint, ConstraintKind

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"
_WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    """What a piece of output adds to the reasoning and to the answer (and, from a splitter
    that reads calls, tool-call fragments in OpenAI's streamed shape)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __iadd__(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class Splitter(ABC):
    """One choice's split, fed its text as it is released."""

    reads_tool_calls: ClassVar[bool] = False  # its deltas carry the calls (harmony)

    @abstractmethod
    def push(self, text: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...

    @property
    @abstractmethod
    def reasoned(self) -> bool:
        """Whether the output has a reasoning part (so far)."""


class _State(enum.Enum):
    OPENING = 0  # before anything: the output may still open with <think>
    REASONING = 1
    ANSWER_START = 2  # after </think>: whitespace before the answer is dropped
    ANSWER = 3


def held_marker_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ThinkSplitter(Splitter):
    """``<think>`` reasoning ``</think>`` answer, fed in pieces of any size."""

    def __init__(self, in_reasoning: bool, may_open: bool) -> None:
        """``in_reasoning``: the output starts inside the reasoning (a leading ``<think>`` is
        dropped); else ``may_open``: it reasons only if it opens with ``<think>``."""
        self.state = _State.OPENING if (in_reasoning or may_open) else _State.ANSWER
        self.opening_reasons = in_reasoning  # what OPENING becomes without a <think>
        self.pending = ""
        self._reasoned = False

    @property
    def reasoned(self) -> bool:
        return self._reasoned

    def _to(self, state: _State) -> None:
        self.state = state
        self._reasoned = self._reasoned or state is _State.REASONING

    def push(self, text: str) -> ReasoningDelta:
        self.pending += text
        out = ReasoningDelta()
        while self.pending and self._step(out, final=False):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        """The output ended: what is held back goes to the part it is in (a marker that never
        completed is text of that part)."""
        out = ReasoningDelta()
        while self.pending and self._step(out, final=True):
            pass
        return out

    def _step(self, out: ReasoningDelta, final: bool) -> bool:
        """Move on through ``pending``; False when it must wait for more text."""
        if self.state is _State.OPENING:
            return self._opening(final)
        if self.state is _State.REASONING:
            return self._reasoning(out, final)
        if self.state is _State.ANSWER_START:
            stripped = self.pending.lstrip(_WHITESPACE)
            self.pending = stripped
            if stripped:
                self._to(_State.ANSWER)
            return bool(stripped)
        out.content += self.pending
        self.pending = ""
        return False

    def _opening(self, final: bool) -> bool:
        head = self.pending.lstrip(_WHITESPACE)
        if head.startswith(THINK_START):
            self.pending = head[len(THINK_START) :]
            self._to(_State.REASONING)
            return True
        if THINK_START.startswith(head) and not final:
            return False  # it may still become <think>
        self._to(_State.REASONING if self.opening_reasons else _State.ANSWER)
        return True

    def _reasoning(self, out: ReasoningDelta, final: bool) -> bool:
        end = self.pending.find(THINK_END)
        if end >= 0:
            out.reasoning += self.pending[:end]
            self.pending = self.pending[end + len(THINK_END) :]
            self._to(_State.ANSWER_START)
            return True
        held = 0 if final else held_marker_prefix(self.pending, THINK_END)
        out.reasoning += self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(self.pending) - held :]
        return False


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output had no reasoning part
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # from a parser that reads calls (harmony)


class ReasoningParser(ABC):
    """A reasoning convention, bound to a tokenizer (its marker tokens)."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens

    @abstractmethod
    def in_reasoning(self, opening: str) -> bool:
        """Whether the output starts inside the reasoning, given the text it continues that no
        earlier message wrote (output_opening in frontend/chat.py): a marker the client's
        messages hold (a question about ``<think>``) opens nothing."""

    def reads_opening(self, prompt: str) -> bool:
        """Whether in_reasoning needs the opening of this rendered prompt (else it gets "")."""
        return False

    @abstractmethod
    def splitter(self, in_reasoning: bool) -> Splitter: ...

    def split(self, text: str, in_reasoning: bool) -> ReasoningSplit:
        """The whole output's split: what the streamed splitter gives, pieced together."""
        splitter = self.splitter(in_reasoning)
        delta = splitter.push(text)
        delta += splitter.finish()
        reasoning = delta.reasoning if splitter.reasoned else None
        calls = assemble([StreamDelta(tool_calls=delta.tool_calls)]).tool_calls
        return ReasoningSplit(reasoning, delta.content, tuple(calls))

    @abstractmethod
    def reasoning_tokens(self, token_ids: list[int], in_reasoning: bool) -> int:
        """How many of an output's tokens are reasoning (the markers included)."""

    @abstractmethod
    def reasoning_grammar(self, in_reasoning: bool, budget: int | None) -> str:
        """The Lark rules of the reasoning part, ``start`` ending with ``@answer``."""


class ThinkTagParser(ReasoningParser):
    """``<think>`` ... ``</think>`` with both markers single tokens of the tokenizer."""

    opens_itself: ClassVar[bool]  # the output may open the block itself (qwen3)

    def __init__(self, hf_tokenizer: Any) -> None:
        self.start_id = single_token_id(hf_tokenizer, THINK_START)
        self.end_id = single_token_id(hf_tokenizer, THINK_END)
        if self.start_id is None or self.end_id is None:
            # vLLM refuses such a tokenizer; its text still splits here, but a request whose
            # grammar starts after the reasoning is refused (reasoning_grammar).
            logger.warning(
                "--reasoning-parser %s: the tokenizer has no single %s and %s tokens; the "
                "reasoning is split from the text, but requests with structured output, a "
                "forced tool call or a thinking budget will be refused",
                self.name, THINK_START, THINK_END,
            )  # fmt: skip

    def splitter(self, in_reasoning: bool) -> Splitter:
        return ThinkSplitter(in_reasoning, may_open=self.opens_itself)

    def reasoning_tokens(self, token_ids: list[int], in_reasoning: bool) -> int:
        if self.end_id is not None and self.end_id in token_ids:
            return token_ids.index(self.end_id) + 1
        opened = self.start_id is not None and token_ids[:1] == [self.start_id]
        return len(token_ids) if in_reasoning or opened else 0

    def reasoning_grammar(self, in_reasoning: bool, budget: int | None) -> str:
        if self.start_id is None or self.end_id is None:
            raise ValueError(
                f"the tokenizer has no single {THINK_START} and {THINK_END} tokens, which a "
                "grammar after the reasoning (structured output, tool_choice or a thinking "
                "budget) needs"
            )
        limit = "" if budget is None else f"[max_tokens={budget}]"
        block = f"thinking? <[{self.end_id}]> ws?"
        start = block if in_reasoning else f"(<[{self.start_id}]> {block})?"
        if in_reasoning and not self.opens_itself:
            start = f"<[{self.start_id}]>? {block}"
        # A few characters of whitespace may part the end marker from the answer (Qwen3 writes
        # two newlines); bounded, or a model could spend its tokens there.
        return f"start: {start} @answer\nthinking{limit}: /(.|\\n)+/\nws: /[ \\t\\r\\n]{{1,8}}/\n"


class DeepSeekR1Parser(ThinkTagParser):
    name = "deepseek_r1"
    opens_itself = False

    def in_reasoning(self, opening: str) -> bool:
        return True  # its template opens the block; a model that opens it too is read the same


class Qwen3Parser(ThinkTagParser):
    name = "qwen3"
    opens_itself = True

    def in_reasoning(self, opening: str) -> bool:
        """An opening that leaves a ``<think>`` block open (a thinking-only template's, or an
        assistant message continued inside its thinking)."""
        return opening.rfind(THINK_START) > opening.rfind(THINK_END)

    def reads_opening(self, prompt: str) -> bool:
        # The opening ends the prompt: where the prompt leaves no <think> open, neither does it
        # (so no second render); where it does, the block may be a message's text.
        return self.in_reasoning(prompt)


class HarmonySplitter(Splitter):
    """The harmony tool-call parser's state machine, read for all three parts."""

    reads_tool_calls = True

    def __init__(self) -> None:
        self.streamer = HarmonyStreamer()
        self._reasoned = False

    @property
    def reasoned(self) -> bool:
        return self._reasoned

    def push(self, text: str) -> ReasoningDelta:
        return self._of(self.streamer.push(text))

    def finish(self) -> ReasoningDelta:
        return self._of(self.streamer.finish())

    def _of(self, delta: StreamDelta) -> ReasoningDelta:
        self._reasoned = self._reasoned or bool(delta.reasoning)
        return ReasoningDelta(delta.reasoning, delta.content, list(delta.tool_calls))


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages: ``<|channel|>analysis<|message|>...<|end|>`` then
    ``<|start|>assistant<|channel|>final<|message|>...``."""

    name = "openai_gptoss"
    needs_special_tokens = True
    markers = (CHANNEL, MESSAGE, END, START)

    def __init__(self, hf_tokenizer: Any) -> None:
        self.ids = {m: single_token_id(hf_tokenizer, m) for m in self.markers}

    def in_reasoning(self, opening: str) -> bool:
        return False  # every message of the output opens with its own header

    def splitter(self, in_reasoning: bool) -> Splitter:
        return HarmonySplitter()

    def reasoning_tokens(self, token_ids: list[int], in_reasoning: bool) -> int:
        """The analysis message's tokens, its header and end included, where the output opens
        with one (the tokens of a later analysis message are not counted)."""
        end = self.ids[END]
        if end is None or end not in token_ids:
            return 0
        head = token_ids[: token_ids.index(end) + 1]
        return len(head) if head[:1] == [self.ids[CHANNEL]] else 0

    def reasoning_grammar(self, in_reasoning: bool, budget: int | None) -> str:
        missing = [m for m, token in self.ids.items() if token is None]
        if missing:
            raise ValueError(
                f"the tokenizer has no harmony tokens {missing}, which a grammar after the "
                "reasoning (structured output, tool_choice or a thinking budget) needs"
            )
        channel, message, end, start = (f"<[{self.ids[m]}]>" for m in self.markers)
        limit = "" if budget is None else f"[max_tokens={budget}]"
        analysis = f'{channel} "analysis" {message} thinking? {end} {start} "assistant"'
        return (
            f'start: ({analysis})? {channel} "final" {message} @answer\n'
            f"thinking{limit}: /(.|\\n)+/\n"
        )


PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1Parser.name: DeepSeekR1Parser,
    Qwen3Parser.name: Qwen3Parser,
    HarmonyParser.name: HarmonyParser,
}


def get_reasoning_parser(name: str, hf_tokenizer: Any) -> ReasoningParser:
    """The parser ``--reasoning-parser`` names, bound to the model's tokenizer."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name](hf_tokenizer)


def single_token_id(hf_tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` where the tokenizer has it as one token, else None."""
    token_id = hf_tokenizer.convert_tokens_to_ids(text)
    unknown = getattr(hf_tokenizer, "unk_token_id", None)
    if not isinstance(token_id, int) or token_id == unknown:
        return None
    return token_id if hf_tokenizer.decode([token_id]) == text else None


def after_reasoning(
    parser: ReasoningParser,
    in_reasoning: bool,
    answer: Constraint | None,
    budget: int | None,
) -> Constraint:
    """One grammar: the reasoning (at most ``budget`` tokens of it), its end marker, then the
    answer, which ``answer`` constrains (None: any text)."""
    from engine_core.grammar import named_grammar

    main = parser.reasoning_grammar(in_reasoning, budget)
    if answer is None:
        answer_grammar = {"name": "answer", "lark_grammar": "start: /(.|\\n)*/\n"}
    else:
        answer_grammar = named_grammar(answer, "answer")
    grammar = {"grammars": [{"lark_grammar": main}, answer_grammar]}
    return Constraint(ConstraintKind.LLGUIDANCE, json.dumps(grammar))
