"""Structured outputs, tools, logit_bias and prompt logprobs through the OpenAI door: the official
`openai` client against a real `tandem serve` on the default model.

Independent checks: the `jsonschema` package for every JSON output, Python's `re` for regexes, a
recursive-descent parser for the grammar, HF transformers' log-softmax for prompt logprobs, and
the tokenizer for logit_bias. Every bad input is a 400 naming its parameter, and never reaches the
engine (its step count does not move).
"""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from protocol.client import EngineClient
from protocol.messages import ControlKind
from tests.server_fixture import Server, server, wait_engine_idle  # noqa: F401
from tests.structured_cases import (
    CHOICES,
    GRAMMAR,
    MAX_TOKENS,
    REGEX,
    SAMPLES,
    SCHEMAS,
    matches_regex,
    parse_expression,
)

pytestmark = pytest.mark.slow

ASK_JSON = [{"role": "user", "content": "Answer with a JSON document."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the time in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zone": {"enum": ["utc", "local"]},
            },
            "required": ["city", "zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300
    )


def engine_steps(server: Server) -> int:
    with EngineClient(server.engine_address) as raw:
        raw.connect(timeout=30)
        return raw.control(ControlKind.STATS).stats.num_steps


def in_parallel(calls: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


# ---- constraints ------------------------------------------------------------------------------


def test_every_schema_validates_over_five_samples_at_temperature_one(
    client: openai.OpenAI, server: Server
) -> None:
    def ask(name: str, schema: dict) -> Any:
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        return lambda: client.chat.completions.create(
            model="default", messages=ASK_JSON, response_format=fmt, n=SAMPLES,
            temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
        )  # fmt: skip

    responses = in_parallel([ask(name, schema) for name, schema in SCHEMAS.items()])
    for (name, schema), response in zip(SCHEMAS.items(), responses, strict=True):
        assert len(response.choices) == SAMPLES
        for choice in response.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
    wait_engine_idle(server)


def test_every_spelling_of_every_kind(client: openai.OpenAI) -> None:
    """response_format, structured_outputs and the guided_* fields, on both routes, streamed
    and not: each output passes its own check."""
    schema = SCHEMAS["enum"]

    def valid(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"json": schema}}, valid),
        ({"guided_json": schema}, valid),
        ({"structured_outputs": {"regex": REGEX}}, matches_regex),
        ({"guided_regex": REGEX}, matches_regex),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"grammar": GRAMMAR}}, parse_expression),
        ({"guided_grammar": GRAMMAR}, parse_expression),
    ]  # fmt: skip

    def completion(extra: dict[str, Any], stream: bool) -> Any:
        def call() -> str:
            kwargs = dict(model="default", prompt="Answer:", max_tokens=MAX_TOKENS, n=2,
                          temperature=1.0, seed=3, extra_body=extra)  # fmt: skip
            if not stream:
                return [c.text for c in client.completions.create(**kwargs).choices]
            texts = ["", ""]
            for chunk in client.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    texts[c.index] += c.text
            return texts

        return call

    calls = [completion(extra, stream) for extra, _ in cases for stream in (False, True)]
    for i, texts in enumerate(in_parallel(calls)):
        check = cases[i // 2][1]
        assert all(check(t) for t in texts), (cases[i // 2][0], texts)


def test_json_object_on_chat_streamed(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Describe a dog as a JSON object with its name and age."}
    ]
    text = ""
    stream = client.chat.completions.create(
        model="default", messages=messages, response_format={"type": "json_object"},
        temperature=0, max_tokens=MAX_TOKENS, stream=True,
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert isinstance(json.loads(text), dict)


# ---- logit_bias -------------------------------------------------------------------------------


def test_a_turn_without_tools_keeps_the_earlier_calls_in_its_prompt(server: Server) -> None:
    """The default model's own template drops tool calls and results; the server renders tool
    turns with its tool template. A last turn sent with no tools, or tool_choice none (as agent
    loops ask for the answer), kept only the user's words: the result answered nothing."""
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "SUNNY_21C"},
    ]  # fmt: skip

    def prompt_of(extra: dict[str, Any]) -> str:
        body = {"model": "default", "messages": history, "max_tokens": 1, "prompt_logprobs": 0}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body | extra, timeout=60)
        assert r.status_code == 200, r.text
        entries = r.json()["prompt_logprobs"][1:]  # the first token has none
        return "".join(next(iter(e.values()))["decoded_token"] for e in entries)

    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        prompt = prompt_of(extra)
        assert '"name": "get_weather"' in prompt and "SUNNY_21C" in prompt, (extra, prompt)
        assert "<tools>" not in prompt  # no tool to call this turn


def test_logprobs_of_tokens_a_grammar_masks_are_json_numbers(server: Server) -> None:
    """Under tool_choice required (or any grammar) the top logprobs include tokens the grammar
    masks, at -inf in the engine: JSON has no -inf, so the whole answer was a 500 and the
    stream carried "-Infinity". They come at -9999.0, vLLM's floor, on both routes."""

    def strict(text: str) -> Any:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text[:200]}"))

    body = {"model": "default", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": "required", "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}  # fmt: skip
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    values = [
        top["logprob"]
        for entry in strict(r.text)["choices"][0]["logprobs"]["content"]
        for top in entry["top_logprobs"]
    ]
    assert min(values) == -9999.0 and all(v <= 0 for v in values)
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as stream:  # fmt: skip
        assert stream.status_code == 200
        chunks = [strict(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert any(c["choices"] and c["choices"][0]["logprobs"] for c in chunks)
    completion = {"model": "default", "prompt": "Weather in Paris as JSON:", "max_tokens": 8,
                  "temperature": 0, "logprobs": 5,
                  "response_format": {"type": "json_object"}}  # fmt: skip
    r = httpx.post(f"{server.base_url}/v1/completions", json=completion, timeout=60)
    assert r.status_code == 200, r.text
    tops = strict(r.text)["choices"][0]["logprobs"]["top_logprobs"]
    assert min(v for top in tops for v in top.values()) == -9999.0


def test_logit_bias_forces_and_bans_a_token(client: openai.OpenAI, server: Server) -> None:
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": " Paris"}, timeout=30)
    paris = tokens.json()["tokens"][-1]
    base = dict(model="default", prompt="The capital of France is", max_tokens=3, temperature=0)
    free = client.completions.create(**base).choices[0].text
    assert free.startswith(" Paris")
    banned = client.completions.create(**base, logit_bias={str(paris): -100}).choices[0].text
    assert not banned.startswith(" Paris")
    forced = client.completions.create(**base, logit_bias={"1234": 100}).choices[0].text
    decoded = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [1234] * 3}, timeout=30)
    assert forced == decoded.json()["prompt"]


