"""The frontend's constraint checker on its own: the verdicts, the time limit and the cache."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from frontend.constraints import ConstraintChecker
from frontend.errors import OpenAIError
from protocol.messages import Constraint, ConstraintKind
from tests.structured_cases import SCHEMAS


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def schema(name: str) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[name]))


def test_a_compile_over_the_time_limit_is_a_400_and_a_good_one_passes(hf_tokenizer: object) -> None:
    async def main() -> None:
        slow = ConstraintChecker(hf_tokenizer, 49152, timeout_s=1e-6)  # no compile is this fast
        with pytest.raises(OpenAIError) as info:
            await slow.check(schema("defs and ref"), "response_format")
        assert info.value.status == 400 and info.value.info.param == "response_format"
        assert "did not compile within" in info.value.info.message
        checker = ConstraintChecker(hf_tokenizer, 49152, timeout_s=30)
        await checker.check(schema("defs and ref"), "response_format")

    asyncio.run(main())


def test_verdicts_are_cached_and_one_compile_serves_a_burst(hf_tokenizer: object) -> None:
    async def main() -> None:
        checker = ConstraintChecker(hf_tokenizer, 49152, timeout_s=30)
        constraint = schema("nested objects")
        await asyncio.gather(*(checker.check(constraint, "p") for _ in range(8)))
        await checker.check(constraint, "p")
        assert checker.num_compiles == 1 and checker.num_cached == 1
        bad = Constraint(ConstraintKind.REGEX, "a(b")
        for _ in range(2):
            with pytest.raises(OpenAIError, match="unclosed group"):
                await checker.check(bad, "guided_regex")
        assert checker.num_compiles == 2 and checker.num_cached == 2

    asyncio.run(main())


TOO_COMPLEX = [
    Constraint(ConstraintKind.REGEX, "(a{1000}){1000}"),
    Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "string", "pattern": "^(a{1000}){1000}$"}'),
]


@pytest.mark.parametrize("constraint", TOO_COMPLEX, ids=["regex", "schema pattern"])
def test_a_constraint_too_complex_at_its_first_token_is_a_400(
    hf_tokenizer: object, constraint: Constraint
) -> None:
    """It compiles, and its lexer gives up only at the first token: the engine would end the
    request there with no output (a 200), so the check takes that token too."""
    from engine_core.grammar import compile_matcher, token_table

    compile_matcher(constraint, token_table(hf_tokenizer, 49152))  # no error yet

    async def main() -> None:
        checker = ConstraintChecker(hf_tokenizer, 49152, timeout_s=60)
        with pytest.raises(OpenAIError, match="too many expressions") as info:
            await checker.check(constraint, "guided_regex")
        assert info.value.status == 400 and info.value.info.code == "invalid_constraint"
        assert "<state>" not in info.value.info.message  # llguidance's reason, not its dump
        for name in SCHEMAS:  # what is served still passes
            await checker.check(schema(name), "response_format")

    asyncio.run(main())


def test_a_tool_schema_that_does_not_compile_is_named_without_the_servers_grammar(
    hf_tokenizer: object,
) -> None:
    """The tool-call grammar is the server's text around the client's schemas: the 400 says
    what is wrong with the schema (llguidance's first line), not the grammar listing."""
    from frontend.tool_parsers import tool_call_grammar

    parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    grammar = Constraint(ConstraintKind.GRAMMAR, tool_call_grammar("hermes", tools, None, True, {}))

    async def main() -> None:
        checker = ConstraintChecker(hf_tokenizer, 49152, timeout_s=30)
        with pytest.raises(OpenAIError) as info:
            await checker.check(grammar, "tools")
        message = info.value.info.message
        assert info.value.status == 400 and info.value.info.param == "tools"
        assert "does not exist" in message and "$defs/missing" in message, message
        assert "\n" not in message and "start:" not in message and "at 3(" not in message
        with pytest.raises(OpenAIError) as raw:  # a grammar the client wrote keeps its listing
            await checker.check(grammar, "guided_grammar")
        assert "start:" in raw.value.info.message

    asyncio.run(main())
