"""Chat templates parsed as Hugging Face renders them: a sandboxed Jinja environment with loop
controls (``{% break %}``, ``{% continue %}``). Imports jinja2 when called, not at import."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def parse_chat_template(source: str) -> Any:
    """The template's Jinja syntax tree; jinja2's TemplateSyntaxError where it does not parse."""
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(extensions=[ext.loopcontrols]).parse(source)


def syntax_error_text(exc: Any) -> str:
    """A TemplateSyntaxError as every message about a broken template says it."""
    return f"{exc.message} (line {exc.lineno})"


def check_chat_template_file(path: str) -> None:
    """ValueError naming ``path`` and the line where it does not parse: a template that does
    not would fail every chat request."""
    from jinja2 import TemplateSyntaxError

    try:
        parse_chat_template(Path(path).read_text(encoding="utf-8"))
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"--chat-template {path}: not a Jinja template as chat templates are rendered: "
            f"{syntax_error_text(exc)}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--chat-template {path}: not UTF-8 text ({exc.reason})") from None
