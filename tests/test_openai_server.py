"""The official `openai` client against a real `tandem serve` on the default model.

Independent expectations: HF transformers' greedy generate and log-softmax on the same weights,
the tokenizer itself, and invariants (the same seed gives the same text; a stop string cuts the
unstopped text exactly where it occurs; a client that leaves frees every KV block). Requests that
do not depend on each other are sent at once, so the engine batches them (the CPU is slow).
"""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.client import EngineClient
from protocol.messages import ControlKind
from tests.server_fixture import Server, server, wait_engine_idle  # noqa: F401

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def hf(default_model_dir: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    return model.eval(), tok


def hf_greedy(hf: tuple[Any, Any], ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def chat_ids(tok: Any, text: str) -> list[int]:
    templated = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(templated, add_special_tokens=False)


def finish_of(tok: Any, new_ids: list[int]) -> str:
    return "stop" if new_ids and new_ids[-1] == tok.eos_token_id else "length"


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls at once (the engine batches them); results in call order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def by_index(choices: list[Any]) -> list[Any]:
    return sorted(choices, key=lambda c: c.index)


# ---- greedy = HF, streaming = non-streaming ---------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["default"]


def test_greedy_matches_hf_streamed_or_not(client: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    _, tok = hf
    cmpl: dict[str, Any] = dict(model="default", prompt=PROMPT, max_tokens=16, temperature=0)
    messages = [{"role": "user", "content": QUESTION}]
    chat: dict[str, Any] = dict(model="default", messages=messages, max_tokens=12, temperature=0)
    usage = {"include_usage": True}
    c_whole, c_chunks, h_whole, h_chunks = parallel(
        lambda: client.completions.create(**cmpl),
        lambda: list(client.completions.create(**cmpl, stream=True, stream_options=usage)),
        lambda: client.chat.completions.create(**chat),
        lambda: list(client.chat.completions.create(**chat, stream=True, stream_options=usage)),
    )
    ids, chat_prompt = tok.encode(PROMPT), chat_ids(tok, QUESTION)
    want, want_chat = hf_greedy(hf, ids, 16), hf_greedy(hf, chat_prompt, 12)

    assert c_whole.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert c_whole.choices[0].finish_reason == finish_of(tok, want)
    u = c_whole.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(ids), len(want))
    assert u.total_tokens == len(ids) + len(want)
    assert "".join(c.choices[0].text for c in c_chunks if c.choices) == c_whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in c_chunks if c.choices]
    assert finishes[-1] == c_whole.choices[0].finish_reason and not any(finishes[:-1])
    assert c_chunks[-1].choices == [] and c_chunks[-1].usage == c_whole.usage

    assert h_whole.choices[0].message.role == "assistant"
    assert h_whole.choices[0].message.content == tok.decode(want_chat, skip_special_tokens=True)
    assert h_whole.choices[0].finish_reason == finish_of(tok, want_chat)
    assert h_whole.usage.prompt_tokens == len(chat_prompt)
    assert h_whole.usage.completion_tokens == len(want_chat)
    assert h_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in h_chunks if c.choices)
    assert streamed == h_whole.choices[0].message.content
    assert [c for c in h_chunks if c.choices][-1].choices[0].finish_reason == finish_of(
        tok, want_chat
    )
    assert h_chunks[-1].usage == h_whole.usage


