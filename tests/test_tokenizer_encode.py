"""Tokenizer.encode (frontend/tokenizer.py) coalesces the prompt texts of requests that arrive
together into one encode call on the worker thread. Checked against HF's own encode of each
text, with the default model's tokenizer: every request gets exactly its own ids; a burst takes
far fewer calls than requests; a text that fails fails only its own request; a request whose
client left while it waited does not disturb the others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from frontend.tokenizer import Tokenizer, load_hf_tokenizer

TEXTS = [
    "Hello, world!",
    "Café crème, naïve façade.",
    "日本語のテキストと中文文本",
    "Emoji: 🚀🔥 and 👨‍👩‍👧",
    "  leading spaces,\n\nnew lines\tand tabs  ",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def hf(default_model_dir: Path) -> Any:
    return load_hf_tokenizer(default_model_dir)


def requests(count: int) -> list[list[str]]:
    """``count`` requests of 1 to 3 texts each, all different."""
    return [
        [f"{TEXTS[(i + j) % len(TEXTS)]} #{i}.{j}" for j in range(1 + i % 3)] for i in range(count)
    ]


class CountingTokenizer(Tokenizer):
    """Counts the encode calls that reach the worker thread; fails on a text holding FAIL."""

    def __init__(self, hf: Any) -> None:
        super().__init__(hf)
        self.calls: list[int] = []

    def encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        self.calls.append(len(texts))
        if any("FAIL" in t for t in texts):
            raise ValueError("this text cannot be encoded")
        return super().encode_all(texts, add_special_tokens)


def hf_ids(hf: Any, texts: list[str]) -> list[list[int]]:
    return [hf.encode(t) for t in texts]


def test_a_burst_is_encoded_in_few_calls_each_request_getting_its_own_ids(hf: Any) -> None:
    tok = CountingTokenizer(hf)
    burst = requests(64)

    async def main() -> list[list[list[int]]]:
        return await asyncio.gather(*(tok.encode(texts) for texts in burst))

    got = asyncio.run(main())
    assert got == [hf_ids(hf, texts) for texts in burst]
    assert sum(tok.calls) == sum(len(texts) for texts in burst)
    assert len(tok.calls) <= 2  # the first request alone, then everyone who queued behind it


def test_a_lone_request_goes_at_once(hf: Any) -> None:
    tok = CountingTokenizer(hf)
    assert asyncio.run(tok.encode(["just one", "or two"])) == hf_ids(hf, ["just one", "or two"])
    assert tok.calls == [2]


def test_a_text_that_fails_fails_only_its_own_request(hf: Any) -> None:
    tok = CountingTokenizer(hf)
    burst = requests(8)
    burst[5] = ["FAIL here", "and a fine text"]

    async def main() -> list[Any]:
        return await asyncio.gather(*(tok.encode(t) for t in burst), return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[5], ValueError)
    for i, texts in enumerate(burst):
        if i != 5:
            assert got[i] == hf_ids(hf, texts)


def test_a_request_whose_client_left_does_not_disturb_the_others(hf: Any) -> None:
    tok = CountingTokenizer(hf)
    burst = requests(10)

    async def main() -> list[Any]:
        tasks = [asyncio.ensure_future(tok.encode(t)) for t in burst]
        await asyncio.sleep(0)  # all queued: the first is on the thread, the rest wait
        tasks[4].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[4], asyncio.CancelledError)
    for i, texts in enumerate(burst):
        if i != 4:
            assert got[i] == hf_ids(hf, texts)


@pytest.mark.parametrize("folder", ["default", "tiny"])
def test_the_direct_load_is_autotokenizers_own(
    folder: str, default_model_dir: Path, tiny_model_dir: Path
) -> None:
    """load_hf_tokenizer skips AutoTokenizer for these folders (common/hf_tokenizer.py
    DIRECT_BACKEND_MODEL_TYPES): it must give the tokenizer AutoTokenizer gives, class, ids,
    texts, special tokens and chat template alike."""
    from transformers import AutoTokenizer

    from common.hf_tokenizer import loads_backend_directly

    path = default_model_dir if folder == "default" else tiny_model_dir
    assert loads_backend_directly(path)
    ours, auto = load_hf_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        auto.bos_token_id, auto.eos_token_id, auto.pad_token_id,
    )  # fmt: skip
    for text in TEXTS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(
                    ids, skip_special_tokens=skip
                )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    for generation_prompt in (True, False):
        assert ours.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        ) == auto.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
