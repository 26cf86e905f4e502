"""`tandem serve`: the engine core in a subprocess and the OpenAI-compatible API in this one.

    tandem serve [--model default] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]

Startup: resolve the model folder (once, here), spawn the engine core on a private ipc address,
load the tokenizer while the engine loads the weights, wait for the engine's handshake, then run
uvicorn. The engine's raw ZMQ address is printed (and served at GET /v1/engine) so that
`tandem client --address ...` reaches the same engine. Ctrl-C or SIGTERM stops uvicorn gracefully
and then the engine; the engine also dies with this process if it is killed outright.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem.serve")


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine_core.args import add_engine_args

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
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from engine_core.loader import resolve_for_serving
    from frontend.engine_client import EngineDeadError
    from frontend.launcher import EngineProcess, engine_flags
    from protocol.address import EngineAddress, private_ipc_address

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine_model, model_dir = resolve_for_serving(args.model)
    if args.engine_address:
        address, owns = EngineAddress.parse(args.engine_address), False
    else:
        address, owns = private_ipc_address(), True
    proc = EngineProcess(engine_model, engine_flags(args), address, args.log_level, owns)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so the finally below runs on SIGTERM too
    try:
        proc.start()
        asyncio.run(serve(args, model_dir, proc))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, TimeoutError) as exc:
        logger.error("the engine core did not come up: %s", exc)
        return 1
    finally:
        proc.stop()
        logger.info("stopped")
    return 0


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


async def serve(args: argparse.Namespace, model_dir: Path, proc: Any) -> None:
    """Handshake with the engine, then run uvicorn until a signal stops it."""
    import uvicorn

    from frontend.launcher import connect_engine

    loop = asyncio.get_running_loop()
    tokenizer = loop.run_in_executor(None, load_tokenizer, model_dir)  # while the engine loads
    engine = await connect_engine(proc, args.engine_start_timeout, args.engine_timeout)
    try:
        app = build(args, model_dir, proc, engine, await tokenizer)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.access_log,
            timeout_graceful_shutdown=5,
        )
        announce(args, proc, engine)
        await uvicorn.Server(config).serve()
    finally:
        await engine.close()


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build(args: argparse.Namespace, model_dir: Path, proc: Any, engine: Any, hf_tok: Any) -> Any:
    from frontend.metrics import Metrics
    from frontend.server import ServerState, build_app
    from frontend.serving import ServingContext, Tokenizer

    ready = engine.ready
    name = args.served_model_name or args.model
    serving = ServingContext(
        engine=engine,
        tokenizer=Tokenizer(hf_tok),
        served_model=name,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        metrics=Metrics(name),
    )
    info = {"address": str(proc.address), "pid": proc.pid, "model": name}
    return build_app(ServerState(serving, str(model_dir), args.api_key, info))


def announce(args: argparse.Namespace, proc: Any, engine: Any) -> None:
    ready = engine.ready
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"tandem serve: model {args.served_model_name or args.model} "
        f"(max_model_len {ready.max_model_len}, {ready.num_kv_blocks} KV blocks)\n"
        f"  OpenAI API:  http://{host}:{args.port}/v1\n"
        f"  engine core: {proc.address} (pid {proc.pid}); "
        f"raw client: tandem client --address {proc.address}",
        flush=True,
    )
