"""A model whose own chat template does not parse: `tandem serve` says so at start, chat
requests are a 500 naming the template's error (not "internal server error" and a traceback),
and completions, which need no template, still serve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from tests.server_fixture import TINY_ARGS, start_server, stop_server


def test_a_model_template_that_does_not_parse_fails_chat_requests_by_name(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model_dir = tmp_path / "broken-template"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"
    config_path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)  # the template file wins
    srv = start_server(tmp_path, model=str(model_dir), args=TINY_ARGS)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(
                model=str(model_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert "the model's chat template does not parse: unexpected '}' (line 1)" in str(
            info.value
        )
        done = client.completions.create(model=str(model_dir), prompt="hi", max_tokens=2)
        assert done.choices[0].finish_reason == "length"
        log = srv.log_path.read_text(errors="replace")
        assert f"the chat template of {model_dir} does not parse" in log
        assert "Traceback" not in log
    finally:
        stop_server(srv)
