"""Speculative decoding: a proposer guesses a request's next tokens, the target model scores the
guesses in the same step as the request's own next token, and the scheduler keeps the longest
run of guesses the target agrees with, plus the target's own token after it.

One step of a speculating request computes its last known token and its K drafts together
(K + 1 positions of one forward). At each position the runner draws the target's token exactly
as a step without drafts would draw it there (greedy or sampled, its penalties counting only the
tokens before the position, a seeded row's noise keyed by its output position): a draft is kept
when the target's own token equals it. The kept drafts and the target's token at the first
disagreement (or, when every draft was right, its token after the last one) are the step's
output, 1 to K + 1 tokens. Every output token is thus the target's own draw given the tokens
before it, so greedy and seeded requests give the non-speculative output token for token and
unseeded ones its distribution; for a draft that is one token (n-gram), keeping it exactly when
the target draws it is the rejection-sampling rule (accept with probability p(draft), else draw
from p without the draft). The KV of the rejected drafts is written but never read, as the next
step writes over it (the scheduler moves the request's computed tokens back). A linear-attention
state cannot be written over so: a verify step keeps the state after each of its positions and
the last kept draft's becomes the request's (docs/design/qwen3-next.md, "Speculation").

Proposers: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of
the context's last n tokens, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), no
weights, asked request by request; ``draft_model`` (engine_core/draft_model.py: a smaller model
of the same tokenizer, its greedy tokens), ``eagle3`` (engine_core/eagle3.py: a head that
drafts from the target's hidden states) and ``mtp`` (engine_core/mtp.py: the multi-token
prediction layer a DeepSeek-V3, Qwen3-Next or Qwen3.5 checkpoint ships), BatchProposers asked once a
step for every row whose verify slots the scheduler reserved. A constrained request's matcher
takes the drafts it allows to fill each drafted position's mask, then gives them back
(engine_core/grammar.py); the update feeds it the kept tokens. A request that scores or pools
its prompt decodes one token a step. A speculating engine runs the simple loop (each step's
accepted count decides the next plan), not the overlapped one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# The proposers the model runner loads (the others need no weights).
LOADED_METHODS = ("draft_model", "eagle3", "mtp")
# vLLM's other spellings of a method, read as ours.
ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}
# The peers' other methods, refused by name until built.
NOT_YET = {
    "eagle": "EAGLE heads are not supported yet",
    "medusa": "Medusa heads are not supported",
}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (the peers' spelling, JSON)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model's: a folder or hub id of the target's vocabulary; eagle3's: the head's folder
    model: str | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config of ``text``; ValueError naming the field that is wrong or unknown."""
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown field {unknown[0]!r}")
        if "method" not in value and "model" in value:
            value["method"] = "draft_model"  # the peers read a bare model as a draft model
        method = value.get("method")
        if isinstance(method, str) and method in ALIASES:
            method = value["method"] = ALIASES[method]
        if method in NOT_YET:
            raise ValueError(f"--speculative-config method {method!r}: {NOT_YET[method]}")
        if method not in METHODS:
            raise ValueError(f"--speculative-config method must be one of {list(METHODS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError('--speculative-config needs "num_speculative_tokens"')
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        checks: list[tuple[str, Any, int, int]] = [
            ("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", self.prompt_lookup_max, 1, 64),
            ("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max),
        ]
        for name, value, low, high in checks:
            if type(value) is not int or not low <= value <= high:
                raise ValueError(
                    f"--speculative-config {name} must be an integer in [{low}, {high}], "
                    f"got {value!r}"
                )
        needs_model = self.method in ("draft_model", "eagle3")
        if needs_model and not (isinstance(self.model, str) and self.model):
            raise ValueError(f'--speculative-config method {self.method!r} needs a "model"')
        lookup = (self.prompt_lookup_max, self.prompt_lookup_min)
        if self.method != "ngram" and lookup != (4, 2):  # the defaults: not asked for
            raise ValueError(
                f"--speculative-config method {self.method!r} takes no prompt_lookup_max or "
                "prompt_lookup_min (they are the n-gram proposer's)"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError("--speculative-config method 'ngram' takes no \"model\"")
        if self.method == "mtp" and self.model is not None:
            raise ValueError(
                "--speculative-config method 'mtp' takes no \"model\": the MTP layer is read "
                "from the target's own checkpoint"
            )


class Proposer(Protocol):
    """What the scheduler asks for drafts: at most ``max_drafts`` a step."""

    max_drafts: int

    def propose(self, token_ids: list[int], k: int) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class DraftRow:
    """One request in a batched proposal: its last known token ``token`` at ``position`` (the
    KV of the tokens before it is in the cache), the block table that covers its verify chunk
    (that token and ``count`` drafts), and how many drafts it wants."""

    token: int
    position: int
    block_ids: Sequence[int]
    count: int
    request_id: str = ""  # an EAGLE-3 head reads the target's features it kept per request


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that drafts for all of a step's speculating requests at once (a draft model,
    engine_core/draft_model.py): exactly ``row.count`` tokens for each row, in order."""

    max_drafts: int

    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]: ...


class NgramProposer:
    """Prompt lookup over a request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_drafts = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens: those that followed the latest earlier occurrence of the last n
        tokens, for the longest n that occurs; none where nothing repeats."""
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = latest_match(tokens, n)
            if start >= 0:
                return tokens[start + n : start + n + k].tolist()
        return []


def latest_match(tokens: np.ndarray, n: int) -> int:
    """Where the latest earlier occurrence of the last ``n`` tokens starts (one that has a
    token after it, so not the tail itself), or -1."""
    tail = tokens[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n]
    hits = np.flatnonzero((windows == tail).all(axis=1))
    return int(hits[-1]) if hits.size else -1


def accepted_run(drafts: tuple[int, ...], target: list[int]) -> list[int]:
    """The step's output: the drafts the target agrees with (``target[i]`` is its token after
    the context up to draft i), then its own token where it first disagrees (``target`` has one
    more than ``drafts``: its token after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and target[accepted] == drafts[accepted]:
        accepted += 1
    return [*drafts[:accepted], target[accepted]]


def make_proposer(
    config: SpeculativeConfig | None, draft: BatchProposer | None = None
) -> Proposer | BatchProposer | None:
    """The engine's proposer: ``draft`` (what the model runner loaded: the draft model, the
    EAGLE-3 head, the MTP layer) for ``draft_model``, ``eagle3`` and ``mtp``, prompt lookup
    for ``ngram``, None without speculation."""
    if config is None:
        return None
    if config.method in LOADED_METHODS:
        if draft is None:
            raise ValueError(f"--speculative-config method {config.method!r}: nothing loaded")
        return draft
    return NgramProposer(config)
