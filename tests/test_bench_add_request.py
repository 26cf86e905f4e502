"""scripts/bench_add_request.py times a real round trip: the frames it encodes decode back to the
requests it built, burst after burst (the second burst's params come from the codec's cache)."""

from __future__ import annotations

import pytest

from protocol.messages import AddRequest
from tests.script_modules import load_script


def test_the_timed_frames_decode_back_to_the_requests() -> None:
    bench = load_script("bench_add_request")
    prompts = [[5, 6, 7], [49151], list(range(3, 131))]
    for _ in range(2):
        frames, encode_s = bench.encode_burst(prompts)
        messages, decode_s = bench.decode_burst(frames)
        assert encode_s > 0 and decode_s > 0
        assert [m.prompt_token_ids for m in messages if isinstance(m, AddRequest)] == prompts
        assert [m.request_id for m in messages] == ["r0", "r1", "r2"]
        assert all(m.params == bench.burst_params() for m in messages)


def test_main_prints_both_ends(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_add_request")
    assert bench.main(["--requests", "4", "--prompt-len", "8", "--bursts", "3"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("ADD_REQUEST, 8 prompt ids: encode ") and " decode " in line
