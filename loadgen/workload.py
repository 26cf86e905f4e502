"""What the load generator sends: prompts (token ids or text) and output lengths per request.

Four sources: random token ids of a set or ranged length (the default), one fixed prompt for
every request (``--prompt``), a JSONL file, or a ShareGPT-format JSON file. Backends that take
token ids (zmq, ``--pretok``) get ids; the HTTP text backends get text, decoded from the random ids
with the model's tokenizer, so the server's own token count can differ a little from the length
asked for (the records keep the server's count).

Random prompts are drawn afresh for every run (the seed is mixed with the run number), so a
repeat run never hits the prefix cache on the previous run's prompts. ``--unique-prompts`` puts a
distinct head in front of every fixed or dataset prompt for the same reason.

Conversations (``--conversations C --turns T``) are the multi-turn chat workload: each has T
random user messages, and turn k's prompt is the optional shared system prompt
(``--shared-prefix-len``, one per run, the same in every conversation), every earlier user
message with the server's reply to it, and user message k. The replies are only known as the
run goes, so a ``Conversation`` makes each turn's request from what it has been told so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class TokenizerLike(Protocol):
    """The slice of a Hugging Face tokenizer the workloads need."""

    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class LenRange:
    """A token count: one value, or an inclusive range drawn uniformly per request."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LenRange:
        """``"128"`` -> 128..128, ``"64:256"`` -> 64..256."""
        bad = f"bad length {text!r}: expected N or LOW:HIGH with 1 <= LOW <= HIGH"
        low, _, high = text.partition(":")
        try:
            lo, hi = int(low), int(high or low)
        except ValueError:
            raise ValueError(bad) from None
        if lo < 1 or hi < lo:
            raise ValueError(bad)
        return cls(lo, hi)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt as ids or text (or both) and how many tokens to ask for.

    A conversation's turn also carries its chat messages (what the chat route sends; the
    completions route sends ``prompt_text``, the same turns joined) and asks the backend to keep
    the reply's text, which the next turn's prompt contains."""

    prompt_ids: list[int] | None
    prompt_text: str | None
    output_len: int
    messages: list[dict[str, str]] | None = None
    keep_reply: bool = False

    @property
    def prompt_len(self) -> int:
        """Our own token count: exact for ids; the server's count replaces it for text."""
        return len(self.prompt_ids) if self.prompt_ids is not None else 0


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int
    input_len: LenRange
    output_len: LenRange | None  # None: the dataset's own lengths, else the default
    prompt: str | None = None  # one fixed prompt for every request
    dataset: Path | None = None
    dataset_format: str = "auto"  # auto | jsonl | sharegpt
    unique_prompts: bool = False
    seed: int = 0
    conversations: int | None = None  # multi-turn: this many conversations of ``turns`` turns
    turns: int = 1
    shared_prefix_len: int = 0  # tokens of the system prompt every conversation shares


DEFAULT_OUTPUT_LEN = LenRange(128, 128)


def build_workload(
    cfg: WorkloadConfig,
    run_index: int,
    want_ids: bool,
    tokenizer: TokenizerLike | None,
    vocab: list[int] | None = None,
) -> list[RequestSpec]:
    """The requests of run ``run_index``: token ids when ``want_ids``, else text.

    ``vocab`` is the ids random prompts draw from (default: every non-special id of the
    tokenizer); a tokenizer is needed for text, for ``--prompt`` and for datasets.
    """
    rng = np.random.default_rng([cfg.seed, run_index])
    if cfg.dataset is not None:
        return dataset_workload(cfg, run_index, want_ids, _need(tokenizer), rng)
    n = cfg.num_requests
    out_lens = (cfg.output_len or DEFAULT_OUTPUT_LEN).draw(rng, n)
    if cfg.prompt is not None:
        tok = _need(tokenizer)
        texts = [
            _unique(cfg.prompt, run_index, i) if cfg.unique_prompts else cfg.prompt
            for i in range(n)
        ]
        return [_from_text(t, o, want_ids, tok) for t, o in zip(texts, out_lens, strict=True)]
    pool = np.asarray(vocab if vocab is not None else usable_ids(_need(tokenizer)))
    ids = [[int(t) for t in rng.choice(pool, size=k)] for k in cfg.input_len.draw(rng, n)]
    if want_ids:
        return [RequestSpec(p, None, o) for p, o in zip(ids, out_lens, strict=True)]
    tok = _need(tokenizer)
    return [RequestSpec(p, tok.decode(p), o) for p, o in zip(ids, out_lens, strict=True)]


