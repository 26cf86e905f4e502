"""A mixture-of-experts model through a real `tandem serve`, asked with the official openai
client: a small random Qwen3-MoE (with the default model's vocabulary and tokenizer) answers each
prompt, streamed and not, with HF transformers' greedy tokens on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.factories import copy_tokenizer, write_tiny_qwen3_moe
from tests.server_fixture import Server, start_server, stop_server

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PROMPTS = ["The capital of France is", "1, 2, 3,", "Mixture of experts models route"]


@pytest.fixture(scope="module")
def moe_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's vocabulary and tokenizer, so prompts are text."""
    path = write_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), vocab_size=49152)
    return copy_tokenizer(default_model_dir, path)


@pytest.fixture(scope="module")
def moe_server(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("serve-moe"), model=str(moe_dir),
                       args=["--max-model-len", "256", "--num-kv-blocks", "256"])  # fmt: skip
    try:
        yield srv
    finally:
        stop_server(srv)


def hf_greedy_text(moe_dir: Path, prompt: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
    return tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_moe_model_serves_hf_greedy_text(moe_server: Server, moe_dir: Path, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{moe_server.base_url}/v1", api_key="unused")
    for prompt in PROMPTS:
        args = {"model": str(moe_dir), "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        if stream:
            text = "".join(
                c.choices[0].text for c in client.completions.create(**args, stream=True)
            )
        else:
            answer = client.completions.create(**args)
            assert answer.usage is not None and answer.usage.completion_tokens == NEW_TOKENS
            text = answer.choices[0].text
        assert text == hf_greedy_text(moe_dir, prompt)
