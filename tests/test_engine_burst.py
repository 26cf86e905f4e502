"""The idle engine's intake of a burst (EngineProc._absorb_burst): a message with nothing queued
behind it is stepped on at once; one with more queued behind it brings the rest of the burst in
before the first step."""

from __future__ import annotations

import queue
from typing import Any

from engine_core.proc import EngineProc


class Intake:
    """An EngineProc's inbox and burst flag, with ``_handle`` recording what it was given (the
    engine core behind it is not needed to see which messages are taken before a step)."""

    def __init__(self, messages: list[str], more_queued: bool, last_ends_burst: str = "") -> None:
        self.proc = EngineProc.__new__(EngineProc)
        self.proc.inbox = queue.Queue()
        for msg in messages:
            self.proc.inbox.put((b"client", msg))
        self.proc._more_queued = more_queued
        self.handled: list[Any] = []
        self.last_ends_burst = last_ends_burst
        self.proc._handle = self.handle  # type: ignore[method-assign]

    def handle(self, client: bytes, msg: Any) -> None:
        self.handled.append(msg)
        if msg == self.last_ends_burst:  # as the input thread flags the burst's last message
            self.proc._more_queued = False


def test_a_lone_message_is_stepped_on_at_once() -> None:
    """Nothing was queued behind the message that woke the engine: it takes nothing more, even
    what arrives meanwhile is left to the ordinary drain."""
    intake = Intake(["late"], more_queued=False)
    intake.proc._absorb_burst()
    assert intake.handled == []
    assert intake.proc.inbox.qsize() == 1


def test_a_burst_is_taken_in_before_the_first_step() -> None:
    intake = Intake(["second", "third", "last"], more_queued=True, last_ends_burst="last")
    intake.proc._absorb_burst()
    assert intake.handled == ["second", "third", "last"]
    assert intake.proc.inbox.empty()


def test_a_burst_that_stops_arriving_ends_the_wait() -> None:
    """The input thread still flags more queued, but nothing comes: the wait is bounded and
    what did come is taken."""
    intake = Intake(["second"], more_queued=True)
    intake.proc._absorb_burst()
    assert intake.handled == ["second"]
