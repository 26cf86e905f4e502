"""The frontend's bound on work in flight: past it, new requests get 503 with Retry-After at once.

One HTTP request becomes ``prompts × n`` engine requests (sequences). The gate admits a request
only while the sequences in flight, from tokenization to the last output, stay within
``max_num_seqs + max_waiting_requests``: what the engine can run at once plus a bounded queue.
Past that an answer now ("busy, retry in a second") beats a queue whose memory and latency grow
without limit; OpenAI clients retry 503s, honouring Retry-After. A request that could never fit
(more sequences than the whole bound) is a 400. Everything runs on the event loop: no locks.
"""

from __future__ import annotations

import sys

RETRY_AFTER_S = 1


class OverloadedError(Exception):
    """No room for this request now; the caller answers 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManySequencesError(ValueError):
    """The request alone needs more sequences than the bound: it can never be admitted."""


class AdmissionGate:
    """Counts admitted engine requests; ``admit`` hands out a lease that ``release`` returns."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the admission limit must be at least 1, got {limit}")
        self.limit = limit
        self.in_use = 0
        self.peak = 0  # the most ever admitted at once: a check that the bound held
        self.rejected = 0

    @classmethod
    def unbounded(cls) -> AdmissionGate:
        return cls(sys.maxsize)

    def admit(self, count: int) -> Admission:
        """A lease on ``count`` sequences; OverloadedError when they do not fit now."""
        if count > self.limit:
            raise TooManySequencesError(
                f"this request needs {count} sequences (prompts x n) but the server admits at "
                f"most {self.limit} at once"
            )
        if self.in_use + count > self.limit:
            self.rejected += 1
            raise OverloadedError(
                f"the server is at capacity ({self.in_use} of {self.limit} sequences in "
                f"flight); retry in {RETRY_AFTER_S} s"
            )
        self.in_use += count
        self.peak = max(self.peak, self.in_use)
        return Admission(self, count)


class Admission:
    """What one request holds; ``release`` is idempotent, so every exit path may call it."""

    def __init__(self, gate: AdmissionGate, count: int) -> None:
        self._gate = gate
        self.count = count

    def release(self) -> None:
        if self.count:
            self._gate.in_use -= self.count
            self.count = 0
