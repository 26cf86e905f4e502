"""uvicorn's HTTP parser in an API process: httptools (a dependency) where installed, and where
it is missing h11 with a warning that names the missing package, so a slower server says why.
The configuration uvicorn gets carries the choice; uvicorn loads that protocol class."""

from __future__ import annotations

import argparse
import importlib.util
import logging

import pytest

from frontend import http_server
from frontend.http_server import ApiRole, http_parser, uvicorn_config


def config_args() -> argparse.Namespace:
    return argparse.Namespace(host="127.0.0.1", port=0, log_level="WARNING", access_log=False)


def test_httptools_parses_where_installed(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("httptools")
    with caplog.at_level(logging.WARNING, logger="tandem.frontend"):
        config = uvicorn_config(config_args(), app=object(), role=ApiRole())
    assert config.http == "httptools"
    config.load()  # the protocol class uvicorn will run
    assert config.http_protocol_class.__module__.endswith("httptools_impl")
    assert not caplog.records


def test_without_httptools_h11_parses_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        http_server.importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "httptools" else real(name, *rest),
    )
    with caplog.at_level(logging.WARNING, logger="tandem.frontend"):
        assert http_parser() == "h11"
    assert any("httptools is not installed" in r.getMessage() for r in caplog.records)
