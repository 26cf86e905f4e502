"""`tandem engine` (and ``python -m engine_core``): the engine core process's flags, and its run.
The engine's modules (torch, the models) are imported only once it runs: `tandem engine --help`
and a refused flag answer at once."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from protocol.address import EngineAddress

if TYPE_CHECKING:
    from engine_core.config import EngineConfig
    from protocol.curve import CurveServerKeys

logger = logging.getLogger("tandem.engine")


def add_args(parser: argparse.ArgumentParser) -> None:
    from common.arg_types import add_log_level_arg
    from engine_core.args import add_engine_args

    parser.add_argument(
        "--address",
        "--listen",
        dest="address",
        default=None,
        help="where to listen: ipc:///dir/name (default: a fresh private 0700 directory) or "
        "tcp://HOST:PORT (uses PORT and PORT+1; a non-loopback HOST needs the CURVE flags)",
    )
    parser.add_argument(
        "--curve-secret-key",
        default=None,
        help="this engine's CURVE key pair (a .key_secret file from `tandem keygen`)",
    )
    parser.add_argument(
        "--curve-authorized-keys",
        default=None,
        help="directory of the client public keys (*.key) let in; needs --curve-secret-key",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (checked every second); `tandem serve` passes "
        "its own pid. The parent then owns the engine's lifetime: SIGINT is left to it, "
        "SIGTERM stops the engine 30 s later unless the parent stops it first (a SIGTERM to "
        "the whole process group lets the parent drain its requests), as a death would (the "
        "parent restarts it; other nodes rejoin), and SIGUSR1 stops it for good (other nodes "
        "exit with it)",
    )
    add_log_level_arg(parser)
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    import sys

    from engine_core.args import engine_config_from_args
    from engine_core.memory_plan import ModelTooLargeError
    from engine_core.nodes import NodeRefused, read_secret
    from engine_core.server import EngineServer, SocketFailed, stop_on_signals
    from protocol.address import (
        AddressInUse,
        check_ipc_free,
        is_loopback,
        private_ipc_address,
        remove_ipc_files,
    )

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = engine_config_from_args(args)
        if config.node_rank > 0:
            return run_worker_node(args, config)
        address = EngineAddress.parse(args.address) if args.address else private_ipc_address()
        for folder in {os.path.dirname(path) for path in address.ipc_paths}:
            if not os.path.isdir(folder):  # checked now: the bind comes after the model loads
                raise ValueError(f"the folder of ipc address {address} does not exist: {folder}")
        check_ipc_free(address)  # and again as it binds
        curve = _server_keys(args)
        if curve is None and not is_loopback(address):
            raise ValueError(
                f"refusing to listen on {address} without authentication: give "
                "--curve-secret-key and --curve-authorized-keys (see `tandem keygen`)"
            )
        read_secret(config.dist_secret_file)
    except (ValueError, AddressInUse) as exc:
        print(f"tandem engine: {exc}", file=sys.stderr)
        return 2
    try:
        proc = EngineServer(config, address, curve, args.parent_pid)
    except (ModelTooLargeError, NodeRefused) as exc:  # the message names the sizes and flags
        print(f"tandem engine: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:  # a node that never joined
        print(f"tandem engine: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # a model (or its files) or flags it cannot serve, named
        logger.debug("the engine did not start", exc_info=True)  # --log-level debug: where
        print(f"tandem engine: {exc}", file=sys.stderr)
        return 2
    stop_on_signals(proc, supervised=args.parent_pid is not None)
    print(f"tandem engine: serving {proc.ready.model} at {address}", flush=True)
    try:
        proc.run()
    except AddressInUse as exc:  # taken while the model loaded
        print(f"tandem engine: {exc}", file=sys.stderr)
        return 2
    except SocketFailed as exc:
        logger.critical("%s: the engine process exits", exc)
        return 1
    finally:
        if not args.address:  # the private address it made: its socket files go with it
            remove_ipc_files(address)
    if proc.stopped_for_good:
        proc.core.announce_stop()
    return 0


def run_worker_node(args: argparse.Namespace, config: EngineConfig) -> int:
    """`tandem engine --node-rank R` (R > 0): only this node's ranks
    (engine_core/worker_node.py)."""
    import sys

    from engine_core.nodes import read_secret
    from engine_core.worker_node import serve_node

    given = [flag for flag, value in NODE_ZERO_FLAGS.items() if getattr(args, value) is not None]
    try:
        if given:
            raise ValueError(
                f"{', '.join(given)}: node {config.node_rank} runs no engine sockets (they are "
                "node 0's)"
            )
        read_secret(config.dist_secret_file)
    except ValueError as exc:
        print(f"tandem engine: {exc}", file=sys.stderr)
        return 2
    return serve_node(config)


# `tandem engine` flags of the engine core's sockets, which only node 0 has.
NODE_ZERO_FLAGS = {
    "--address": "address",
    "--curve-secret-key": "curve_secret_key",
    "--curve-authorized-keys": "curve_authorized_keys",
    "--parent-pid": "parent_pid",
}


def _server_keys(args: argparse.Namespace) -> CurveServerKeys | None:
    from protocol.curve import load_server_keys

    secret, authorized = args.curve_secret_key, args.curve_authorized_keys
    if (secret is None) != (authorized is None):
        raise ValueError("--curve-secret-key and --curve-authorized-keys go together")
    return None if secret is None else load_server_keys(secret, authorized)
