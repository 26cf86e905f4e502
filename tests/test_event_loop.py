"""TANDEM_EVENT_LOOP picks the event loop of the API processes and the load generator: each
value does what it says, and an unknown one is refused rather than ignored."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import event_loop


def running_loop_module() -> str:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    return event_loop.run(which())


def test_asyncio_runs_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_EVENT_LOOP", "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert running_loop_module().startswith("asyncio")


@pytest.mark.parametrize("value", ["auto", "uvloop"])
def test_auto_and_uvloop_run_uvloop_where_installed(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.setenv("TANDEM_EVENT_LOOP", value)
    assert event_loop.loop_name() == "uvloop"
    assert running_loop_module().startswith("uvloop")


def test_an_unknown_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_EVENT_LOOP", "uv")
    with pytest.raises(ValueError, match="TANDEM_EVENT_LOOP='uv'.*auto, uvloop, asyncio"):
        event_loop.loop_name()


def test_serve_refuses_it_at_start_up_with_the_message(tmp_path: Path) -> None:
    """`tandem serve` with a bad value exits 2 with one line naming it, not a traceback."""
    env = {**os.environ, "TANDEM_EVENT_LOOP": "fast"}
    proc = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--port", "0"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "TANDEM_EVENT_LOOP='fast'" in proc.stderr
    assert "Traceback" not in proc.stderr
