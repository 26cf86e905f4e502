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
        assert len(ids) == length
        # The frontend tokenizes a completions prompt with the special tokens on (encode's
        # default): what the server will prefill.
        assert tokenizer.encode(text).ids == ids