@dataclass
class Conversation:
    """One multi-turn conversation: its user messages and output lengths, drawn up front, and
    the replies the server has given so far (``add_reply``, one per finished turn, in order)."""

    index: int
    system: str | None
    users: list[str]
    output_lens: list[int]
    replies: list[str] = field(default_factory=list)

    def turn(self, k: int) -> RequestSpec:
        """Turn ``k``'s request: the system prompt, turns 0..k-1 with their replies, user k."""
        if k != len(self.replies):
            raise ValueError(f"turn {k} of conversation {self.index} before turn {k - 1}'s reply")
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        for user, reply in zip(self.users[:k], self.replies, strict=True):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": self.users[k]})
        text = "\n".join(m["content"] for m in messages)
        return RequestSpec(None, text, self.output_lens[k], messages, keep_reply=True)

    def add_reply(self, text: str) -> None:
        self.replies.append(text)


def build_conversations(
    cfg: WorkloadConfig, run_index: int, tokenizer: TokenizerLike
) -> list[Conversation]:
    """Run ``run_index``'s conversations: a system prompt of ``cfg.shared_prefix_len`` random
    tokens drawn once for the run (so every conversation shares it and no other run does), and
    ``cfg.turns`` random user messages of ``cfg.input_len`` tokens per conversation."""
    assert cfg.conversations is not None
    rng = np.random.default_rng([cfg.seed, run_index])
    pool = np.asarray(usable_ids(tokenizer))

    def random_text(length: int) -> str:
        return tokenizer.decode([int(t) for t in rng.choice(pool, size=length)])

    system = random_text(cfg.shared_prefix_len) if cfg.shared_prefix_len else None
    output_len = cfg.output_len or DEFAULT_OUTPUT_LEN
    conversations = []
    for c in range(cfg.conversations):
        users = [random_text(n) for n in cfg.input_len.draw(rng, cfg.turns)]
        conversations.append(Conversation(c, system, users, output_len.draw(rng, cfg.turns)))
    return conversations


