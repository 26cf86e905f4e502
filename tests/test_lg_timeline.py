"""scripts/lg_timeline.py against hand computations on a made-up result file."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_modules import load_script


@pytest.fixture(scope="module")
def lg_timeline() -> ModuleType:
    return load_script("lg_timeline")


def _request(submitted: float, chunks: list[float]) -> dict:
    return {"submitted_at": submitted, "chunk_times": chunks, "ended_at": chunks[-1]}


RUN = {
    "label": "run 1/1",
    "summary": {"duration_s": 1.0},
    "requests": [
        # 8 chunks, 10 ms apart from 0.1 s: chunks 2 and 6 are 40 ms apart, 10 ms a chunk.
        _request(0.0, [0.1 + 0.01 * i for i in range(8)]),
        # 8 chunks, 20 ms apart from 0.3 s: 20 ms a chunk.
        _request(0.002, [0.3 + 0.02 * i for i in range(8)]),
        # 4 chunks, 30 ms apart from 0.2 s: chunks 1 and 3, 30 ms a chunk.
        _request(0.004, [0.2 + 0.03 * i for i in range(4)]),
    ],
}


def test_timeline_of_a_run(lg_timeline: ModuleType) -> None:
    t = lg_timeline.timeline(RUN)
    assert t.duration_ms == pytest.approx(1000.0)
    assert t.submits_ms == pytest.approx((0.0, 4.0))
    assert t.first_tokens_ms == pytest.approx((100.0, 200.0, 300.0))
    # Ends: 0.17, 0.29 and 0.44 s.
    assert t.ends_ms == pytest.approx((170.0, 290.0, 440.0))
    assert t.mid_pace_ms == pytest.approx(20.0)  # the median of 10, 20 and 30
    assert t.chunks == 8


def test_failed_requests_are_left_out(lg_timeline: ModuleType) -> None:
    failed = {"submitted_at": 0.001, "chunk_times": [], "ended_at": None}
    never_sent = {"submitted_at": None, "chunk_times": [], "ended_at": None}
    run = dict(RUN, requests=[failed, *RUN["requests"], never_sent])
    assert lg_timeline.timeline(run) == lg_timeline.timeline(RUN)
    assert lg_timeline.timeline(dict(RUN, requests=[failed, never_sent])) is None


def test_main_prints_a_line_per_run(lg_timeline: ModuleType, tmp_path: Path, capsys) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"config": {}, "runs": [RUN, RUN]}))
    assert lg_timeline.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "dur 1000 ms" in lines[0] and "end 170/290/440" in lines[0]
    assert lg_timeline.main([]) == 2
