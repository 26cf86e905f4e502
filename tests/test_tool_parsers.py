"""Tool-call parsing (frontend/tool_parsers/): each convention's whole-output reading, the
stream's equality with it under every chunking, hold-back of partial markers, template detection,
and the grammars that force calls, checked by llguidance on the default model's tokenizer."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from frontend.tool_parsers import (
    PARSERS,
    ParsedMessage,
    StreamDelta,
    ToolCall,
    detect_parser,
    get_parser,
    new_call_id,
    tool_call_grammar,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
WEATHER_CALL = ("get_weather", '{"city":"Paris","days":2}')
NOOP = '{"name": "noop", "arguments": {}}'
NOOP_CALL = ("noop", "{}")
Case = tuple[str, str, str | None, list[tuple[str, str]]]


def text_only(parser: str, text: str) -> Case:
    """A case whose whole text stays content."""
    return (parser, text, text, [])


# (parser, output text, expected content, expected (name, arguments) per call)
CASES: list[Case] = [
    text_only("hermes", "Just text, no <tool call here."),
    text_only("hermes", "  \n"),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [WEATHER_CALL]),
    (
        "hermes",
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{NOOP}\n</tool_call>\n",
        None,
        [WEATHER_CALL, NOOP_CALL],
    ),
    (
        "hermes",
        f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
        "Let me look.\n\n",
        [WEATHER_CALL],
    ),
    text_only("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    text_only("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"s": "é ✓ \\u00e9"}}</tool_',
        None,
        [("f", '{"s":"é ✓ é"}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>',
        None,
        [("f", '{"a":[1]}')],
    ),
    (
        "hermes",
        f"Use <tool_call> tags: <tool_call>{NOOP}</tool_call>",
        "Use <tool_call> tags: ",
        [NOOP_CALL],
    ),
    ("hermes", f"<tool_call>\n{NOOP}\n</tool_call>\nDone.", "\nDone.", [NOOP_CALL]),
    text_only("llama3_json", "The weather is fine."),
    text_only("llama3_json", 'Sure: {"name": "f", "parameters": {}}'),
    text_only("llama3_json", '{"answer": 42}'),
    text_only("llama3_json", '{"name": "f", "parameters": {"x": 1'),
    ("llama3_json", '{"name": "f", "parameters": {"x": "}{"}}', None, [("f", '{"x":"}{"}')]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}',
        None,
        [("f", '{"x":1}'), ("g", "{}")],
    ),
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": NaN}}',
        '; {"name": "g", "parameters": {"x": NaN}}',
        [("f", "{}")],
    ),
    ("llama3_json", '\n{"name": "f"}\n', None, [("f", "{}")]),
    text_only("mistral", "No tools needed."),
    text_only("mistral", "[TOOL_CALLS] is a marker"),
    text_only("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": }}]'),
    text_only("mistral", '[TOOL_CALLS][{"name": "f"}, {"arguments": {}}]'),
    text_only("mistral", f'[TOOL_CALLS][{NOOP}, {{"name": "g"'),
    ("mistral", f"[TOOL_CALLS][{WEATHER}]", None, [WEATHER_CALL]),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, {NOOP}]", None, [WEATHER_CALL, NOOP_CALL]),
    ("mistral", f"Checking.[TOOL_CALLS][{NOOP}]", "Checking.", [NOOP_CALL]),
]
CASE_IDS = [f"{parser}-{i}" for i, (parser, *_) in enumerate(CASES)]


def summary(message: ParsedMessage) -> tuple[str | None, list[tuple[str, str]]]:
    return message.content, [(c.name, c.arguments) for c in message.tool_calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_extract(parser: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert summary(get_parser(parser).extract(text)) == (content, calls)


def test_a_well_formed_call_keeps_its_arguments() -> None:
    args = {"q": 'a "quoted" \\ path\n', "n": [1, 2.5, -0.0, None, True], "deep": {"é": {}}}
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": args}, indent=2) + "</tool_call>"
    (call,) = get_parser("hermes").extract(text).tool_calls
    assert json.loads(call.arguments) == args
    assert call.arguments == json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def reassemble(deltas: list[StreamDelta]) -> ParsedMessage:
    """A client's view of a stream, checking the fragments' shape on the way: each is one
    whole call (the next index, its id, type, name and arguments), as a client that reads one
    fragment a call (LlamaIndex's) needs."""
    calls: list[ToolCall] = []
    for fragment in (f for d in deltas for f in d.tool_calls):
        function = fragment["function"]
        assert set(fragment) == {"index", "id", "type", "function"}
        assert fragment["index"] == len(calls) and fragment["type"] == "function"
        assert set(function) == {"name", "arguments"}
        calls.append(ToolCall(fragment["id"], function["name"], function["arguments"]))
    return ParsedMessage("".join(d.content for d in deltas) or None, calls)


def stream(parser: str, pieces: list[str]) -> ParsedMessage:
    streamer = get_parser(parser).streamer()
    deltas = [streamer.push(piece) for piece in pieces]
    return reassemble([*deltas, streamer.finish()])


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_stream_equals_extract_one_char_at_a_time(
    parser: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    assert summary(stream(parser, list(text))) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_stream_equals_extract_in_random_chunks(
    parser: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    rng = random.Random(1234)
    for _ in range(30):
        assert summary(stream(parser, random_pieces(text, rng))) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_stream_equals_extract_split_anywhere_in_two(
    parser: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    for cut in range(len(text) + 1):
        assert summary(stream(parser, [text[:cut], "", text[cut:]])) == (content, calls)


# Pieces that random outputs are built from: markers whole and cut, calls good and bad, JSON
# fragments, separators, whitespace and text, so that the state machines meet odd mixtures.
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL_", "<|python_tag|>", "<|py",
    WEATHER, NOOP, '{"name": "f"', '"}', "}", "{", "[", "]", ", ", "; ", ";", "\n", "  ", "\\",
    '"', "text", "é✓", f"<tool_call>\n{NOOP}\n</tool_call>", f"[{NOOP}]", f"[{WEATHER}, {NOOP}]",
    f"[TOOL_CALLS][{NOOP}]",
]  # fmt: skip


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_stream_equals_extract_on_random_outputs(parser: str) -> None:
    rng = random.Random(99)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10)))
        expected = summary(get_parser(parser).extract(text))
        assert summary(stream(parser, random_pieces(text, rng))) == expected, text
        assert summary(stream(parser, list(text))) == expected, text