# ---- prompt logprobs --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_logprobs(default_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)

    def logprobs(ids: list[int]) -> Any:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)  # [P, V]

    return logprobs


def test_echo_logprobs_with_max_tokens_zero_equal_hf(
    client: openai.OpenAI, server: Server, hf_logprobs: Any
) -> None:
    """lm-evaluation-harness's request: echo, logprobs, max_tokens 0. Tolerance 1e-4 (float32
    on both sides, different kernels)."""
    prompt = "The capital of France is Paris. The capital of Spain is Madrid."
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}, timeout=30).json()
    ids = ids["tokens"]
    reference = hf_logprobs(ids)
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert math.isclose(
            lp.token_logprobs[pos], reference[pos - 1, ids[pos]].item(), abs_tol=1e-4
        )
        # The two most likely, and the prompt's own token where it is not among them.
        top = reference[pos - 1].topk(2)
        want = top.values.tolist()
        if ids[pos] not in top.indices.tolist():
            want.append(reference[pos - 1, ids[pos]].item())
        assert sorted(lp.top_logprobs[pos].values(), reverse=True) == pytest.approx(
            sorted(want, reverse=True), abs=1e-4
        )
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0


def test_vllm_prompt_logprobs_and_echo_with_generation(
    client: openai.OpenAI, server: Server, hf_logprobs: Any
) -> None:
    prompt = "Hello, my name is"
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}, timeout=30).json()
    ids = ids["tokens"]
    reference = hf_logprobs(ids)
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=0,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    choice = r.choices[0]
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for pos in range(1, len(ids)):
        got = entries[pos][str(ids[pos])]["logprob"]
        assert math.isclose(got, reference[pos - 1, ids[pos]].item(), abs_tol=1e-4)
        # Every entry has a rank, the prompt token's too (as vLLM): HF's, counting each token
        # at least as likely, up to the ties that 1e-4 of rounding could reorder.
        ranks = {tid: e["rank"] for tid, e in entries[pos].items()}
        assert all(isinstance(r, int) and r >= 1 for r in ranks.values()), entries[pos]
        row, mine = reference[pos - 1], reference[pos - 1, ids[pos]].item()
        low, high = int((row > mine + 1e-4).sum()) + 1, int((row >= mine - 1e-4).sum())
        assert low <= ranks[str(ids[pos])] <= high, (pos, ranks, low, high)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert choice.text.startswith(prompt) and lp.text_offset[len(ids)] == len(prompt)
    streamed = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=0,
        stream=True,
    )  # fmt: skip
    pieces = [(c.choices[0].text, c.choices[0].logprobs) for c in streamed if c.choices]
    assert "".join(t for t, _ in pieces) == choice.text
    assert [x for _, lps in pieces if lps for x in lps.token_logprobs] == lp.token_logprobs


