"""What an ADD_REQUEST costs each end of the wire: the client's encode and the engine's decode.

    python scripts/bench_add_request.py [--requests 256] [--prompt-len 128] [--bursts 7]

Each burst encodes ``--requests`` requests (random prompts, greedy params built anew for each
request, as the load generator and the API server build them), then decodes the frames, with
the codec of ``protocol/codec.py`` on this machine's CPU. Prints the median over the bursts of
the microseconds per request at each end. On the engine the decode runs in the input thread,
which shares the interpreter with the busy loop: a burst that takes longer to decode than the
intake window (``engine_core/server.py`` BURST_MAX_S) reaches an idle engine in slices.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.codec import decode_client_message, encode  # noqa: E402
from protocol.messages import AddRequest, ClientMessage, SamplingParams  # noqa: E402


def burst_params() -> SamplingParams:
    """A request's sampling params: built anew for each request, as the frontends build them."""
    return SamplingParams(max_tokens=256, temperature=0.0)


def encode_burst(prompts: list[list[int]]) -> tuple[list[bytes], float]:
    """The ADD_REQUEST frames of these prompts, and the seconds their encoding took."""
    start = time.perf_counter()
    frames = [
        encode(AddRequest(f"r{i}", prompt, burst_params())) for i, prompt in enumerate(prompts)
    ]
    return frames, time.perf_counter() - start


def decode_burst(frames: list[bytes]) -> tuple[list[ClientMessage], float]:
    """The frames decoded as the engine's input thread decodes them, and the seconds it took."""
    start = time.perf_counter()
    messages = [decode_client_message(frame) for frame in frames]
    return messages, time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256, help="requests in a burst")
    parser.add_argument("--prompt-len", type=int, default=128, help="token ids per prompt")
    parser.add_argument("--bursts", type=int, default=7, help="bursts timed (the median)")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    times = []
    for _ in range(args.bursts):
        prompts = [
            [rng.randrange(3, 49152) for _ in range(args.prompt_len)] for _ in range(args.requests)
        ]
        frames, encode_s = encode_burst(prompts)
        _, decode_s = decode_burst(frames)
        times.append((encode_s * 1e6 / args.requests, decode_s * 1e6 / args.requests))
    print("# python scripts/bench_add_request.py " + " ".join(argv))
    encode_us = statistics.median(t[0] for t in times)
    decode_us = statistics.median(t[1] for t in times)
    print(
        f"ADD_REQUEST, {args.prompt_len} prompt ids: encode {encode_us:.1f} us, decode "
        f"{decode_us:.1f} us a request (median of {args.bursts} bursts of {args.requests})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