def test_call_ids_have_openai_form_and_differ() -> None:
    text = f"<tool_call>{NOOP}</tool_call><tool_call>{NOOP}</tool_call>"
    ids = [c.id for c in get_parser("hermes").extract(text).tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids + [new_call_id()])
    assert len(set(ids)) == 2


def pushes(parser: str, pieces: list[str]) -> list[StreamDelta]:
    streamer = get_parser(parser).streamer()
    return [streamer.push(piece) for piece in pieces] + [streamer.finish()]


def test_hermes_holds_back_a_partial_marker_until_it_is_clear() -> None:
    deltas = pushes("hermes", ["Hi <tool_c", "ar wash"])
    assert [d.content for d in deltas] == ["Hi ", "<tool_car wash", ""]
    deltas = pushes("hermes", ["Hi <tool_c", "all>\n" + NOOP, "\n</tool_call>"])
    assert [d.content for d in deltas] == ["Hi ", "", "", ""]
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 1, 0]


def test_a_partial_marker_at_the_end_is_content() -> None:
    assert [d.content for d in pushes("hermes", ["ok <tool_"])] == ["ok ", "<tool_"]
    assert [d.content for d in pushes("mistral", ["ok [TOOL_"])] == ["ok ", "[TOOL_"]


def test_mistral_holds_back_its_marker_and_the_open_array() -> None:
    deltas = pushes("mistral", ["a [TOOL", "_CALLS] [", NOOP, "]"])
    assert [d.content for d in deltas] == ["a ", "", "", "", ""]
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 0, 1, 0]


def test_llama_waits_for_the_first_character_and_the_closing_brace() -> None:
    deltas = pushes("llama3_json", ["<|pyth", "on_tag|>", '{"name": "f", ', '"parameters": {}}'])
    assert [d.content for d in deltas] == [""] * 5
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 0, 1, 0]
    deltas = pushes("llama3_json", ["<|pyth", "on is fun"])
    assert [d.content for d in deltas] == ["", "<|python is fun", ""]


def test_whitespace_before_a_call_is_held_and_dropped() -> None:
    deltas = pushes("hermes", ["\n\n", f"<tool_call>{NOOP}</tool_call>", "\n"])
    assert "".join(d.content for d in deltas) == ""
    deltas = pushes("hermes", ["\n\n", "Hello"])
    assert [d.content for d in deltas] == ["", "\n\nHello", ""]


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, "{" * 50_000 + "}" * 50_000, "<tool_call>" + "[" * 100_000 + "</tool_call>",
     '[TOOL_CALLS][{"name": "f", "arguments": {"x": Infinity}}]', "\\", '"', "}{][", ""],
)  # fmt: skip
def test_never_raises(parser: str, text: str) -> None:
    message = get_parser(parser).extract(text)
    assert message.tool_calls == [] and message.content == (text or None)


