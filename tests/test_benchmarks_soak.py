"""How the soak benchmark tells a completed request from an error, a disconnect and a lost
one, and when it passes."""

from __future__ import annotations

from benchmarks.soak import Tally, classify_stream, error_kind, passed, retry_after


def test_streams_are_completed_errors_or_lost() -> None:
    tally = Tally(sent=4)
    classify_stream(['data: {"choices": [{"text": "a", "finish_reason": "stop"}]}',
                     "data: [DONE]"], tally)  # fmt: skip
    classify_stream(['data: {"error": {"code": "engine_down"}}', "data: [DONE]"], tally)
    classify_stream(['data: {"choices": [{"text": "a"}]}'], tally)  # no [DONE]
    classify_stream(['data: {"choices": [{"text": "a"}]}', "data: [DONE]"], tally)  # no finish
    assert (tally.completed, tally.errors, tally.lost) == (1, 1, 2)
    assert tally.failed_by_engine_death == 1 and tally.error_kinds == {"sse:engine_down": 1}
    assert tally.lost_kinds == {"stream-without-done": 1, "stream-without-finish": 1}
    assert tally.accounted


def test_errors_in_the_openai_shape_and_their_retry_after() -> None:
    assert error_kind(503, {"error": {"code": "overloaded"}}) == "503:overloaded"
    assert (
        error_kind(400, {"error": {"type": "invalid_request_error"}}) == "400:invalid_request_error"
    )
    assert error_kind(500, {"detail": "oops"}) is None and error_kind(500, None) is None
    assert retry_after(503, {"Retry-After": "2"}) == 2.0
    assert retry_after(429, {"Retry-After": "2"}) == 0.0
    assert retry_after(503, {"Retry-After": "soon"}) == 0.0


def test_a_run_passes_only_with_nothing_lost_and_a_clean_end() -> None:
    clean = {"healthy": True, "frontend_idle": True, "engine_restarts": 3.0, "kv_all_free": True}
    ok = Tally(sent=3, completed=2, disconnected=1)
    assert passed(ok, clean, 0, allow_failures=False)
    assert not passed(ok, clean | {"kv_all_free": False}, 0, allow_failures=False)
    assert not passed(ok, clean, 1, allow_failures=False)  # the server's exit code
    lost = Tally(sent=3, completed=2, lost=1)
    assert not passed(lost, clean, 0, allow_failures=False)
    died = Tally(sent=1, errors=1, failed_by_engine_death=1)
    assert not passed(died, clean, None, allow_failures=False)
    assert passed(died, clean, None, allow_failures=True)
    assert not passed(Tally(sent=2, completed=1), clean, 0, allow_failures=False)  # unaccounted
