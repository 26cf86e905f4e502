"""The tool-call conventions of 2026's models (frontend/tool_parsers/): Qwen3-Coder's XML,
pythonic (Llama 3.2, Llama 4), DeepSeek V3 and V3.1, harmony (gpt-oss).

Each convention is checked against outputs written in its model's real format (from the models'
published chat templates and format docs: the Qwen3-Coder template's tool-call block, vLLM's Llama
pythonic templates, DeepSeek's templates, OpenAI's harmony guide), whole and streamed: every split
of each output into two chunks, sampled splits into three, one character at a time, all of which
must reassemble to the hand-written expected calls and content. Then what each convention holds
back while streaming, chat-template detection, and the grammars that force calls, compiled and
run by llguidance on the default model's tokenizer (with each family's markers added as the
tokens they are in that family's vocabulary)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from frontend.errors import OpenAIError
from frontend.openai_schemas import ChatCompletionRequest
from frontend.tool_parsers import (
    ParsedMessage,
    StreamDelta,
    ToolParser,
    detect_parser,
    get_parser,
    split_harmony,
    tool_call_grammar,
)
from frontend.tools import ToolPlan, ToolSupport, answer_expression, plan_tools, tool_support
from protocol.messages import Constraint, ConstraintKind
from tests.test_tool_parsers import calls_text, random_pieces, reassemble, summary


def function_tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = function_tool(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
)
WRITE_FILE = function_tool(
    "write_file",
    {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "content": {"type": "string"},
            "options": {"type": "object"},
            "overwrite": {"type": "boolean"},
            "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]},
            "count": {"$ref": "#/$defs/count"},
        },
        "required": ["path", "content"],
        "$defs": {"count": {"type": "integer", "minimum": 0}},
    },
)
GET_TIME = function_tool("get_time", {"type": "object", "properties": {}})
TOOLS = [WEATHER, WRITE_FILE, GET_TIME]

# DeepSeek's tool tokens (full-width bars, U+2581 for the spaces) and harmony's special tokens.
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>"]  # fmt: skip

Call = tuple[str, dict[str, Any]]
Fixture = tuple[str, str, str | None, list[Call]]  # parser, output, content, calls

FIXTURES: list[Fixture] = [
    # ---- qwen3_coder: the template's block, values on lines of their own -------------------
    (
        "qwen3_coder",
        "I'll check both cities.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo 🌧\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        "I'll check both cities.\n\n",
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            ("get_weather", {"city": "São Paulo 🌧", "unit": "celsius"}),
        ],
    ),
    (  # a multi-line value holding tags, and each schema type converted
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n</parameter>\n"
        "<parameter=content>\ndef f(x):\n    return x < 3 and \"</function>\" != '{'\n\n"
        "</parameter>\n"
        '<parameter=options>\n{"mode": "w", "meta": {"depth": 2, "ok": null}}\n</parameter>\n'
        "<parameter=overwrite>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        '<parameter=tags>\n["a", "ü"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n'
        "<parameter=count>\n7\n</parameter>\n</function>\n</tool_call>",
        None,
        [
            (
                "write_file",
                {
                    "path": "src/app.py",
                    "content": "def f(x):\n    return x < 3 and \"</function>\" != '{'\n",
                    "options": {"mode": "w", "meta": {"depth": 2, "ok": None}},
                    "overwrite": True,
                    "ratio": 0.5,
                    "tags": ["a", "ü"],
                    "note": None,
                    "count": 7,
                },
            )
        ],
    ),
    (  # a value not of its type, an unknown parameter, an unknown function: strings
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\nthree\n</parameter>\n<parameter=foo>\n1\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=lookup>\n<parameter=n>\n5\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        None,
        [
            ("get_weather", {"city": "Oslo", "days": "three", "foo": "1"}),
            ("lookup", {"n": "5"}),
            ("get_time", {}),
        ],
    ),
    (  # Jinja writes Python's words: None is null where null is allowed, a string stays one
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\nx\n</parameter>\n"
        "<parameter=content>\nNone\n</parameter>\n<parameter=note>\nNone\n</parameter>\n"
        "<parameter=overwrite>\nfalse\n</parameter>\n</function>\n</tool_call>",
        None,
        [("write_file", {"path": "x", "content": "None", "note": None, "overwrite": False})],
    ),
    (  # a block without </function> is content; the retry after it is a call
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>\n"
        "Retrying.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>\nRetrying.\n",
        [("get_time", {})],
    ),
    (  # cut off by max_tokens inside </tool_call>
        "qwen3_coder",
        "Sure.\n<tool_call>\n<function=get_time>\n</function>\n</tool_",
        "Sure.\n",
        [("get_time", {})],
    ),
    (  # unclosed <parameter=...>
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        [],
    ),
    (
        "qwen3_coder",
        "Calls look like <tool_call>...</tool_call> in my output.",
        "Calls look like <tool_call>...</tool_call> in my output.",
        [],
    ),
    # ---- pythonic: Llama 3.2 bare, Llama 4 in <|python_start|> --------------------------------
    (
        "pythonic",
        "[get_weather(city=\"San Francisco\", days=3), get_weather(city='Seattle', "
        'unit="fahrenheit")]',
        None,
        [
            ("get_weather", {"city": "San Francisco", "days": 3}),
            ("get_weather", {"city": "Seattle", "unit": "fahrenheit"}),
        ],
    ),
    (
        "llama4_pythonic",
        '<|python_start|>[write_file(path="notes/ü.md", content="line 1\\nline \\"2\\" ✓", '
        'options={"mode": "a", "meta": {"depth": 2, "ok": None}}, tags=["x", "y"], '
        "overwrite=True, ratio=-0.5), get_time()]<|python_end|>",
        None,
        [
            (
                "write_file",
                {
                    "path": "notes/ü.md",
                    "content": 'line 1\nline "2" ✓',
                    "options": {"mode": "a", "meta": {"depth": 2, "ok": None}},
                    "tags": ["x", "y"],
                    "overwrite": True,
                    "ratio": -0.5,
                },
            ),
            ("get_time", {}),
        ],
    ),
    (  # JSON's literals, a tuple
        "pythonic",
        '[f(a=true, b=null, c=(1, 2), d=[{"k": false}])]',
        None,
        [("f", {"a": True, "b": None, "c": [1, 2], "d": [{"k": False}]})],
    ),
    (
        "pythonic",
        "The weather in Paris is sunny [citation needed].",
        "The weather in Paris is sunny [citation needed].",
        [],
    ),
    ("pythonic", "[1, 2, 3] are the first primes? No.", "[1, 2, 3] are the first primes? No.", []),
    (  # never evaluated: a call is not a literal
        "pythonic",
        "[get_weather(city=__import__('os').getenv('HOME'))]",
        "[get_weather(city=__import__('os').getenv('HOME'))]",
        [],
    ),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),  # cut off
    (
        "llama4_pythonic",
        "Checking now.<|python_start|>[get_time()]<|python_end|>",
        "Checking now.",
        [("get_time", {})],
    ),
    (
        "pythonic",
        "[write_file(path='a.py', content='''x = [1, (2]\n''')]\nDone.",
        "\nDone.",
        [("write_file", {"path": "a.py", "content": "x = [1, (2]\n"})],
    ),
    # ---- deepseek_v3 (and R1-0528): type, name, fenced JSON; calls a line apart -------------
    (
        "deepseek_v3",
        f"Let me look that up.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
        f'{{"city": "Paris", "days": 3}}\n```{CALL_END}\n{CALL_BEGIN}function{SEP}write_file\n'
        '```json\n{"path": "a/ü.txt", "content": "```\\ncode\\n```", "options": {"meta": '
        f'{{"depth": 2}}}}}}\n```{CALL_END}{CALLS_END}',
        "Let me look that up.",
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            (
                "write_file",
                {"path": "a/ü.txt", "content": "```\ncode\n```", "options": {"meta": {"depth": 2}}},
            ),
        ],
    ),
    (  # bad JSON: the whole section is content
        "deepseek_v3",
        f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris",}}\n```'
        f"{CALL_END}{CALLS_END}",
        f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris",}}\n```'
        f"{CALL_END}{CALLS_END}",
        [],
    ),
    (  # a good call, then a bad block: the bad block is content
        "deepseek_v3",
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}\n"
        f"{CALL_BEGIN}function{SEP}get_weather\n```json\n[1]\n```{CALL_END}{CALLS_END}",
        f"\n{CALL_BEGIN}function{SEP}get_weather\n```json\n[1]\n```{CALL_END}",
        [("get_time", {})],
    ),
    (  # the section cut off after a call
        "deepseek_v3",
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}\n",
        None,
        [("get_time", {})],
    ),
    ("deepseek_v3", "No tools needed.", "No tools needed.", []),
    ("deepseek_v3", "Done <｜tool▁calls", "Done <｜tool▁calls", []),
    ("deepseek_v3", f"a{CALLS_BEGIN}b", f"a{CALLS_BEGIN}b", []),
    # ---- deepseek_v31: name, then the JSON; calls chained --------------------------------------
    (
        "deepseek_v31",
        f'I will check.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Tōkyō", "days": 2}}'
        f"{CALL_END}{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}{CALLS_END}",
        "I will check.",
        [("get_weather", {"city": "Tōkyō", "days": 2}), ("get_time", {})],
    ),
    (  # V3's form is not V3.1's
        "deepseek_v31",
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}{CALLS_END}",
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}{CALLS_END}",
        [],
    ),
    (
        "deepseek_v31",
        f'{CALLS_BEGIN}{CALL_BEGIN}write_file{SEP}{{"path": "x", "content": "{{\\"a\\": [1]}}", '
        f'"options": {{"deep": {{"er": [null, true]}}}}}}{CALL_END}{CALLS_END}',
        None,
        [
            (
                "write_file",
                {"path": "x", "content": '{"a": [1]}', "options": {"deep": {"er": [None, True]}}},
            )
        ],
    ),
    # ---- openai (harmony): the format guide's examples --------------------------------------
    (
        "openai",
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"San Francisco"}<|call|>',
        None,
        [("get_weather", {"city": "San Francisco"})],
    ),
    (
        "openai",
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        "2 + 2 = 4.",
        [],
    ),
    (  # a preamble, then the recipient in the role part (as the template writes it), no stop
        "openai",
        "<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant"
        "<|channel|>commentary<|message|>**Action plan**:\n1. Generate a file\n<|end|>"
        "<|start|>assistant to=functions.write_file<|channel|>commentary json<|message|>"
        '{"path": "index.html", "content": "<p>héllo</p>", "options": {"meta": {"depth": 2}}}',
        "**Action plan**:\n1. Generate a file\n",
        [
            (
                "write_file",
                {
                    "path": "index.html",
                    "content": "<p>héllo</p>",
                    "options": {"meta": {"depth": 2}},
                },
            )
        ],
    ),
    (  # bad JSON: the message is content as written
        "openai",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": }<|call|>',
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": }<|call|>',
        [],
    ),
    (  # a built-in tool's call is the model's own business (analysis)
        "openai",
        "<|channel|>analysis<|message|>Let me search.<|end|><|start|>assistant<|channel|>analysis"
        ' to=browser.search<|message|>{"query": "weather"}<|call|>',
        None,
        [],
    ),
    ("openai", "Just plain text.", "Just plain text.", []),
]
FIXTURE_IDS = [f"{parser}-{i}" for i, (parser, *_) in enumerate(FIXTURES)]


def expected(content: str | None, calls: list[Call]) -> tuple[str | None, list[tuple[str, str]]]:
    """The summary a fixture must give: arguments as OpenAI sends them (compact JSON)."""
    compact = [(n, json.dumps(a, ensure_ascii=False, separators=(",", ":"))) for n, a in calls]
    return content, compact


def stream(parser: str | ToolParser, pieces: list[str]) -> ParsedMessage:
    """A client's view of the stream, checking each fragment as it comes: OpenAI's shape, a
    whole name, and arguments that are whole JSON in every fragment that carries them."""
    tool_parser = get_parser(parser, TOOLS) if isinstance(parser, str) else parser
    streamer = tool_parser.streamer()
    deltas = [streamer.push(p) for p in pieces] + [streamer.finish()]
    for fragment in (f for d in deltas for f in d.tool_calls):
        if fragment["function"].get("arguments"):
            assert isinstance(json.loads(fragment["function"]["arguments"]), dict)
    return reassemble(deltas)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES, ids=FIXTURE_IDS)
def test_extract(parser: str, text: str, content: str | None, calls: list[Call]) -> None:
    assert summary(get_parser(parser, TOOLS).extract(text)) == expected(content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES, ids=FIXTURE_IDS)
def test_every_split_in_two(parser: str, text: str, content: str | None, calls: list[Call]) -> None:
    for cut in range(len(text) + 1):
        assert summary(stream(parser, [text[:cut], text[cut:]])) == expected(content, calls), cut


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES, ids=FIXTURE_IDS)
def test_splits_in_three(parser: str, text: str, content: str | None, calls: list[Call]) -> None:
    rng = random.Random(2026)
    for _ in range(150):
        a, b = sorted(rng.sample(range(len(text) + 1), 2))
        pieces = [text[:a], text[a:b], text[b:]]
        assert summary(stream(parser, pieces)) == expected(content, calls), (a, b)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES, ids=FIXTURE_IDS)
def test_one_character_at_a_time(
    parser: str, text: str, content: str | None, calls: list[Call]
) -> None:
    assert summary(stream(parser, list(text))) == expected(content, calls)


# Pieces that random outputs are built from, so that the state machines meet odd mixtures.
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "<function=get_time>", "</function>", "<function=",
    "<parameter=city>", "</parameter>", "<parameter=", "\nParis\n", "[", "]", "(", ")", "'", '"',
    "'''", "\\", "get_time()", "get_weather(city='x')", "=", ", ", "<|python_start|>",
    "<|python_end|>", "<|python_", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "<｜tool",
    "function", "\n```json\n", "```", "{}", '{"a": 1}', "{", "}", *HARMONY, "<|chan",
    "analysis", "final", "commentary", " to=functions.get_time ", "json", "text", "é✓", "\n",
    "  ",
]  # fmt: skip
NEW_PARSERS = ["qwen3_coder", "pythonic", "llama4_pythonic", "deepseek_v3", "deepseek_v31",
               "openai"]  # fmt: skip


@pytest.mark.parametrize("parser", NEW_PARSERS)
def test_stream_equals_extract_on_random_outputs(parser: str) -> None:
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        whole = summary(get_parser(parser, TOOLS).extract(text))
        assert summary(stream(parser, random_pieces(text, rng))) == whole, text
        assert summary(stream(parser, list(text))) == whole, text


# ---- what a stream holds back ------------------------------------------------------------


def pushes(parser: str, pieces: list[str]) -> list[StreamDelta]:
    streamer = get_parser(parser, TOOLS).streamer()
    return [streamer.push(piece) for piece in pieces] + [streamer.finish()]


def test_qwen3_coder_sends_content_up_to_the_block_and_the_call_when_it_closes() -> None:
    deltas = pushes("qwen3_coder", ["Let me <tool_c", "all>\n<function=get_time>\n</function>\n",
                                    "</tool_call>"])  # fmt: skip
    assert [d.content for d in deltas] == ["Let me ", "", "", ""]
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 1, 0]


def test_pythonic_lets_text_go_once_it_cannot_be_calls() -> None:
    deltas = pushes("pythonic", ["[The ans", "wer] is 4"])
    assert [d.content for d in deltas] == ["[The ans", "wer] is 4", ""]
    deltas = pushes("pythonic", ["<|python_st", "art|>[get_ti", "me()]<|python_", "end|>"])
    assert [d.content for d in deltas] == [""] * 5
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 1, 0, 0]


def test_deepseek_holds_its_marker_and_sends_each_call_as_it_closes() -> None:
    first = f"{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}"
    deltas = pushes("deepseek_v31", ["Hi <｜tool▁ca", f"lls▁begin｜>{first}", CALL_BEGIN,
                                     f"get_time{SEP}{{}}", f"{CALL_END}{CALLS_END}"])  # fmt: skip
    assert [d.content for d in deltas] == ["Hi ", "", "", "", "", ""]
    assert [len(d.tool_calls) for d in deltas] == [0, 1, 0, 0, 1, 0]


def test_harmony_streams_thinking_and_answer_and_holds_the_call() -> None:
    deltas = pushes("openai", [
        "<|channel|>analysis<|message|>Think", "ing.<|e", "nd|><|start|>assistant<|channel|>final",
        "<|message|>It is", " sunny.<|ret", "urn|>",
    ])  # fmt: skip
    assert [d.reasoning for d in deltas] == ["Think", "ing.", "", "", "", "", ""]
    assert [d.content for d in deltas] == ["", "", "", "It is", " sunny.", "", ""]
    call = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    deltas = pushes("openai", [call[:-1], "}", "<|call|>"])
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 1, 0]


def test_split_harmony_gives_thinking_answer_and_calls() -> None:
    text = FIXTURES[[i for i, f in enumerate(FIXTURES) if f[0] == "openai"][2]][1]
    parts = split_harmony(text)
    assert parts.analysis == "{long chain of thought}"
    assert parts.final == "**Action plan**:\n1. Generate a file\n"
    assert [c.name for c in parts.calls] == ["write_file"]
    parts = split_harmony(
        "<|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final"
        "<|message|>4<|return|>"
    )
    assert (parts.analysis, parts.final, parts.calls) == ("2+2 is 4.", "4", [])


def test_qwen3_coder_reads_values_by_the_request_tools() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
    assert get_parser("qwen3_coder", TOOLS).extract(text).tool_calls[0].arguments == '{"days":3}'
    assert get_parser("qwen3_coder").extract(text).tool_calls[0].arguments == '{"days":"3"}'


# ---- detection from the chat template ----------------------------------------------------

QWEN3_CODER_TEMPLATE = (
    "{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
    "\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
)
LLAMA32_PYTHONIC_TEMPLATE = (
    '{{- "Environment: ipython\\n" }}{{- \'Respond in the format [func_name1(params_name1='
    "params_value1, params_name2=params_value2...), func_name2(params)] ' }}"
)
LLAMA4_PYTHONIC_TEMPLATE = (
    '{{- "<|header_start|>system<|header_end|>\\n\\n" }}Use exact format: '
    "[func_name1(param1=value1, param2=value2), func_name2(...)]"
)
DEEPSEEK_V3_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + "
    "'\\n' + '```' + '<｜tool▁call▁end｜>'}}"
)
DEEPSEEK_V31_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
)
GPT_OSS_TEMPLATE = (
    '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary '
    '" }}{{- (tool_call.content_type if tool_call.content_type is defined else "json") + '
    '"<|message|>" }}'
)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
        (LLAMA32_PYTHONIC_TEMPLATE, "pythonic"),
        (LLAMA4_PYTHONIC_TEMPLATE, "llama4_pythonic"),
        (DEEPSEEK_V3_TEMPLATE, "deepseek_v3"),
        (DEEPSEEK_V31_TEMPLATE, "deepseek_v31"),
        (GPT_OSS_TEMPLATE, "openai"),
    ],
)
def test_detect_parser(template: str, parser: str) -> None:
    assert detect_parser(template) == parser


# ---- grammars ----------------------------------------------------------------------------

# Each family's markers, as its tokenizer has them: added tokens (harmony's special ones).
PLAIN_MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_start|>",
                 "<|python_end|>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP,
                 "<think>", "</think>"]  # fmt: skip


@pytest.fixture(scope="module")
def vocabularies(
    default_model_dir: Path, default_grammar_vocabulary: tuple[Any, Any]
) -> dict[str, tuple[Any, Any]]:
    """(HF tokenizer, llguidance's view of it) for the default model as it is ("plain", shared
    with tests/test_tool_parsers.py), and with every family's markers added as tokens
    ("markers", a tokenizer of its own: adding tokens changes it)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    hf.add_tokens(PLAIN_MARKERS)
    hf.add_special_tokens({"additional_special_tokens": HARMONY})
    markers = (hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf)))
    return {"plain": default_grammar_vocabulary, "markers": markers}