def test_get_parser_by_name() -> None:
    assert sorted(PARSERS) == [
        "deepseek_v3", "deepseek_v31", "hermes", "llama3_json", "llama4_pythonic", "mistral",
        "openai", "pythonic", "qwen3_coder", "qwen3_xml",
    ]  # fmt: skip
    for name in PARSERS:
        assert get_parser(name).name == name
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, qwen3_coder"):
        get_parser("qwen")


def test_the_cli_offers_every_parser() -> None:
    from frontend.serve import TOOL_PARSERS

    assert sorted(TOOL_PARSERS) == sorted(PARSERS)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (None, None),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        ("{%- if tools %}<tools>{{ tools }}</tools> answer in <tool_call></tool_call>", "hermes"),
        ("{%- if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls|tojson }}", "mistral"),
        ('{{- "Environment: ipython\\n" }}', "llama3_json"),
        ("{{- '<|python_tag|>' + tool_call.arguments }}", "llama3_json"),
        ("""'Respond in the format {"name": function name, "parameters": dict'""", "llama3_json"),
    ],
)
def test_detect_parser(template: str | None, parser: str | None) -> None:
    assert detect_parser(template) == parser


# ---- grammars ----------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOOP_TOOL = {"type": "function", "function": {"name": "noop"}}
TOOLS = [WEATHER_TOOL, NOOP_TOOL]


@pytest.fixture(scope="module")
def tokenizers(default_grammar_vocabulary: tuple[Any, Any]) -> tuple[Any, Any]:
    """(the HF tokenizer, llguidance's view of it) for the default model (tests/conftest.py)."""
    return default_grammar_vocabulary


