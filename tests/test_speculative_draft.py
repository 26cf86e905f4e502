"""Speculative decoding with a draft model (engine_core/draft_model.py): its config and refusals,
and exactness through the engine. Greedy and seeded requests give the non-speculative engine's
tokens, token for token, beside sampled, penalised and logprob requests, with stops and
max_tokens inside a drafted run, after preemptions and prefix-cache hits, and every block free
at the end. Two drafts on a tiny random Llama: the target itself, whose drafts the target must
keep every time (so the draft's KV cache must be right wherever the target's is, which a stale
or misplaced draft cache would break), and a near copy of it (weights plus noise), which is
right about half the time, so drafts are kept and rejected in the same runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.draft_model import check_same_tokenizer
from engine_core.llm import LLM
from engine_core.request import Request
from engine_core.scheduler import PLACEHOLDER, Scheduler
from engine_core.speculative import DraftRow, SpeculativeConfig
from protocol.messages import Constraint, ConstraintKind, SamplingParams
from tests.factories import write_near_copy, write_tiny_llama
from tests.test_speculative import (
    ITEMS,
    ITEMS_SCHEMA,
    abort_two_of_three_with_drafts_in_flight,
    assert_same_logprobs,
)

K = 4
OPTIONS = {"device": "cpu", "max_model_len": 512, "num_kv_blocks": 128, "block_size": 4}


def draft_config(model: Path | str, k: int = K) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k})


# ---- config --------------------------------------------------------------------------------------


def test_the_peers_spellings_of_a_draft_model() -> None:
    bare = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}')
    named = SpeculativeConfig.parse(draft_config("/m", 3))
    assert bare == named == SpeculativeConfig("draft_model", 3, model="/m")


def test_a_draft_of_another_vocabulary_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    other = write_tiny_llama(tmp_path / "draft", vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size 256 differs from the target's 49152"):
        LLM(str(tiny_model_dir), speculative_config=draft_config(other), **OPTIONS)


def test_a_missing_draft_is_named_as_the_speculative_configs(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    missing = tmp_path / "no-such-draft"
    words = f"--speculative-config draft model: model path not found: {missing}"
    with pytest.raises(FileNotFoundError, match=words):
        LLM(str(tiny_model_dir), speculative_config=draft_config(missing), **OPTIONS)


def test_a_draft_with_a_shorter_context_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    short = write_tiny_llama(tmp_path / "draft", vocab_size=49152, max_positions=128)
    with pytest.raises(ValueError, match="reaches 128 positions, fewer than --max-model-len 512"):
        LLM(str(tiny_model_dir), speculative_config=draft_config(short), **OPTIONS)


def test_a_target_with_sliding_window_layers_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
    )  # fmt: skip
    MistralForCausalLM(config).save_pretrained(tmp_path / "windowed")
    roomy = {**OPTIONS, "num_kv_blocks": 256}  # a window group's pool holds its null block too
    with pytest.raises(ValueError, match="the target has sliding-window or chunked attention"):
        LLM(str(tmp_path / "windowed"), speculative_config=draft_config(tiny_model_dir), **roomy)
    with pytest.raises(ValueError, match="only a text model whose layers all attend to the full"):
        LLM(str(tiny_model_dir), speculative_config=draft_config(tmp_path / "windowed"), **OPTIONS)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    def folder(name: str, words: list[str]) -> Path:
        (tmp_path / name).mkdir()
        vocab = {word: i for i, word in enumerate(words)}
        Tokenizer(WordLevel(vocab, unk_token=words[0])).save(
            str(tmp_path / name / "tokenizer.json")
        )
        return tmp_path / name

    target = folder("target", ["<unk>", "a", "b", "c"])
    check_same_tokenizer(target, folder("same", ["<unk>", "a", "b", "c"]))  # passes
    with pytest.raises(ValueError, match="other ids than the target's"):
        check_same_tokenizer(target, folder("swapped", ["<unk>", "b", "a", "c"]))


def test_speculation_with_a_draft_and_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(speculative_config=draft_config("/m"), tensor_parallel_size=2)


# ---- the scheduler's side: slots reserved, then one batched proposal ----------------------------


class RecordingProposer:
    """A BatchProposer that records its rows and proposes 50 + i for each row's i-th draft."""

    max_drafts = 3

    def __init__(self) -> None:
        self.rows: list[DraftRow] = []

    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        self.rows = rows
        return [[50 + i for i in range(row.count)] for row in rows]


