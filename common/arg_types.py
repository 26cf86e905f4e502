"""argparse types shared by the commands (`tandem serve`, `tandem bench`, ...): each checks a
value and refuses a bad one with a message argparse prints after the flag's name."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def readable_file(text: str) -> str:
    """A path that names a readable file, checked as the flags are read."""
    try:
        with open(text, "rb"):
            return text
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror}") from None


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    """--log-level, as every process that logs takes it (`tandem serve` passes it on)."""
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default: INFO)",
    )  # fmt: skip
