"""`multi-turn`: multi-turn chats that share a long system prompt, Tandem beside vLLM.

    python -m benchmarks multi-turn --model llama-8b \\
        --vllm-python python3 --vllm-pythonpath /tmp/vsite --json OUT.json

One server at a time (side_by_side.py, as `serving`), both with prefix caching on (each is on
by default; `--enable-prefix-caching` is passed to both all the same, so that neither can run
without it). On each: a warm-up run, then --runs reported runs of `python -m loadgen --backend
openai-chat --ignore-eos --conversations C --turns T --shared-prefix-len S`: C conversations at
once (or started at --rate per second), each opening with the same S-token random system prompt
(fresh per run), each sending its T turns one after another; turn k's messages are the system
prompt, every earlier user message with the server's reply, and a new random user message
(docs/loadgen.md). From turn 2 on, a server with a working prefix cache computes only the new
reply and user message; turn 1 shares the system prompt with every other conversation.
Beside a peer, a preset is served from one random checkpoint that both load (--checkpoint is
on unless --no-checkpoint): the replies each turn sends back must be the same text on both.

The table: each server's turns per second, output and prompt tok/s (the prompt tokens each
server counted, cached ones included), TTFT p50 and p99 and TPOT p50, TTFT p50 of the
conversations' first turns and of their later ones, and the share of prompt tokens its prefix
cache served (its own counters, vLLM's prefix_cache_hits over prefix_cache_queries, over the
warm-up and the reported runs), and Tandem's advantage on each (vLLM's benchmarks/multi_turn
measures the same turns over the same route).
"""

from __future__ import annotations

import argparse
import math

from benchmarks import serving
from benchmarks.servers import ConversationWorkload
from benchmarks.side_by_side import Metric
from loadgen.workload import LenRange

MULTI_TURN_METRICS = (
    Metric("turns/s", "request_rate", ".2f", True),
    Metric("tok/s", "output_tok_s", ",.0f", True),
    Metric("prompt tok/s", "prompt_tok_s", ",.0f", True),
    Metric("TTFT p50 ms", "ttft_p50_ms", ",.1f", False),
    Metric("TTFT p99 ms", "ttft_p99_ms", ",.1f", False),
    Metric("TPOT p50 ms", "tpot_p50_ms", ".2f", False),
    Metric("TTFT p50 turn 1 ms", "ttft_first_turn_p50_ms", ",.1f", False),
    Metric("TTFT p50 later turns ms", "ttft_later_turns_p50_ms", ",.1f", False),
    Metric("prefix-cache hits", "prefix_cache_hit_rate", ".1%", True),
)
TEMPLATE_TOKENS_PER_MESSAGE = 8  # a chat template's role markers, room kept in the length check
# Each turn sends back the text of the server's own replies, and how much of a reply the prefix
# cache can serve depends on that text: a random model's greedy reply is one or two tokens
# repeated, and whether their text re-tokenizes into the same tokens (" cave cave" does, "))))"
# merges into other tokens) depends on which tokens the weights pick. Two servers with their own
# random weights would reuse different shares of their histories for reasons of the weights,
# not of the servers; one checkpoint gives both the same replies.
CHECKPOINT_DEFAULT_HELP = (
    "default: on beside a peer of a preset (each turn sends back the server's own replies, and "
    "how much of them the prefix cache serves depends on which tokens the weights choose)"
)


def add_args(parser: argparse.ArgumentParser) -> None:
    serving.add_model_arg(parser)
    serving.add_checkpoint_args(parser, CHECKPOINT_DEFAULT_HELP)
    parser.add_argument(
        "--conversations", type=int, default=32, help="conversations per run (default: 32)"
    )
    parser.add_argument("--turns", type=int, default=5, help="turns each (default: 5)")
    parser.add_argument(
        "--shared-prefix-len", type=int, default=2000,
        help="tokens of the random system prompt every conversation of a run shares "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--input-len", type=LenRange.parse, default=LenRange(128, 128),
        help="tokens of each turn's new user message: N or LOW:HIGH (default: 128)",
    )  # fmt: skip
    parser.add_argument(
        "--output-len", type=LenRange.parse, default=LenRange(128, 128),
        help="tokens each turn asks for, EOS ignored: N or LOW:HIGH (default: 128)",
    )  # fmt: skip
    parser.add_argument(
        "--rate", type=float, default=math.inf,
        help="conversations started per second, Poisson (default: inf, all at once)",
    )  # fmt: skip
    parser.add_argument(
        "--backend", choices=("openai-chat", "openai-completions"), default="openai-chat",
        help="the route: chat messages, or the same texts joined as one completions prompt "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--runs", type=int, default=1,
        help="reported runs, after one warm-up run of the same workload (default: 1)",
    )  # fmt: skip
    serving.add_server_args(parser)
    serving.add_output_args(parser)
    parser.set_defaults(lora=0)  # serving.compare's many-adapter mode: not part of this one


def workload(args: argparse.Namespace) -> ConversationWorkload:
    return ConversationWorkload(
        args.conversations, args.turns, args.shared_prefix_len, args.input_len,
        args.output_len, args.rate, args.backend,
    )  # fmt: skip


def check(args: argparse.Namespace) -> None:
    """Refuse a conversation whose last turn the servers could not take (--max-model-len)."""
    if args.conversations < 1 or args.turns < 1 or args.shared_prefix_len < 0 or args.rate <= 0:
        raise SystemExit(
            "--conversations and --turns must be >= 1, --shared-prefix-len >= 0, --rate > 0"
        )
    per_turn = args.input_len.high + args.output_len.high + 2 * TEMPLATE_TOKENS_PER_MESSAGE
    longest = args.shared_prefix_len + TEMPLATE_TOKENS_PER_MESSAGE + args.turns * per_turn
    if longest > args.max_model_len:
        raise SystemExit(
            f"the last turn of a conversation can reach {longest} tokens (system prompt, "
            f"{args.turns} turns of --input-len {args.input_len} and --output-len "
            f"{args.output_len}, template): more than --max-model-len {args.max_model_len}"
        )


def uses_checkpoint(args: argparse.Namespace) -> bool:
    """--checkpoint as given, else on where a peer serves a preset beside Tandem."""
    if args.checkpoint is not None:
        return args.checkpoint
    from engine_core.presets import PRESETS

    peer = bool(args.vllm_python or args.sglang_python)
    return peer and args.model in PRESETS


def run(args: argparse.Namespace) -> int:
    check(args)
    args.checkpoint = uses_checkpoint(args)
    args.workloads = [workload(args)]
    args.tandem_args = f"--enable-prefix-caching {args.tandem_args}"
    args.vllm_args = f"--enable-prefix-caching {args.vllm_args}"
    return serving.compare(args, MULTI_TURN_METRICS)
