#!/usr/bin/env python
"""Load generator for Tandem: TTFT, TPOT, ITL, latency and throughput over HTTP or raw ZMQ.

    python scripts/loadgen.py --backend openai-chat --url http://127.0.0.1:8000 -n 64

The same tool as `tandem bench`; the code lives in frontend/loadgen, see docs/loadgen.md.
"""

from __future__ import annotations

import argparse
import sys

from frontend.loadgen.cli import add_args, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loadgen", description=__doc__.split("\n\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