def accepts(tokenizers: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether a matcher for ``grammar`` takes ``text``'s tokens and may stop after them."""
    import llguidance

    hf, table = tokenizers
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
    assert not is_error, messages
    matcher = llguidance.LLMatcher(table, grammar, log_level=0)
    ok = matcher.consume_tokens(hf.encode(text, add_special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


def call_json(name: str, args: dict[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args})


# The JSON conventions; the others' grammars are tested in tests/test_tool_parsers_2026.py.
JSON_PARSERS = ["hermes", "llama3_json", "mistral"]


def calls_text(parser: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """``calls`` written as the model writes them in ``parser``'s convention."""
    if parser == "hermes":
        return "\n".join(f"<tool_call>\n{call_json(n, a)}\n</tool_call>" for n, a in calls)
    if parser == "llama3_json":
        return "; ".join(call_json(n, a, "parameters") for n, a in calls)
    return "[TOOL_CALLS][" + ", ".join(call_json(n, a) for n, a in calls) + "]"


PARIS = ("get_weather", {"city": "Paris", "days": 3})


@pytest.mark.parametrize("parser", JSON_PARSERS)
def test_grammar_accepts_a_call_that_the_parser_reads_back(
    parser: str, tokenizers: tuple[Any, Any]
) -> None:
    text = calls_text(parser, [PARIS])
    assert accepts(tokenizers, tool_call_grammar(parser, TOOLS, None, False), text)
    (call,) = get_parser(parser).extract(text).tool_calls
    assert (call.name, json.loads(call.arguments)) == PARIS


@pytest.mark.parametrize("parser", JSON_PARSERS)
def test_grammar_takes_several_calls_only_when_parallel(
    parser: str, tokenizers: tuple[Any, Any]
) -> None:
    calls = [PARIS, ("noop", {}), ("get_weather", {"city": "Oslo"})]
    text = calls_text(parser, calls)
    assert accepts(tokenizers, tool_call_grammar(parser, TOOLS, None, True), text)
    assert not accepts(tokenizers, tool_call_grammar(parser, TOOLS, None, False), text)
    extracted = get_parser(parser).extract(text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in extracted] == calls


@pytest.mark.parametrize("parser", JSON_PARSERS)
@pytest.mark.parametrize(
    "call",
    [
        ("get_wether", {"city": "Paris"}),  # no such function
        ("get_weather", {"city": 7}),  # wrong type
        ("get_weather", {"days": 2}),  # required argument missing
        ("get_weather", {"city": "Paris", "unit": "C"}),  # no such argument
    ],
)
def test_grammar_rejects_a_wrong_call(
    parser: str, call: tuple[str, dict[str, Any]], tokenizers: tuple[Any, Any]
) -> None:
    grammar = tool_call_grammar(parser, TOOLS, None, True)
    assert not accepts(tokenizers, grammar, calls_text(parser, [call]))


@pytest.mark.parametrize("parser", JSON_PARSERS)
def test_grammar_rejects_unfinished_or_extra_text(parser: str, tokenizers: tuple[Any, Any]) -> None:
    grammar = tool_call_grammar(parser, TOOLS, None, True)
    text = calls_text(parser, [PARIS])
    assert not accepts(tokenizers, grammar, text[:-1])
    assert not accepts(tokenizers, grammar, "Sure! " + text)
    assert not accepts(tokenizers, grammar, text + " Done.")


@pytest.mark.parametrize("parser", JSON_PARSERS)
def test_forced_grammar_allows_only_that_function(parser: str, tokenizers: tuple[Any, Any]) -> None:
    grammar = tool_call_grammar(parser, TOOLS, "noop", False)
    assert accepts(tokenizers, grammar, calls_text(parser, [("noop", {})]))
    assert not accepts(tokenizers, grammar, calls_text(parser, [PARIS]))
    # noop gives no parameters: OpenAI's "empty parameter list", so no arguments at all.
    assert not accepts(tokenizers, grammar, calls_text(parser, [("noop", {"anything": 1})]))


def test_grammar_follows_refs_into_the_parameters(tokenizers: tuple[Any, Any]) -> None:
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    parameters = {
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/place"}, "via": {"$ref": "#/$defs/place"}},
        "required": ["to"],
        "additionalProperties": False,
        "$defs": {"place": place},
    }
    grammar = tool_call_grammar("hermes", [function_tool("go", parameters)], None, False)
    ok = calls_text("hermes", [("go", {"to": {"city": "Rome"}, "via": {"city": "Pisa"}})])
    assert accepts(tokenizers, grammar, ok)
    assert not accepts(tokenizers, grammar, calls_text("hermes", [("go", {"to": {"city": 1}})]))
    assert parameters["properties"]["to"] == {"$ref": "#/$defs/place"}  # the request is untouched


def test_grammar_follows_a_recursive_ref_to_the_parameters_root(
    tokenizers: tuple[Any, Any],
) -> None:
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
        "additionalProperties": False,
    }
    grammar = tool_call_grammar("mistral", [function_tool("tree", tree)], None, False)
    deep = {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]}
    assert accepts(tokenizers, grammar, calls_text("mistral", [("tree", deep)]))
    bad = {"v": 1, "kids": [{"v": 2, "kids": [{"v": "3"}]}]}
    assert not accepts(tokenizers, grammar, calls_text("mistral", [("tree", bad)]))


def function_tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_grammar_refuses_what_cannot_be_called() -> None:
    with pytest.raises(ValueError, match="llama3_json"):
        tool_call_grammar("nonesuch", TOOLS, None, False)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar("hermes", TOOLS, "get_time", False)
    with pytest.raises(ValueError, match="no function tools"):
        tool_call_grammar("hermes", [], None, True)


def test_a_delta_with_two_calls_goes_out_as_two_chunks_of_one_call() -> None:
    """OpenAI sends one call a chunk (LlamaIndex reads only ``delta.tool_calls[0]``): the
    content goes with the first call, the finish reason with the last."""
    from frontend.chat import one_call_a_chunk

    streamer = get_parser("hermes").streamer()
    step = streamer.push(f"Sure. <tool_call>{NOOP}</tool_call><tool_call>{NOOP}</tool_call>")
    delta = {"content": step.content, "tool_calls": step.tool_calls}
    first, second = one_call_a_chunk(0, delta, None, "tool_calls")
    assert first["delta"]["content"] == "Sure. " and first["finish_reason"] is None
    assert [c["index"] for c in first["delta"]["tool_calls"]] == [0]
    assert second["delta"] == {"tool_calls": [step.tool_calls[1]]}
    assert second["finish_reason"] == "tool_calls" and second["index"] == 0
    (alone,) = one_call_a_chunk(1, {"content": "hi"}, None, "stop")
    assert alone["delta"] == {"content": "hi"} and alone["finish_reason"] == "stop"
