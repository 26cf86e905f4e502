"""The `tandem` command: one subcommand per job, each implemented in the package that owns it."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: an LLM serving engine with an OpenAI-compatible frontend and a "
        "separate engine-core process, joined by ZeroMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add(
        sub,
        "serve",
        "start the engine core and the OpenAI-compatible HTTP server",
        "frontend.serve",
    )
    _add(
        sub,
        "engine",
        "run only the engine core process, serving the raw ZMQ protocol",
        "engine_core.server",
    )
    _add(
        sub,
        "client",
        "send one request to an engine core over raw ZMQ and stream the output",
        "protocol.client_cli",
    )
    _add(
        sub,
        "generate",
        "generate in this process with the offline API (no sockets)",
        "engine_core.llm",
    )
    _add(sub, "bench", "run the load generator (loadgen/; also python -m loadgen)", "loadgen.cli")
    _add(
        sub,
        "keygen",
        "write a CURVE key pair for engine sockets on tcp:// (NAME.key, NAME.key_secret)",
        "protocol.curve",
    )
    return parser


def _add(sub: argparse._SubParsersAction, name: str, help_text: str, module: str) -> None:
    """Each module exposes add_args(parser) and run(args) -> int."""
    import importlib

    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_text, description=help_text)
    mod.add_args(p)
    p.set_defaults(_run=mod.run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
