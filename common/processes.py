"""The contract between a Tandem process and the processes it starts: none outlives its parent.

Engine cores, API processes and tensor-parallel workers are all children of another Tandem
process, and a child left behind holds a GPU or a port for good. Two guards, used by every kind:

- ``die_with_parent()`` (for ``subprocess.Popen``) and ``set_parent_death_signal()`` (called in
  the child itself, for processes started by multiprocessing) ask Linux to SIGKILL the child the
  moment its parent dies, even by SIGKILL;
- ``ParentWatch`` polls for the parent, which also covers what the death signal misses (other
  platforms, a parent thread that exits, wrappers in between).

``pid_alive`` is the one "does that process still run" test.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# The folder that holds this project's packages (common/, engine_core/, frontend/, protocol/).
_PACKAGES_ROOT = str(Path(__file__).resolve().parents[1])


def python_module_argv(module: str) -> list[str]:
    """The command that runs this project's ``module`` in a child Python, with -P: the folder
    it starts in does not come first on its import path, where a common.py or protocol.py of
    the user's would shadow our packages. ``child_env`` puts our own root there instead."""
    return [sys.executable, "-P", "-m", module]


def child_env() -> dict[str, str]:
    """Our environment with this project's root first on PYTHONPATH, for a child started with
    ``python_module_argv`` (an uninstalled checkout is found through it); not where the root
    is a site folder (a wheel's install): there the child finds it anyway, and first on the
    path it would put that folder before the standard library."""
    out = {**os.environ}
    if _PACKAGES_ROOT not in _site_folders():
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGES_ROOT, out.get("PYTHONPATH")]))
    return out


def _site_folders() -> set[str]:
    import site

    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return {str(Path(folder).resolve()) for folder in folders}


# What `tandem serve` sends the engine cores it runs when it stops for good. Any other exit of
# theirs it follows with a restart, so only this one lets an engine tell its other nodes to exit
# with it (engine_core/server.py, engine_core/nodes.py).
STOP_FOR_GOOD = signal.SIGUSR1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when this process dies; None where
    that is not possible (the child's ParentWatch still covers it)."""
    prctl = _prctl()  # resolved here, not in the forked child
    if prctl is None:
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_death_signal


def set_parent_death_signal(parent: int) -> None:
    """From inside a child: be SIGKILLed when ``parent`` dies; exit now if it already has."""
    prctl = _prctl()
    if prctl is not None:
        with contextlib.suppress(OSError):
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class ParentWatch:
    """Whether process ``pid``, which started us (or which we must not outlive), still runs.

    For our own parent the test is whether we were re-parented, which a recycled pid cannot
    fool; for another process (a launcher in between), ``pid_alive``.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._direct = os.getppid() == pid

    def alive(self) -> bool:
        if self._direct:
            return os.getppid() == self.pid
        return pid_alive(self.pid)


# A child's exit code for an error that a restart cannot cure (an API process whose tokenizer
# does not load): its parent stops instead of restarting it for ever.
EXIT_UNSERVABLE = 3


class UnservableError(RuntimeError):
    """A child exited with EXIT_UNSERVABLE."""


# Whether SIGTERM came while ``exit_on_sigterm``'s handler was in place: its SystemExit may have
# been dropped (raised inside a weakref callback or a ``__del__``), so ``stop_on_sigterm`` stops
# at once where it sees one came before it.
_sigterm_seen = False


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit (as Ctrl-C raises KeyboardInterrupt), so that ``finally``
    blocks stop what this process started."""

    def raise_exit(signum: int, _frame: object) -> None:
        global _sigterm_seen
        _sigterm_seen = True
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)


