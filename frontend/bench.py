"""`tandem bench`: the load generator (frontend/loadgen), the same tool as scripts/loadgen.py."""

from __future__ import annotations

import argparse


def add_args(parser: argparse.ArgumentParser) -> None:
    from frontend.loadgen.cli import add_args as add_loadgen_args

    add_loadgen_args(parser)


def run(args: argparse.Namespace) -> int:
    from frontend.loadgen.cli import run as run_loadgen

    return run_loadgen(args)
