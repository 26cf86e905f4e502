"""`tandem serve`: the engine core in a subprocess and the OpenAI-compatible API in this one.

    tandem serve [--model default] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
    tandem serve --model M --engine tcp://HOST:PORT \
        --curve-secret-key keys/frontend.key_secret --curve-server-key keys/engine.key

Startup: resolve the model folder (once, here), spawn the engine core on a private ipc address,
load the tokenizer while the engine loads the weights, wait for the engine's handshake, then run
uvicorn. The engine's raw ZMQ address is printed (and served at GET /v1/engine) so that
`tandem client --address ...` reaches the same engine. Ctrl-C or SIGTERM stops uvicorn gracefully
and then the engine; the engine also dies with this process if it is killed outright. If the
engine dies, requests in flight fail with 503 and, with --restart-engine (the default), a new one
is started (frontend/launcher.py). With --engine ADDRESS (--remote-engine --engine-address
ADDRESS) nothing is spawned: the frontend connects to an engine already serving there (with
CURVE keys over tcp://). With --api-servers N, N API processes share the port and the engine
cores (frontend/api_servers.py); with --data-parallel-size N, N engine cores serve behind the API
(frontend/data_parallel.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem.serve")


MAX_BODY_BYTES = 8 << 20  # as frontend.server.MAX_BODY_BYTES, without importing FastAPI here


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine_core.args import add_engine_args
    from protocol.curve import add_client_args

    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API routes"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    parser.add_argument(
        "--engine-address",
        default=None,
        help="where the engine core listens (default: a fresh private ipc directory)",
    )
    parser.add_argument(
        "--remote-engine",
        action="store_true",
        help="start no engine: connect to the one already serving at --engine-address",
    )
    parser.add_argument(
        "--engine",
        default=None,
        metavar="ADDRESS",
        help="use the engine core already serving at ADDRESS (tcp://HOST:PORT, with the CURVE "
        "flags below, or ipc://PATH): short for --remote-engine --engine-address ADDRESS",
    )
    parser.add_argument(
        "--restart-engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start a new engine core when the one we started dies (default: on)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="sequences (prompts x n) admitted beyond what the engine runs at once "
        "(--max-num-seqs); past that, 503 with Retry-After. With --api-servers N each process "
        "admits its N-th of --max-num-seqs + this (default: 3 x --max-num-seqs)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-start-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the engine's handshake (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=30.0,
        help="seconds of engine silence after which requests in flight fail with 503 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="tokens per SSE chunk: a streamed choice is sent once this many new tokens have "
        "gathered (its first token and its end go out at once, and a client that falls behind "
        "gets everything queued in one chunk); larger values cost the server less per token "
        "at the price of smoothness (default: %(default)s)",
    )
    parser.add_argument(
        "--api-servers",
        type=_positive_int,
        default=1,
        help="HTTP API processes in front of the one engine core, sharing --port (the kernel "
        "spreads connections over them with SO_REUSEPORT), for when one Python process cannot "
        "keep up with the streams. Each has its own /metrics (counters of the requests it "
        "served; scrape each, or read the engine's gauges from any) and admits its share of "
        "--max-num-seqs + --max-waiting-requests; responses carry x-tandem-api-server: INDEX. "
        "With --data-parallel-size each API process routes over every engine core "
        "(default: %(default)s)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_client_args(parser)
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from engine_core.loader import resolve_for_serving
    from frontend.engine_client import EngineDeadError
    from protocol.curve import client_keys_from_args

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        use_engine_flag(args)
        curve = client_keys_from_args(args)
        if args.remote_engine and not args.engine_address:
            raise ValueError("--remote-engine needs --engine-address")
        if curve is not None and not args.remote_engine:
            raise ValueError("the CURVE client keys are for --remote-engine")
        if args.data_parallel_size > 1 and (args.remote_engine or args.engine_address):
            raise ValueError(
                "--data-parallel-size starts its engine cores itself, each on a private ipc "
                "address: it does not take --engine-address or --remote-engine"
            )
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.api_servers > 1:  # several API processes (over one engine or several)
        from frontend import api_servers

        return api_servers.run(args)
    if args.data_parallel_size > 1:  # several engine cores behind this process
        from frontend import data_parallel

        return data_parallel.run(args)
    engine_model, model_dir = resolve_for_serving(args.model)
    address, proc = plan_engine(args, engine_model)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so the finally below runs on SIGTERM too
    try:
        if proc is not None:
            proc.start()
        asyncio.run(serve(args, model_dir, proc, address, curve))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, TimeoutError) as exc:
        logger.error("the engine core did not come up: %s", exc)
        return 1
    finally:
        if proc is not None:
            proc.stop()
        logger.info("stopped")
    return 0


def use_engine_flag(args: argparse.Namespace) -> None:
    """Spell --engine ADDRESS out as --remote-engine --engine-address ADDRESS, which the rest
    of the frontend reads."""
    if args.engine is None:
        return
    if args.engine_address not in (None, args.engine):
        raise ValueError("--engine is short for --remote-engine --engine-address: give one")
    args.engine_address, args.remote_engine = args.engine, True


def plan_engine(args: argparse.Namespace, engine_model: str) -> tuple[Any, Any]:
    """The engine's address and, unless --remote-engine, its (not yet started) EngineProcess."""
    from frontend.launcher import EngineProcess, engine_flags
    from protocol.address import EngineAddress, private_ipc_address

    if args.engine_address:
        address, owns = EngineAddress.parse(args.engine_address), False
    else:
        address, owns = private_ipc_address(), True
    proc = None
    if not args.remote_engine:
        proc = EngineProcess(engine_model, engine_flags(args), address, args.log_level, owns)
    return address, proc


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