@contextlib.contextmanager
def signals_deferred(*signums: int) -> Iterator[None]:
    """Within the block these signals are only noted; as it ends, each that came goes to the
    handler that was in place, which runs there. For start-up work that a handler's exception
    must not cut at an arbitrary bytecode: one raised inside an at-fork callback (logging's
    runs on every spawn) is printed and dropped, and left the logging lock that callback was to
    release held for ever, which hung the next thread that logged. The handlers, not the signal
    mask: a child spawned meanwhile inherits a mask, and exec resets the handlers."""
    came: list[int] = []

    def note(signum: int, _frame: object) -> None:
        came.append(signum)

    previous = {signum: signal.signal(signum, note) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)  # its handler runs before this returns


class Drainable(Protocol):
    """A server that drains and stops once told (uvicorn.Server)."""

    should_exit: bool


class SigtermStop:
    """SIGTERM inside an event loop, as a loop callback: before ``server`` is set it cancels the
    task (whose ``finally`` closes what it opened), once set it asks the server to drain and
    stop, as uvicorn's own handler does.

    Not a handler that raises SystemExit: Python runs a signal handler between any two bytecodes,
    and an exception raised inside a weakref callback or a ``__del__`` (an API process's last
    start-up collection, ``freeze_startup_heap``, runs thousands) is printed and dropped, which
    left a server that had been sent SIGTERM serving."""

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.server: Drainable | None = None
        self.cancelled = False

    def stopping(self) -> bool:
        """Whether the server was told to drain and stop (by this or by uvicorn's SIGINT)."""
        return self.server is not None and self.server.should_exit

    def __call__(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        elif self.task is not None and not self.cancelled and not self.task.cancelling():
            # Once, and not over a Ctrl-C's cancel: a second stop must not cut the clean-up.
            self.cancelled = True
            self.task.cancel()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[SigtermStop]:
    """Within the running task: SIGTERM goes through a ``SigtermStop``, and the cancellation it
    makes ends the block quietly; after it, SIGTERM raises SystemExit again for the process's
    own stopping. A SIGTERM that ``exit_on_sigterm``'s handler took before the block (its
    SystemExit dropped in a weakref callback during the imports) stops it at once."""
    loop = asyncio.get_running_loop()
    stop = SigtermStop(asyncio.current_task())
    loop.add_signal_handler(signal.SIGTERM, stop)
    if _sigterm_seen:  # before this block, and its SystemExit did not end the process
        loop.call_soon(stop)
    try:
        yield stop
    except asyncio.CancelledError:
        if not stop.cancelled or stop.task is None:
            raise
        stop.task.uncancel()
    finally:
        # Blocked meanwhile: between the two, SIGTERM would take its default action and end the
        # process before it stops what it started.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            loop.remove_signal_handler(signal.SIGTERM)
            exit_on_sigterm()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def freeze_startup_heap() -> int:
    """Put every object alive now beyond the garbage collector's reach; returns how many.

    Call it once a long-lived process (an engine core, an API process) has started and before
    it serves. Its start-up leaves hundreds of thousands of objects that live as long as it does
    (torch, transformers and their modules, the tokenizer's tables), and each full collection
    walks all of them: on the API process at 256 streams, the collections that the per-step
    outputs set off stalled the event loop in bursts of hundreds of milliseconds. Frozen, they
    are never walked again; garbage made while serving is collected as before.
    """
    gc.collect()  # the start-up's own garbage goes first, not into the frozen set
    gc.freeze()
    return gc.get_freeze_count()


# Net allocations of tracked objects between two young collections (CPython's default: 700).
YOUNG_COLLECTION_THRESHOLD = 20_000


def spread_young_collections() -> None:
    """Let a serving loop allocate far more between two young collections than the default.

    An engine step allocates a few objects per row (its plan's entry, the row's output event, a
    token list) that all die by reference count within a step or two. At batch 256 about a
    thousand of them are alive at once, so the default threshold (700 net allocations) set off
    one or two young collections every step, each moving that step's live objects to an older
    generation, whose collections then came every few steps and walked them again. With the
    threshold above the largest step's live set, a step's objects are gone before any
    collection sees them; garbage cycles are still collected, only less often.
    """
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)
