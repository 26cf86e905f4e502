"""scripts/first_token.py's prompts: a text prompt must tokenize to exactly the ids sent over raw
ZMQ, or the HTTP trials prefill more tokens and the difference is booked as the frontend's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.script_modules import load_script


@pytest.mark.parametrize("length", [16, 128, 512])
def test_random_prompt_text_tokenizes_back_to_its_ids(default_model_dir: Path, length: int) -> None:
    first_token = load_script("first_token")
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    rng = random.Random(length)
    for _ in range(20):
        ids, text = first_token.random_prompt(rng, tokenizer, length)
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == length
        # The frontend tokenizes a completions prompt with the special tokens on (encode's
        # default): what the server prefills, and what the raw ZMQ trial must send.
        assert tokenizer.encode(text).ids == ids
        assert len(ids) == length  # SmolLM2's tokenizer adds no BOS to a prompt


def test_random_prompt_sends_the_bos_a_tokenizer_adds(default_model_dir: Path) -> None:
    """A tokenizer that puts a BOS before every prompt (Llama's do): the text still holds
    exactly ``length`` tokens of its own, and the ids sent over raw ZMQ carry the BOS too."""
    from tokenizers.processors import TemplateProcessing

    first_token = load_script("first_token")
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    ids, text = first_token.random_prompt(random.Random(0), tokenizer, 64)
    assert ids[0] == bos and len(ids) == 65
    assert tokenizer.encode(text, add_special_tokens=False).ids == ids[1:]


def test_engine_time_sums_read_the_servers_exposition() -> None:
    """The script's /metrics reading against what the API process renders: the engine's queue
    and prefill sums and counts, over the requests it recorded (hand-added here)."""
    from frontend.metrics import Metrics
    from protocol.messages import RequestTimings

    first_token = load_script("first_token")
    metrics = Metrics("random:llama-1b")
    metrics.record_engine_timings(RequestTimings(queue_s=0.25, prefill_s=0.5, decode_s=2.0))
    metrics.record_engine_timings(RequestTimings(queue_s=0.125, prefill_s=1.0, decode_s=0.0))
    found = first_token.parse_engine_time_sums(metrics.render().decode())
    assert found == {
        "queue_sum": 0.375,
        "queue_count": 2.0,
        "prefill_sum": 1.5,
        "prefill_count": 2.0,
    }