def chunked_frames(server: Server, path: str, body: dict[str, Any]) -> list[bytes]:
    """POST ``body`` over a raw socket; the response body's chunks as the server framed them
    (one per write), without the closing empty one."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.sendall(head.encode() + payload)
        data = b""
        while received := sock.recv(65536):
            data += received
    headers, _, rest = data.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in headers.lower()
    frames = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return frames
        frames.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


def test_a_stream_ends_in_one_write(server: Server) -> None:
    """The last deltas, the usage and [DONE] leave in one chunk of the body, so the streams of a
    burst that end together cost one write each; every chunk before it holds one step's events.
    Each event holds one choice, as OpenAI streams ``n`` > 1 (clients read ``choices[0]``)."""
    usage = {"include_usage": True}
    common = dict(model="default", max_tokens=5, ignore_eos=True, stream=True, stream_options=usage)
    messages = [{"role": "user", "content": QUESTION}]
    for path, body in (
        ("/v1/completions", {**common, "prompt": PROMPT}),
        ("/v1/completions", {**common, "prompt": PROMPT, "n": 2, "temperature": 1.0, "seed": 7}),
        ("/v1/chat/completions", {**common, "messages": messages}),
    ):
        frames = chunked_frames(server, path, body)
        n = body.get("n", 1)
        events = [e for e in frames[-1].decode().split("\n\n") if e]
        # the step's chunks (one a choice that ended in it), the usage, [DONE]
        assert 3 <= len(events) <= n + 2 and events[-1] == "data: [DONE]", (path, events)
        *lasts, totals = (json.loads(e.removeprefix("data: ")) for e in events[:-1])
        assert all(last["choices"][0]["finish_reason"] == "length" for last in lasts), path
        assert totals["choices"] == [] and totals["usage"]["completion_tokens"] == 5 * n, path
        whole = httpx.post(
            f"{server.base_url}{path}", json={**body, "stream": False, "stream_options": None},
            timeout=60,
        ).json()  # fmt: skip
        assert totals["usage"] == whole["usage"], path  # the same keys: none null in one only
        assert all(1 <= frame.count(b"data: ") <= n for frame in frames[:-1]), path
        earlier = [e for f in frames[:-1] for e in f.decode().split("\n\n") if e]
        chunks = [json.loads(e.removeprefix("data: ")) for e in earlier] + lasts
        assert all(len(chunk["choices"]) == 1 for chunk in chunks), path
        ended = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
        assert ended == list(range(n)), path  # each choice ends once


def test_token_id_and_batched_prompts_match_hf(client: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    _, tok = hf
    prompts = [PROMPT, "Water boils at"]
    ids = [tok.encode(p) for p in prompts]
    texts, tokens = parallel(
        lambda: client.completions.create(
            model="default", prompt=prompts, max_tokens=4, temperature=0
        ),
        lambda: client.completions.create(model="default", prompt=ids, max_tokens=4, temperature=0),
    )
    want = [tok.decode(hf_greedy(hf, p, 4), skip_special_tokens=True) for p in ids]
    assert [c.text for c in by_index(texts.choices)] == want
    assert [c.text for c in by_index(tokens.choices)] == want
    assert texts.usage.prompt_tokens == tokens.usage.prompt_tokens == sum(len(p) for p in ids)


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="default", prompt=PROMPT, max_tokens=3, temperature=0)
    plain, echoed = parallel(
        lambda: client.completions.create(**kwargs),
        lambda: client.completions.create(**kwargs, echo=True),
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_raw_sse_is_data_lines_ending_with_done(server: Server) -> None:
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "error" not in c for c in chunks)


# ---- stop strings, n, seeds, logprobs ---------------------------------------------------------


def test_stop_string_cuts_the_text_and_ends_the_request(
    client: openai.OpenAI, server: Server
) -> None:
    kwargs: dict[str, Any] = dict(model="default", prompt=PROMPT, max_tokens=8, temperature=0)
    base = client.completions.create(**kwargs).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip(), f"pick a better prompt: {base!r}"
    expected = base[: base.index(stop)]
    whole, chunks = parallel(
        lambda: client.completions.create(**kwargs, stop=[stop, "\u2603 never"]),
        lambda: list(client.completions.create(**kwargs, stop=stop, stream=True)),
    )
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_engine_idle(server)  # the engine was told to abort both: nothing is left running


def test_n2_with_a_seed_is_repeatable_and_choices_differ(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="default", prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=1234
    )
    first, second = parallel(
        lambda: client.completions.create(**kwargs), lambda: client.completions.create(**kwargs)
    )
    assert [c.index for c in by_index(first.choices)] == [0, 1]
    texts = [c.text for c in by_index(first.choices)]
    assert texts == [c.text for c in by_index(second.choices)]
    assert texts[0] != texts[1]  # choice i samples with seed + i
    assert first.usage.completion_tokens == 12  # 2 choices x 6 tokens, prompt counted once
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 4


def test_a_negative_seed_samples_as_its_unsigned_bits(client: openai.OpenAI) -> None:
    """OpenAI's and vLLM's seeds are signed 64-bit: -1 draws what 2**64 - 1 draws (its bits
    read unsigned, as the engine's seeds are), and choice i's seed + i wraps past 2**64 - 1
    to 0, 1, ..."""
    kwargs: dict[str, Any] = dict(
        model="default", prompt="Once upon a time", max_tokens=6, temperature=1.0
    )
    signed, unsigned, wrapped, low = parallel(
        lambda: client.completions.create(**kwargs, seed=-1),
        lambda: client.completions.create(**kwargs, seed=2**64 - 1),
        lambda: client.completions.create(**kwargs, seed=-2, n=3),
        lambda: client.completions.create(**kwargs, seed=0, n=2),
    )
    assert signed.choices[0].text == unsigned.choices[0].text
    texts = [c.text for c in by_index(wrapped.choices)]  # seeds 2**64 - 2, 2**64 - 1, 0
    assert texts[1] == signed.choices[0].text
    assert texts[2] == by_index(low.choices)[0].text
    assert len(set(texts)) == 3


def test_same_seed_same_chat_text(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="default",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=5,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        extra_body={"top_k": 50, "repetition_penalty": 1.1},
    )
    a, b = parallel(
        lambda: client.chat.completions.create(**kwargs),
        lambda: client.chat.completions.create(**kwargs),
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completion_logprobs_match_hf(client: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    import torch

    model, tok = hf
    resp = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    ids = tok.encode(PROMPT)
    new = hf_greedy(hf, ids, 4)
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0]  # [T, V]
    ref = torch.log_softmax(logits.float(), dim=-1)[len(ids) - 1 : -1]  # [4, V]
    for i, tid in enumerate(new):
        assert lp.tokens[i] == tok.decode([tid])
        assert lp.token_logprobs[i] == pytest.approx(ref[i, tid].item(), abs=2e-3)
        top = ref[i].topk(3)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        want = {tok.decode([t]): v for t, v in pairs}
        assert set(lp.top_logprobs[i]) == set(want)
        for key, value in want.items():
            assert lp.top_logprobs[i][key] == pytest.approx(value, abs=2e-3)
    assert "".join(lp.tokens) == resp.choices[0].text


def test_completion_top_logprobs_always_hold_the_sampled_token(client: openai.OpenAI) -> None:
    """OpenAI's legacy completions: up to logprobs + 1 entries, the chosen token's always among
    them; with logprobs 0, only it."""
    for logprobs in (0, 1):
        resp = client.completions.create(
            model="default", prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
            logprobs=logprobs,
        )  # fmt: skip
        lp = resp.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == logprob and len(top) <= logprobs + 1
            if logprobs == 0:
                assert top == {token: logprob}


def test_chat_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())


# ---- tokenize / detokenize --------------------------------------------------------------------


def test_tokenize_and_detokenize_match_the_tokenizer(server: Server, hf: tuple[Any, Any]) -> None:
    _, tok = hf
    text = "héllo 🚀"
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}, timeout=10)
    assert r.status_code == 200
    assert r.json() == {"tokens": tok.encode(text), "count": len(tok.encode(text)),
                        "max_model_len": 2048}  # fmt: skip
    messages = [{"role": "user", "content": QUESTION}]
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=10)
    assert r.json()["tokens"] == chat_ids(tok, QUESTION)
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tok.encode(text)}, timeout=10)
    assert r.json() == {"prompt": text}


# ---- disconnects ------------------------------------------------------------------------------


def engine_running(server: Server) -> int:
    with EngineClient(server.engine_address) as c:
        c.connect(timeout=10)
        return c.control(ControlKind.STATS).stats.num_running


def abort_count(server: Server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.endswith("_total") and labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


def test_disconnect_mid_stream_aborts_and_frees_every_block(server: Server) -> None:
    aborts = abort_count(server)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Count from one to one thousand."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    url = f"{server.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 3:  # role chunk + two content chunks: the request is generating
            seen += bool(next(lines))
        assert engine_running(server) == 1
    # Leaving the block closed the connection mid-stream; 1500 tokens would take minutes.
    wait_engine_idle(server)
    assert abort_count(server) == aborts + 1


def test_disconnect_while_waiting_for_a_non_streamed_answer(server: Server) -> None:
    aborts = abort_count(server)
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(3.0))
    wait_engine_idle(server)
    assert abort_count(server) == aborts + 1
