"""Incremental detokenization and stop strings, one instance per generated sequence.

Byte-level BPE splits a multi-byte UTF-8 character across tokens, so decoding a token on its own
can give U+FFFD. IncrementalDetokenizer decodes a short window of recent tokens twice (without and
with the new ones) and releases only the text the new tokens add once it no longer ends in U+FFFD;
the window (at most CONTEXT_TOKENS released tokens before the new ones) keeps the cost per step
constant. flush() at the end releases the rest the same way, so the concatenated deltas equal
``decode(all ids)`` for every tokenizer whose text the window's context determines (a full
decode settles the end where the window's text visibly disagrees). push() takes any
number of tokens at once: the serving code hands it everything that arrived since its last flush
(a coalesced SSE chunk, or --stream-interval tokens), so it decodes once per chunk rather than
once per token, and flush() takes the last tokens itself so a response that streams nothing
decodes once in all.

StopStringMatcher sits after it: it holds back the longest suffix of the text that could still
grow into a stop string, so no partial stop text is ever sent, and truncates at the first match
(after it, with ``include_stop``: vLLM's include_stop_str_in_output).
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
# (docs/design/frontend-host-costs.md, "What moved it", item 7).
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas with no broken characters mid-stream."""

    def __init__(self, decode: Decode, byte_level: bool = False) -> None:
        self._decode = decode
        # A byte-level BPE decode (GPT-2, Llama 3, Qwen, SmolLM2) is the UTF-8 of its tokens'
        # bytes: once the released text ends on a whole character, the new tokens' text alone
        # is what the whole sequence's decode adds, so no window is decoded before them (one
        # decode of 16 tokens a chunk instead of two of 4 and 20).
        self._byte_level = byte_level
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
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # a character is still split across tokens: wait for the rest
        return self._release(new_text[len(prefix_text) :])

    def flush(self, token_ids: Sequence[int] = ()) -> str:
        """Add the last ``token_ids`` and release whatever remains, so that ``text`` is
        ``decode(token_ids)`` wherever ``push``'s windows read their context right.

        The window's decode, not a full one: at the end of 256 streams of 512 tokens the full
        decodes (173 us each on the 2-core CPU machine) queued on the event loop for 44 ms. A
        response that streamed nothing has an empty window prefix, so its one decode is the
        full decode. Where the window's text does not start with its prefix's (a tokenizer
        whose text depends on more context than the window holds), the full decode settles the
        end, as far as what was sent allows."""
        self.token_ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        if new_text.startswith(prefix_text):
            return self._release(new_text[len(prefix_text) :])
        final = self._decode(self.token_ids)
        if final.startswith(self.text):
            delta = final[len(self.text) :]
        else:  # a tokenizer whose windowed decode disagrees with the full one: keep the stream
            logger.warning("incremental detokenization diverged from the full decode")
            delta = ""
        return self._release(delta)

    def _decode_window(self) -> tuple[str, str]:
        """The window's text without and with the pending tokens (``ids[read:]``)."""
        if self._byte_level:
            return "", self._decode(self.token_ids[self._read :])
        start = max(self._prefix, self._read - CONTEXT_TOKENS)
        prefix_text = self._decode(self.token_ids[start : self._read])
        if start > self._prefix and prefix_text.startswith(_REPLACEMENT):
            # The short window starts inside a character. A byte-fallback decoder (Llama 2,
            # Gemma) then replaces the whole run of byte tokens, the new ones too, so widen it
            # to the last release, which starts on a character.
            start = self._prefix
            prefix_text = self._decode(self.token_ids[start : self._read])
        return prefix_text, self._decode(self.token_ids[start:])

    def _release(self, delta: str) -> str:
        """Mark every token decoded and ``delta`` (their text) released."""
        self._prefix, self._read = self._read, len(self.token_ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to send."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.text = ""  # everything seen, truncated at the stop string once one matched
        self.sent = 0  # chars of text already released
        self.matched: str | None = None

    def feed(self, delta: str, final: bool = False, armed: bool = True) -> str:
        """Add text; return the part safe to release. After a match, text ends before it.
        ``armed=False`` (within min_tokens): no match ends in this text; one that began in it
        may end in later, armed text (held back as any stop string's beginning is)."""
        if self.matched is not None:
            return ""
        old_len = len(self.text)
        self.text += delta
        if self.stop and armed and self._truncate_at_match(old_len):
            return self._release(len(self.text))
        end = len(self.text) if final else len(self.text) - self._holdback()
        return self._release(end)

    def _truncate_at_match(self, old_len: int) -> bool:
        """Cut at the first match that ends past ``old_len`` (in the new text): each string is
        looked for from where it could first end there, never wholly inside older text, which
        was searched before or held off by min_tokens."""
        text = self.text
        hits = [(i, s) for s in self.stop if (i := text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, self.matched = min(hits)
        end = index + len(self.matched) if self.include_stop else index
        self.text = self.text[:end]
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
    """Token ids in, releasable text out: detokenizer + stop strings for one sequence.

    ``min_tokens``: no stop string ends within the text of the first that many tokens (as
    vLLM, whose engine holds off EOS and stop token ids as long; a stop string is the
    frontend's)."""

    def __init__(
        self,
        decode: Decode,
        stop: Sequence[str] = (),
        byte_level: bool = False,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.detok = IncrementalDetokenizer(decode, byte_level)
        self.matcher = StopStringMatcher(stop, include_stop)
        self.unarmed_left = min_tokens  # tokens still to come before a stop string may end
        # Once a stop string matched: how many tokens the stream took in all. A run of
        # several (speculative drafts) goes in one token at a time, as a plain engine's steps
        # bring them, so it stops at the token where one token at a time would have: those
        # after it in the run would not have been generated, and are not output.
        self.tokens_to_stop = 0

    def push(self, token_ids: Sequence[int]) -> str:
        if not self.matcher.stop or len(token_ids) <= 1:
            return self._push(token_ids)
        out = ""
        for token in token_ids:
            out += self._push([token])
            if self.stopped:
                break
        return out

    def finish(self, token_ids: Sequence[int] = ()) -> str:
        """The sequence ended with ``token_ids`` (not pushed yet): release the remaining text (no
        holdback, stop strings still cut)."""
        if self.matcher.stop and len(token_ids) > 1:
            out = self.push(token_ids[:-1])
            return out if self.stopped else out + self._finish(token_ids[-1:])
        return self._finish(token_ids)

    def _push(self, token_ids: Sequence[int]) -> str:
        if not self.unarmed_left:
            out = self.matcher.feed(self.detok.push(token_ids))
        else:
            held, armed = self._split(token_ids)
            out = self.matcher.feed(self.detok.push(held), armed=False)
            out += self.matcher.feed(self.detok.push(armed)) if armed else ""
        self._count_to_stop()
        return out

    def _finish(self, token_ids: Sequence[int]) -> str:
        held, armed = self._split(token_ids)
        out = self.matcher.feed(self.detok.push(held), armed=False) if held else ""
        final = self.detok.flush(armed)  # flushed even where empty: text split across tokens
        out += self.matcher.feed(final, final=True, armed=self.unarmed_left == 0)
        self._count_to_stop()
        return out

    def _count_to_stop(self) -> None:
        if self.stopped and not self.tokens_to_stop:
            self.tokens_to_stop = len(self.detok.token_ids)

    def _split(self, token_ids: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
        """(the tokens still within min_tokens, the rest); counts the former off."""
        k = min(self.unarmed_left, len(token_ids))
        self.unarmed_left -= k
        return token_ids[:k], token_ids[k:]

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
        """The output text so far, cut at the stop string when one matched."""
        return self.matcher.text
