"""common/env.py: each variable read as its function says, unset and set, read when asked (so a
test or a process that sets one before it asks sees it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import env
from frontend.engines import gpu_slices


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in env.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)


def test_every_variable_has_its_default_when_unset() -> None:
    assert env.cache_dir() == Path.home() / ".cache" / "tandem"
    assert env.tokenizer_dir() is None
    assert env.event_loop() == "auto"
    assert env.step_stats() is False
    assert env.xdg_runtime_dir() is None
    assert env.cuda_visible_devices() is None


def test_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", "~/elsewhere")
    assert env.cache_dir() == Path.home() / "elsewhere"
    monkeypatch.setenv("TANDEM_TOKENIZER_DIR", str(tmp_path))
    assert env.tokenizer_dir() == tmp_path
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert env.xdg_runtime_dir() == str(tmp_path)
    for name in ("TANDEM_CACHE_DIR", "TANDEM_TOKENIZER_DIR", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(name, "")  # empty: as unset
    assert env.cache_dir() == Path.home() / ".cache" / "tandem"
    assert env.tokenizer_dir() is None and env.xdg_runtime_dir() is None


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("1", True), ("yes", True)])
def test_step_stats(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("TANDEM_STEP_STATS", value)
    assert env.step_stats() is on


@pytest.mark.parametrize(
    ("value", "ids"),
    [("", []), ("0", ["0"]), ("2, 3,", ["2", "3"]), ("GPU-a,GPU-b", ["GPU-a", "GPU-b"])],
)
def test_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, value: str, ids: list[str]) -> None:
    """Set but empty is no GPU at all, not every GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert env.cuda_visible_devices() == ids


def test_data_parallel_engines_share_out_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert gpu_slices(2, 2, "cuda") == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_slices(2, 1, "cuda") is None
