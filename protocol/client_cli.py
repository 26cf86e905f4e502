"""`tandem client`: send one request to an engine core over raw ZMQ and stream the output.

    tandem client --address ipc:///run/user/1000/tandem-x/engine --prompt "Hi" --chat
    tandem client --address tcp://127.0.0.1:5555 --token-ids 1,2,3 --max-tokens 8
    tandem client --address tcp://gpu-host:5555 --curve-secret-key keys/me.key_secret \
        --curve-server-key keys/engine.key --token-ids 1,2,3

With --prompt the text is tokenized here (the model's tokenizer, from --model or the engine's
READY) and the output detokenized as it streams; with --token-ids ids go in and come out as they
are. The finish reason is printed to stderr at the end.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from protocol.messages import Constraint, RequestOutput, SamplingParams


def add_args(parser: argparse.ArgumentParser) -> None:
    from protocol.client import DEAD_AFTER_S, engine_timeout
    from protocol.curve import add_client_args

    parser.add_argument("--address", required=True, help="engine address: ipc://PATH or tcp://H:P")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text, tokenized here")
    source.add_argument("--token-ids", type=_int_list, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--chat", action="store_true", help="apply the chat template to --prompt")
    parser.add_argument(
        "--model", default=None, help="tokenizer's model (default: the model the engine serves)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)"
    )
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="tokens before EOS may end it (default: 0)"
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="0 means greedy (default: 1)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k (default: 0)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default: 0, off")
    parser.add_argument(
        "--seed", type=int, default=None, help="repeatable sampling (default: none)"
    )
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="default: 0")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="default: 0")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="default: 1, off")
    parser.add_argument("--stop-token-ids", type=_int_list, default=(), help="e.g. 2,13")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past EOS to --max-tokens")
    parser.add_argument("--logprobs", type=int, default=None, help="also the top N (0..20)")
    constraint = parser.add_argument_group(
        "structured output (one at most; the engine compiles it, a bad one is refused)"
    )
    constraint.add_argument(
        "--json-schema", type=Path, default=None, metavar="FILE",
        help="the output is JSON that matches the schema in FILE",
    )  # fmt: skip
    constraint.add_argument(
        "--json-object", action="store_true", help="the output is a JSON object"
    )
    constraint.add_argument("--regex", default=None, help="the output matches this regex")
    constraint.add_argument(
        "--choice", action="append", default=None, metavar="TEXT",
        help="the output is one of these (repeat the flag for each choice)",
    )  # fmt: skip
    constraint.add_argument(
        "--grammar", type=Path, default=None, metavar="FILE",
        help="the output follows the GBNF/EBNF (or Lark) grammar in FILE",
    )  # fmt: skip
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        help="lower is scheduled sooner (an engine with --scheduling-policy priority; others "
        "refuse all but 0)",
    )
    parser.add_argument("--request-id", default=None, help="default: a random one")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for READY (default: 60)"
    )
    parser.add_argument(
        "--engine-timeout", type=engine_timeout, default=DEAD_AFTER_S, metavar="SECONDS",
        help="seconds of silence from the engine (it sends a heartbeat every 0.5 s between "
        "steps, and announces a step it expects to be long, counted from that step's expected "
        f"end) after which the request fails as the engine's death (default: {DEAD_AFTER_S:g})",
    )  # fmt: skip
    add_client_args(parser)


def run(args: argparse.Namespace) -> int:
    import uuid

    from protocol.address import EngineAddress
    from protocol.client import EngineClient, EngineRequestError, HandshakeError
    from protocol.codec import ProtocolError
    from protocol.curve import client_keys_from_args

    if args.chat and args.prompt is None:
        print("tandem client: --chat needs --prompt", file=sys.stderr)
        return 2
    try:
        EngineAddress.parse(args.address)  # a bad one named here, before any socket
        curve = client_keys_from_args(args)
        params = _sampling_params(args)
    except (ValueError, OSError) as exc:
        print(f"tandem client: {exc}", file=sys.stderr)
        return 2
    request_id = args.request_id or f"cli-{uuid.uuid4().hex}"
    with EngineClient(args.address, name="tandem-client", curve=curve) as client:
        try:
            ready = client.connect(timeout=args.timeout)
        except (HandshakeError, TimeoutError) as exc:
            print(f"tandem client: {exc}", file=sys.stderr)
            return 1
        try:
            tokenizer = None if args.prompt is None else _load_tokenizer(args.model or ready.model)
        except (ValueError, OSError) as exc:  # no such model, or a folder without a tokenizer
            print(f"tandem client: {exc}", file=sys.stderr)
            return 2
        prompt_ids = (
            args.token_ids if tokenizer is None else _tokenize(tokenizer, args.prompt, args.chat)
        )
        printer = _IdPrinter(sys.stdout) if tokenizer is None else _TextPrinter(tokenizer)
        try:
            reason = _stream(
                client, request_id, prompt_ids, params, printer, args.priority,
                args.engine_timeout,
            )  # fmt: skip
        except (ProtocolError, EngineRequestError, TimeoutError) as exc:
            print(f"\ntandem client: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # generate() has aborted the request on the way out
            print("\ntandem client: interrupted", file=sys.stderr)
            return 130
    print(f"[finish_reason: {reason}]", file=sys.stderr)
    return 0


def _stream(
    client: Any,
    request_id: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    printer: _IdPrinter | _TextPrinter,
    priority: int,
    silence_s: float,
) -> str:
    reason = "none"
    for out in client.generate(request_id, prompt_ids, params, silence_s, priority):
        printer.feed(out)
        if out.finish_reason is not None:
            reason = out.finish_reason.openai_name
    printer.finish()
    return reason


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from protocol.messages import SamplingParams

    return SamplingParams(
        constraint=constraint_of(args),
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The structured-output flag given, as a Constraint; ValueError if more than one is."""
    import json

    from protocol.messages import Constraint, ConstraintKind

    given = {
        "--json-schema": args.json_schema and (ConstraintKind.JSON_SCHEMA, args.json_schema),
        "--json-object": args.json_object and (ConstraintKind.JSON_OBJECT, ""),
        "--regex": args.regex and (ConstraintKind.REGEX, args.regex),
        "--choice": args.choice and (ConstraintKind.CHOICE, json.dumps(args.choice)),
        "--grammar": args.grammar and (ConstraintKind.GRAMMAR, args.grammar),
    }
    chosen = {flag: value for flag, value in given.items() if value}
    if len(chosen) > 1:
        raise ValueError(f"give one structured-output flag, not {' and '.join(chosen)}")
    if not chosen:
        return None
    kind, spec = next(iter(chosen.values()))
    text = spec.read_text() if isinstance(spec, Path) else spec  # the two FILE flags
    return Constraint(kind, text)


