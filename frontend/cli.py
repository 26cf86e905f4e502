"""The `tandem` command: one subcommand per job, each implemented in the package that owns it.

Only the subcommand being run has its module imported (to add its flags and run it): `tandem
serve` starts its engine cores without first importing the engine's own module and torch with it
(docs/design/start-up-time.md). `tandem --help` lists every subcommand from the table below.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (help, the module that owns it: add_args(parser) and run(args) -> int)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("start the engine core and the OpenAI-compatible HTTP server", "frontend.serve"),
    "engine": (
        "run only the engine core process, serving the raw ZMQ protocol",
        "engine_core.server",
    ),
    "client": (
        "send one request to an engine core over raw ZMQ and stream the output",
        "protocol.client_cli",
    ),
    "generate": ("generate in this process with the offline API (no sockets)", "engine_core.llm"),
    "bench": ("run the load generator (loadgen/; also python -m loadgen)", "loadgen.cli"),
    "keygen": (
        "write a CURVE key pair for engine sockets on tcp:// (NAME.key, NAME.key_secret)",
        "protocol.curve",
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser: every subcommand listed, with its flags where it is ``only`` (every one's
    for None)."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: an LLM serving engine with an OpenAI-compatible frontend and a "
        "separate engine-core process, joined by ZeroMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only in (None, name):
            mod = importlib.import_module(module)
            mod.add_args(p)
            p.set_defaults(_run=mod.run)
    return parser


def named_subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` runs where its first argument names one, else None."""
    return argv[0] if argv and argv[0] in SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(named_subcommand(argv)).parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
