"""What the incremental detokenizer costs a streamed response: microseconds per push of
--chunk tokens (--stream-interval's chunks), the end's flush included, three ways, alternating,
three rounds: a window of the whole previous chunk before the new tokens (the window before
detokenizer.CONTEXT_TOKENS), a window of CONTEXT_TOKENS released tokens (any tokenizer), and no
window (byte-level BPE, as the server runs SmolLM2's tokenizer).

    python scripts/bench_detokenizer.py [--chunk 16] [--tokens 512]

Random ids from the default model's tokenizer (SmolLM2's byte-level BPE); every round checks
that the pieces add up to the full decode.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import frontend.detokenizer as detokenizer  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402
from frontend.tokenizer import load_hf_tokenizer  # noqa: E402


def us_per_push(
    decode: detokenizer.Decode, ids: list[int], chunk: int, repeats: int, byte_level: bool
) -> float:
    elapsed = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        detok = detokenizer.IncrementalDetokenizer(decode, byte_level)
        pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids) - chunk, chunk)]
        pieces.append(detok.flush(ids[len(pieces) * chunk :]))  # the last chunk ends it
        elapsed += time.perf_counter() - start
        if "".join(pieces) != decode(ids):  # checked outside the timing
            raise AssertionError("the pieces do not add up to the full decode")
    pushes = repeats * -(-len(ids) // chunk)
    return elapsed / pushes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    backend = load_hf_tokenizer(resolve_model_dir("default")).backend_tokenizer
    rng = random.Random(0)
    ids = [rng.randrange(1000, backend.get_vocab_size()) for _ in range(args.tokens)]

    def decode(token_ids: list[int]) -> str:
        return backend.decode(token_ids, skip_special_tokens=True)

    context = detokenizer.CONTEXT_TOKENS
    ways = (
        ("whole last chunk", 1 << 30, False),
        (f"{context} tokens", context, False),
        ("none (byte-level)", context, True),
    )
    for round_ in range(3):
        for label, window, byte_level in ways:
            detokenizer.CONTEXT_TOKENS = window
            us = us_per_push(decode, ids, args.chunk, args.repeats, byte_level)
            print(f"round {round_}: window {label:17} {us:6.2f} us a push of {args.chunk}")
    detokenizer.CONTEXT_TOKENS = context


if __name__ == "__main__":
    main()
