"""Speculative decoding (engine_core/speculative.py): the config and its refusals, the n-gram
proposer and the acceptance rule against hand-worked cases, the scheduler's bookkeeping of a
drafted step (kept tokens, computed tokens moved back, no rejected KV in the prefix cache, every
block free at the end), and exactness: greedy requests give the non-speculative engine's tokens,
token for token, on the default model and on a tiny random one, beside requests that do not
speculate (sampled, penalties, logprobs, a constraint) and with stops and max_tokens mid-draft."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.llm import LLM, CompletionOutput
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from engine_core.speculative import (
    NgramProposer,
    SpeculativeConfig,
    accepted_run,
    latest_match,
)
from protocol.messages import Constraint, ConstraintKind, FinishReason, SamplingParams
from tests.factories import copy_tokenizer, write_eagle3_head, write_near_copy, write_tiny_llama

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "method 'eagle3'"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs a \"model\""),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "takes no \"model\""),
        ('{"method": "mtp", "model": "x", "num_speculative_tokens": 3}', "takes no \"model\""),
        ('{"method": "medusa", "num_speculative_tokens": 3}', "Medusa heads"),
        ('{"method": "bogus", "num_speculative_tokens": 3}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "extra": 1}', "unknown field 'extra'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 9}',
         "prompt_lookup_min"),
        ('{"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 1}',
         "method 'eagle3' takes no prompt_lookup_max"),
        ("not json", "not JSON"),
        ('{"method": "ngram"}', 'needs "num_speculative_tokens"'),
    ],
)  # fmt: skip
def test_a_bad_config_is_refused_naming_the_field(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=text)


@pytest.mark.parametrize(
    "spec",
    [
        '{"method": "draft_model", "model": "x", "num_speculative_tokens": 2}',
        '{"method": "eagle3", "model": "x", "num_speculative_tokens": 2}',
        '{"method": "mtp", "num_speculative_tokens": 1}',
    ],
)
def test_a_model_drafting_under_tensor_parallelism_is_refused_by_name(spec: str) -> None:
    """Only n-gram speculation runs at TP > 1 (tests/test_tensor_parallel.py runs it)."""
    method = json.loads(spec)["method"]
    with pytest.raises(ValueError, match=f"'{method}' with --tensor-parallel-size > 1"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)
    EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)  # n-gram is taken


# ---- the proposer and the acceptance rule --------------------------------------------------------


def proposer(k: int = 3, max_n: int = 3, min_n: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, max_n, min_n))


def test_the_longest_tail_that_occurred_before_proposes_what_followed_it() -> None:
    #          0  1  2  3  4  5  6  7  8
    tokens = [7, 1, 2, 3, 4, 9, 1, 2, 3]
    assert proposer().propose(tokens, 3) == [4, 9, 1]  # [1, 2, 3] occurred at 1
    assert proposer().propose(tokens, 1) == [4]
    assert proposer(min_n=2).propose([5, 6, 7, 8], 3) == []  # nothing repeats
    # The latest earlier occurrence wins: [1, 2] at 0 and at 3, then the tail.
    assert proposer(max_n=2).propose([1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]
    assert proposer().propose([4, 4, 4, 4], 3) == [4]  # a run: only what is known follows


def test_latest_match_never_returns_the_tail_itself() -> None:
    import numpy as np

    assert latest_match(np.array([3, 1, 2]), 2) == -1
    assert latest_match(np.array([1, 2, 1, 2]), 2) == 0


@pytest.mark.parametrize(
    ("drafts", "target", "kept"),
    [
        ((5, 6, 7), [5, 6, 7, 8], [5, 6, 7, 8]),  # every draft right: the bonus token too
        ((5, 6, 7), [5, 9, 7, 8], [5, 9]),  # the second is wrong: the target's token there
        ((5, 6, 7), [4, 6, 7, 8], [4]),  # the first is wrong: one token, as without drafts
    ],
)
def test_the_kept_run_is_the_agreed_drafts_and_the_targets_next(
    drafts: tuple[int, ...], target: list[int], kept: list[int]
) -> None:
    assert accepted_run(drafts, target) == kept


# ---- the scheduler's bookkeeping -----------------------------------------------------------------


class ListProposer:
    """Proposes whatever the test set, at most k of it."""

    max_drafts = 4

    def __init__(self) -> None:
        self.next: list[int] = []

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return self.next[:k]


def drafted_scheduler(num_blocks: int = 32) -> tuple[Scheduler, ListProposer]:
    config = EngineConfig(block_size=4, speculative_config=NGRAM).with_max_num_seqs(large_gpu=False)
    fake = ListProposer()
    return Scheduler(config, num_blocks, 256, (0,), proposer=fake), fake


def greedy(request_id: str, prompt: list[int], **params: object) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0, **params))


def test_a_drafted_step_keeps_the_agreed_tokens_and_moves_back_what_was_rejected() -> None:
    scheduler, fake = drafted_scheduler()
    request = greedy("r", [10, 11, 12, 13, 14], max_tokens=20)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), [20])  # the prefill: token 20
    fake.next = [21, 22, 23]
    plan = scheduler.schedule()
    (row,) = plan.scheduled
    assert (row.start, row.num_new_tokens, row.drafts) == (5, 4, (21, 22, 23))
    assert plan.num_batched_tokens == 4
    # The target agrees with 21, disagrees at 22 (it says 30): 21 and 30 are the output.
    (event,) = scheduler.update_from_output(plan, [99], [[21, 30, 77]])
    assert event.new_token_ids == [21, 30]
    assert request.token_ids == [10, 11, 12, 13, 14, 20, 21, 30]
    assert request.num_computed_tokens == 7  # through 21; 30's KV comes next step
    fake.next = []
    plan = scheduler.schedule()
    assert (plan.scheduled[0].start, plan.scheduled[0].num_new_tokens) == (7, 1)
    # Block 1 (positions 4..7) held 22's KV at position 7, where the output has 30: a prompt
    # of the kept tokens may reuse block 0 only, never that block.
    twin = greedy("twin", [10, 11, 12, 13, 14, 20, 21, 30, 1], max_tokens=2)
    scheduler.add_request(twin)
    scheduler.schedule()
    assert twin.num_cached_tokens == 4


def test_every_draft_right_gives_the_bonus_token() -> None:
    scheduler, fake = drafted_scheduler()
    request = greedy("r", [10, 11, 12], max_tokens=20)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), [20])
    fake.next = [21, 22]
    (event,) = scheduler.update_from_output(scheduler.schedule(), [23], [[21, 22]])
    assert event.new_token_ids == [21, 22, 23]
    assert request.num_computed_tokens == 6  # 10 11 12 20 21 22


def test_a_stop_or_the_length_limit_inside_the_run_ends_it_there() -> None:
    scheduler, fake = drafted_scheduler()
    stops = greedy("stop", [10, 11], max_tokens=20, stop_token_ids=(22,))
    short = greedy("short", [40, 41], max_tokens=3)
    for request in (stops, short):
        scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), [20, 50])
    fake.next = [21, 22, 23]
    plan = scheduler.schedule()
    # max_tokens 3 with one token out: at most one draft, so the run fits the limit.
    assert [len(s.drafts) for s in plan.scheduled] == [3, 1]
    events = scheduler.update_from_output(plan, [24, 52], [[21, 22, 23], [21]])
    by_id = {e.request.request_id: e for e in events}
    assert (by_id["stop"].new_token_ids, by_id["stop"].finish_reason) == (
        [21, 22],
        FinishReason.STOP,
    )
    assert (by_id["short"].new_token_ids, by_id["short"].finish_reason) == (
        [21, 52], FinishReason.LENGTH,
    )  # fmt: skip
    assert scheduler.block_manager.num_used_blocks == 0


def test_which_requests_speculate() -> None:
    """Sampling, penalties, logprobs and grammars apply at every drafted position as at a plain
    step; only requests that score or pool their prompt plan their chunks apart."""
    scheduler, fake = drafted_scheduler()
    constraint = Constraint(ConstraintKind.REGEX, "[a-z]+")
    requests = {
        "sampled": Request("s", [10, 11], SamplingParams(temperature=0.8, max_tokens=9)),
        "penalised": greedy("p", [10, 11], max_tokens=9, repetition_penalty=1.2),
        "min_tokens": greedy("m", [10, 11], max_tokens=9, min_tokens=3),
        "logprobs": greedy("l", [10, 11], max_tokens=9, logprobs=0),
        "constraint": greedy("c", [10, 11], max_tokens=9, constraint=constraint),
        "prompt logprobs": greedy("q", [10, 11], max_tokens=9, prompt_logprobs=0),
    }
    assert {name: r.speculates for name, r in requests.items()} == {
        "sampled": True,
        "penalised": True,
        "min_tokens": True,
        "logprobs": True,
        "constraint": True,
        "prompt logprobs": False,
    }
    for name in ("sampled", "penalised", "prompt logprobs"):
        scheduler.add_request(requests[name])
    scheduler.update_from_output(scheduler.schedule(), [20, 20, 20])
    fake.next = [21, 22]
    drafted = {s.request.request_id: s.drafts for s in scheduler.schedule().scheduled}
    assert drafted == {"s": (21, 22), "p": (21, 22), "q": ()}


# ---- exactness through the engine ----------------------------------------------------------------

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


def chat_ids(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = llm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def default_pair() -> tuple[LLM, LLM]:
    options = {"device": "cpu", "max_model_len": 1024, "num_kv_blocks": 256}
    return LLM("default", **options), LLM("default", speculative_config=NGRAM, **options)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def assert_same_logprobs(want: CompletionOutput, got: CompletionOutput) -> None:
    """Every token's logprobs, drafted or not, are the plain engine's (to float rounding)."""
    assert len(got.logprobs) == len(got.token_ids)
    assert [lp.top_token_ids for lp in got.logprobs] == [lp.top_token_ids for lp in want.logprobs]
    # float32 products over a verify step's rows and over one row round apart in the last bits,
    # which grow through the layers with the logprob's size (1.07e-4 at -1.79 at AVX2).
    assert [lp.logprob for lp in got.logprobs] == pytest.approx(
        [lp.logprob for lp in want.logprobs], rel=1e-4, abs=1e-4
    )


@pytest.mark.slow
def test_outputs_are_the_same_with_drafts_beside_requests_that_do_not_speculate(
    default_pair: tuple[LLM, LLM],
) -> None:
    plain, spec = default_pair
    prompt = chat_ids(plain, f"Rename add to plus and print the whole code:\n{CODE}")
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    params = [
        SamplingParams(max_tokens=48, temperature=0.0),
        SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(28,)),  # ")" stops it
        SamplingParams(max_tokens=7, temperature=0.0),  # max_tokens falls inside a run
        SamplingParams(max_tokens=24, temperature=0.9, seed=5),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3),
        # Seeded draws at each drafted position are the plain step's draws there, penalties
        # counting only the tokens before it: the same tokens, not just the same distribution.
        SamplingParams(
            max_tokens=32,
            temperature=0.7,
            seed=11,
            top_k=40,
            top_p=0.95,
            repetition_penalty=1.1,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            min_tokens=8,
            logit_bias=((28, 2.0),),
        ),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.0, constraint=constraint),
    ]
    want = plain.generate([prompt] * len(params), params, detokenize=False)
    got = spec.generate([prompt] * len(params), params, detokenize=False)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    for w, g in zip(want[6:8], got[6:8], strict=True):
        assert_same_logprobs(w, g)
    scheduler = spec.engine.scheduler
    assert scheduler.counts().spec_accepted_tokens > 0  # the greedy requests did take drafts
    assert scheduler.block_manager.num_used_blocks == 0


ITEMS = [{"name": "pen", "price": 2}, {"name": "ink", "price": 5}, {"name": "pad", "price": 3}]
ITEMS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "price": {"type": "integer"}},
        "required": ["name", "price"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow
def test_a_constrained_request_keeps_drafts_its_grammar_allows(
    default_pair: tuple[LLM, LLM],
) -> None:
    """JSON that repeats the prompt's: the drafts come from the prompt, the grammar's mask at
    each drafted position is the one after the drafts before it, and the output is the
    non-speculative one (greedy and seeded), valid against the schema."""
    plain, spec = default_pair
    prompt = chat_ids(plain, f"Copy this JSON list exactly:\n{json.dumps(ITEMS)}")
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ITEMS_SCHEMA))
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, constraint=constraint),
        SamplingParams(max_tokens=60, temperature=0.8, seed=2, constraint=constraint),
    ]
    accepted_before = spec.engine.scheduler.counts().spec_accepted_tokens
    want = plain.generate([prompt] * 2, params)
    got = spec.generate([prompt] * 2, params)
    assert spec.engine.scheduler.counts().spec_accepted_tokens - accepted_before > 10
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    jsonschema.validate(json.loads(got[0].text), ITEMS_SCHEMA)
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_aborting_requests_with_drafts_in_flight_frees_every_block(
    default_pair: tuple[LLM, LLM],
) -> None:
    _, spec = default_pair
    engine = spec.engine
    prompt = chat_ids(spec, f"Print this code again, unchanged:\n{CODE}")
    requests = [greedy(f"abort-{i}", prompt, max_tokens=200) for i in range(3)]
    abort_two_of_three_with_drafts_in_flight(engine, requests, min_drafts=3)


def abort_two_of_three_with_drafts_in_flight(
    engine: EngineCore, requests: list[Request], min_drafts: int
) -> None:
    """Run three requests until ``min_drafts`` more rows have drafted, abort the first and the
    last, let the middle one finish: every block is free again and the pool is whole."""
    drafted_before = engine.scheduler.counts().spec_drafts
    for request in requests:
        engine.add_request(request)
    while engine.scheduler.counts().spec_drafts - drafted_before < min_drafts:
        engine.step()
    engine.abort([requests[0].request_id, requests[2].request_id])
    while engine.has_unfinished():  # the one left finishes while the others' blocks go back
        engine.step()
    engine.scheduler.block_manager.check_integrity()
    assert engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_a_tiny_random_model_gives_the_same_tokens(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A random model falls into loops, which prompt lookup then drafts from."""
    options = {"device": "cpu", "max_model_len": 512, "num_kv_blocks": 128, "block_size": 4}
    plain = LLM(str(tiny_model_dir), **options)
    spec = LLM(str(tiny_model_dir), speculative_config=NGRAM, **options)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300], list(range(1000, 1040))]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    want = plain.generate(prompts, params, detokenize=False)
    got = spec.generate(prompts, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.counts().spec_accepted_tokens > 0
    # A prompt sharing a prefix with an earlier one: the prefix cache holds only right tokens.
    again = spec.generate([prompts[2] + want[2].token_ids[:30]], params, detokenize=False)
    fresh = plain.generate([prompts[2] + want[2].token_ids[:30]], params, detokenize=False)
    assert again[0].token_ids == fresh[0].token_ids
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


# ---- through a server --------------------------------------------------------------------------


def eagle3_pair(folder: Path, tokenizer_dir: Path, prompt: list[int]) -> tuple[Path, Path]:
    """A 4-layer random Llama with ``tokenizer_dir``'s tokenizer, and a random EAGLE-3 head
    whose two draft ids map (d2t) to the two tokens the target's greedy output on ``prompt``
    holds most, so that some of its drafts are kept."""
    from collections import Counter

    target = write_tiny_llama(folder / "target", vocab_size=49152, num_layers=4)
    copy_tokenizer(tokenizer_dir, target)
    plain = LLM(str(target), device="cpu", max_model_len=512, num_kv_blocks=128)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    output = plain.generate([prompt], params, detokenize=False)[0].token_ids
    common = [token for token, _ in Counter(output).most_common(2)]
    d2t = torch.tensor(common) - torch.arange(len(common))
    return target, write_eagle3_head(folder / "head", 49152, d2t)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_a_speculating_server_streams_the_same_text_and_counts_its_drafts(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, method: str
) -> None:
    """Whole, streamed, n = 2 and cut by a stop string inside a drafted run: the plain
    engine's text; /metrics counts the drafts. The draft model is a near copy of the target;
    the EAGLE-3 head a random one beside a 4-layer target."""
    import openai

    from tests.server_fixture import start_server, stop_server, wait_engine_idle

    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "default"]
    config, model = NGRAM, tiny_model_dir
    prompt = [5, 6, 7, 8, 5, 6, 7]
    if method == "draft_model":
        near = write_near_copy(tmp_path_factory.mktemp("near") / "draft", tiny_model_dir)
        config = json.dumps({"model": str(near), "num_speculative_tokens": 4})
    elif method == "eagle3":
        model, head = eagle3_pair(tmp_path_factory.mktemp("eagle3"), tiny_model_dir, prompt)
        config = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    srv = start_server(
        tmp_path_factory.mktemp("serve-spec"), model=str(model),
        args=[*args, "--speculative-config", config],
    )  # fmt: skip
    try:
        plain = LLM(str(model), device="cpu", max_model_len=512, num_kv_blocks=128)
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        plain_out = plain.generate([prompt], params)[0]
        want = plain_out.text
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        greedy_body = {"model": "default", "prompt": prompt, "max_tokens": 60, "temperature": 0}
        extra = {"ignore_eos": True}
        whole = client.completions.create(**greedy_body, extra_body=extra)
        assert whole.choices[0].text == want
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(**greedy_body, stream=True, extra_body=extra)
        )
        assert streamed == want
        both = client.completions.create(**greedy_body, n=2, extra_body=extra)
        assert [c.text for c in both.choices] == [want, want]
        stop = want[len(want) // 2 : len(want) // 2 + 3]  # a stop string inside a drafted run
        cut = client.completions.create(**greedy_body, stop=[stop], logprobs=1, extra_body=extra)
        assert cut.choices[0].text == want[: want.index(stop)]
        # Its tokens end with the one whose text completes the stop string, as generated one
        # at a time: the drafts accepted after it in the same run are not output.
        ids = plain_out.token_ids
        text_of = lambda n: plain.tokenizer.decode(ids[:n], skip_special_tokens=True)  # noqa: E731
        upto = next(n for n in range(1, len(ids) + 1) if stop in text_of(n))
        assert cut.usage.completion_tokens == upto
        assert len(cut.choices[0].logprobs.tokens) == upto
        wait_engine_idle(srv)  # every KV block free, the integrity check passing

        values = counters_once_drafts_counted(srv.base_url)
        drafted = values["tandem_spec_decode_num_draft_tokens_total"]
        assert 0 < values["tandem_spec_decode_num_accepted_tokens_total"] <= drafted
        assert values["tandem_spec_decode_num_drafts_total"] > 0
        # A request's timings carry its own drafts: the four that ran to their length (the last
        # was aborted at its stop string, and an aborted request reports no timings).
        assert values["tandem_request_spec_decode_acceptance_rate_count"] == 4
        assert 0 < values["tandem_request_spec_decode_acceptance_rate_sum"] <= 4
    finally:
        stop_server(srv)


# ---- sampled requests: the target's distribution -------------------------------------------------

VOCAB = 16


def counters_once_drafts_counted(base_url: str) -> dict[str, float]:
    """The server's /metrics samples by name, read once its draft count is above 0 (the
    engine's counts come with its stats, each second; 10 s at most)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def counters() -> dict[str, float]:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        families = text_string_to_metric_families(text)
        return {s.name: s.value for family in families for s in family.samples}

    deadline = time.monotonic() + 10
    while (values := counters())["tandem_spec_decode_num_draft_tokens_total"] == 0:
        assert time.monotonic() < deadline, "no drafts counted"
        time.sleep(0.2)
    return values


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` [V] against ``probs`` [V]; categories expecting fewer than
    5 draws are pooled into one, as the test's approximation needs."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic.double() / 2))


def target_marginals(path: Path, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's distributions of the second and third output tokens at temperature 1, summed over
    the tokens before them: [V] each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1, :VOCAB]
        return logits.softmax(dim=-1).double()  # [len(contexts), V]

    first = next_probs([prompt])[0]  # [V]
    second = next_probs([[*prompt, a] for a in range(VOCAB)])  # [V, V]: row a, token b
    pairs = [[*prompt, a, b] for a in range(VOCAB) for b in range(VOCAB)]
    third = next_probs(pairs).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None] * second  # [V, V]
    return joint.sum(dim=0), (joint[:, :, None] * third).sum(dim=(0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_sampled_tokens_follow_the_targets_distribution(tmp_path: Path, method: str) -> None:
    """Drafts on a 16-token random model: the second and third output tokens of 3,000 unseeded
    requests match HF's distribution by a chi-square test, and drafts were checked and some
    kept on the way. ``ngram``: every token occurs in the prompt, so a draft follows almost
    every token; ``draft_model``: a near copy of the target (its weights plus noise) drafts
    greedily at every step; ``eagle3``: a random EAGLE-3 head over the even ids (a draft
    vocabulary of 8, d2t) drafts from a 4-layer target's hidden states at every step."""
    layers = 4 if method == "eagle3" else 2  # EAGLE-3 reads three layers' inputs
    target = write_tiny_llama(tmp_path / "target", vocab_size=VOCAB, num_layers=layers)
    prompt = [*range(VOCAB), *range(VOCAB - 1, -1, -1), 5]
    drafts: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        drafts["prompt_lookup_min"] = 1
    elif method == "eagle3":
        d2t = torch.arange(0, VOCAB, 2) - torch.arange(VOCAB // 2)
        drafts["model"] = str(write_eagle3_head(tmp_path / "head", VOCAB, d2t))
    else:
        drafts["model"] = str(write_near_copy(tmp_path / "draft", target))
    llm = LLM(
        str(target),
        device="cpu",
        max_model_len=64,
        num_kv_blocks=4096,
        block_size=4,
        max_num_seqs=256,
        speculative_config=json.dumps(drafts),
    )
    try:
        params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
        outputs = llm.generate([prompt] * 3000, params, detokenize=False)
        counts = llm.engine.scheduler.counts()
    finally:
        llm.engine.shutdown()
    second, third = target_marginals(target, prompt)
    for position, probs in ((1, second), (2, third)):
        drawn = torch.tensor([o.token_ids[position] for o in outputs])
        observed = torch.bincount(drawn, minlength=VOCAB).double()
        assert chi_square_p_value(observed, probs) > 1e-3, position
    assert counts.spec_draft_tokens > 3000 and counts.spec_accepted_tokens > 300
