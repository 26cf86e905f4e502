"""`python -m loadgen ...`: the load generator without the `tandem` command (the same as
`tandem bench`)."""

from __future__ import annotations

import argparse
import sys

from loadgen.cli import add_args, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Load generator for Tandem: TTFT, TPOT, ITL, latency and throughput over HTTP "
        "or raw ZMQ (docs/loadgen.md).",
    )
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
