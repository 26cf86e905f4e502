"""``python -m engine_core``: the engine-core process (what `tandem engine` runs; see
engine_core/engine_cli.py). `tandem serve` starts its engine cores this way."""

from __future__ import annotations

import argparse
import sys

from engine_core.engine_cli import add_args, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_core",
        description="run the engine core process, serving the raw ZMQ protocol",
    )
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
