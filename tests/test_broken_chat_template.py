"""A model whose own chat template does not parse: `tandem generate --chat` says so in one line,
`tandem serve` says so at start, chat requests are a 500 naming the template's error (not
"internal server error" and a traceback), and completions, which need no template, still
serve. A template with transformers' own ``{% generation %}`` block is not a broken one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
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
    offline = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "generate", "--model", str(model_dir), "--chat",
         "--prompt", "hi", "--max-tokens", "2", "--num-kv-blocks", "16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert offline.returncode == 2, offline.stderr
    assert (
        "tandem generate: the model's chat template does not parse: unexpected '}' (line 1)"
        in offline.stderr
    )
    assert "Traceback" not in offline.stderr
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


GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_hfs_generation_block_serves(tmp_path: Path, tiny_model_dir: Path) -> None:
    """transformers renders ``{% generation %}`` (its assistant-token tracker): such a template
    is no broken one. It is accepted at start, and chat prompts render as HF renders them."""
    from transformers import AutoTokenizer

    from common.chat_template import check_chat_template_file

    template_file = tmp_path / "generation.jinja"
    template_file.write_text(GENERATION_TEMPLATE)
    check_chat_template_file(str(template_file))
    model_dir = tmp_path / "generation-template"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    srv = start_server(tmp_path, model=str(model_dir), args=TINY_ARGS)
    try:
        tokenized = httpx.post(f"{srv.base_url}/tokenize", json={"messages": messages}, timeout=60)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == list(expected)
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        done = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=2)
        assert done.usage.prompt_tokens == len(expected)
        assert "does not parse" not in srv.log_path.read_text(errors="replace")
    finally:
        stop_server(srv)