def _load_tokenizer(model: str) -> Any:
    """``model``'s tokenizer; ValueError or OSError in one line where there is none."""
    from common.hf_tokenizer import load_explained, load_pretrained_tokenizer
    from engine_core.model_dir import resolve_model_dir

    return load_explained(
        load_pretrained_tokenizer, resolve_model_dir(model), "or send --token-ids"
    )


def _tokenize(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    # The template already holds the special tokens; adding them again would double BOS.
    return tokenizer.encode(text, add_special_tokens=False)


class _IdPrinter:
    """Prints token ids as they arrive, with their logprob when asked for."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def feed(self, out: RequestOutput) -> None:
        lps = out.logprobs or [None] * len(out.new_token_ids)
        for tid, lp in zip(out.new_token_ids, lps, strict=True):
            self.stream.write(f"{tid} " if lp is None else f"{tid}({lp.logprob:.4f}{top_of(lp)}) ")
        self.stream.flush()

    def finish(self) -> None:
        self.stream.write("\n")


def top_of(lp: Any) -> str:
    """A token's top alternatives, ``[id:logprob ...]``, where --logprobs asked for them."""
    pairs = zip(lp.top_token_ids, lp.top_logprobs, strict=True)
    top = " ".join(f"{t}:{p:.3f}" for t, p in pairs)
    return f" [{top}]" if top else ""


class _TextPrinter:
    """Incremental detokenization: decode a short window, print only text that is complete.

    The window starts a few tokens back so that tokenizers which merge spaces or bytes across
    token boundaries still produce the right text; output ending in U+FFFD is an unfinished
    UTF-8 sequence and is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Any, stream: TextIO | None = None) -> None:
        self.tokenizer = tokenizer
        self.stream = stream or sys.stdout
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.logprobs: list[Any] = []

    def feed(self, out: RequestOutput) -> None:
        self.ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs or [])
        self._emit(final=False)

    def finish(self) -> None:
        self._emit(final=True)
        self.stream.write("\n")
        for tid, lp in zip(self.ids, self.logprobs, strict=False):
            pairs = zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            top = ", ".join(f"{t}:{p:.3f}" for t, p in pairs)
            print(f"{tid}\t{lp.logprob:.4f}\t{top}", file=sys.stderr)

    def _emit(self, final: bool) -> None:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        text = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(text) > len(prefix) and (final or not text.endswith("\ufffd")):
            self.stream.write(text[len(prefix) :])
            self.stream.flush()
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