def assert_offsets_index_the_text(text: str, lp: Any, special: set[str]) -> None:
    """Each token's text_offset is where its text starts in the returned text; a special token
    the text leaves out sits, empty, where the next token starts."""
    assert lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        shown = "" if token in special and token not in text else token
        assert text[offset : offset + len(shown)] == shown, (token, offset, text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_echoed_token_ids_with_a_special_token_keep_offsets_in_the_text(
    client: openai.OpenAI, server: Server, skip_special_tokens: bool
) -> None:
    """A token-id prompt opening with <|im_start|>: the echo decodes it as the output is decoded
    (left out by default, kept with skip_special_tokens false), and the offsets follow the text."""
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}, timeout=30)
    prompt = [1, *ids.json()["tokens"]]  # 1: SmolLM2's <|im_start|>
    args = {
        "model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
        "logprobs": 1, "extra_body": {"skip_special_tokens": skip_special_tokens},
    }  # fmt: skip
    choice = client.completions.create(**args).choices[0]
    assert choice.text.startswith("<|im_start|>Hello world" if not skip_special_tokens else "Hello")
    assert choice.logprobs.tokens[0] == "<|im_start|>"
    assert_offsets_index_the_text(choice.text, choice.logprobs, {"<|im_start|>", "<|im_end|>"})
    pieces = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(p.text for p in pieces) == choice.text
    streamed = [x for p in pieces if p.logprobs for x in p.logprobs.text_offset]
    assert streamed == choice.logprobs.text_offset


# ---- tools ------------------------------------------------------------------------------------


def check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required, named = in_parallel([
        lambda: client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=5, max_tokens=MAX_TOKENS, n=3,
        ),
        lambda: client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, n=3,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
            seed=6, parallel_tool_calls=False,
        ),
    ])  # fmt: skip
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_time"})


def reassemble(stream: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    """Tool-call deltas joined as a client joins them: id and name from the first fragment of
    each index, arguments concatenated. A chunk holds one choice and a delta one call, as
    OpenAI sends them (LlamaIndex reads only ``delta.tool_calls[0]``)."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        assert len(chunk.choices) <= 1
        for choice in chunk.choices:
            assert len(choice.delta.tool_calls or []) <= 1
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    assert not call["id"], "the id comes once, in the first fragment"
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return calls, finish


def test_streamed_tool_calls_reassemble_into_the_same_calls(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What time is it in Oslo?"}]
    kwargs = dict(model="default", messages=messages, tools=TOOLS, tool_choice="required",
                  temperature=0, max_tokens=MAX_TOKENS)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, finish = reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def few_shot_history() -> list[dict[str, Any]]:
    """Earlier turns in which the assistant called the tool and used its result: how the
    135M-parameter default model learns, in context, to call tools of its own accord."""
    history: list[dict[str, Any]] = []
    for i, city in enumerate(["Paris", "Berlin", "Rome"]):
        call_id = f"call_{i}"
        arguments = json.dumps({"city": city})
        history += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 20}'},
            {"role": "assistant", "content": f"It is 20 degrees in {city}."},
        ]  # fmt: skip
    return history


def test_auto_calls_a_tool_and_a_second_turn_uses_its_result(client: openai.OpenAI) -> None:
    messages = [*few_shot_history(), {"role": "user", "content": "What is the weather in Tokyo?"}]
    first = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], temperature=0, max_tokens=60
    ).choices[0]
    assert first.finish_reason == "tool_calls"
    check_calls(first.message.tool_calls, {"get_weather"})
    call = first.message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Tokyo"}
    calls, finish = reassemble(client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], temperature=0, max_tokens=60,
        stream=True,
    ))  # fmt: skip
    assert finish == "tool_calls" and calls[0]["arguments"] == call.function.arguments
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12}'},
    ]
    second = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    ).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert "12" in second.message.content  # it read the tool's result
    none = client.chat.completions.create(
        model="default", messages=messages[:-2], tools=[WEATHER], tool_choice="none",
        temperature=0, max_tokens=30,
    ).choices[0]  # fmt: skip
    assert not none.message.tool_calls and none.finish_reason in ("stop", "length")


STRICT_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
STRICT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": STRICT_SCHEMA, "strict": True},
}


def test_a_strict_tool_under_auto_gets_arguments_its_schema_takes(client: openai.OpenAI) -> None:
    """The few-shot history teaches calls without a unit, which this schema requires: free, the
    model writes one anyway; strict, its call is held to the schema, streamed or not."""
    messages = [*few_shot_history(), {"role": "user", "content": "What is the weather in Tokyo?"}]
    loose = {**STRICT_WEATHER, "function": {**STRICT_WEATHER["function"], "strict": False}}
    kwargs = dict(model="default", messages=messages, temperature=0, max_tokens=60)
    free, held = in_parallel([
        lambda: client.chat.completions.create(tools=[loose], **kwargs),
        lambda: client.chat.completions.create(tools=[STRICT_WEATHER], **kwargs),
    ])  # fmt: skip
    free_call = free.choices[0].message.tool_calls[0]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(free_call.function.arguments), STRICT_SCHEMA)
    choice = held.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), STRICT_SCHEMA)
    assert json.loads(call.function.arguments)["city"] == "Tokyo"
    calls, finish = reassemble(
        client.chat.completions.create(tools=[STRICT_WEATHER], stream=True, **kwargs)
    )
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)
    ]


def test_strict_tools_beside_an_answer_format_give_that_answer_or_a_call(
    client: openai.OpenAI,
) -> None:
    """An agent's output type beside its strict tools: asked about the weather with the
    few-shot history, the model calls (held to the schema); asked to answer, its answer is the
    format's JSON, as the format alone would have it."""
    answer_schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                     "required": ["city"], "additionalProperties": False}  # fmt: skip
    answer_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer_schema}}
    history = few_shot_history()
    asks = [[*history, {"role": "user", "content": "What is the weather in Tokyo?"}],
            [{"role": "user", "content": "Name a city, as JSON."}]]  # fmt: skip
    call_turn, answer_turn = in_parallel([
        lambda m=m: client.chat.completions.create(
            model="default", messages=m, tools=[STRICT_WEATHER], response_format=answer_format,
            temperature=0, max_tokens=60,
        ) for m in asks
    ])  # fmt: skip
    call = call_turn.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), STRICT_SCHEMA)
    answer = answer_turn.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    jsonschema.validate(json.loads(answer.message.content), answer_schema)


