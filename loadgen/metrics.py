"""Per-request records and the figures computed from them, with the seeds' definitions.

All times are seconds from the start of the run (``t = 0`` when the first request is due), so a
record reads the same in memory, in the result JSON and in a hand-written test:

- TTFT = first chunk - submit
- TPOT = (last chunk - first chunk) / (output tokens - 1); undefined for a one-token answer
- ITL = the gaps between consecutive chunks (a chunk may carry several tokens)
- E2E latency = end - submit
- submit lag = submit - when the arrival schedule wanted it sent (the generator falling behind,
  or waiting for a slot under ``--max-concurrency``)

Only completed requests enter the latency and throughput figures; failed ones are counted and
listed with their errors. The duration of a run is from t = 0 to the last request's end.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request's life as the load generator saw it."""

    request_id: str
    prompt_len: int  # tokens; the server's count when it reports one (chat templates add some)
    max_tokens: int  # output tokens asked for
    scheduled_at: float  # when the arrival schedule wanted it sent
    submitted_at: float | None = None  # when it was actually sent
    chunk_times: list[float] = field(default_factory=list)  # each chunk that carried output
    ended_at: float | None = None  # response complete (or failed)
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    conversation: int | None = None  # multi-turn: which conversation, and its turn
    turn: int | None = None
    reply: str | None = None  # the reply's text, kept only for a conversation's next turn

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended_at is not None

    @property
    def ttft(self) -> float | None:
        if not self.chunk_times or self.submitted_at is None:
            return None
        return self.chunk_times[0] - self.submitted_at

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        if self.ended_at is None or self.submitted_at is None:
            return None
        return self.ended_at - self.submitted_at

    @property
    def submit_lag(self) -> float | None:
        return None if self.submitted_at is None else self.submitted_at - self.scheduled_at

    def fail(self, error: str, now: float) -> None:
        self.error = error
        self.ended_at = now

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ok=self.ok, ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return out


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in seconds; a request meets them when it meets every one set."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``"ttft=500,tpot=50"`` (milliseconds) -> Slo(ttft=0.5, tpot=0.05)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, ms = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO {part!r}: expected ttft=MS, tpot=MS or e2e=MS")
            limit = float(ms)
            if not 0 < limit < math.inf:  # NaN too: it would fail every request
                raise ValueError(f"bad SLO {part!r}: a limit is a number of ms above 0")
            values[key] = limit / 1000.0
        if not values:
            raise ValueError("an SLO needs at least one of ttft=MS, tpot=MS, e2e=MS")
        return cls(**values)

    def met_by(self, rec: RequestRecord) -> bool:
        # A one-token answer has no TPOT, so no TPOT objective can fail for it.
        checks = ((self.ttft, rec.ttft), (self.tpot, rec.tpot), (self.e2e, rec.e2e))
        return rec.ok and all(lim is None or v is None or v <= lim for lim, v in checks)

    def as_ms(self) -> dict[str, float]:
        return {k: v * 1000.0 for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds; all NaN when there are no samples."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls(0, *([math.nan] * (1 + len(PERCENTILES))))
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        pcts = np.percentile(ms, PERCENTILES)  # linear interpolation between order statistics
        return cls(len(seconds), float(ms.mean()), *(float(p) for p in pcts))


@dataclass(frozen=True)
class Summary:
    """The figures of one run."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    submit_lag: Distribution
    slo: dict[str, float] | None = None  # milliseconds
    good_requests: int | None = None
    goodput: float | None = None  # requests meeting the SLO / s
    errors: dict[str, int] = field(default_factory=dict)  # error message -> how many
    # Multi-turn runs: the TTFT of each conversation's first turn, and of its later turns (which
    # a server's prefix cache serves from the conversation so far); None for other runs.
    ttft_first_turn: Distribution | None = None
    ttft_later_turns: Distribution | None = None

    def as_json(self) -> dict[str, Any]:
        return _nan_to_none(asdict(self))


def summarize(records: list[RequestRecord], slo: Slo | None = None) -> Summary:
    """The run's figures from its records (see the module docstring for the definitions)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max((r.ended_at for r in records if r.ended_at is not None), default=0.0)
    n_in = sum(r.prompt_len for r in done)
    n_out = sum(r.output_tokens for r in done)
    good = sum(slo.met_by(r) for r in done) if slo else None
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error or "not finished"
        errors[key] = errors.get(key, 0) + 1
    return Summary(
        num_requests=len(records),
        completed=len(done),
        failed=len(failed),
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=_rate(len(done), duration),
        output_throughput=_rate(n_out, duration),
        total_token_throughput=_rate(n_in + n_out, duration),
        ttft=Distribution.of(_present(r.ttft for r in done)),
        tpot=Distribution.of(_present(r.tpot for r in done)),
        itl=Distribution.of([gap for r in done for gap in r.itls]),
        e2e=Distribution.of(_present(r.e2e for r in done)),
        submit_lag=Distribution.of(_present(r.submit_lag for r in records)),
        slo=slo.as_ms() if slo else None,
        good_requests=good,
        goodput=_rate(good, duration) if good is not None else None,
        errors=errors,
        **ttft_by_turn(done),
    )


def ttft_by_turn(done: list[RequestRecord]) -> dict[str, Distribution]:
    """Summary's ttft_first_turn and ttft_later_turns for a multi-turn run's completed turns;
    nothing for a run without conversations."""
    if not any(r.turn is not None for r in done):
        return {}
    first = _present(r.ttft for r in done if r.turn == 0)
    later = _present(r.ttft for r in done if r.turn is not None and r.turn > 0)
    return {"ttft_first_turn": Distribution.of(first), "ttft_later_turns": Distribution.of(later)}


def _present(values: Any) -> list[float]:
    return [v for v in values if v is not None]


def _rate(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def _nan_to_none(obj: Any) -> Any:
    """JSON has no NaN: empty distributions become nulls."""
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def format_summary(s: Summary, title: str = "Serving Benchmark Result") -> str:
    """The printed summary, laid out as the seeds' benchmark scripts print it."""
    lines = [f"{' ' + title + ' ':=^60}"]
    row = lines.append
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", s.completed),
        ("Failed requests:", s.failed),
        ("Benchmark duration (s):", f"{s.duration_s:.2f}"),
        ("Total input tokens:", s.total_input_tokens),
        ("Total generated tokens:", s.total_output_tokens),
        ("Request throughput (req/s):", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{s.total_token_throughput:.2f}"),
    ]
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={v:g}" for k, v in (s.slo or {}).items())
        rows.append(("SLO (ms):", slo))
        rows.append(("Requests meeting the SLO:", s.good_requests))
        rows.append(("Request goodput (req/s):", f"{s.goodput:.2f}"))
    for label, value in rows:
        row(f"{label:<44}{value:>16}")
    sections = [
        ("Time to First Token", "TTFT", s.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot),
        ("Inter-token Latency", "ITL", s.itl),
        ("End-to-end Latency", "E2E", s.e2e),
        ("Submit Lag (behind the arrival schedule)", "lag", s.submit_lag),
    ]
    if s.ttft_first_turn is not None and s.ttft_later_turns is not None:
        sections[1:1] = [
            ("TTFT, each conversation's first turn", "TTFT", s.ttft_first_turn),
            ("TTFT, later turns", "TTFT", s.ttft_later_turns),
        ]
    for heading, short, dist in sections:
        row(f"{heading:-^60}")
        row(f"{'Mean ' + short + ' (ms):':<44}{dist.mean:>16.2f}")
        for p in PERCENTILES:
            name = "Median" if p == 50 else f"P{p}"
            row(f"{name + ' ' + short + ' (ms):':<44}{getattr(dist, f'p{p}'):>16.2f}")
    for error, count in s.errors.items():
        row(f"failed x{count}: {error}")
    row("=" * 60)
    return "\n".join(lines)
