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


@pytest.mark.parametrize(
    ("skip", "include", "text"),
    [(True, False, ""), (False, False, ""), (True, True, ""), (False, True, "<|im_end|>")],
)
def test_skip_special_tokens(server: Server, skip: bool, include: bool, text: str) -> None:  # noqa: F811
    """The end-of-turn token forced first: it ends the output, and as vLLM its text shows only
    when special tokens are kept and the stop token asked for (include_stop_str_in_output)."""
    out = post(
        server, "/v1/completions", prompt="Hi", max_tokens=4, temperature=0,
        logit_bias={str(EOS): 100}, skip_special_tokens=skip, include_stop_str_in_output=include,
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


def test_a_stop_token_id_leaves_its_text_out_unless_asked(server: Server) -> None:  # noqa: F811
    """As vLLM: the token that stopped the output is counted, but its text is left out unless
    include_stop_str_in_output; streamed alike."""
    prompt, greedy = "The capital of France is", {"max_tokens": 12, "temperature": 0}
    full = post(server, "/v1/completions", prompt=prompt, logprobs=0, **greedy)["choices"][0]
    pieces = full["logprobs"]["tokens"]
    at = next(i for i, piece in enumerate(pieces) if i > 0 and piece.strip())  # a word's token
    stop_id = post(server, "/tokenize", prompt=pieces[at], add_special_tokens=False)["tokens"]
    assert len(stop_id) == 1, stop_id  # the piece is one token alone too
    # The first place that token comes (earlier ones would stop first).
    first = pieces.index(pieces[at])
    for include, shown in ((False, first), (True, first + 1)):
        body = {"prompt": prompt, "stop_token_ids": stop_id, **greedy}
        body["include_stop_str_in_output"] = include
        out = post(server, "/v1/completions", **body)
        choice = out["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("".join(pieces[:shown]), "stop")
        assert out["usage"]["completion_tokens"] == first + 1
        streamed = stream_text(server, body)
        assert streamed == choice["text"]


def stream_text(srv: Server, body: dict[str, Any]) -> str:
    """The text of a streamed completion, joined from its chunks."""
    import json

    text = ""
    with httpx.stream(
        "POST", f"{srv.base_url}/v1/completions", json={"model": "default", **body, "stream": True},
        timeout=60,
    ) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


@pytest.mark.parametrize("min_tokens", [0, 4, 7])
def test_min_tokens_holds_off_stop_strings(server: Server, min_tokens: int) -> None:  # noqa: F811
    """As vLLM: no stop string ends within the first min_tokens tokens' text; the first that
    ends past it cuts there (found by hand in the unstopped greedy output)."""
    prompt, greedy = "The capital of France is", {"max_tokens": 16, "temperature": 0}
    full = post(server, "/v1/completions", prompt=prompt, logprobs=0, **greedy)["choices"][0]
    pieces, text = full["logprobs"]["tokens"], full["text"]
    assert "".join(pieces) == text
    stop = " "  # every word's start: the plainest stop string to find again and again
    held = len("".join(pieces[:min_tokens]))
    end = next(i + 1 for i in range(len(text)) if text.startswith(stop, i) and i + 1 > held)
    body = {"prompt": prompt, "stop": [stop], "min_tokens": min_tokens, **greedy}
    out = post(server, "/v1/completions", **body)["choices"][0]
    assert (out["text"], out["finish_reason"]) == (text[: end - 1], "stop")
    assert stream_text(server, body) == out["text"]


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


def test_detokenize_keeps_special_tokens_so_a_chat_prompt_tokenizes_back(
    server: Server,  # noqa: F811
) -> None:
    ids = post(server, "/tokenize", messages=PARTIAL)["tokens"]
    prompt = post(server, "/detokenize", tokens=ids)["prompt"]
    assert prompt.startswith("<|im_start|>system") and prompt.count("<|im_end|>") == 3
    again = post(server, "/tokenize", prompt=prompt, add_special_tokens=False)["tokens"]
    assert again == ids


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
