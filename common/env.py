"""Every environment variable Tandem's code reads, each through a typed function below.

Reading the environment in one module gives a reader one place to find every switch the code
answers to; ``VARIABLES`` names each with its type, default and meaning, and README.md's
"Environment variables" table lists the same (tests/test_project_rules.py checks both, and that
no other product module reads ``os.environ``). The functions read the environment when called,
not at import, so a process that sets a variable before it asks sees it. Setting a variable for
a child process is not reading one, and happens where the child is started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One environment variable the code reads: the type and default of its value as text (as
    the README's table shows them), and what it changes."""

    name: str
    type: str
    default: str
    meaning: str

    def value(self) -> str | None:
        """The variable's value; None where it is unset."""
        return os.environ.get(self.name)


CACHE_DIR = Variable(
    "TANDEM_CACHE_DIR",
    "path",
    "~/.cache/tandem",
    "where models converted from GGUF (the embedded default model's included) are kept",
)
TOKENIZER_DIR = Variable(
    "TANDEM_TOKENIZER_DIR",
    "path",
    "the default model's folder",
    "the tokenizer of the random-weight presets (a tokenizer-only folder)",
)
EVENT_LOOP = Variable(
    "TANDEM_EVENT_LOOP",
    "auto, uvloop or asyncio",
    "auto",
    "the event loop of the API processes and the load generator (auto: uvloop where installed)",
)
STEP_STATS = Variable(
    "TANDEM_STEP_STATS",
    "0 or 1",
    "0",
    "the engine core times each part of a step and logs a summary (as --step-stats)",
)
XDG_RUNTIME_DIR = Variable(
    "XDG_RUNTIME_DIR",
    "path",
    "unset",
    "where private ipc:// socket folders go first (else the temporary folder, then /tmp)",
)
CUDA_VISIBLE_DEVICES = Variable(
    "CUDA_VISIBLE_DEVICES",
    "comma-separated GPU ids",
    "every GPU",
    "the GPUs that --data-parallel-size shares out among its engine cores",
)

VARIABLES = (
    CACHE_DIR,
    TOKENIZER_DIR,
    EVENT_LOOP,
    STEP_STATS,
    XDG_RUNTIME_DIR,
    CUDA_VISIBLE_DEVICES,
)
EVENT_LOOP_CHOICES = ("auto", "uvloop", "asyncio")


def cache_dir() -> Path:
    configured = CACHE_DIR.value()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"


def tokenizer_dir() -> Path | None:
    """The tokenizer folder asked for; None: the default model's."""
    configured = TOKENIZER_DIR.value()
    return Path(configured) if configured else None


def event_loop() -> str:
    """One of EVENT_LOOP_CHOICES; ValueError naming the variable for any other value."""
    wanted = EVENT_LOOP.value()
    wanted = EVENT_LOOP.default if wanted is None else wanted
    if wanted not in EVENT_LOOP_CHOICES:
        choices = ", ".join(EVENT_LOOP_CHOICES)
        raise ValueError(f"{EVENT_LOOP.name}={wanted!r}: choose one of {choices}")
    return wanted


def step_stats() -> bool:
    return (STEP_STATS.value() or "0") != "0"


def xdg_runtime_dir() -> str | None:
    return XDG_RUNTIME_DIR.value() or None


def cuda_visible_devices() -> list[str] | None:
    """The GPU ids CUDA_VISIBLE_DEVICES lists (empty: none); None where it is unset."""
    visible = CUDA_VISIBLE_DEVICES.value()
    if visible is None:
        return None
    return [d.strip() for d in visible.split(",") if d.strip()]
