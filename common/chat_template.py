"""Chat templates parsed as Hugging Face renders them: a sandboxed Jinja environment with loop
controls (``{% break %}``, ``{% continue %}``) and transformers' ``{% generation %}`` block (its
assistant-token tracker; rendering it is transformers' job, parsing only needs the tag). Imports
jinja2 when called, not at import."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def parse_chat_template(source: str) -> Any:
    """The template's Jinja syntax tree; jinja2's TemplateSyntaxError where it does not parse."""
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    extensions = [ext.loopcontrols, _generation_block()]
    return ImmutableSandboxedEnvironment(extensions=extensions).parse(source)


@functools.cache
def _generation_block() -> type:
    """A Jinja extension that parses ``{% generation %} ... {% endgeneration %}`` as
    transformers' AssistantTracker does: a call block around its body."""
    from jinja2 import ext, nodes

    class GenerationBlock(ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    return GenerationBlock


def syntax_error_text(exc: Any) -> str:
    """A TemplateSyntaxError as every message about a broken template says it."""
    return f"{exc.message} (line {exc.lineno})"


def template_error_text(exc: Any) -> str:
    """What went wrong with a template, after "the model's chat template": it does not parse
    (where), or it raised while rendering (a template's raise_exception says why)."""
    from jinja2 import TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return f"does not parse: {syntax_error_text(exc)}"
    return f"does not render: {exc}"


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
