"""``common/processes.py`` ``stop_on_sigterm``: SIGTERM inside an event loop as a loop callback;
``signals_deferred``: a signal during a spawn waits for the spawn to end.

Each case runs a small asyncio program in a subprocess of its own (signals go to the whole
process) and reads what it printed. A SIGTERM sent from inside a weakref callback is where a
handler that raises SystemExit loses it (Python prints and drops an exception raised there);
``weakref.finalize`` makes that moment deterministic: the signal is handled at the first bytecode
after ``os.kill`` returns, inside the finalizer."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

PROGRAM = """
import asyncio, os, signal, sys, weakref
from common.processes import exit_on_sigterm, stop_on_sigterm

class Thing:
    pass

def sigterm_from_a_weakref_callback():
    thing = Thing()
    weakref.finalize(thing, os.kill, os.getpid(), signal.SIGTERM)
    del thing

async def main(case):
    if case == "before-the-loop":
        sigterm_from_a_weakref_callback()  # exit_on_sigterm's SystemExit: printed and dropped
    with stop_on_sigterm():
        try:
            if case == "weakref":
                sigterm_from_a_weakref_callback()
            elif case == "sigint-then-sigterm":  # SIGTERM during the clean-up Ctrl-C started
                os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(20)
            print("still running", flush=True)
        finally:
            if case == "sigint-then-sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(0.2)
            print("cleaned up", flush=True)
    print("stopped", flush=True)

exit_on_sigterm()
# A CI run started in the background inherits SIGINT ignored: asyncio.run would not take it.
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    asyncio.run(main(sys.argv[1]))
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def run_case(case: str) -> tuple[list[str], str]:
    """What the program printed (words), and its stderr."""
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, case], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split(), result.stderr


def test_a_sigterm_raised_in_a_weakref_callback_stops_the_task() -> None:
    """The task is cancelled, its clean-up runs, the block ends quietly."""
    printed, stderr = run_case("weakref")
    assert printed == ["cleaned", "up", "stopped"]
    assert "Exception ignored" not in stderr, stderr


def test_a_sigterm_during_a_ctrl_cs_clean_up_does_not_cut_it() -> None:
    """Ctrl-C cancels the task (asyncio.Runner); a SIGTERM during the clean-up that began is
    not a second cancel: the clean-up finishes and Ctrl-C's KeyboardInterrupt comes out."""
    printed, _ = run_case("sigint-then-sigterm")
    assert printed == ["cleaned", "up", "interrupted"]


def test_a_sigterm_dropped_before_the_loop_stops_it_when_it_starts() -> None:
    """SIGTERM under ``exit_on_sigterm`` inside a weakref callback (as during the imports
    before an API process's loop): its SystemExit is printed and dropped, and the block that
    follows stops at once instead of serving."""
    printed, stderr = run_case("before-the-loop")
    assert "Exception ignored" in stderr  # the case this covers: the SystemExit was lost
    assert printed == ["cleaned", "up", "stopped"]


SPAWN = """
import os, signal, subprocess, sys
from common.processes import die_with_parent, exit_on_sigterm, signals_deferred

signum = int(sys.argv[1])
exit_on_sigterm()
signal.signal(signal.SIGINT, signal.default_int_handler)
# Handled at the first bytecode after os.kill returns: inside this at-fork callback (they run
# where Popen has a preexec_fn, as the engines' spawn has), where an exception is printed and
# dropped, as when a signal came during logging's own callback.
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signum))
child = None
try:
    with signals_deferred(signal.SIGTERM, signal.SIGINT):
        child = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=die_with_parent())
        print("spawned", flush=True)
    print("went on", flush=True)
except (SystemExit, KeyboardInterrupt) as exc:
    print(type(exc).__name__, "after the spawn" if child else "during the spawn", flush=True)
finally:
    if child is not None:
        child.wait()
"""


@pytest.mark.parametrize(
    ("signum", "raised"), [(signal.SIGTERM, "SystemExit"), (signal.SIGINT, "KeyboardInterrupt")]
)
def test_a_signal_during_a_spawn_takes_effect_after_it(signum: int, raised: str) -> None:
    """The signal comes inside an at-fork callback of the spawn: its exception is neither lost
    there nor left to cut the spawn; the handler runs once the block ends, the child known."""
    result = subprocess.run(
        [sys.executable, "-c", SPAWN, str(int(signum))], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["spawned", raised, "after", "the", "spawn"]
    assert "Exception ignored" not in result.stderr, result.stderr
