"""The `tandem` command: one subcommand per job, each implemented in the package that owns it."""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (help, the module with its add_args(parser) and run(args) -> int)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("start the engine core and the OpenAI-compatible HTTP server", "frontend.serve"),
    "engine": (
        "run only the engine core process, serving the raw ZMQ protocol",
        "engine_core.engine_cli",
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand listed; only ``command``'s flags are added (all of them
    when None), because each subcommand's module is imported to add them. None of those modules
    imports torch or the HTTP stack until its command runs: `--help` and a refused flag answer
    at once, and `tandem serve` starts its engines before it pays for either."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: an LLM serving engine with an OpenAI-compatible frontend and a "
        "separate engine-core process, joined by ZeroMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command in (None, name):
            mod = importlib.import_module(module)
            mod.add_args(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The top-level parser has no flags but -h, so a command, if any, comes first.
    command = argv[0] if argv and argv[0] in COMMANDS else ""
    parser = build_parser(command)
    if not command:
        parser.parse_args(argv)  # tandem's own usage and error (no command, or a flag first)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser, with its usage line rather than tandem's
        subcommand_parser(parser, args.command).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    try:
        return args._run(args)
    except KeyboardInterrupt:  # Ctrl-C: what was started is stopped on the way out (finally)
        print(f"\ntandem {args.command}: interrupted", file=sys.stderr)
        return 130


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` in ``parser`` (built by ``build_parser``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


if __name__ == "__main__":
    sys.exit(main())
