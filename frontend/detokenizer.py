"""Incremental detokenization and stop strings, one instance per generated sequence.

Byte-level BPE splits a multi-byte UTF-8 character across tokens, so decoding a token on its own
can give U+FFFD. IncrementalDetokenizer decodes a short window of recent tokens twice (without and
with the new ones) and releases only the text the new tokens add once it no longer ends in U+FFFD;
the window (at most CONTEXT_TOKENS released tokens before the new ones) keeps the cost per step
constant. flush() at the end reconciles with a full decode, so
the concatenated deltas equal ``decode(all ids)`` exactly. push() takes any number of tokens at
once: the serving code hands it everything that arrived since its last flush (a coalesced SSE
chunk, or --stream-interval tokens), so it decodes once per chunk rather than once per token, and
flush() takes the last tokens itself so a response that streams nothing decodes once in all.

StopStringMatcher sits after it: it holds back the longest suffix of the text that could still
grow into a stop string, so no partial stop text is ever sent, and truncates at the first match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

Decode = Callable[[list[int]], str]
_REPLACEMENT = "\ufffd"
# Released tokens decoded before the new ones, for the context a token's text may depend on (a
# SentencePiece word's leading space, the bytes of a character split across tokens). A decode
# costs about its length: with --stream-interval 16, four instead of the whole last chunk took a
# push of 16 tokens from 14.0-14.6 to 10.5-10.8 us on the 2-core CPU machine, SmolLM2's tokenizer
# (scripts/bench_detokenizer.py).
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas with no broken characters mid-stream."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self.text = ""  # everything released so far
        # ids[prefix:read] were decoded into text already; ids[read:] are still pending.
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (may be empty while a character is split)."""
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        start = max(self._prefix, self._read - CONTEXT_TOKENS)
        prefix_text = self._decode(self.token_ids[start : self._read])
        if start > self._prefix and prefix_text.startswith(_REPLACEMENT):
            # The short window starts inside a character. A byte-fallback decoder (Llama 2,
            # Gemma) then replaces the whole run of byte tokens, the new ones too, so widen it
            # to the last release, which starts on a character.
            start = self._prefix
            prefix_text = self._decode(self.token_ids[start : self._read])
        new_text = self._decode(self.token_ids[start:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # a character is still split across tokens: wait for the rest
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self, token_ids: Sequence[int] = ()) -> str:
        """Add the last ``token_ids`` and release whatever remains, so that
        ``text == decode(token_ids)`` exactly (one full decode)."""
        self.token_ids.extend(token_ids)
        final = self._decode(self.token_ids)
        if final.startswith(self.text):
            delta = final[len(self.text) :]
        else:  # a tokenizer whose windowed decode disagrees with the full one: keep the stream
            logger.warning("incremental detokenization diverged from the full decode")
            delta = ""
        self.text += delta
        self._prefix = self._read = len(self.token_ids)
        return delta


class StopStringMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to send."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything seen, truncated at the stop string once one matched
        self.sent = 0  # chars of text already released
        self.matched: str | None = None

    def feed(self, delta: str, final: bool = False) -> str:
        """Add text; return the part safe to release. After a match, text ends before it."""
        if self.matched is not None:
            return ""
        old_len = len(self.text)
        self.text += delta
        if self.stop and self._truncate_at_match(max(0, old_len - self._longest + 1)):
            return self._release(len(self.text))
        end = len(self.text) if final else len(self.text) - self._holdback()
        return self._release(end)

    def _truncate_at_match(self, start: int) -> bool:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        index, self.matched = min(hits)
        self.text = self.text[:index]
        return True

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out


class TextStream:
    """Token ids in, releasable text out: detokenizer + stop strings for one sequence."""

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.matcher = StopStringMatcher(stop)

    def push(self, token_ids: Sequence[int]) -> str:
        return self.matcher.feed(self.detok.push(token_ids))

    def finish(self, token_ids: Sequence[int] = ()) -> str:
        """The sequence ended with ``token_ids`` (not pushed yet): release the remaining text (no
        holdback, stop strings still cut)."""
        return self.matcher.feed(self.detok.flush(token_ids), final=True)

    @property
    def has_stop_strings(self) -> bool:
        """Whether text must be decoded as tokens arrive, to catch a stop string early."""
        return bool(self.matcher.stop)

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: the caller aborts the request in the engine."""
        return self.matcher.matched is not None

    @property
    def text(self) -> str:
        """The output text so far, cut before the stop string when one matched."""
        return self.matcher.text