def test_the_scheduler_reserves_the_verify_slots_then_asks_once_for_every_row() -> None:
    config = EngineConfig(block_size=4, speculative_config=draft_config("/m", 3)).with_max_num_seqs(
        large_gpu=False
    )
    proposer = RecordingProposer()
    scheduler = Scheduler(config, 32, 256, (0,), proposer=proposer)
    long = Request("long", [10, 11, 12], SamplingParams(temperature=0.0, max_tokens=20))
    short = Request("short", [20, 21, 22, 23], SamplingParams(temperature=0.0, max_tokens=3))
    for request in (long, short):
        scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), [30, 40])  # the prefills
    plan = scheduler.schedule()
    table = scheduler.block_manager.block_table
    # "short" has 1 of 3 tokens: room for 1 draft; each row's table covers its verify chunk
    # (its last token at 3 or 4 and the drafts after it: positions up to 6 and 5).
    rows = [(r.token, r.position, list(r.block_ids), r.count) for r in proposer.rows]
    assert rows == [(30, 3, list(table("long")), 3), (40, 4, list(table("short")), 1)]
    assert [len(table(r)) for r in ("long", "short")] == [2, 2]
    assert [(s.start, s.num_new_tokens, s.drafts) for s in plan.scheduled] == [
        (3, 4, (50, 51, 52)),
        (4, 2, (50,)),
    ]
    assert long.token_ids[3:] == [30, 50, 51, 52, PLACEHOLDER]
    events = scheduler.update_from_output(plan, [60, 61], [[50, 51, 99], [50]])
    assert [e.new_token_ids for e in events] == [[50, 51, 99], [50, 61]]
    assert long.num_computed_tokens == 6  # through draft 51; 99's KV comes next step
    assert scheduler.block_manager.num_used_blocks == 2  # "short" finished by its length


def test_the_draft_cache_takes_its_share_of_the_kv_memory(tiny_model_dir: Path) -> None:
    """On the CPU the KV budget is --kv-cache-memory-gb: a model drafting for itself doubles
    what a block id costs, so the pool holds half the blocks."""
    options = {"device": "cpu", "max_model_len": 512, "kv_cache_memory_gb": 0.01}
    plain = LLM(str(tiny_model_dir), **options)
    spec = LLM(str(tiny_model_dir), speculative_config=draft_config(tiny_model_dir), **options)
    # Per block of 16 tokens: 2 layers x K and V x 2 KV heads x head dim 16 x 4 bytes.
    block = 2 * 2 * 2 * 16 * 16 * 4
    assert plain.engine.runner.num_kv_blocks == int(0.01 * 2**30 // block)
    assert spec.engine.runner.num_kv_blocks == int(0.01 * 2**30 // (2 * block))


# ---- exactness through the engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, LLM]:
    near = write_near_copy(tmp_path_factory.mktemp("near") / "draft", tiny_model_dir)
    target = str(tiny_model_dir)
    return {
        "plain": LLM(target, **OPTIONS),
        "self": LLM(target, speculative_config=draft_config(tiny_model_dir), **OPTIONS),
        "near": LLM(target, speculative_config=draft_config(near), **OPTIONS),
    }


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300], list(range(10, 50))]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
JSON = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))


def counts_since(llm: LLM, before: tuple[int, int, int]) -> tuple[int, int, int]:
    c = llm.engine.scheduler.counts()
    now = (c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens)
    return tuple(a - b for a, b in zip(now, before, strict=True))  # type: ignore[return-value]


