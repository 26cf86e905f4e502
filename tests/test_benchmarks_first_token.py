"""The first-token benchmark's prompts and arithmetic. A text prompt must tokenize to exactly
the ids sent over raw ZMQ, or the HTTP trials prefill more tokens and the difference is booked
as the frontend's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from benchmarks.first_token import Trials, carries_token, parse_engine_time_sums, random_prompt


@pytest.mark.parametrize("length", [16, 128, 512])
def test_random_prompt_text_tokenizes_back_to_its_ids(default_model_dir: Path, length: int) -> None:
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    rng = random.Random(length)
    for _ in range(20):
        ids, text = random_prompt(rng, tokenizer, length)
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == length
        # The frontend tokenizes a completions prompt with the special tokens on (encode's
        # default): what the server prefills, and what the raw ZMQ trial must send.
        assert tokenizer.encode(text).ids == ids
        assert len(ids) == length  # SmolLM2's tokenizer adds no BOS to a prompt


def test_random_prompt_sends_the_bos_a_tokenizer_adds(default_model_dir: Path) -> None:
    """A tokenizer that puts a BOS before every prompt (Llama's do): the text still holds
    exactly ``length`` tokens of its own, and the ids sent over raw ZMQ carry the BOS too."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    ids, text = random_prompt(random.Random(0), tokenizer, 64)
    assert ids[0] == bos and len(ids) == 65
    assert tokenizer.encode(text, add_special_tokens=False).ids == ids[1:]


def test_engine_time_sums_read_the_servers_exposition() -> None:
    """The /metrics reading against what the API process renders: the engine's queue and
    prefill sums and counts, over the requests it recorded (hand-added here)."""
    from frontend.metrics import Metrics
    from protocol.messages import RequestTimings

    metrics = Metrics("random:llama-1b")
    metrics.record_engine_timings(RequestTimings(queue_s=0.25, prefill_s=0.5, decode_s=2.0))
    metrics.record_engine_timings(RequestTimings(queue_s=0.125, prefill_s=1.0, decode_s=0.0))
    assert parse_engine_time_sums(metrics.render().decode()) == {
        "queue_sum": 0.375,
        "queue_count": 2.0,
        "prefill_sum": 1.5,
        "prefill_count": 2.0,
    }


def test_the_frontend_share_is_http_less_its_engine_time_and_the_raw_wakeup() -> None:
    trials = Trials(
        http=[5.0, 6.0], http_engine=[2.0, 2.5], zmq=[3.0, 3.5], queue=[0.25, 0.5],
        prefill=[1.75, 2.0],
    )  # fmt: skip
    assert trials.wakeup_ipc() == [1.0, 1.0]
    assert trials.frontend("http") == [2.0, 2.5]


def test_an_sse_event_carries_the_token_as_text_or_as_the_finish() -> None:
    assert carries_token({"choices": [{"text": "a"}]})
    assert carries_token({"choices": [{"delta": {"content": "a"}}]})
    assert carries_token({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not carries_token({"choices": [{"delta": {"role": "assistant"}}]})
    assert not carries_token({"choices": [], "usage": {"prompt_tokens": 3}})
