"""The event loop every Tandem asyncio process (API processes, the load generator) runs on:
uvloop's where it is installed.

The API process spends its time in the event loop's own machinery (waking tasks, callbacks,
socket reads and writes): at 256 streams a sample of the pure-Python loop showed its handles,
futures and queues taking more of the process than the per-chunk work itself. uvloop runs the
same asyncio programs on libuv in C; it is a dependency on Linux and macOS, and elsewhere (or
with TANDEM_EVENT_LOOP=asyncio, for comparisons) the standard loop runs; any other value of that
variable is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from common import env

T = TypeVar("T")


def loop_name() -> str:
    """'uvloop' or 'asyncio': the loop ``run`` uses here. TANDEM_EVENT_LOOP: 'auto' (the
    default: uvloop where installed), 'uvloop' (an error if it is not) or 'asyncio'."""
    wanted = env.event_loop()
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise ImportError("TANDEM_EVENT_LOOP=uvloop, but uvloop is not installed") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_name`` names."""
    if loop_name() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # Python 3.11's API
            return runner.run(main)
    return asyncio.run(main)