def usable_ids(tokenizer: TokenizerLike) -> list[int]:
    """Every id of the tokenizer but its special ones (EOS in a prompt would read oddly)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def dataset_workload(
    cfg: WorkloadConfig,
    run_index: int,
    want_ids: bool,
    tokenizer: TokenizerLike,
    rng: np.random.Generator,
) -> list[RequestSpec]:
    """``cfg.num_requests`` entries of the dataset in a seeded order, cycling when it is short."""
    assert cfg.dataset is not None
    entries = load_dataset(cfg.dataset, cfg.dataset_format)
    if not entries:
        raise DatasetError(f"--dataset {cfg.dataset}: no usable entries")
    order = rng.permutation(len(entries))
    specs = []
    for i in range(cfg.num_requests):
        entry = entries[int(order[i % len(entries)])]
        specs.append(_from_entry(entry, cfg, run_index, i, want_ids, tokenizer, rng))
    return specs


@dataclass(frozen=True)
class DatasetEntry:
    prompt_text: str | None
    prompt_ids: list[int] | None
    output_len: int | None  # given in the file, or the length of ShareGPT's answer
    answer_text: str | None = None


class DatasetError(ValueError):
    """A --dataset file that cannot be read as its format, naming where (the CLI's exit 2)."""


def load_dataset(path: Path, fmt: str = "auto") -> list[DatasetEntry]:
    """Read a JSONL file (one ``{"prompt"|"prompt_token_ids", "output_len"?}`` per line) or a
    ShareGPT JSON file (a list of ``{"conversations": [{"from", "value"}, ...]}``)."""
    if fmt == "auto":
        fmt = "jsonl" if path.suffix == ".jsonl" else "sharegpt"
    if fmt == "jsonl":
        lines = path.read_text().splitlines()
        return [_jsonl_line(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if fmt == "sharegpt":
        try:
            entries = [e for e in map(_sharegpt_entry, json.loads(path.read_text())) if e]
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise DatasetError(f"--dataset {path}: not a ShareGPT JSON list ({exc})") from None
        return entries
    raise DatasetError(f"unknown dataset format {fmt!r} (jsonl or sharegpt)")


def _jsonl_line(path: Path, number: int, line: str) -> DatasetEntry:
    try:
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return _jsonl_entry(obj)
    except ValueError as exc:
        raise DatasetError(f"--dataset {path}, line {number}: {exc}") from None


def _jsonl_entry(obj: dict[str, Any]) -> DatasetEntry:
    ids = obj.get("prompt_token_ids")
    text = obj.get("prompt")
    if ids is None and not isinstance(text, str):
        raise ValueError(f"a JSONL line needs 'prompt' or 'prompt_token_ids': {obj!r:.80}")
    if ids == [] and isinstance(text, str):
        ids = None  # the prompt's text then
    if ids is not None and not (
        isinstance(ids, list) and ids and all(_whole(t) and t >= 0 for t in ids)
    ):
        raise ValueError("'prompt_token_ids' must be a non-empty list of token ids (ints >= 0)")
    out = obj.get("output_len", obj.get("max_tokens"))
    if out is not None and not (_whole(out) and out >= 1):
        raise ValueError(f"'output_len' must be a whole number >= 1, got {out!r}")
    ids = [int(t) for t in ids] if ids else None
    return DatasetEntry(text, ids, None if out is None else int(out))


def _whole(value: object) -> bool:
    """An int, or a float with no fraction (JSON writers differ), never a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _sharegpt_entry(obj: dict[str, Any]) -> DatasetEntry | None:
    """The first human turn as the prompt, the reply after it as the answer (for its length)."""
    turns = obj.get("conversations") or obj.get("conversation") or []
    for i, turn in enumerate(turns[:-1]):
        if turn.get("from") in ("human", "user") and turns[i + 1].get("from") in (
            "gpt",
            "assistant",
        ):
            return DatasetEntry(turn["value"], None, None, turns[i + 1]["value"])
    return None


def _from_entry(
    entry: DatasetEntry,
    cfg: WorkloadConfig,
    run_index: int,
    i: int,
    want_ids: bool,
    tokenizer: TokenizerLike,
    rng: np.random.Generator,
) -> RequestSpec:
    if cfg.output_len is not None:
        out = cfg.output_len.draw(rng, 1)[0]
    elif entry.output_len is not None:
        out = int(entry.output_len)
    elif entry.answer_text is not None:
        out = max(1, len(tokenizer.encode(entry.answer_text, add_special_tokens=False)))
    else:
        out = DEFAULT_OUTPUT_LEN.low
    text = entry.prompt_text
    if text is None:
        assert entry.prompt_ids is not None
        ids = entry.prompt_ids
        if cfg.unique_prompts:
            ids = tokenizer.encode(_unique("", run_index, i), add_special_tokens=False) + ids
        return RequestSpec(ids, None if want_ids else tokenizer.decode(ids), out)
    if cfg.unique_prompts:
        text = _unique(text, run_index, i)
    return _from_text(text, out, want_ids, tokenizer)


def _from_text(text: str, out: int, want_ids: bool, tokenizer: TokenizerLike) -> RequestSpec:
    # Encoded as /v1/completions encodes a text prompt, so both paths see the same ids.
    ids = tokenizer.encode(text, add_special_tokens=True)
    return RequestSpec(ids, None if want_ids else text, out)


def _unique(text: str, run_index: int, i: int) -> str:
    """A head no other request of any run shares, so prefix caching cannot join them."""
    return f"[run {run_index} request {i}] {text}"


def _need(tokenizer: TokenizerLike | None) -> TokenizerLike:
    if tokenizer is None:
        raise ValueError("this workload needs a tokenizer (--tokenizer)")
    return tokenizer
