"""vLLM's small request fields through a real server on the default model, each against an
independent expectation: skip_special_tokens, include_stop_str_in_output, min_tokens on chat,
continue_final_message and echo (seen through /tokenize and the answer), and
spaces_between_special_tokens (false is what the fast tokenizer does; true is refused)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server_fixture import Server, server  # noqa: F401

pytestmark = pytest.mark.slow

EOS = 2  # <|im_end|>, the default model's end of turn


def post(srv: Server, route: str, **body: Any) -> dict[str, Any]:
    resp = httpx.post(f"{srv.base_url}{route}", json={"model": "default", **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def refused(srv: Server, route: str, **body: Any) -> dict[str, Any]:
    resp = httpx.post(f"{srv.base_url}{route}", json={"model": "default", **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize(("skip", "text"), [(True, ""), (False, "<|im_end|>")])
def test_skip_special_tokens(server: Server, skip: bool, text: str) -> None:  # noqa: F811
    """The end-of-turn token forced first: it ends the output, and its text shows only when
    special tokens are kept."""
    out = post(
        server, "/v1/completions", prompt="Hi", max_tokens=4, temperature=0,
        logit_bias={str(EOS): 100}, skip_special_tokens=skip,
    )  # fmt: skip
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, "stop")


def test_include_stop_str_in_output(server: Server) -> None:  # noqa: F811
    prompt, greedy = "The capital of France is", {"max_tokens": 12, "temperature": 0}
    full = post(server, "/v1/completions", prompt=prompt, **greedy)["choices"][0]["text"]
    stop = full[4:7]  # a stop string the greedy output is known to hold
    at = full.index(stop)
    cut = post(server, "/v1/completions", prompt=prompt, stop=[stop], **greedy)
    kept = post(
        server, "/v1/completions", prompt=prompt, stop=[stop], include_stop_str_in_output=True,
        **greedy,
    )  # fmt: skip
    assert cut["choices"][0]["text"] == full[:at]
    assert kept["choices"][0]["text"] == full[: at + len(stop)]


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_min_tokens_on_chat_holds_off_the_end(server: Server, min_tokens: int) -> None:  # noqa: F811
    out = post(
        server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8, temperature=0, logit_bias={str(EOS): 100}, min_tokens=min_tokens,
    )  # fmt: skip
    # The end-of-turn token is forced as soon as min_tokens allows it; it counts as a token.
    assert out["usage"]["completion_tokens"] == min_tokens + 1
    assert out["choices"][0]["finish_reason"] == "stop"


PARTIAL = [
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "The fruit I pick is"},
]


def test_continue_final_message_leaves_the_turn_open(server: Server) -> None:  # noqa: F811
    ids = post(
        server, "/tokenize", messages=PARTIAL, add_generation_prompt=False,
        continue_final_message=True,
    )["tokens"]  # fmt: skip
    closed = post(server, "/tokenize", messages=PARTIAL, add_generation_prompt=False)["tokens"]
    prompt = post(server, "/detokenize", tokens=ids)["prompt"]
    assert prompt.endswith("The fruit I pick is") and closed != ids  # no end of turn after it
    greedy = {"max_tokens": 6, "temperature": 0}
    echoed = post(
        server, "/v1/chat/completions", messages=PARTIAL, add_generation_prompt=False,
        continue_final_message=True, echo=True, **greedy,
    )["choices"][0]["message"]["content"]  # fmt: skip
    plain = post(
        server, "/v1/chat/completions", messages=PARTIAL, add_generation_prompt=False,
        continue_final_message=True, **greedy,
    )["choices"][0]["message"]["content"]  # fmt: skip
    # The continuation is the model's text after the open turn, as a completion of that prompt.
    completion = post(server, "/v1/completions", prompt=ids, **greedy)["choices"][0]["text"]
    assert plain == completion
    assert echoed == "The fruit I pick is" + plain


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt"),
    [(PARTIAL, True), (PARTIAL[:1], False)],  # a new turn would open; the last turn is the user's
)
def test_continue_final_message_needs_an_open_assistant_turn(
    server: Server,  # noqa: F811
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    error = refused(
        server, "/v1/chat/completions", messages=messages, max_tokens=2,
        continue_final_message=True, add_generation_prompt=add_generation_prompt,
    )  # fmt: skip
    assert "continue_final_message" in error["message"]


def test_spaces_between_special_tokens(server: Server) -> None:  # noqa: F811
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    post(server, "/v1/completions", spaces_between_special_tokens=False, **body)
    error = refused(server, "/v1/completions", spaces_between_special_tokens=True, **body)
    assert error["param"] == "spaces_between_special_tokens"


def test_an_assistant_refusal_part_is_that_turns_text(server: Server) -> None:  # noqa: F811
    """OpenAI's assistant messages may hold refusal parts: sent back, the turn is their text."""
    ask = {"role": "user", "content": "Help me pick a lock."}
    parts = [{"type": "refusal", "refusal": "I can't help with that."}]
    with_parts = [ask, {"role": "assistant", "content": parts}, {"role": "user", "content": "Ok."}]
    as_text = [ask, {"role": "assistant", "content": "I can't help with that."}, with_parts[2]]
    ids = post(server, "/tokenize", messages=with_parts)["tokens"]
    assert ids == post(server, "/tokenize", messages=as_text)["tokens"]
    field = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    assert ids == post(server, "/tokenize", messages=[ask, field, as_text[2]])["tokens"]
    error = refused(server, "/v1/chat/completions", messages=[{"role": "user", "content": parts}])
    assert error["param"] == "messages.0" and "only assistant messages" in error["message"]
