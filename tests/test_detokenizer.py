"""Incremental detokenization and stop strings, against the default model's byte-level BPE
tokenizer: the streamed pieces must concatenate to exactly ``tokenizer.decode(all ids)``, never
carry a broken character, and never let out any part of a stop string."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from frontend.detokenizer import (
    CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
)

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Café crème, naïve façade, smörgåsbord and jalapeño.",
    "日本語のテキストと中文文本, mixed with English.",
    "Emoji: 🚀🔥 and a family 👨‍👩‍👧 plus flags 🇫🇷🇯🇵.",
    "  leading spaces,\n\nnew lines\tand tabs  ",
    "Ωμέγα, Привет мир, مرحبا بالعالم, שלום",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(params=[False, True], ids=["window", "byte-level"])
def byte_level(request: pytest.FixtureRequest) -> bool:
    """Both ways the detokenizer decodes SmolLM2's byte-level BPE: with a window of released
    tokens before the new ones (any tokenizer), and the new tokens alone (byte-level only)."""
    return request.param


def decode_fn(tokenizer: Any) -> Any:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    """Split ids into runs of 1-3 tokens, as an engine step or a batched SSE flush delivers."""
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        out.append(ids[i : i + k])
        i += k
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", ["one", "chunks"])
def test_stream_reassembles_exact_text_without_broken_chars(
    tokenizer: Any, text: str, step: str, byte_level: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in expected
    detok = IncrementalDetokenizer(decode_fn(tokenizer), byte_level)
    pieces = [[t] for t in ids] if step == "one" else chunked(ids, random.Random(len(text)))
    deltas = [detok.push(p) for p in pieces]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected


def test_split_character_is_held_until_complete(tokenizer: Any, byte_level: bool) -> None:
    ids = tokenizer.encode(" 🚀", add_special_tokens=False)
    # The tokenizer really does split the emoji over several byte tokens.
    assert len(ids) > 1
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(decode_fn(tokenizer), byte_level)
    early = [detok.push([t]) for t in ids[:-1]]
    last = detok.push(ids[-1:])
    assert "".join(early) + last == " 🚀"
    assert "🚀" in last


def test_random_ids_reassemble_to_the_full_decode(tokenizer: Any, byte_level: bool) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    for trial in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if trial % 2:  # only single-byte tokens (ids 17..272 here): characters split a lot
            ids = [rng.randrange(17, 273) for _ in ids]
        ids = [t for t in ids if t not in special] or [42]
        detok = IncrementalDetokenizer(decode_fn(tokenizer), byte_level)
        text = "".join(detok.push(p) for p in chunked(ids, rng)) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_end_of_a_long_stream_decodes_only_its_window(tokenizer: Any) -> None:
    """flush() after 512 streamed tokens decodes the window (CONTEXT_TOKENS and the last chunk),
    not the whole sequence, and still adds up to the full decode."""
    rng = random.Random(3)
    ids = [rng.randrange(300, 40000) for _ in range(512)]
    decoded: list[int] = []

    def counting(seq: list[int]) -> str:
        decoded.append(len(seq))
        return tokenizer.decode(seq, skip_special_tokens=True)

    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.push(ids[i : i + 16]) for i in range(0, 496, 16))
    decoded.clear()
    text += detok.flush(ids[496:])
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(decoded) <= CONTEXT_TOKENS + 16 + 16  # what push held back, plus the last chunk


def test_a_window_that_cannot_settle_the_end_falls_back_to_the_full_decode() -> None:
    """A decoder whose text changes before the window when a token comes (here: all of it turns
    upper case once id 0 appears) makes flush() reconcile with the full decode; what was sent
    already cannot change, so it adds nothing rather than contradict it."""

    def decode(ids: list[int]) -> str:
        text = "".join(chr(ord("a") + i) for i in ids)
        return text.upper() if 0 in ids else text

    detok = IncrementalDetokenizer(decode)
    assert detok.push([1, 2, 3, 4, 5, 6]) == "bcdefg"
    assert detok.flush([0]) == ""
    assert detok.text == "bcdefg"


def test_a_window_that_misreads_its_context_is_settled_by_the_full_decode() -> None:
    """A decoder whose text depends on more than the window holds (here: a decode of fewer than
    five tokens comes out in upper case) fails the window's check at the end, and the full
    decode supplies the rest."""

    def decode(ids: list[int]) -> str:
        text = "".join(chr(ord("a") + i) for i in ids)
        return text.upper() if len(ids) < 5 else text

    detok = IncrementalDetokenizer(decode)
    assert detok.push([1, 2, 3, 4, 5]) == "bcdef"
    assert detok.flush([6]) == "g"
    assert detok.text == decode([1, 2, 3, 4, 5, 6])


def test_special_tokens_inside_split_characters_reassemble(
    tokenizer: Any, byte_level: bool
) -> None:
    """Special tokens (dropped by the decode) between the byte tokens of a character, and runs
    that hold nothing but them, still add up to the full decode."""
    rng = random.Random(5)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(40):
        ids = [
            rng.choice(special) if rng.random() < 0.3 else rng.randrange(17, 273)
            for _ in range(rng.randint(1, 40))
        ]
        detok = IncrementalDetokenizer(decode_fn(tokenizer), byte_level)
        text = "".join(detok.push(p) for p in chunked(ids, rng)) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def sentencepiece_style_tokenizer() -> Any:
    """A Llama-2/Gemma-style tokenizer built here: words marked by a leading "▁" that the
    decoder turns into a space (and strips at the start of a decode), characters outside the
    vocabulary as byte tokens (<0xE6>) that the decoder fuses back into UTF-8."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{i:02X}>": 3 + i for i in range(256)})
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,.!?▁":
        vocab[c] = len(vocab)
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "w"), ("o", "r"), ("▁", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


@pytest.mark.parametrize("chunk", [1, 2, 5, 16])
def test_sentencepiece_byte_fallback_stream_reassembles(chunk: int) -> None:
    """Chunks longer than the decode window's context (CONTEXT_TOKENS), whose window then starts
    inside a character's bytes or on a word's stripped leading space, still add up to the full
    decode, with no broken character in any piece."""
    tok = sentencepiece_style_tokenizer()

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    for text in TEXTS:
        ids = tok.encode(text).ids
        detok = IncrementalDetokenizer(decode)
        deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        deltas.append(detok.flush())
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == decode(ids)


def test_stop_string_is_trimmed_and_never_streamed(tokenizer: Any, byte_level: bool) -> None:
    text = "The answer is forty-two. END of the answer, and more text after it."
    stop = "END of"
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = text[: text.index(stop)]
    stream = TextStream(decode_fn(tokenizer), [stop], byte_level)
    sent = ""
    for t in ids:
        sent += stream.push([t])
        assert expected.startswith(sent)  # nothing beyond the cut, ever
        if stream.stopped:
            break
    assert stream.stopped
    sent += stream.finish()
    assert sent == expected == stream.text


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_no_stop_string_ends_within_min_tokens(
    tokenizer: Any, byte_level: bool, chunk: int
) -> None:
    """As vLLM: a stop string ending in the first min_tokens tokens' text is passed over; the
    first that ends after it cuts, one that began before it included; in chunks of any size."""
    text = "One. Two. Three. Four. Five. Six. Seven."
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = decode_fn(tokenizer)
    for min_tokens in range(len(ids) + 1):
        held_text = decode(ids[:min_tokens])
        # By hand: the first ". " whose end lies past the text of the first min_tokens tokens.
        ends = [i + 2 for i in range(len(text)) if text.startswith(". ", i)]
        end = next((e for e in ends if e > len(held_text)), None)
        expected = text if end is None else text[: end - 2]
        stream = TextStream(decode, [". "], byte_level, min_tokens=min_tokens)
        sent = ""
        for i in range(0, len(ids), chunk):
            sent += stream.push(ids[i : i + chunk])
            if stream.stopped:
                break
        sent += stream.finish()
        assert (sent, stream.stopped) == (expected, end is not None), min_tokens


def test_a_shorter_stop_string_inside_held_off_text_is_passed_over(
    tokenizer: Any, byte_level: bool
) -> None:
    """Two stop strings of different lengths: the short one, wholly inside the first
    min_tokens tokens' text, must not match once the long one's window reaches back over it."""
    text = "hello xyz and more words follow"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = decode_fn(tokenizer)
    held = 1 + next(k for k in range(len(ids)) if "x" in decode(ids[: k + 1]))  # past the "x"
    stream = TextStream(decode, ["x", "abcdef"], byte_level, min_tokens=held)
    sent = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert (sent, stream.stopped) == (text, False)


def test_partial_stop_is_held_then_released_on_mismatch() -> None:
    m = StopStringMatcher(["world"])
    assert m.feed("Hello wor") == "Hello "
    assert m.feed("k and wo") == "work and "
    assert m.feed("rl") == ""
    assert m.feed("d!") == ""
    assert m.matched == "world"
    assert m.text == "Hello work and "


def test_held_text_is_released_when_the_sequence_ends() -> None:
    m = StopStringMatcher(["world"])
    assert m.feed("abc wo") == "abc "
    assert m.feed("", final=True) == "wo"
    assert m.matched is None


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopStringMatcher(["cat", "at the"])
    assert m.feed("look at the cat") == "look "
    assert m.matched == "at the"


def test_stop_string_with_a_multibyte_character(tokenizer: Any, byte_level: bool) -> None:
    text = "ready 🚀 go now"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(decode_fn(tokenizer), ["🚀 go"], byte_level)
    sent = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert sent == "ready "
    assert stream.stopped


# ---- runs of tokens of any length (a coalesced SSE chunk, or --stream-interval tokens), the
# last run handed to finish() undecoded: the pieces reassemble the full decode, and a stop string
# cuts the same text whatever the run lengths.


def runs(ids: list[int], longest: int, rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, longest)
        out.append(ids[i : i + k])
        i += k
    return out


def stream_text(
    tokenizer: Any, ids: list[int], longest: int, seed: int, stop: list[str], byte_level: bool
) -> str:
    """Push all runs but the last, then finish() with the last, as serving.Generation does."""
    stream = TextStream(decode_fn(tokenizer), stop, byte_level)
    pieces = runs(ids, longest, random.Random(seed))
    sent = [stream.push(p) for p in pieces[:-1] if not stream.stopped]
    sent.append(stream.finish(pieces[-1]))
    assert all("\ufffd" not in s for s in sent)
    return "".join(sent)


@pytest.mark.parametrize("longest", [1, 4, 16, 1000])
@pytest.mark.parametrize("text", TEXTS)
def test_runs_of_any_length_reassemble_the_full_decode(
    tokenizer: Any, text: str, longest: int, byte_level: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    for seed in range(5):
        assert stream_text(tokenizer, ids, longest, seed, [], byte_level) == want


@pytest.mark.parametrize("longest", [1, 4, 1000])
def test_a_stop_string_cuts_the_same_text_whatever_the_runs(
    tokenizer: Any, longest: int, byte_level: bool
) -> None:
    text = "Emoji: 🚀🔥 then STOP 🇫🇷 and more text after the stop."
    ids = tokenizer.encode(text, add_special_tokens=False)
    for seed in range(5):
        assert (
            stream_text(tokenizer, ids, longest, seed, ["STOP 🇫"], byte_level)
            == "Emoji: 🚀🔥 then "
        )


def test_encode_all_gives_what_hf_encode_gives(tokenizer: Any) -> None:
    """The frontend encodes through the Rust tokenizer directly; the ids must be HF's."""
    from frontend.tokenizer import Tokenizer

    texts = [
        "Hello, world!",
        "",
        "  leading spaces and émojis 🤖 and 中文",
        "<|im_start|>user\nhi<|im_end|>\n",  # special tokens written as text
        "a" * 3000,
    ]
    ours = Tokenizer(tokenizer)
    for special in (True, False):
        want = [tokenizer.encode(t, add_special_tokens=special) for t in texts]
        assert ours.encode_all(texts, add_special_tokens=special) == want


def test_only_a_byte_level_decoder_streams_without_a_window(tokenizer: Any) -> None:
    """The serving tokenizer takes the window-free path for SmolLM2's byte-level BPE and keeps
    the window for a SentencePiece-style decoder, whose text depends on the tokens before."""
    from transformers import PreTrainedTokenizerFast

    from frontend.tokenizer import Tokenizer

    assert Tokenizer(tokenizer).byte_level
    sentencepiece = PreTrainedTokenizerFast(tokenizer_object=sentencepiece_style_tokenizer())
    assert not Tokenizer(sentencepiece).byte_level


def tokens_to_first_stop(decode: Any, ids: list[int], stops: list[str]) -> int:
    """The tokens a one-token-a-step engine generates before a stop string ends it, from full
    decodes: the fewest whose text holds one, and ends on a whole character (text is released
    only then)."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        if any(stop in text for stop in stops) and not text.endswith("\ufffd"):
            return n
    raise AssertionError("no stop string in the text")


STOP_CASES = [
    ("def sub(a, b):\n    return a - b\n\ndef mul(a, b):", ["a - b"]),
    ("Emoji: 🚀🔥 then STOP 🇫🇷 and more text after the stop.", ["STOP 🇫"]),
    ("Emoji: 🚀🔥 then STOP 🇫🇷 and more text after the stop.", ["🔥 then"]),
    # The later-starting string ends first: one token at a time, it is the one that stops.
    ("Tell me the abcdef of cd things", ["abcdef", "cd"]),
]


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("longest", [1, 4, 1000])
@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
def test_a_run_that_completes_a_stop_string_stops_where_one_token_at_a_time_would(
    tokenizer: Any, longest: int, byte_level: bool, text: str, stops: list[str],
    include_stop: bool,
) -> None:  # fmt: skip
    """Runs of several tokens (speculative drafts) pushed until a stop string matches, then
    finish()ed, as Generation does: ``tokens_to_stop`` and the text are those of an engine
    that generates one token a step (from full decodes), whatever the runs."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = decode_fn(tokenizer)
    want = tokens_to_first_stop(decode, ids, stops)
    stop_text = decode(ids[:want])
    first, stop = min((stop_text.find(s), s) for s in stops if s in stop_text)
    want_text = stop_text[: first + len(stop) if include_stop else first]
    for seed in range(5):
        stream = TextStream(decode, stops, byte_level, include_stop=include_stop)
        pieces, sent = runs(ids, longest, random.Random(seed)), ""
        for i, piece in enumerate(pieces):
            sent += stream.finish(piece) if i == len(pieces) - 1 else stream.push(piece)
            if stream.stopped:
                break
        assert stream.stopped and stream.tokens_to_stop == want
        assert sent + stream.finish() == want_text


@pytest.mark.parametrize("longest", [2, 5, 1000])
def test_a_byte_fallback_run_stops_where_one_token_at_a_time_would(longest: int) -> None:
    """A Llama-2-style tokenizer (byte tokens fused by its decoder; the detokenizer's window
    widens when it starts inside a character) through runs: the one-token-a-step count."""
    from tokenizers import Tokenizer

    tok: Tokenizer = sentencepiece_style_tokenizer()

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    ids = tok.encode("é€€STOP more words here").ids
    want = tokens_to_first_stop(decode, ids, ["€STOP"])
    for seed in range(5):
        stream = TextStream(decode, ["€STOP"])
        for piece in runs(ids, longest, random.Random(seed)):
            stream.push(piece)
            if stream.stopped:
                break
        assert stream.stopped and stream.tokens_to_stop == want
        assert stream.text == "é€"
