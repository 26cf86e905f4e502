"""When a request's gathered tokens go on: the one rule that the engine, the client and the
frontend each apply at their own stage.

A request's first tokens and its end go at once; otherwise its tokens gather until ``every`` of
them are waiting. ``every=None`` lets only the end go (a consumer that needs the whole output).
The engine core holds a request's tokens by it before it sends them
(``AddRequest.output_interval``), the client library wakes the consumer of a request group by
it, and the frontend sends a streamed choice's chunk by it (``--stream-interval``), so no stage
handles a request at the steps in between. Why the rule is this one:
docs/design/output-intervals-and-streaming.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutputInterval:
    """The rule: whether what one request has gathered is due to go on."""

    every: int | None  # tokens to gather before they go on; None: only at the end

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"an output interval is None or at least 1, got {self.every}")

    def due(self, gathered: int, sent_any: bool, ending: bool = False) -> bool:
        """Whether ``gathered`` waiting tokens go on now: at the end (``ending``: also any
        output that carries something other than tokens); unless ``every`` is None, also with
        the request's first tokens (``sent_any`` False) and once ``every`` have gathered."""
        if ending:
            return True
        if self.every is None or gathered == 0:
            return False
        return not sent_any or gathered >= self.every


@dataclass(slots=True)
class IntervalCounter:
    """One request's count under an ``OutputInterval``: what has gathered since it last went on."""

    interval: OutputInterval
    gathered: int = 0
    sent_any: bool = False

    def add(self, num_tokens: int, ending: bool = False) -> bool:
        """Count ``num_tokens`` more; whether what has gathered is now due. Once tokens are
        due, the request's first tokens count as gone: later ones gather for ``every``."""
        self.gathered += num_tokens
        due = self.interval.due(self.gathered, self.sent_any, ending)
        if due and self.gathered:
            self.sent_any = True
        return due

    def went_on(self) -> None:
        """What had gathered went on: count afresh from here."""
        self.gathered = 0
        self.sent_any = True
