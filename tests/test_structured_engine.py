"""Structured outputs in the engine core on the default model: the offline API and the raw ZMQ
client produce output that the constraint's own independent check accepts (the jsonschema
package for schemas), sampled at temperature 1.0; logit_bias and prompt logprobs against hand
computations and HF; a constraint that allows no token ends its request, with its blocks freed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from engine_core.llm import LLM
from protocol.address import private_ipc_address, remove_ipc_files
from protocol.client import EngineClient, EngineRequestError
from protocol.messages import Constraint, ConstraintKind, FinishReason, SamplingParams
from tests.server_fixture import outputs_of
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


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", device="cpu", max_model_len=1024, num_kv_blocks=512, max_num_seqs=16)


def chat_prompt(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = llm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def sampled(constraint: Constraint, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, constraint=constraint)


def schema_constraint(schema: dict) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def test_every_schema_gives_valid_json_at_temperature_one(llm: LLM) -> None:
    prompt = chat_prompt(llm, "Answer with a JSON document.")
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        for seed in range(SAMPLES):
            prompts.append(prompt)
            params.append(sampled(schema_constraint(schema), seed))
            schemas.append((name, schema))
    outputs = llm.generate(prompts, params)
    for (name, schema), out in zip(schemas, outputs, strict=True):
        assert out.finish_reason == FinishReason.STOP, (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    prompt = chat_prompt(llm, "Say something.")
    cases = [
        (Constraint(ConstraintKind.REGEX, REGEX), matches_regex),
        (Constraint(ConstraintKind.CHOICE, json.dumps(CHOICES)), lambda t: t in CHOICES),
        (Constraint(ConstraintKind.GRAMMAR, GRAMMAR), parse_expression),
    ]
    params = [sampled(c, seed) for c, _ in cases for seed in range(SAMPLES)]
    outputs = llm.generate([prompt] * len(params), params)
    for i, out in enumerate(outputs):
        check = cases[i // SAMPLES][1]
        assert out.finish_reason == FinishReason.STOP and check(out.text), out.text
    # Any JSON object: its keys and strings are unbounded, so greedy (sampled, a small model
    # may write one string until max_tokens); the JSON-schema test bounds them instead.
    ask = chat_prompt(llm, "Describe a dog as a JSON object with its name and age.")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                            constraint=Constraint(ConstraintKind.JSON_OBJECT))  # fmt: skip
    out = llm.generate([ask], params)[0]
    assert out.finish_reason == FinishReason.STOP and isinstance(json.loads(out.text), dict)


def test_constrained_and_free_requests_share_batches_in_both_loops(llm: LLM) -> None:
    """The overlapped loop settles the step in flight before a constrained step's bitmask: the
    same seeded requests give the same tokens with and without overlap, and the unconstrained
    ones the same tokens as when run alone."""
    prompt = chat_prompt(llm, "Describe a cat in JSON.")
    schema = SCHEMAS["flat object"]
    params = [sampled(schema_constraint(schema), s) for s in range(3)]
    params += [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    runs = []
    for overlap in (True, False):
        llm.engine.set_async_scheduling(overlap)
        runs.append([o.token_ids for o in llm.generate([prompt] * 5, params, detokenize=False)])
    llm.engine.set_async_scheduling(True)
    assert runs[0] == runs[1]
    alone = llm.generate([prompt], params[3:4], detokenize=False)[0].token_ids
    assert runs[0][3] == runs[0][4] == alone


def test_bad_constraints_are_refused_before_anything_runs(llm: LLM) -> None:
    prompt = chat_prompt(llm, "hi")
    for constraint in [
        Constraint(ConstraintKind.REGEX, "a(b"),
        Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strin"}'),
        Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "array", "uniqueItems": true}'),
        Constraint(ConstraintKind.CHOICE, "[]"),
        Constraint(ConstraintKind.GRAMMAR, "root ::= missing"),
    ]:
        with pytest.raises(ValueError):
            llm.generate([prompt], SamplingParams(constraint=constraint))
    assert not llm.engine.has_unfinished()


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    prompt = chat_prompt(llm, "Count to three.")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    free = llm.generate([prompt], greedy, detokenize=False)[0].token_ids
    forced_token = 1234
    forced = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            logit_bias=((forced_token, 100.0),))  # fmt: skip
    assert llm.generate([prompt], forced, detokenize=False)[0].token_ids == [forced_token] * 4
    banned = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            logit_bias=((free[0], -100.0),))  # fmt: skip
    assert llm.generate([prompt], banned, detokenize=False)[0].token_ids[0] != free[0]


def test_prompt_logprobs_equal_hf_with_chunked_prefill(tmp_path: Path) -> None:
    """Against HF's log-softmax over the same prompt, with prompts longer than the step budget
    (chunked prefill) and a second copy that would hit the prefix cache."""
    from transformers import AutoModelForCausalLM

    llm = LLM("default", device="cpu", max_model_len=512, num_kv_blocks=128,
              max_num_batched_tokens=16, max_num_seqs=4)  # fmt: skip
    prompt = llm.tokenizer.encode(
        "The capital of France is Paris. The capital of Italy is Rome, and"
    )
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.runner.model_dir), dtype=torch.float32)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [P, V]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    first, again = llm.generate([prompt, prompt], params, detokenize=False)
    for out in (first, again):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) - 1
        for pos, entry in enumerate(entries):
            assert math.isclose(entry.logprob, reference[pos, prompt[pos + 1]].item(), abs_tol=1e-4)
            top = reference[pos].topk(3)
            assert entry.top_token_ids == top.indices.tolist()
            assert all(
                math.isclose(a, b, abs_tol=1e-4)
                for a, b in zip(entry.top_logprobs, top.values.tolist(), strict=False)
            )
    one_token = llm.generate([prompt[:1]], params, detokenize=False)[0]
    assert one_token.prompt_logprobs == []


def test_a_constraint_that_allows_nothing_ends_its_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every token masked out: the token sampled there is refused by the matcher, and the
    request ends with DEAD_END and the tokens it had, its blocks freed, a warning logged."""
    from engine_core import grammar

    def nothing_allowed(self: grammar.BitmaskFiller, grammars: list) -> torch.Tensor:
        return torch.zeros((len(grammars), (self.vocab_size + 31) // 32), dtype=torch.int32)

    monkeypatch.setattr(grammar.BitmaskFiller, "fill", nothing_allowed)
    prompt = chat_prompt(llm, "hi")
    out = llm.generate([prompt], sampled(Constraint(ConstraintKind.REGEX, REGEX), 0))[0]
    assert out.finish_reason == FinishReason.DEAD_END and out.token_ids == []
    assert any("allows no token" in r.getMessage() for r in caplog.records)
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0


@pytest.fixture(scope="module")
def engine_address(default_model_dir: Path) -> Iterator[str]:
    address = private_ipc_address()
    cmd = [sys.executable, "-m", "frontend.cli", "engine", "--model", "default",
           "--address", str(address), "--max-model-len", "1024", "--num-kv-blocks", "256",
           "--max-num-seqs", "8", "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        yield str(address)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        remove_ipc_files(address)


def test_raw_zmq_client_gets_schema_valid_json(engine_address: str, llm: LLM) -> None:
    """Every schema's request in flight at once (batched, as a server's would be), each read
    back from the shared stream by its id."""
    prompt = chat_prompt(llm, "Answer with a JSON document.")
    schemas = {f"r{i}": schema for i, schema in enumerate(SCHEMAS.values())}
    with EngineClient(engine_address) as client:
        client.connect(timeout=120)
        for i, (rid, schema) in enumerate(schemas.items()):
            client.add_request(rid, prompt, sampled(schema_constraint(schema), i))
        outs = outputs_of(client, set(schemas), timeout=120)
        for rid, schema in schemas.items():
            text = llm.tokenizer.decode(
                [t for o in outs[rid] for t in o.new_token_ids], skip_special_tokens=True
            )
            assert outs[rid][-1].finish_reason == FinishReason.STOP, (rid, text)
            jsonschema.validate(json.loads(text), schema)
        with pytest.raises(EngineRequestError, match="invalid constraint") as info:
            list(
                client.generate(
                    "bad",
                    prompt,
                    SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "a(b")),
                    60,
                )
            )
        assert info.value.code == 400


def test_tandem_client_flags(engine_address: str, tmp_path: Path, llm: LLM) -> None:
    schema_file = tmp_path / "schema.json"
    schema = SCHEMAS["enum"]
    schema_file.write_text(json.dumps(schema))
    base = [sys.executable, "-m", "frontend.cli", "client", "--address", engine_address,
            "--prompt", "Pick a color.", "--chat", "--max-tokens", "40", "--seed", "3"]  # fmt: skip
    runs = {
        "--json-schema": (
            ["--json-schema", str(schema_file)],
            lambda t: jsonschema.validate(json.loads(t), schema) is None,
        ),
        "--regex": (["--regex", REGEX], matches_regex),
        "--choice": ([a for c in CHOICES for a in ("--choice", c)], lambda t: t in CHOICES),
    }
    # The three clients run at once: the engine batches their requests.
    procs = {
        flag: subprocess.Popen([*base, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        for flag, (extra, _) in runs.items()
    }  # fmt: skip
    for flag, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert runs[flag][1](stdout.strip()), (flag, stdout)
    both = subprocess.run(
        [*base, "--regex", "a", "--json-object"], capture_output=True, text=True, timeout=60
    )
    assert both.returncode == 2 and "not --json-object and --regex" in both.stderr


def record_calls(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, each stage of a step appends its name as the engine core calls it (the real
    methods run: the recorder only wraps them)."""
    core, calls = llm.engine, []

    def spy(owner: object, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args: object, **kwargs: object) -> object:
            calls.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    spy(core.scheduler, "schedule", "P")
    spy(core.runner, "forward", "F")
    spy(core, "_bitmask", "B")
    spy(core.runner, "sample", "S")
    spy(core.runner, "collect", "C")
    return calls


@pytest.mark.parametrize("constrained", [False, True])
def test_a_step_runs_its_stages_in_order_and_the_runner_calls_nothing_back(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, constrained: bool
) -> None:
    """With overlap, step N is scheduled and its forward enqueued; a constrained step then
    settles step N-1 (collect) before its bitmask and sampler, since the bitmask needs N-1's
    token; an unconstrained one enqueues its sampler first and settles N-1 while N runs. The
    runner's stages take data only: no callable reaches it."""
    import inspect

    for stage in (llm.engine.runner.forward, llm.engine.runner.sample):
        for parameter in inspect.signature(stage).parameters.values():
            assert "Callable" not in str(parameter.annotation), parameter
    prompt = chat_prompt(llm, "Describe a cat in JSON.")
    constraint = schema_constraint(SCHEMAS["flat object"]) if constrained else None
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, constraint=constraint)
    calls = record_calls(llm, monkeypatch)
    llm.generate([prompt], params, detokenize=False)
    # Plan, Forward, Bitmask, Sample, Collect, six steps of one token each. Plans with nothing
    # to run (while the grammar compiles) come first; the last step is settled by a turn whose
    # plan is empty, as the request's pending token already reaches max_tokens.
    steps = "P" + "".join(calls).lstrip("P")
    if constrained:
        assert steps == "PFBS" + "PFCBS" * 5 + "PC", steps
    else:
        assert steps == "PFS" + "PFSC" * 5 + "PC", steps
