"""A burst of prompts through the API process's tokenizer: one encode call per request on the
worker thread (how completions were encoded before) against Tokenizer.encode, which coalesces
the requests that wait into one call.

    python scripts/bench_prompt_encode.py [--requests 256] [--prompt-len 128]

The prompts are the default model's decodes of random token ids (as the load generator makes
them), all submitted at once, as 256 streams arriving together do. Prints the milliseconds until
the last request has its ids, three rounds; then one Rust call on all the prompts, with the
character offsets (``encode_batch``) and without (``encode_batch_fast``, what encode_all calls).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_core.loader import resolve_model_dir  # noqa: E402
from frontend.tokenizer import Tokenizer, load_hf_tokenizer  # noqa: E402


async def burst_ms(tok: Tokenizer, texts: list[str], coalesced: bool) -> float:
    start = time.perf_counter()
    if coalesced:
        await asyncio.gather(*(tok.encode([t]) for t in texts))
    else:
        await asyncio.gather(*(tok.run(tok.encode_all, [t]) for t in texts))
    return (time.perf_counter() - start) * 1e3


def one_call_ms(encode_batch: Callable[[list[str]], Any], texts: list[str]) -> float:
    start = time.perf_counter()
    encode_batch(texts)
    return (time.perf_counter() - start) * 1e3


async def main(args: argparse.Namespace) -> None:
    tok = Tokenizer(load_hf_tokenizer(resolve_model_dir("default")))
    rng = random.Random(0)
    vocab = tok.hf.vocab_size
    texts = [
        tok.decode([rng.randrange(100, vocab) for _ in range(args.prompt_len)])
        for _ in range(args.requests)
    ]
    for _ in range(3):
        each = await burst_ms(tok, texts, coalesced=False)
        coalesced = await burst_ms(tok, texts, coalesced=True)
        print(f"{args.requests} prompts: one call each {each:.1f} ms, coalesced {coalesced:.1f} ms")
    backend = tok.hf.backend_tokenizer
    for _ in range(3):
        with_offsets = one_call_ms(backend.encode_batch, texts)
        without = one_call_ms(backend.encode_batch_fast, texts)
        print(f"one call: with offsets {with_offsets:.1f} ms, without {without:.1f} ms")
    print(f"command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    uvloop.run(main(parser.parse_args()))