# ---- bad input: a 400 naming the parameter, nothing sent to the engine -------------------------


def json_schema_format(schema: dict[str, Any] | None) -> dict[str, Any]:
    inner: dict[str, Any] = {"name": "x"} if schema is None else {"name": "x", "schema": schema}
    return {"response_format": {"type": "json_schema", "json_schema": inner}}


BAD_COMPLETIONS = [
    (json_schema_format({"type": "strin"}), "response_format.json_schema.schema"),
    (json_schema_format({"type": "array", "uniqueItems": True}),
     "response_format.json_schema.schema"),
    (json_schema_format(None), "response_format.json_schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "garbage ::: ]["}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"frobnicate": True}, "frobnicate"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    # A constraint ends the output once complete: nothing can hold that end off.
    ({"guided_choice": ["red", "green"], "min_tokens": 5}, "min_tokens"),
    ({"structured_outputs": {"regex": "[a-z]+"}, "ignore_eos": True}, "ignore_eos"),
]  # fmt: skip
BAD_CHAT = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [STRICT_WEATHER], "structured_outputs": {"regex": "[a-z]+"}}, "tools"),
    ({"tools": [WEATHER], "structured_outputs": {"regex": "[a-z]+"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["audio"]}, "modalities.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD_COMPLETIONS)
def test_bad_completion_input(server: Server, extra: dict[str, Any], param: str) -> None:
    before = engine_steps(server)
    body = {"model": "default", "prompt": "Hi", "max_tokens": 3, **extra}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine_steps(server) == before  # nothing reached the engine


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_bad_chat_input(server: Server, extra: dict[str, Any], param: str) -> None:
    before = engine_steps(server)
    body = {"model": "default", "messages": ASK_JSON, "max_tokens": 3, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine_steps(server) == before


def test_a_schema_beyond_the_grammar_engines_bounds_is_refused(server: Server) -> None:
    """200 levels of nested objects pass llguidance's recursion bound: a 400, not a compile
    that runs away (docs/security.md lists the bounds)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "default", "prompt": "Hi", "max_tokens": 3, "guided_json": schema}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    assert "recursion" in r.json()["error"]["message"]


def test_version(server: Server) -> None:
    from importlib.metadata import version

    r = httpx.get(f"{server.base_url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": version("tandem")}