def accepts(vocabulary: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether a matcher for ``grammar`` (which must compile without a warning) takes
    ``text``'s tokens and may stop after them."""
    import llguidance

    hf, table = vocabulary
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
    assert not is_error and not messages, messages
    matcher = llguidance.LLMatcher(table, grammar, log_level=0)
    ok = matcher.consume_tokens(hf.encode(text, add_special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


def xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def written(parser: str, calls: list[Call]) -> str:
    """``calls`` as the model writes them in ``parser``'s convention (JSON laid out with ", "
    and ": ", as the grammars lay it out)."""
    if parser == "qwen3_coder":
        return "\n".join(
            f"<tool_call>\n<function={name}>\n"
            + "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in args.items())
            + "</function>\n</tool_call>"
            for name, args in calls
        )
    if parser in ("pythonic", "llama4_pythonic"):
        keywords = [", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) for _, args in calls]
        return (
            "[" + ", ".join(f"{n}({kw})" for (n, _), kw in zip(calls, keywords, strict=True)) + "]"
        )
    if parser == "deepseek_v3":
        blocks = [f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a)}\n```{CALL_END}"
                  for n, a in calls]  # fmt: skip
        return CALLS_BEGIN + "\n".join(blocks) + CALLS_END
    if parser == "deepseek_v31":
        blocks = [f"{CALL_BEGIN}{n}{SEP}{json.dumps(a)}{CALL_END}" for n, a in calls]
        return CALLS_BEGIN + "".join(blocks) + CALLS_END
    return "".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}"
        "<|call|>"
        for n, a in calls
    )


# (parser, vocabulary): harmony needs its special tokens; the others work with either.
GRAMMAR_CASES = [(p, v) for p in NEW_PARSERS for v in ("plain", "markers") if p != "openai"]
GRAMMAR_CASES.append(("openai", "markers"))
PARIS = ("get_weather", {"city": "Paris", "days": 3})
FILE = ("write_file", {"path": "a.txt", "content": "x < y\n</para", "overwrite": False, "count": 2})


def grammar_for(parser: str, vocabulary: tuple[Any, Any], forced: str | None = None,
                parallel: bool = True) -> str:  # fmt: skip
    added = vocabulary[0].get_added_vocab()
    return tool_call_grammar(parser, TOOLS, forced, parallel, added)


@pytest.mark.parametrize(("parser", "vocab"), GRAMMAR_CASES)
@pytest.mark.parametrize("call", [PARIS, FILE, ("get_time", {})])
def test_grammar_accepts_a_call_that_the_parser_reads_back(
    parser: str, vocab: str, call: Call, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    text = written(parser, [call])
    assert accepts(vocabularies[vocab], grammar_for(parser, vocabularies[vocab], None, False), text)
    assert summary(get_parser(parser, TOOLS).extract(text)) == expected(None, [call])


@pytest.mark.parametrize(("parser", "vocab"), GRAMMAR_CASES)
def test_grammar_takes_several_calls_only_when_parallel(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies[vocab]
    calls = [PARIS, ("get_time", {}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    text = written(parser, calls)
    single_call = parser == "openai"  # <|call|> stops generation: one call an output
    assert accepts(vocabulary, grammar_for(parser, vocabulary), text) is not single_call
    assert not accepts(vocabulary, grammar_for(parser, vocabulary, None, False), text)
    assert summary(get_parser(parser, TOOLS).extract(text)) == expected(None, calls)


WRONG_CALLS = [
    ("get_wether", {"city": "Paris"}),  # no such function
    ("get_weather", {"city": "Paris", "days": "two"}),  # wrong type
    ("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
    ("get_weather", {"days": 2}),  # required argument missing
    ("get_weather", {"city": "Paris", "wind": "yes"}),  # no such argument
    ("write_file", {"path": "a", "content": "b", "count": -1}),  # $ref'd minimum broken
]


@pytest.mark.parametrize(("parser", "vocab"), GRAMMAR_CASES)
@pytest.mark.parametrize("call", WRONG_CALLS)
def test_grammar_rejects_a_wrong_call(
    parser: str, vocab: str, call: Call, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies[vocab]
    assert not accepts(vocabulary, grammar_for(parser, vocabulary), written(parser, [call]))


@pytest.mark.parametrize(("parser", "vocab"), GRAMMAR_CASES)
def test_grammar_rejects_unfinished_or_extra_text(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies[vocab]
    grammar = grammar_for(parser, vocabulary)
    text = written(parser, [PARIS])
    assert not accepts(vocabulary, grammar, text[:-1])
    assert not accepts(vocabulary, grammar, "Sure! " + text)
    assert not accepts(vocabulary, grammar, text + " Done.")


@pytest.mark.parametrize(("parser", "vocab"), GRAMMAR_CASES)
def test_forced_grammar_allows_only_that_function(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies[vocab]
    grammar = grammar_for(parser, vocabulary, "get_time", False)
    assert accepts(vocabulary, grammar, written(parser, [("get_time", {})]))
    assert not accepts(vocabulary, grammar, written(parser, [PARIS]))


@pytest.mark.parametrize(("parser", "vocab"), GRAMMAR_CASES)
def test_a_function_without_parameters_is_called_with_none(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """OpenAI: "Omitting parameters defines a function with an empty parameter list", where
    ``parameters: {}`` (JSON Schema's "anything") takes any arguments."""
    vocabulary = vocabularies[vocab]
    added = vocabulary[0].get_added_vocab()
    tools = [function_tool("ping"), function_tool("log", {})]
    ping = tool_call_grammar(parser, tools, "ping", False, added)
    assert accepts(vocabulary, ping, written(parser, [("ping", {})]))
    assert not accepts(vocabulary, ping, written(parser, [("ping", {"host": "a"})]))
    log = tool_call_grammar(parser, tools, "log", False, added)
    assert accepts(vocabulary, log, written(parser, [("log", {"line": "a", "level": 2})]))


def test_the_template_sees_a_function_without_parameters_as_one_of_no_arguments(
    vocabularies: dict[str, tuple[Any, Any]],
) -> None:
    """The tools a chat template gets state the no-arguments schema where a function gave no
    parameters: the model is told so, and a template that renders ``parameters | tojson``
    (DeepSeek-V3.1's) does not fail on a missing key."""
    hf = vocabularies["plain"][0]
    support = ToolSupport("hermes", None, hf.get_added_vocab(), frozenset())
    plan = plan_tools(chat_request(tools=[function_tool("ping")]), support)
    template = "{% for t in tools %}{{ t.function.parameters | tojson }}{% endfor %}"
    text = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=plan.tools, chat_template=template,
        tokenize=False,
    )  # fmt: skip
    assert json.loads(text) == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_a_loose_tool_without_parameters_takes_any_arguments_beside_an_answer_format(
    parser: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """Under tool_choice "auto" beside an answer format, a tool that is not strict has its
    arguments unconstrained, as any such tool's are (frontend/tools.py): its missing
    ``parameters`` do not turn into "no arguments" there; a strict one's do."""
    vocabulary = vocabularies["markers"]
    hf = vocabulary[0]
    support = ToolSupport(parser, None, hf.get_added_vocab(), frozenset(special_tokens(hf)))
    answer = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER_FORMAT))
    with_arguments = any_written(parser, [("ping", {"host": "a"})])
    for tool, takes_them in ((function_tool("ping"), True), (strict(function_tool("ping")), False)):
        plan = plan_tools(chat_request(tools=[tool]), support, answer)
        assert plan.constraint is not None
        assert accepts(vocabulary, plan.constraint.spec, with_arguments) is takes_them
        assert accepts(vocabulary, plan.constraint.spec, any_written(parser, [("ping", {})]))


@pytest.mark.parametrize("vocab", ["plain", "markers"])
def test_xml_grammar_ends_a_value_where_the_parser_does(
    vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """A string value holding a closing tag would be cut there by the parser (the call then
    read as content): the grammar lets no value hold one."""
    vocabulary = vocabularies[vocab]
    grammar = grammar_for("qwen3_coder", vocabulary, "write_file", False)
    for content, ok in [("x < y\n</para", True), ("a</parameter>b", False)]:
        text = written("qwen3_coder", [("write_file", {"path": "a", "content": content})])
        assert accepts(vocabulary, grammar, text) is ok
        assert bool(get_parser("qwen3_coder", TOOLS).extract(text).tool_calls) is ok


def test_harmony_grammar_lets_the_model_think_first(
    vocabularies: dict[str, tuple[Any, Any]],
) -> None:
    vocabulary = vocabularies["markers"]
    thought = (
        "<|channel|>analysis<|message|>The user wants <b>Paris</b>.\n<|end|><|start|>assistant"
    )
    text = thought + written("openai", [PARIS])
    assert accepts(vocabulary, grammar_for("openai", vocabulary), text)
    assert summary(get_parser("openai").extract(text)) == expected(None, [PARIS])
    assert split_harmony(text).analysis == "The user wants <b>Paris</b>.\n"


def test_markers_are_written_as_the_tokens_they_are(
    vocabularies: dict[str, tuple[Any, Any]],
) -> None:
    hf = vocabularies["markers"][0]
    grammar = grammar_for("deepseek_v31", vocabularies["markers"])
    assert f"<[{hf.convert_tokens_to_ids(CALL_BEGIN)}]>" in grammar and CALL_BEGIN not in grammar
    assert '"<tool_call>' in grammar_for("qwen3_coder", vocabularies["plain"])


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_json_conventions_write_their_markers_as_tokens(
    parser: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies["markers"]
    grammar = grammar_for(parser, vocabulary)
    text = calls_text(parser, [PARIS, ("get_time", {})])
    assert "<[" in grammar and accepts(vocabulary, grammar, text)
    assert summary(get_parser(parser).extract(text)) == expected(None, [PARIS, ("get_time", {})])


@pytest.mark.parametrize(
    ("parser", "tools", "message"),
    [
        ("openai", TOOLS, "no <|channel|> token"),  # the default tokenizer lacks harmony's
        ("pythonic", [function_tool("f", {"properties": {"first-name": {}}})], "identifier"),
        ("qwen3_coder", [function_tool("f", {"properties": {"a>b": {}}})], "XML tag"),
    ],
)
def test_grammar_refuses_what_it_cannot_write(
    parser: str, tools: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tool_call_grammar(parser, tools, None, True, {})


def test_a_forced_call_that_cannot_be_written_is_a_400() -> None:
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
        "tools": [function_tool("f", {"type": "object", "properties": {"first-name": {}}})],
    })  # fmt: skip
    with pytest.raises(OpenAIError) as refused:
        plan_tools(req, ToolSupport("pythonic"))
    assert refused.value.status == 400 and refused.value.info.param == "tool_choice"
    assert "not a Python identifier" in refused.value.info.message


# ---- strict tools under tool_choice "auto": content, then possibly calls -----------------------

JSON_PARSERS = ["hermes", "llama3_json", "mistral"]
OPTIONAL_CASES = GRAMMAR_CASES + [(p, v) for p in JSON_PARSERS for v in ("plain", "markers")]
TRIGGERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]",
            "deepseek_v3": CALLS_BEGIN, "deepseek_v31": CALLS_BEGIN}  # fmt: skip
ANSWER = "It is sunny in Paris, <b>22</b> degrees [source: met office]."


def any_written(parser: str, calls: list[Call]) -> str:
    return calls_text(parser, calls) if parser in JSON_PARSERS else written(parser, calls)


def special_tokens(hf: Any) -> set[str]:
    return {t.content for t in hf.added_tokens_decoder.values() if t.special}


def optional_grammar(parser: str, vocabulary: tuple[Any, Any], answer: str | None = None) -> str:
    hf = vocabulary[0]
    added = hf.get_added_vocab()
    return tool_call_grammar(parser, TOOLS, None, True, added, True, answer, special_tokens(hf))


def content_output(parser: str) -> str:
    """An answer without calls, as the convention writes one (harmony: in the final channel)."""
    return f"<|channel|>final<|message|>{ANSWER}" if parser == "openai" else ANSWER


@pytest.mark.parametrize(("parser", "vocab"), OPTIONAL_CASES)
def test_optional_calls_grammar_takes_content_alone(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies[vocab]
    text = content_output(parser)
    assert accepts(vocabulary, optional_grammar(parser, vocabulary), text)
    assert summary(get_parser(parser, TOOLS).extract(text)) == expected(ANSWER, [])


@pytest.mark.parametrize(("parser", "vocab"), OPTIONAL_CASES)
def test_optional_calls_grammar_takes_calls_after_content(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """Content before the calls where the convention has a trigger; calls from the first
    character where it has none; the parser reads back what the grammar let through."""
    vocabulary = vocabularies[vocab]
    single_call = parser == "openai"
    calls = [PARIS] if single_call else [PARIS, ("get_time", {})]
    lead = "Let me look that up. " if parser in TRIGGERS else None
    text = (lead or "") + any_written(parser, calls)
    assert accepts(vocabulary, optional_grammar(parser, vocabulary), text)
    assert summary(get_parser(parser, TOOLS).extract(text)) == expected(lead, calls)


@pytest.mark.parametrize(("parser", "vocab"), OPTIONAL_CASES)
@pytest.mark.parametrize("call", WRONG_CALLS)
def test_optional_calls_grammar_rejects_a_wrong_call(
    parser: str, vocab: str, call: Call, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    vocabulary = vocabularies[vocab]
    lead = "Let me look that up. " if parser in TRIGGERS else ""
    text = lead + any_written(parser, [call])
    assert not accepts(vocabulary, optional_grammar(parser, vocabulary), text)


@pytest.mark.parametrize(("parser", "vocab"), [c for c in OPTIONAL_CASES if c[0] != "openai"])
def test_optional_calls_grammar_commits_where_the_parser_would_read_a_call(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """After the trigger only a call may follow; without a trigger, content cannot start with
    what a call starts with (a JSON object, a Python list)."""
    vocabulary = vocabularies[vocab]
    grammar = optional_grammar(parser, vocabulary)
    if parser in TRIGGERS:
        assert not accepts(vocabulary, grammar, f"I write {TRIGGERS[parser]} tags in my answers.")
        assert accepts(vocabulary, grammar, f"I write {TRIGGERS[parser][:-2]} tags.")
    else:
        start = "{" if parser == "llama3_json" else "["
        assert not accepts(vocabulary, grammar, f"{start}1, 2]")
        assert not accepts(vocabulary, grammar, f"  {start}1, 2]")
        assert accepts(vocabulary, grammar, f"The list is {start}1, 2].")


def test_harmony_optional_calls_let_the_model_think_then_answer_or_call(
    vocabularies: dict[str, tuple[Any, Any]],
) -> None:
    vocabulary = vocabularies["markers"]
    grammar = optional_grammar("openai", vocabulary)
    thought = "<|channel|>analysis<|message|>Weather? Look it up.<|end|><|start|>assistant"
    assert accepts(vocabulary, grammar, thought + written("openai", [PARIS]))
    assert accepts(vocabulary, grammar, thought + content_output("openai"))
    wrong = written("openai", [("get_weather", {"days": 2})])
    assert not accepts(vocabulary, grammar, thought + wrong)


def accepts_ids(vocabulary: tuple[Any, Any], grammar: str, ids: list[int]) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(vocabulary[1], grammar, log_level=0)
    ok = matcher.consume_tokens(ids)
    return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("parser", list(TRIGGERS))
def test_optional_calls_grammar_refuses_a_trigger_spelled_in_plain_tokens(
    parser: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """Where the trigger is a token, its text spelled out of ordinary tokens is no content
    either: the parser would read a call there, which the grammar did not check."""
    marked, plain = vocabularies["markers"], vocabularies["plain"]
    grammar = optional_grammar(parser, marked)
    bad = any_written(parser, [("get_weather", {"city": "Paris", "days": "two"})])
    spelled = plain[0].encode(TRIGGERS[parser], add_special_tokens=False)
    assert len(spelled) > 1  # not the marker's token
    rest = marked[0].encode(bad.removeprefix(TRIGGERS[parser]), add_special_tokens=False)
    lead = marked[0].encode("Hi ", add_special_tokens=False)
    assert not accepts_ids(marked, grammar, lead + spelled + rest)
    assert get_parser(parser, TOOLS).extract("Hi " + bad).tool_calls  # what it would have read


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("pythonic", 'Sure. <|python_start|>[get_weather(days="two")]'),
        ("llama4_pythonic", '<|python_start|>[get_weather(days="two")]'),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"days": "two"}}'),
        ("pythonic", '\x1c[get_weather(days="two")]'),
        ("llama3_json", '\x1c{"name": "get_weather", "parameters": {"days": "two"}}'),
    ],
)
def test_optional_calls_grammar_refuses_what_the_parser_reads_as_a_call_past_the_start(
    parser: str, text: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """Llama's tags lead calls (``<|python_start|>`` anywhere), and Python's whitespace is
    wider than the grammar engine's: none of these may pass as content."""
    vocabulary = vocabularies["plain"]
    assert get_parser(parser, TOOLS).extract(text).tool_calls
    assert not accepts(vocabulary, optional_grammar(parser, vocabulary), text)


@pytest.mark.parametrize(("parser", "vocab"), [c for c in OPTIONAL_CASES if c[0] != "openai"])
def test_optional_calls_grammar_lets_content_hold_the_tokenizers_other_tokens(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """A model's thinking in ``<think>`` tokens (a server without a reasoning parser) is
    content: strict tools constrain calls, not what else the model writes."""
    vocabulary = vocabularies[vocab]
    grammar = optional_grammar(parser, vocabulary)
    thought = "<think>\nThe user wants [Paris] {now}.\n</think>\n\n"
    assert accepts(vocabulary, grammar, thought + ANSWER)
    if parser in TRIGGERS:
        assert accepts(vocabulary, grammar, thought + any_written(parser, [PARIS]))


@pytest.mark.parametrize(
    ("parser", "before", "after"),
    [
        ("hermes", "<tool_", 'call>\n{"name": "get_weather", "arguments": {"days": "two"}}\n'
                             "</tool_call>"),
        ("pythonic", "", '[get_weather(days="two")]'),
        ("llama3_json", "", '{"name": "get_weather", "parameters": {"days": "two"}}'),
    ],
)  # fmt: skip
def test_free_text_holds_no_token_that_decoding_skips(
    parser: str, before: str, after: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """A special token (the default model's <repo_name>) vanishes from the text the parser
    reads: between two texts it would join them into a call the grammar never checked."""
    hf, table = vocabularies["plain"]
    special = hf.convert_tokens_to_ids("<repo_name>")
    ids = [*hf.encode(before, add_special_tokens=False), special]
    ids += hf.encode(after, add_special_tokens=False)
    assert get_parser(parser, TOOLS).extract(hf.decode(ids, skip_special_tokens=True)).tool_calls
    assert not accepts_ids((hf, table), optional_grammar(parser, (hf, table)), ids)


ANSWER_FORMAT = {"type": "object", "properties": {"answer": {"type": "string"}},
                 "required": ["answer"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(("parser", "vocab"), OPTIONAL_CASES)
def test_optional_calls_with_an_answer_format_take_that_answer_or_calls(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """Strict tools beside a JSON answer format (an agent's output type): the output is the
    answer, laid out as the format alone lays it out, or calls, with no text before them."""
    vocabulary = vocabularies[vocab]
    answer = answer_expression(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER_FORMAT)))
    if parser == "llama3_json":  # its calls are JSON objects too
        with pytest.raises(ValueError, match="cannot be told from a call"):
            optional_grammar(parser, vocabulary, answer)
        return
    grammar = optional_grammar(parser, vocabulary, answer)
    final = "<|channel|>final<|message|>" if parser == "openai" else ""
    reply = '{"answer":"sunny"}'
    assert accepts(vocabulary, grammar, final + reply)
    assert summary(get_parser(parser, TOOLS).extract(final + reply)) == expected(reply, [])
    assert accepts(vocabulary, grammar, any_written(parser, [PARIS]))
    assert not accepts(vocabulary, grammar, final + '{"answer":3}')
    assert not accepts(vocabulary, grammar, content_output(parser))
    if parser in TRIGGERS:
        assert not accepts(vocabulary, grammar, "Sure. " + any_written(parser, [PARIS]))


# Call text that JSON's escaping leaves as the convention's parser reads it (no quotes, no line
# breaks), for the conventions whose parser finds calls anywhere in an output.
CALL_IN_A_STRING = {
    "qwen3_coder": "<tool_call><function=get_weather><parameter=days>3</parameter></function>"
    "</tool_call>",
    "llama4_pythonic": "<|python_start|>[get_time()]<|python_end|>",
    "deepseek_v31": f"{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}{CALLS_END}",
}


def answer_plan(parser: str, vocabulary: tuple[Any, Any], strict_tools: bool = True) -> ToolPlan:
    """The plan of a request with tools (strict or not) beside the ANSWER_FORMAT format."""
    hf = vocabulary[0]
    support = ToolSupport(parser, None, hf.get_added_vocab(), frozenset(special_tokens(hf)))
    answer = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER_FORMAT))
    tools = [strict(t) for t in TOOLS] if strict_tools else TOOLS
    return plan_tools(chat_request(tools=tools), support, answer)


@pytest.mark.parametrize("strict_tools", [True, False], ids=["strict", "not strict"])
@pytest.mark.parametrize("parser", sorted(CALL_IN_A_STRING))
def test_an_answer_whose_string_holds_call_text_is_read_as_the_answer(
    parser: str, strict_tools: bool, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    """The grammar takes such an answer (it checks no call there), and the convention's parser
    alone would cut a call out of it; the request's parser leaves the answer whole. Tools
    that are not strict get the same grammar: a format alone would leave the parser reading
    the answer's strings, and the model no way to call."""
    vocabulary = vocabularies["plain"]
    plan = answer_plan(parser, vocabulary, strict_tools)
    reply = json.dumps(
        {"answer": CALL_IN_A_STRING[parser]}, ensure_ascii=False, separators=(",", ":")
    )
    assert plan.constraint is not None and plan.parser is not None
    assert accepts(vocabulary, plan.constraint.spec, reply)
    assert get_parser(parser, TOOLS).extract(reply).tool_calls
    assert summary(plan.parser.extract(reply)) == expected(reply, [])
    rng = random.Random(11)
    for pieces in [list(reply), *(random_pieces(reply, rng) for _ in range(50))]:
        assert summary(stream(plan.parser, pieces)) == expected(reply, []), pieces


@pytest.mark.parametrize(("parser", "vocab"), OPTIONAL_CASES)
def test_calls_beside_an_answer_format_are_read_as_the_convention_reads_them(
    parser: str, vocab: str, vocabularies: dict[str, tuple[Any, Any]]
) -> None:
    if parser == "llama3_json":  # refused: its calls are JSON objects too
        return
    plan = answer_plan(parser, vocabularies[vocab])
    assert plan.parser is not None
    text = any_written(parser, [PARIS, FILE])
    whole = summary(get_parser(parser, TOOLS).extract(text))
    assert whole[1] == expected(None, [PARIS, FILE])[1]
    assert summary(plan.parser.extract(text)) == whole
    rng = random.Random(5)
    for pieces in [list(text), *(random_pieces(text, rng) for _ in range(30))]:
        assert summary(stream(plan.parser, pieces)) == whole, pieces


@pytest.mark.parametrize(
    ("text", "opens"),
    [("", None), ("[", None), ("[get_ti", None), ("[get_time(", True), ("[true", None),
     ("[true,", False), ('["get_time("', False), ("[1", False), ("{", False), ("[ f(", False)],
)  # fmt: skip
def test_a_pythonic_output_opens_calls_only_with_a_name_and_a_parenthesis(
    text: str, opens: bool | None
) -> None:
    """A JSON answer may be an array; a list of calls is "[" and a name before "("."""
    assert get_parser("pythonic").syntax.opens_calls(text) is opens


def test_tools_beside_a_format_that_is_no_json_are_a_400() -> None:
    regex = Constraint(ConstraintKind.REGEX, "[a-z]+")
    for tools in ([WEATHER], [strict(WEATHER)]):
        with pytest.raises(OpenAIError) as info:
            plan_tools(chat_request(tools=tools), ToolSupport("hermes"), regex)
        assert info.value.info.param == "tools" and "json_object" in info.value.info.message
    none = plan_tools(
        chat_request(tools=[WEATHER], tool_choice="none"), ToolSupport("hermes"), regex
    )
    assert none.constraint is None and none.parser is None


def test_an_answer_schemas_own_layout_is_kept_and_a_null_one_ignored() -> None:
    from engine_core.grammar import JSON_OPTIONS

    def layout(schema: dict[str, Any]) -> dict[str, Any]:
        spec = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        return json.loads(answer_expression(spec).removeprefix("%json "))["x-guidance"]

    assert layout({"type": "object", "x-guidance": None}) == JSON_OPTIONS
    assert layout({"x-guidance": {"whitespace_flexible": True}})["whitespace_flexible"] is True
    regex = Constraint(ConstraintKind.REGEX, "[a-z]+")
    with pytest.raises(ValueError, match='send tool_choice "none"'):
        answer_expression(regex)


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def strict(tool: dict[str, Any]) -> dict[str, Any]:
    return {**tool, "function": {**tool["function"], "strict": True}}


def test_strict_tools_under_auto_constrain_only_their_own_arguments(
    vocabularies: dict[str, tuple[Any, Any]],
) -> None:
    vocabulary = vocabularies["plain"]
    support = ToolSupport("hermes", None, vocabulary[0].get_added_vocab())
    plan = plan_tools(chat_request(tools=[strict(WEATHER), WRITE_FILE]), support)
    assert plan.constraint is not None and plan.constraint.kind == ConstraintKind.GRAMMAR
    grammar = plan.constraint.spec
    assert accepts(vocabulary, grammar, ANSWER)
    assert not accepts(vocabulary, grammar, calls_text("hermes", [("get_weather", {"days": 2})]))
    # write_file is not strict: any object of arguments, though its schema wants a path
    assert accepts(vocabulary, grammar, calls_text("hermes", [("write_file", {"x": [1]})]))
    assert not accepts(vocabulary, grammar, calls_text("hermes", [("get_time", {})]))
    one = plan_tools(chat_request(tools=[strict(WEATHER)], parallel_tool_calls=False), support)
    assert not accepts(vocabulary, one.constraint.spec, calls_text("hermes", [PARIS, PARIS]))


@pytest.mark.parametrize(
    ("fields", "constrained"),
    [
        ({"tools": [WEATHER, WRITE_FILE]}, False),  # auto, nothing strict: the model's choice
        ({"tools": [strict(WEATHER)], "tool_choice": "none"}, False),
        ({"tools": [strict(WEATHER)], "tool_choice": "auto"}, True),
        ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": False}}]}, False),
    ],
)
def test_which_requests_get_the_optional_calls_grammar(
    fields: dict[str, Any], constrained: bool
) -> None:
    plan = plan_tools(chat_request(**fields), ToolSupport("hermes"))
    assert (plan.constraint is not None) is constrained


# ---- start-up: the served template's parser ----------------------------------------------

RENDERS_TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}"


def test_start_up_finds_the_parser_a_template_names(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    hf.chat_template = RENDERS_TOOLS + "{# <function=x> <parameter=y> #}"
    support, how = tool_support(hf, None)
    assert support is not None and support.parser == "qwen3_coder", how
    assert support.added_tokens == hf.get_added_vocab()
    hf.chat_template = RENDERS_TOOLS + "{# <|channel|> #}"
    support, how = tool_support(hf, None)  # harmony: its text keeps the special tokens
    assert support is not None and support.parser == "openai", how