def test_the_target_as_its_own_draft_has_every_draft_kept(engines: dict[str, LLM]) -> None:
    """41 tokens: the prefill's, then 8 steps of 4 drafts and the target's token after them.
    Beside them a request of 8 tokens: 4 drafts, then 1 (its length limit), so it leaves the
    batched proposal after its first draft in its second drafted step."""
    plain, spec = engines["plain"], engines["self"]
    params = [SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)] * 3
    params.append(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    prompts = [*PROMPTS, [7, 7, 7, 9]]
    before = counts_since(spec, (0, 0, 0))
    want = plain.generate(prompts, params, detokenize=False)
    got = spec.generate(prompts, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert counts_since(spec, before) == (3 * 8 + 2, 3 * 8 * K + 5, 3 * 8 * K + 5)
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def assert_mixed_requests_give_plain_tokens(plain: LLM, spec: LLM, prompt: list[int]) -> None:
    """Greedy, seeded, penalised, biased, min_tokens, logprob, JSON-constrained and stop-id
    requests on one prompt: the speculating engine gives the plain engine's tokens, finish
    reasons and logprobs, keeps some drafts and rejects others, and frees every block."""
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # ends inside a run
        SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
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
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, constraint=JSON),
    ]
    want = plain.generate([prompt] * len(params), params, detokenize=False)
    # A stop id the greedy run meets at its 10th token: the run ends there, mid-draft or not.
    stop = SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(want[0].token_ids[9],))
    params.append(stop)
    want += plain.generate([prompt], [stop], detokenize=False)
    before = counts_since(spec, (0, 0, 0))
    got = spec.generate([prompt] * len(params), params, detokenize=False)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    for w, g in zip(want[5:7], got[5:7], strict=True):
        assert_same_logprobs(w, g)
    assert len(got[-1].token_ids) == 10
    _, drafted, kept = counts_since(spec, before)
    assert 0 < kept < drafted  # drafts were kept and rejected
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def assert_prefix_hits_give_plain_tokens(plain: LLM, spec: LLM, prompts: list[list[int]]) -> None:
    """Prompts that extend earlier ones by 21 of their outputs start from prefix-cache hits:
    the speculating engine's tokens are still the plain engine's, and no block is left held."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = spec.generate(prompts, params, detokenize=False)
    longer = [p + f.token_ids[:21] for p, f in zip(prompts, first, strict=True)]
    hits = spec.engine.scheduler.counts().prefix_cache_hits
    got = spec.generate(longer, params, detokenize=False)
    want = plain.generate(longer, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.counts().prefix_cache_hits > hits
    spec.engine.scheduler.block_manager.check_integrity()
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def test_a_draft_that_is_often_wrong_gives_the_same_tokens(engines: dict[str, LLM]) -> None:
    assert_mixed_requests_give_plain_tokens(engines["plain"], engines["near"], PROMPTS[2])


def test_preemption_and_prefix_hits_keep_the_draft_cache_right(tiny_model_dir: Path) -> None:
    """A pool too small for all three requests: the last admitted are preempted and recompute
    (the draft's KV with the target's); then prompts that extend earlier ones start from
    prefix-cache hits. The target drafting for itself still has every draft kept, so the
    draft's cache held the right KV at every position the target read from its own."""
    small = {**OPTIONS, "num_kv_blocks": 40, "max_model_len": 160}  # all 40 blocks
    plain = LLM(str(tiny_model_dir), **small)
    spec = LLM(str(tiny_model_dir), speculative_config=draft_config(tiny_model_dir), **small)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = plain.generate(PROMPTS, params, detokenize=False)
    got = spec.generate(PROMPTS, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.counts().preemptions > 0
    longer = [p + w.token_ids[:20] for p, w in zip(PROMPTS, want, strict=True)]
    counts = spec.engine.scheduler.counts()
    hits_before = counts.prefix_cache_hits
    before = (counts.spec_drafts, counts.spec_draft_tokens, counts.spec_accepted_tokens)
    again = spec.generate(longer, params, detokenize=False)
    fresh = plain.generate(longer, params, detokenize=False)
    assert [a.token_ids for a in again] == [f.token_ids for f in fresh]
    assert spec.engine.scheduler.counts().prefix_cache_hits > hits_before
    _, drafted, kept = counts_since(spec, before)
    assert kept == drafted > 0
    spec.engine.scheduler.block_manager.check_integrity()
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def test_aborting_requests_with_drafts_in_flight_frees_every_block(
    engines: dict[str, LLM],
) -> None:
    requests = [Request(f"abort-{i}", PROMPTS[i], SamplingParams(max_tokens=200)) for i in range(3)]
    abort_two_of_three_with_drafts_in_flight(engines["near"].engine, requests, min_drafts=6)


# ---- structured outputs on the default model ---------------------------------------------------


@pytest.mark.slow
def test_a_constrained_request_gives_the_same_tokens_with_the_default_model_drafting() -> None:
    """The default model drafts for itself, unconstrained: where the grammar masks the
    target's choice away from the draft's, the draft is rejected; the output is the plain
    engine's, greedy and seeded, with penalties and logprobs on."""
    options = {"device": "cpu", "max_model_len": 1024, "num_kv_blocks": 256}
    plain = LLM("default", **options)
    spec = LLM("default", speculative_config=draft_config("default"), **options)
    messages = [{"role": "user", "content": f"Copy this JSON list:\n{json.dumps(ITEMS)}"}]
    rendered = plain.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt = plain.tokenizer.encode(rendered, add_special_tokens=False)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ITEMS_SCHEMA))
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, constraint=constraint),
        SamplingParams(max_tokens=60, temperature=0.8, seed=2, constraint=constraint),
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            repetition_penalty=1.2,
            logprobs=2,
            constraint=constraint,
        ),  # fmt: skip
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=1),
    ]
    want = plain.generate([prompt] * len(params), params)
    got = spec.generate([prompt] * len(params), params)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        if w.logprobs:
            assert [lp.logprob for lp in g.logprobs] == pytest.approx(
                [lp.logprob for lp in w.logprobs], rel=1e-4, abs=1e-4
            )
    counts = spec.engine.scheduler.counts()
    assert 0 < counts.spec_accepted_tokens <= counts.spec_draft_tokens
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0
