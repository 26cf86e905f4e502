"""When each request is due: all at once, a fixed interval, or a (bursty) Poisson process.

A schedule yields, for each request, how long to wait before it is due, given the time the
previous request actually went out. ``absolute`` intervals are measured from the start (request
i is due at i * interval, however late the earlier ones went), ``relative`` ones from the previous
submit (a late request pushes every later one back). A Poisson rate draws gaps from a gamma
distribution with shape = burstiness and mean 1 / rate: burstiness 1 is Poisson, below 1 burstier,
above 1 more even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Arrival:
    """How requests arrive; ``due_times`` turns it into a schedule."""

    mode: str = "burst"  # burst | interval | poisson
    interval: float = 0.0  # seconds, for mode "interval"
    interval_mode: str = "absolute"  # absolute | relative
    rate: float = math.inf  # requests / s, for mode "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("burst", "interval", "poisson"):
            raise ValueError(f"unknown arrival mode {self.mode!r}")
        if self.interval_mode not in ("absolute", "relative"):
            raise ValueError(f"unknown interval mode {self.interval_mode!r}")
        if self.burstiness <= 0 or self.rate <= 0 or self.interval < 0:
            raise ValueError("rate and burstiness must be > 0, interval >= 0")

    @classmethod
    def from_rate(cls, rate: float, burstiness: float = 1.0, seed: int = 0) -> Arrival:
        """Poisson (gamma) arrivals at ``rate`` per second; an infinite rate is all at once."""
        if math.isinf(rate):
            return cls("burst")
        return cls("poisson", rate=rate, burstiness=burstiness, seed=seed)

    def describe(self) -> str:
        if self.mode == "interval":
            return f"every {self.interval * 1000:g} ms ({self.interval_mode})"
        if self.mode == "poisson":
            return f"Poisson {self.rate:g} req/s, burstiness {self.burstiness:g}"
        return "all at once"

    def gaps(self, n: int, run_index: int = 0) -> list[float]:
        """The n gaps (seconds) before each request; the first is 0."""
        if self.mode == "burst" or n == 0:
            return [0.0] * n
        if self.mode == "interval":
            return [0.0] + [self.interval] * (n - 1)
        rng = np.random.default_rng([self.seed, run_index, 1])
        theta = 1.0 / (self.rate * self.burstiness)
        drawn = rng.gamma(shape=self.burstiness, scale=theta, size=n - 1)
        return [0.0] + [float(g) for g in drawn]

    @property
    def relative(self) -> bool:
        """Whether each gap counts from the previous actual submit rather than the schedule.

        Poisson gaps count from the schedule, like absolute intervals: the generator keeps the
        offered rate even when it falls behind for a moment.
        """
        return self.mode == "interval" and self.interval_mode == "relative"
