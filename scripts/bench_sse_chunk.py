"""What one SSE chunk's JSON costs the API process: microseconds per ``ChunkWriter.chunk`` for a
completion chunk of one choice (16 tokens' worth of text), against building the whole body as a
dict and calling ``json.dumps`` on it each time (the chunk builder before 8d4206c), alternating,
three rounds; both must give the same JSON.

    python scripts/bench_sse_chunk.py [--chunks 200000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from frontend.completions import completion_delta  # noqa: E402
from frontend.sse import ChunkWriter  # noqa: E402

TEXT = " the quick brown fox jumps over the lazy dog, again and again"  # about 16 tokens


def dict_and_dumps(writer: ChunkWriter) -> Callable[[list[dict[str, Any]]], str]:
    """The builder before: the head dict merged into each body, then json.dumps."""
    head = json.loads(writer.chunk([])[len("data: ") : -2])
    del head["choices"]

    def chunk(choices: list[dict[str, Any]]) -> str:
        body = {**head, "choices": choices}
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    return chunk


def us_per_chunk(build: Callable[[list[dict[str, Any]]], str], chunks: int) -> float:
    start = time.perf_counter()
    for _ in range(chunks):
        build([completion_delta(0, TEXT)])
    return (time.perf_counter() - start) / chunks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    args = parser.parse_args()
    writer = ChunkWriter("cmpl-" + "0" * 32, "text_completion", "/models/llama-1b", False)
    before = dict_and_dumps(writer)
    one = [completion_delta(0, TEXT)]
    if json.loads(writer.chunk(one)[6:]) != json.loads(before(one)[6:]):
        raise AssertionError("the two builders disagree")
    for round_ in range(3):
        for label, build in (("dict + json.dumps", before), ("ChunkWriter.chunk", writer.chunk)):
            print(f"round {round_}: {label:18} {us_per_chunk(build, args.chunks):6.2f} us a chunk")


if __name__ == "__main__":
    main()
