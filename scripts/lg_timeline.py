"""When a load-generator run's requests went out, started and ended: one line per run.

    python scripts/lg_timeline.py RESULT.json [RESULT.json ...]

For each run in a ``--result-json`` file of ``python -m loadgen``: the run's duration, the
first and last submit, the first, median and last first-token time, the first, median and last
end (all ms on the run's clock), and the median over requests of the mid-run pace: the time per
chunk between a request's 25% and 75% chunks (a token a chunk over raw ZMQ, ``--stream-interval``
tokens over HTTP). Two transports side by side show where a run's time goes: a late first token
(admission), a wide spread of ends (requests that started many engine steps apart), or a slower
pace (the streaming path).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Timeline:
    label: str
    duration_ms: float
    submits_ms: tuple[float, float]  # first, last
    first_tokens_ms: tuple[float, float, float]  # first, median, last
    ends_ms: tuple[float, float, float]  # first, median, last
    mid_pace_ms: float  # median over requests of the time per chunk, 25% to 75% of its chunks
    chunks: int  # the most chunks a request had

    def line(self) -> str:
        def ms(values: tuple[float, ...]) -> str:
            return "/".join(f"{v:.0f}" for v in values)

        return (
            f"{self.label}: dur {self.duration_ms:.0f} ms; submit {ms(self.submits_ms)}; "
            f"first token {ms(self.first_tokens_ms)}; end {ms(self.ends_ms)}; "
            f"mid-run {self.mid_pace_ms:.2f} ms/chunk ({self.chunks} chunks)"
        )


def timeline(run: dict[str, Any]) -> Timeline | None:
    """One run of a result file (its ``requests`` with submit, chunk and end times in s), over
    the requests that completed; None where none did."""
    requests = [
        r for r in run["requests"]
        if r["submitted_at"] is not None and r["ended_at"] is not None and r["chunk_times"]
    ]  # fmt: skip
    if not requests:
        return None
    submits = sorted(1e3 * r["submitted_at"] for r in requests)
    firsts = sorted(1e3 * r["chunk_times"][0] for r in requests)
    ends = sorted(1e3 * r["ended_at"] for r in requests)
    paces = []
    for r in requests:
        chunks = r["chunk_times"]
        lo, hi = len(chunks) // 4, 3 * len(chunks) // 4
        if hi > lo:
            paces.append(1e3 * (chunks[hi] - chunks[lo]) / (hi - lo))
    return Timeline(
        label=str(run.get("label", "")),
        duration_ms=1e3 * run["summary"]["duration_s"],
        submits_ms=(submits[0], submits[-1]),
        first_tokens_ms=(firsts[0], statistics.median(firsts), firsts[-1]),
        ends_ms=(ends[0], statistics.median(ends), ends[-1]),
        mid_pace_ms=statistics.median(paces) if paces else float("nan"),
        chunks=max(len(r["chunk_times"]) for r in requests),
    )


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for path in paths:
        for run in json.loads(Path(path).read_text())["runs"]:
            t = timeline(run)
            print(f"{path} {t.line() if t else run.get('label', '') + ': no request completed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