async def serve(
    args: argparse.Namespace, model_dir: Path, proc: Any, address: Any, curve: Any
) -> None:
    """Handshake with the engine, then run uvicorn (and the engine's supervisor) until a signal
    stops it."""
    import uvicorn

    from frontend.launcher import EngineSupervisor, connect_engine
    from frontend.server import build_app

    loop = asyncio.get_running_loop()
    tokenizer = loop.run_in_executor(None, load_tokenizer, model_dir)  # while the engine loads
    engine = await connect_engine(
        proc, args.engine_start_timeout, args.engine_timeout, address, curve
    )
    state = None
    supervisor_task = None
    try:
        state = build(args, model_dir, address, proc, engine, await tokenizer)
        if proc is not None and args.restart_engine:
            supervisor = EngineSupervisor(
                proc, state.serving, state.engine_info, args.engine_start_timeout,
                args.engine_timeout,
            )  # fmt: skip
            supervisor_task = asyncio.ensure_future(supervisor.run())
        config = uvicorn_config(args, build_app(state))
        announce(args, address, proc, engine)
        await uvicorn.Server(config).serve()
    finally:
        if supervisor_task is not None:
            supervisor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor_task
        await (state.serving.engine if state is not None else engine).close()


def uvicorn_config(args: argparse.Namespace, app: Any, **extra: Any) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
        **extra,
    )


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build(
    args: argparse.Namespace,
    model_dir: Path,
    address: Any,
    proc: Any,
    engine: Any,
    hf_tok: Any,
    share: tuple[int, int] = (0, 1),
) -> Any:
    """The server's state: serving context (with the admission bound), engine info.

    ``share`` = (index, count) of this API process among --api-servers: it admits its part of
    the bound (the parts add up to the whole, each at least 1)."""
    from frontend.admission import AdmissionGate
    from frontend.metrics import Metrics
    from frontend.server import ServerState
    from frontend.serving import ServingContext, Tokenizer

    ready = engine.ready
    name = args.served_model_name or args.model
    waiting = args.max_waiting_requests
    waiting = 3 * ready.max_num_seqs if waiting is None else max(waiting, 0)
    limit = share_of(ready.max_num_seqs + waiting, *share)
    serving = ServingContext(
        engine=engine,
        tokenizer=Tokenizer(hf_tok),
        served_model=name,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        metrics=Metrics(name),
        admission=AdmissionGate(limit),
        stream_interval=args.stream_interval,
    )
    info = {"address": str(address), "pid": proc.pid if proc else None, "model": name}
    return ServerState(
        serving, str(model_dir), args.api_key, info, max_body_bytes=args.max_body_bytes
    )


def share_of(total: int, index: int, count: int) -> int:
    """Part ``index`` of ``total`` split in ``count`` parts that differ by at most one."""
    return max(1, total // count + (1 if index < total % count else 0))


def announce(args: argparse.Namespace, address: Any, proc: Any, engine: Any) -> None:
    ready = engine.ready
    host = f"[{args.host}]" if ":" in args.host else args.host
    where = f"pid {proc.pid}" if proc is not None else "remote"
    print(
        f"tandem serve: model {args.served_model_name or args.model} "
        f"(max_model_len {ready.max_model_len}, {ready.num_kv_blocks} KV blocks)\n"
        f"  OpenAI API:  http://{host}:{args.port}/v1\n"
        f"  engine core: {address} ({where}); "
        f"raw client: tandem client --address {address}",
        flush=True,
    )
