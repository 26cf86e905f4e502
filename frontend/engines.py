"""Starts the engine-core subprocess for `tandem serve`, restarts it when it dies, and makes sure
it never outlives us.

The frontend resolves the model folder first (for the default model that converts and caches the
GGUF once) and hands the engine the resolved folder, so the two processes never convert twice.
The engine is `python -m frontend.cli engine --address ADDR --model DIR --parent-pid PID [engine
flags]`. Two guards against an orphaned engine holding the GPU: on Linux the child gets
PR_SET_PDEATHSIG, so even a frontend killed with SIGKILL takes its engine with it at once; and
--parent-pid makes the engine poll for us every second and exit on its own, which also covers
what the death signal misses (other platforms, a launcher thread that exits, wrappers in between).

``EngineSupervisor`` watches the process under a live server: when it exits, every request in
flight fails (503, or a final SSE error event), /health answers 503, and a new engine core is
started on the same address with a new handshake; the server then serves again.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from engine_core.config import EngineConfig
from protocol.address import EngineAddress, remove_ipc_files

if TYPE_CHECKING:
    from frontend.engine_client import AsyncEngine
    from frontend.serving import ServingContext
    from protocol.curve import CurveClientKeys

logger = logging.getLogger("tandem.frontend")

_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 10.0
_EXIT_POLL_S = 0.1
# Seconds to wait before each restart in a row; an engine that served STABLE_AFTER_S resets it.
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 60.0


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
            "--parent-pid", str(os.getpid()),
            "--log-level", self.log_level, *self.flags,
        ]  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def start(self) -> None:
        """Spawn the engine. Call from the main thread (the event loop's, not an executor's):
        the death signal fires when the thread that spawned the child exits."""
        logger.info("starting the engine core: %s", " ".join(self.argv))
        self.process = subprocess.Popen(self.argv, preexec_fn=die_with_parent())

    def restart(self) -> None:
        """Kill what is left of the old process and start a new one on the same address (the
        ipc directory stays; the new engine replaces the stale socket files when it binds)."""
        self.kill()
        self.start()

    def kill(self) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

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
    proc: EngineProcess | None,
    timeout: float,
    dead_after_s: float = 30.0,
    address: EngineAddress | None = None,
    curve: CurveClientKeys | None = None,
    is_alive: Callable[[], bool] | None = None,
) -> AsyncEngine:
    """The frontend's engine connection, once the handshake succeeded: to ``proc``, or with
    ``proc`` None to an engine at ``address`` that another process started; ``is_alive`` tells
    whether that engine's process lives (without it, its death is seen only as silence).

    Fails fast with EngineDeadError if the process exits first, TimeoutError after ``timeout``.
    """
    from frontend.engine_client import AsyncEngine

    if proc is not None:
        engine = AsyncEngine(proc.address, proc.alive, dead_after_s, curve)
    else:
        alive = is_alive or (lambda: True)
        engine = AsyncEngine(address, alive, dead_after_s=dead_after_s, curve=curve)
    try:
        await engine.start(timeout)
    except BaseException:
        await engine.close()
        raise
    return engine


class EngineSupervisor:
    """Restarts the engine core whenever its process exits, under a live server.

    The old connection is closed first (failing what is in flight and dropping whatever its
    sockets still queue, so no stale request reaches the new engine), then a new process is
    started and handshaken, then ``ctx.engine`` is swapped for the new connection. Restarts in
    a row back off (RESTART_BACKOFF_S). Meanwhile /health answers 503 and new requests 503.
    """

    def __init__(
        self,
        proc: EngineProcess,
        ctx: ServingContext,
        info: dict[str, object],
        start_timeout: float,
        dead_after_s: float,
    ) -> None:
        self.proc = proc
        self.ctx = ctx
        self.info = info  # served at /v1/engine: the pid changes with each restart
        self.start_timeout = start_timeout
        self.dead_after_s = dead_after_s
        self.restarts = 0
        self._in_a_row = 0
        self._up_since = time.monotonic()

    async def run(self) -> None:
        while True:
            while self.proc.alive():
                await asyncio.sleep(_EXIT_POLL_S)
            await self._replace()

    async def _replace(self) -> None:
        if time.monotonic() - self._up_since > STABLE_AFTER_S:
            self._in_a_row = 0
        delay = RESTART_BACKOFF_S[min(self._in_a_row, len(RESTART_BACKOFF_S) - 1)]
        self._in_a_row += 1
        reason = f"the engine process exited (code {self.proc.returncode}); restarting it"
        logger.error("%s in %.0f s", reason, delay)
        await self.ctx.engine.close(reason)
        await asyncio.sleep(delay)
        self.proc.restart()  # on the loop's thread: see EngineProcess.start
        try:
            engine = await connect_engine(self.proc, self.start_timeout, self.dead_after_s)
        except Exception as exc:  # EngineDeadError, TimeoutError, a socket error
            logger.error("the new engine core did not come up: %s", exc)
            self.proc.kill()  # run() sees it gone and tries again, after a longer pause
            return
        self.ctx.engine = engine
        self.info["pid"] = self.proc.pid
        self.restarts += 1
        self._up_since = time.monotonic()
        self.ctx.metrics.record_restart()
        logger.warning("engine core restarted (pid %s); serving again", self.proc.pid)
