"""The SSE chunks both streams send: each is one ``data:`` event whose JSON the official openai
client's own types accept, with every field as given (quotes, newlines and non-ASCII text in the
id, the model name and the text), and a usage field exactly when the client asked for one."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from frontend.openai_schemas import UsageInfo
from frontend.sse import ChunkWriter

AWKWARD = 'a "quoted"\nline, café, 日本, \u2028 and \\ backslash'


def parse(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert "\n" not in event[:-2]  # one line: a raw newline would end the event early
    return json.loads(event[len("data: ") : -2])


def test_a_completion_chunk_is_what_the_openai_client_parses() -> None:
    writer = ChunkWriter('cmpl-"1"', "text_completion", 'org/"model" é', include_usage=False)
    choice = {"index": 0, "text": AWKWARD, "logprobs": None, "finish_reason": None}
    body = parse(writer.chunk([choice, {**choice, "index": 1, "finish_reason": "length"}]))
    assert "usage" not in body
    assert body["choices"][0]["finish_reason"] is None
    body["choices"][0]["finish_reason"] = "stop"  # the client's type has no null here
    parsed = Completion.model_validate(body)
    assert parsed.id == 'cmpl-"1"' and parsed.model == 'org/"model" é'
    assert parsed.object == "text_completion"
    assert [c.text for c in parsed.choices] == [AWKWARD, AWKWARD]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]


def test_a_chat_chunk_carries_usage_only_when_asked() -> None:
    writer = ChunkWriter("chatcmpl-1", "chat.completion.chunk", "m", include_usage=True)
    delta = {"index": 0, "delta": {"content": AWKWARD}, "logprobs": None, "finish_reason": None}
    first = parse(writer.chunk([delta]))
    assert first["usage"] is None  # present, null until the last chunk
    assert ChatCompletionChunk.model_validate(first).choices[0].delta.content == AWKWARD
    last = ChatCompletionChunk.model_validate(parse(writer.chunk([], UsageInfo.of(3, 4))))
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.usage.total_tokens == 7
    assert first["created"] == last.created  # one creation time for the whole stream


def test_a_plain_chunk_is_compact_json_in_openai_key_order() -> None:
    """No spaces and the keys in the order OpenAI sends them: clients that read the stream as
    text (curl, log scrapers) see what they would from OpenAI or vLLM."""
    writer = ChunkWriter("cmpl-1", "text_completion", "m", include_usage=False)
    created = parse(writer.chunk([]))["created"]
    choice = {"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}
    assert writer.chunk([choice]) == (
        f'data: {{"id":"cmpl-1","object":"text_completion","created":{created},"model":"m",'
        '"choices":[{"index":0,"text":"hi","logprobs":null,"finish_reason":null}]}\n\n'
    )
