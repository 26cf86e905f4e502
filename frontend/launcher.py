"""Starts the engine-core subprocess for `tandem serve`, and makes sure it never outlives us.

The frontend resolves the model folder first (for the default model that converts and caches the
GGUF once) and hands the engine the resolved folder, so the two processes never convert twice.
The engine is `python -m frontend.cli engine --address ADDR --model DIR [engine flags]`; on Linux
it also gets PR_SET_PDEATHSIG, so even a frontend killed with SIGKILL takes its engine with it.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from engine_core.config import EngineConfig
from protocol.address import EngineAddress, remove_ipc_files

if TYPE_CHECKING:
    from frontend.engine_client import AsyncEngine

logger = logging.getLogger("tandem.frontend")

_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 10.0


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `tandem serve` (from add_engine_args), passed on to `tandem engine`."""
    out: list[str] = []
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model" or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        else:
            out += [flag, str(value)]
    return out


class EngineProcess:
    """One engine-core subprocess serving ``address``; stop() (or leaving ``with``) ends it."""

    def __init__(
        self,
        model_dir: Path | str,
        flags: list[str],
        address: EngineAddress,
        log_level: str = "INFO",
        owns_address: bool = True,
    ) -> None:
        self.model_dir = str(model_dir)
        self.flags = flags
        self.address = address
        self.log_level = log_level
        self.owns_address = owns_address  # remove the ipc directory when done
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "frontend.cli", "engine",
            "--address", str(self.address), "--model", self.model_dir,
            "--log-level", self.log_level, *self.flags,
        ]  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> None:
        """Spawn the engine (call from the main thread: the death signal follows that thread)."""
        logger.info("starting the engine core: %s", " ".join(self.argv))
        self.process = subprocess.Popen(self.argv, preexec_fn=die_with_parent())

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL if it is still there after ``timeout`` s; idempotent."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("engine core did not stop within %.0f s: killing it", timeout)
                proc.kill()
                proc.wait()
        if self.owns_address:
            remove_ipc_files(self.address)

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when this process dies; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_death_signal


async def connect_engine(
    proc: EngineProcess, timeout: float, dead_after_s: float = 30.0
) -> AsyncEngine:
    """The frontend's engine connection, once the handshake succeeded.

    Fails fast with EngineDeadError if the process exits first, TimeoutError after ``timeout``.
    """
    from frontend.engine_client import AsyncEngine

    engine = AsyncEngine(proc.address, is_process_alive=proc.alive, dead_after_s=dead_after_s)
    try:
        await engine.start(timeout)
    except BaseException:
        await engine.close()
        raise
    return engine
