"""`tandem serve`: the OpenAI-compatible API over one or more engine cores.

    tandem serve [--model default] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
    tandem serve --model M --engine tcp://HOST:PORT \
        --curve-secret-key keys/frontend.key_secret --curve-server-key keys/engine.key

The one launch path: check the flags, resolve the model folder (once, here), plan the engine
cores (frontend/engines.py: one local engine, the --data-parallel-size ones, or a remote one),
start the ones we run (they load in parallel), then either serve HTTP in this process
(frontend/http_server.py) or, with --api-servers N, start N API processes that do
(frontend/api_processes.py). Ctrl-C or SIGTERM stops the HTTP side gracefully, then the engines;
the engines also die with this process if it is killed outright. If an engine dies, with
--restart-engine (the default) a new one is started and the requests in flight on it resume there
(--max-request-resumes; past it, or without a restart, they fail with 503). The
engines' raw ZMQ addresses are printed (and served at GET /v1/engine) so that `tandem client
--address ...` reaches the same engine.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from common.arg_types import (
    add_log_level_arg,
    non_negative_int,
    positive_float,
    positive_int,
    readable_file,
)
from common.listen import probe_bind

if TYPE_CHECKING:
    from frontend.engines import EngineSpec
    from protocol.curve import CurveClientKeys

logger = logging.getLogger("tandem.serve")

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt as JSON token ids is about 1 MiB
# frontend/tool_parsers PARSERS, named here so that the CLI starts without importing it
TOOL_PARSERS = (
    "deepseek_v3", "deepseek_v31", "hermes", "llama3_json", "llama4_pythonic", "mistral",
    "openai", "pythonic", "qwen3_coder", "qwen3_xml",
)  # fmt: skip
REASONING_PARSERS = ("deepseek_r1", "openai_gptoss", "qwen3")  # frontend/reasoning.py PARSERS


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine_core.args import add_engine_args
    from frontend.lora_args import add_lora_args
    from frontend.operations import add_operations_args
    from protocol.curve import add_client_args

    add_http_args(parser)
    add_operations_args(parser)
    add_engine_link_args(parser)
    add_lora_args(parser)
    add_log_level_arg(parser)
    add_client_args(parser)
    add_engine_args(parser, command="serve")


def add_http_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP")
    group.add_argument("--host", default="127.0.0.1", help="HTTP host (default: %(default)s)")
    group.add_argument("--port", type=port, default=8000, help="HTTP port (default: %(default)s)")
    group.add_argument(
        "--api-key",
        default=None,
        type=api_key,
        help="require 'Authorization: Bearer KEY' on the API routes",
    )
    group.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    group.add_argument(
        "--max-waiting-requests", type=non_negative_int, default=None,
        help="sequences (prompts x n) admitted beyond what the engine runs at once "
        "(--max-num-seqs); past that, 503 with Retry-After. With --api-servers N each process "
        "admits its N-th of --max-num-seqs + this (default: 3 x --max-num-seqs)",
    )  # fmt: skip
    group.add_argument(
        "--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--stream-interval", type=positive_int, default=1,
        help="tokens per SSE chunk: a streamed choice is sent once this many new tokens have "
        "gathered (its first token and its end go out at once, and a client that falls behind "
        "gets everything queued in one chunk; the engine sends the stream's tokens as many at a "
        "time); larger values cost the server less per token at the price of smoothness "
        "(default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--api-servers", type=positive_int, default=1,
        help="HTTP API processes in front of the engine core(s), sharing --port (the kernel "
        "spreads connections over them with SO_REUSEPORT), for when one Python process cannot "
        "keep up with the streams. Each has its own /metrics (counters of the requests it "
        "served; scrape each, or read the engine's gauges from any) and admits its share of "
        "--max-num-seqs + --max-waiting-requests; responses carry x-tandem-api-server: INDEX. "
        "With --data-parallel-size each API process routes over every engine core "
        "(default: %(default)s)",
    )  # fmt: skip
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    group.add_argument(
        "--chat-template", default=None, metavar="FILE", type=readable_file,
        help="a Jinja chat template to use instead of the model's own",
    )  # fmt: skip
    group.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
        help="how tool calls are read from the model's output (default: named by the chat "
        "template's syntax; for a ChatML model whose template ignores tools, hermes with a "
        "packaged tool template)",
    )  # fmt: skip
    group.add_argument(
        "--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
        help="split a thinking model's reasoning from its answer: message.reasoning_content "
        "(and reasoning), streamed as delta.reasoning_content; also what lets structured "
        "outputs, forced tool calls and thinking_token_budget start after the reasoning "
        "(default: none, the whole output is the answer)",
    )  # fmt: skip
    group.add_argument(
        "--grammar-timeout", type=positive_float, default=10.0, metavar="SECONDS",
        help="a structured-output constraint (JSON schema, regex, grammar) that does not "
        "compile within this long is refused with 400 (default: %(default)s)",
    )  # fmt: skip
    add_media_args(parser)


def add_media_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("images (vision-language models)")
    group.add_argument(
        "--limit-mm-per-prompt", default=None, metavar="JSON",
        help='the most images one prompt may hold, as vLLM spells it: \'{"image": 4}\' '
        "(default: 4)",
    )  # fmt: skip
    group.add_argument(
        "--allowed-media-domains", nargs="*", default=None, metavar="HOST",
        help="hosts whose http(s) image URLs the API process fetches (default: none; images "
        "come as data: URLs)",
    )  # fmt: skip
    group.add_argument(
        "--allowed-local-media-path", default=None, metavar="DIR",
        help="file:// image URLs are read from under this folder only (default: none are)",
    )  # fmt: skip
    group.add_argument(
        "--media-fetch-timeout", type=positive_float, default=10.0, metavar="SECONDS",
        help="an image URL not fetched within this long is a 400 (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--max-image-bytes", type=positive_int, default=20 << 20,
        help="a larger image (its encoded bytes) is a 400 (default: %(default)s)",
    )  # fmt: skip


def add_engine_link_args(parser: argparse.ArgumentParser) -> None:
    from protocol.client import engine_timeout

    group = parser.add_argument_group("engine cores (see also the engine flags)")
    group.add_argument(
        "--engine-address", default=None,
        help="where the engine core listens (default: a fresh private ipc directory)",
    )  # fmt: skip
    group.add_argument(
        "--remote-engine", action="store_true",
        help="start no engine: connect to the one already serving at --engine-address",
    )  # fmt: skip
    group.add_argument(
        "--engine", default=None, metavar="ADDRESS",
        help="use the engine core already serving at ADDRESS (tcp://HOST:PORT, with the CURVE "
        "flags below, or ipc://PATH): short for --remote-engine --engine-address ADDRESS",
    )  # fmt: skip
    group.add_argument(
        "--restart-engine", action=argparse.BooleanOptionalAction, default=True,
        help="start a new engine core when one we started dies (default: on)",
    )  # fmt: skip
    group.add_argument(
        "--engine-start-timeout", type=positive_float, default=600.0,
        help="seconds to wait for an engine's handshake (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--max-request-resumes", type=non_negative_int, default=3, metavar="N",
        help="when an engine core dies, each request in flight is sent again (to the restarted "
        "engine, or at once to another with --data-parallel-size) with what it had generated, "
        "and goes on as if nothing happened, at most N times; 0 fails them with 503 "
        "(default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--resume-timeout", type=positive_float, default=120.0, metavar="SECONDS",
        help="how long in all a request may wait for an engine to resume on before it fails "
        "(default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--engine-timeout", type=engine_timeout, default=30.0,
        help="seconds of engine silence after which it counts as dead (past a step the engine "
        "announced as long, counted from that step's expected end): /health answers 503, "
        "and requests in flight resume once it answers again (or fail with 503 past "
        "--max-request-resumes or --resume-timeout; docs/reliability.md) (default: "
        "%(default)s)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from engine_core.model_dir import resolve_for_serving
    from frontend.engines import plan_engines
    from frontend.request_id import tag_log_records

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s",
    )
    tag_log_records()
    try:
        curve = check_args(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.node_rank > 0:
        return serve_worker_node(args)
    warn_if_open(args)
    listeners = None
    try:
        if args.api_servers > 1:
            from frontend.api_processes import bind_sockets  # the HTTP stack: see launch

            listeners = bind_sockets(args.host, args.port, args.api_servers)
        else:  # uvicorn binds once the engine is up: a port in use fails now, not then
            args.port = probe_bind(args.host, args.port)  # port 0: the one the banner shows
    except OSError as exc:
        logger.error("cannot listen on %s port %s: %s", args.host, args.port, exc)
        return 1
    try:
        engine_model, model_dir = resolve_for_serving(args.model)
        check_lora_modules(args, engine_model)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    if not listeners:  # one API process, this one: it watches the engines itself
        return launch(args, model_dir, plan_engines(args, engine_model, curve, None), None)
    # API processes read the engines' pids from files here (mkdtemp: 0700, only we read them).
    with tempfile.TemporaryDirectory(prefix="tandem-api-", ignore_cleanup_errors=True) as pids:
        specs = plan_engines(args, engine_model, curve, Path(pids))
        return launch(args, model_dir, specs, listeners)


def warn_if_open(args: argparse.Namespace) -> None:
    """Serving past loopback without --api-key is allowed (a pod behind its Service, a private
    network), as in vLLM, but said at start: anyone who reaches the port can use the API."""
    from protocol.address import is_loopback_host

    if args.api_key is None and not is_loopback_host(args.host):
        logger.warning(
            "serving HTTP on %s:%s without --api-key: anyone who can reach this port can use "
            "the API (pass --api-key, or keep the port on a private network)",
            args.host,
            args.port,
        )


def serve_worker_node(args: argparse.Namespace) -> int:
    """--node-rank R > 0: no API and no engine core here, only this node's tensor-parallel
    ranks of node 0's engine (engine_core/worker_node.py). The same command runs on every node
    (torchrun's convention); its HTTP flags take effect on node 0, which serves the API."""
    from engine_core.args import engine_config_from_args
    from engine_core.worker_node import serve_node

    return serve_node(engine_config_from_args(args))


def launch(
    args: argparse.Namespace,
    model_dir: Path,
    specs: list[EngineSpec],
    listeners: list[socket.socket] | None,
) -> int:
    """Start the engines, serve until a signal, then stop the HTTP side and the engines.

    The engines start before this process imports its HTTP stack (FastAPI, the OpenAI schemas,
    the tokenizer's libraries): their start-up (imports, the model) overlaps ours."""
    from common import event_loop
    from common.hf_tokenizer import TokenizerError
    from common.processes import UnservableError, exit_on_sigterm, signals_deferred
    from protocol.client import EngineDeadError, HandshakeError

    exit_on_sigterm()  # so the finally below runs on SIGTERM too
    # A shell's `tandem serve ... &` starts it with SIGINT ignored: Ctrl-C / kill -INT must stop it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    api = None
    try:
        # A signal here takes effect once the engines are spawned and the HTTP stack imported:
        # raised in the middle of a spawn it would be lost (see signals_deferred).
        with signals_deferred(signal.SIGTERM, signal.SIGINT):
            for spec in specs:  # they load in parallel
                spec.start()
            from frontend.api_processes import ApiProcesses
            from frontend.http_server import serve_http

            api = ApiProcesses(args, model_dir, specs, listeners) if listeners else None
        event_loop.run(api.run() if api is not None else serve_http(args, model_dir, specs))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, HandshakeError, TimeoutError) as exc:
        logger.error("an engine core did not come up: %s", exc)
        return 1
    except (TokenizerError, UnservableError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        # Our copies of the API processes' listening sockets first: held open, the kernel would
        # go on accepting connections that no process serves while they drain (a client's
        # request then waits out the drain and is reset, where a refused connect is retried).
        for sock in listeners or ():
            sock.close()
        if api is not None:
            api.stop()  # before the engines: their requests end first
        for spec in specs:
            spec.stop()
        logger.info("stopped")
    return 0


def check_args(args: argparse.Namespace) -> CurveClientKeys | None:
    """ValueError for flags that do not go together (and for engine limits the engine would
    refuse, so that they fail here, at once); the CURVE client keys, if given."""
    from common import event_loop
    from common.chat_template import check_chat_template_file
    from engine_core.args import engine_config_from_args
    from frontend.engines import changed_engine_flags
    from frontend.lora_args import check_lora_args
    from frontend.operations import check_operations_args
    from frontend.vision import MediaOptions
    from protocol.address import EngineAddress
    from protocol.curve import client_keys_from_args

    event_loop.loop_name()  # a bad TANDEM_EVENT_LOOP fails here, with its message
    if args.chat_template is not None:
        check_chat_template_file(args.chat_template)
    check_operations_args(args)
    use_engine_flag(args)
    if args.engine_address is not None:
        try:
            EngineAddress.parse(args.engine_address)
        except ValueError as exc:
            flag = "--engine" if args.engine is not None else "--engine-address"
            raise ValueError(f"{flag}: {exc}") from None
    curve = client_keys_from_args(args)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty: give the id clients use, or leave it out")
    if args.remote_engine and not args.engine_address:
        raise ValueError("--remote-engine needs --engine-address")
    if curve is not None and not args.remote_engine:
        raise ValueError("the CURVE client keys are for --remote-engine")
    if args.data_parallel_size > 1 and (args.remote_engine or args.engine_address):
        raise ValueError(
            "--data-parallel-size starts its engine cores itself, each on a private ipc "
            "address: it does not take --engine-address or --remote-engine"
        )
    if args.remote_engine and (given := changed_engine_flags(args)):
        raise ValueError(
            f"{', '.join(given)}: engine flags set up an engine core that tandem serve starts; "
            f"the engine at {args.engine_address} runs with its own (give them to its "
            "`tandem engine`)"
        )
    engine_config_from_args(args)  # raises ValueError on limits that do not fit together
    if args.dist_secret_file is not None:  # checked before any engine starts or port opens
        from engine_core.nodes import read_secret

        read_secret(args.dist_secret_file)
    check_lora_args(args)
    MediaOptions.from_args(args)  # --limit-mm-per-prompt and the media paths
    return curve


def check_lora_modules(args: argparse.Namespace, engine_model: str) -> None:
    """Read and check every --lora-modules adapter against the model, before any engine
    starts (ValueError naming a bad one)."""
    from frontend.lora_args import lora_on

    if lora_on(args):
        from frontend.lora import lora_registry

        lora_registry(args, engine_model, check=True)


def use_engine_flag(args: argparse.Namespace) -> None:
    """Spell --engine ADDRESS out as --remote-engine --engine-address ADDRESS, which the rest
    of the frontend reads."""
    if args.engine is None:
        return
    if args.engine_address not in (None, args.engine):
        raise ValueError("--engine is short for --remote-engine --engine-address: give one")
    args.engine_address, args.remote_engine = args.engine, True


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:  # 0: a free port the system picks
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {value}")
    return value


def api_key(text: str) -> str:
    # An empty key (say --api-key "$KEY" with KEY unset) would leave the API open.
    if not text:
        raise argparse.ArgumentTypeError("an empty key would leave the API open; give a key")
    return text
