"""Prefix-cache hits on Qwen3-Next (linear-attention layers) through saved states, on the CPU
against HF transformers: a tiny random ``Qwen3NextForCausalLM`` written with ``save_pretrained``
(the one of tests/test_models_qwen3_next.py). A request extending an earlier prompt (another
turn of a chat, or a prompt sharing a long prompt's first chunk) resumes at the state saved
there: HF's greedy tokens, its hit counted, and only the tokens after the hit computed (the
scheduler's step-token count, beside the hit count). An evicted state shortens the hit; the
sampled tokens' logprobs match a miss's; preemption and aborts leave no block, slot or saved
state unaccounted for."""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_core.args import add_engine_args, engine_config_from_args
from engine_core.config import EngineConfig
from engine_core.llm import LLM
from engine_core.model_runner import copy_state_rows
from engine_core.request import Request
from engine_core.state_snapshots import independent_runs
from protocol.messages import SamplingParams
from tests.paged_harness import hf_greedy
from tests.test_models_qwen3_next import NEW_TOKENS, VOCAB, make_llm, qwen3_next

__all__ = ["qwen3_next"]  # the module-scoped HF model fixture, shared with that file


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def roomy(qwen3_next: tuple[Path, torch.nn.Module]) -> Iterator[LLM]:
    """Room for every block and state these tests make; a budget of 64 tokens a step, so a
    150-token prompt comes in chunks ending at 64 and 128 (block boundaries: states saved)."""
    llm = make_llm(qwen3_next[0], num_kv_blocks=256, max_num_batched_tokens=64, state_snapshots=16)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tight(qwen3_next: tuple[Path, torch.nn.Module]) -> Iterator[LLM]:
    """Two saved states, 40 blocks: evictions and preemptions."""
    llm = make_llm(
        qwen3_next[0], num_kv_blocks=40, max_num_batched_tokens=64, state_snapshots=2,
        max_num_seqs=3,
    )  # fmt: skip
    yield llm
    llm.engine.shutdown()


def run(llm: LLM, tokens: list[int], logprobs: int | None = None) -> tuple[list[int], int, int]:
    """(output tokens, prefix-hit tokens, tokens computed) of one request run alone."""
    before = llm.engine.scheduler.counts()
    out = llm.generate([tokens], greedy(logprobs), detokenize=False)[0]
    after = llm.engine.scheduler.counts()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return out.token_ids, hits, after.step_tokens_sum - before.step_tokens_sum


def hf_tokens(hf_model: torch.nn.Module, tokens: list[int]) -> list[int]:
    return hf_greedy(hf_model, tokens, NEW_TOKENS).tokens[0]


def check_all_given_back(llm: LLM, slots: int) -> None:
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()  # also: every saved state free or cached under one hash
    assert bm.num_used_blocks == 0
    assert bm.num_free_state_slots == bm.num_state_slots == slots


def test_later_turns_and_shared_first_chunks_resume_at_a_saved_state(
    qwen3_next: tuple[Path, torch.nn.Module], roomy: LLM
) -> None:
    """Turn 1 (150 tokens, chunks of 64) saves states at 64, 128 and 144 (its last block
    boundary before its last token), and at 160 as its answer's decode reaches it. Turn 2
    (turn 1, its answer, new text) resumes at 160, inside the answer; a prompt sharing only
    turn 1's first 130 tokens resumes at 128. Each computes only the tokens after its hit (and
    a token per decode step) and gives HF's tokens."""
    _, hf_model = qwen3_next
    first = prompt(150, seed=1)
    answer, hits, _ = run(roomy, first)
    assert answer == hf_tokens(hf_model, first) and hits == 0
    for tokens, want_hit in (
        (first + answer + prompt(20, seed=2), 160),
        (first[:130] + prompt(25, seed=3), 128),
    ):
        got, hits, computed = run(roomy, tokens)
        assert got == hf_tokens(hf_model, tokens)
        assert hits == want_hit
        assert computed == len(tokens) - want_hit + NEW_TOKENS - 1
    check_all_given_back(roomy, 4)


def test_next_turns_resume_inside_long_answers_as_cold_runs_would(
    qwen3_next: tuple[Path, torch.nn.Module], roomy: LLM
) -> None:
    """Three first turns of 100 tokens, batched, answer 40 each: their decode saves states at
    112 and 128 (three in one step, the first of each demoted for the second). The next turns
    (a first turn, its answer, 10 new tokens), batched, resume at 128, 28 tokens into the
    answer, and compute only what follows; their tokens are HF's and, with their logprobs,
    those of cold runs (prompt logprobs asked: no prefix hit)."""
    _, hf_model = qwen3_next
    firsts = [prompt(100, seed=11 + i) for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    answers = [o.token_ids for o in roomy.generate(firsts, params, detokenize=False)]
    assert answers == [hf_greedy(hf_model, first, 40).tokens[0] for first in firsts]
    pairs = enumerate(zip(firsts, answers, strict=True))
    turns = [first + answer + prompt(10, seed=21 + i) for i, (first, answer) in pairs]
    counts = roomy.engine.scheduler.counts
    before = counts()
    hits = roomy.generate(turns, greedy(2), detokenize=False)
    between = counts()
    cold_params = dataclasses.replace(greedy(2), prompt_logprobs=0)
    colds = roomy.generate(turns, cold_params, detokenize=False)
    after = counts()
    assert between.prefix_cache_hits - before.prefix_cache_hits == 3 * 128
    assert after.prefix_cache_hits == between.prefix_cache_hits
    computed = [
        b.step_tokens_sum - a.step_tokens_sum for a, b in ((before, between), (between, after))
    ]
    decodes = 3 * (NEW_TOKENS - 1)
    assert computed == [3 * (len(turns[0]) - 128) + decodes, 3 * len(turns[0]) + decodes]
    for turn, hit, cold in zip(turns, hits, colds, strict=True):
        assert hit.token_ids == cold.token_ids == hf_tokens(hf_model, turn)
        for a, b in zip(hit.logprobs, cold.logprobs, strict=True):
            assert a.top_token_ids == b.top_token_ids
            # float32, the two cut into other chunks and batches: sums in another order
            torch.testing.assert_close(
                torch.tensor([a.logprob, *a.top_logprobs]),
                torch.tensor([b.logprob, *b.top_logprobs]),
                atol=1e-4,
                rtol=1e-5,
            )
    check_all_given_back(roomy, 4)


def test_a_hit_gives_the_logprobs_of_a_miss(
    qwen3_next: tuple[Path, torch.nn.Module], roomy: LLM
) -> None:
    """The same 70-token prompt twice: the second resumes at 64 from the first's saved state,
    and its tokens' logprobs (and top 3) are the miss's within float tolerance."""
    tokens = prompt(70, seed=4)
    counts = roomy.engine.scheduler.counts
    before = counts().prefix_cache_hits
    miss = roomy.generate([tokens], greedy(3), detokenize=False)[0]
    assert counts().prefix_cache_hits == before
    hit = roomy.generate([tokens], greedy(3), detokenize=False)[0]
    assert counts().prefix_cache_hits - before == 64
    assert hit.token_ids == miss.token_ids
    for a, b in zip(hit.logprobs, miss.logprobs, strict=True):
        assert a.top_token_ids == b.top_token_ids
        torch.testing.assert_close(
            torch.tensor([a.logprob, *a.top_logprobs]), torch.tensor([b.logprob, *b.top_logprobs])
        )


def test_an_evicted_state_gives_a_shorter_hit(
    qwen3_next: tuple[Path, torch.nn.Module], tight: LLM
) -> None:
    """Two saved states. X (145 tokens) saves at 64, 128, 144 (64's dropped); Y (X's first 140
    tokens, new text: 145) resumes at 128 and saves at its own 144, dropping X's 144 (128 was
    used since). X extended still finds its attention blocks cached up to 144 but resumes at
    128. (A 145-token prompt's 16-token answer starts no decode step on a block boundary:
    decode saves are tests/test_kv_groups.py's and the next test's.)"""
    _, hf_model = qwen3_next
    bm = tight.engine.scheduler.block_manager
    assert bm.snapshots is not None
    x = prompt(145, seed=5)
    evicted = bm.snapshots.num_evicted
    run(tight, x)
    got, hits, _ = run(tight, x[:140] + prompt(5, seed=6))
    assert hits == 128
    assert bm.snapshots.num_evicted - evicted == 2
    extended = x + prompt(20, seed=7)
    got, hits, computed = run(tight, extended)
    assert got == hf_tokens(hf_model, extended)
    assert hits == 128 and computed == len(extended) - 128 + NEW_TOKENS - 1
    check_all_given_back(tight, 3)


def test_preemptions_and_aborts_leak_nothing(
    qwen3_next: tuple[Path, torch.nn.Module], tight: LLM
) -> None:
    """A request aborted mid-prompt (its state saved at 64), then three requests sharing its
    first 70 tokens, too many for 40 blocks at once (preempted, readmitted with hits): HF's
    tokens, and every block, slot and saved state accounted for after. (The sync loop's
    preemptions with states saved: tests/test_models_qwen3_next.py.)"""
    _, hf_model = qwen3_next
    engine = tight.engine
    shared = prompt(70, seed=8)
    prompts = [shared + prompt(200, seed=10 + i) for i in range(3)]
    preemptions = engine.scheduler.counts().preemptions
    engine.add_request(Request("gone", shared + prompt(120, seed=9), greedy()))
    for _ in range(2):
        engine.step()
    engine.abort(["gone"])
    got = tight.generate(prompts, greedy(), detokenize=False)
    assert [o.token_ids for o in got] == [hf_tokens(hf_model, p) for p in prompts]
    assert engine.scheduler.counts().preemptions > preemptions
    check_all_given_back(tight, 3)


def test_the_pool_follows_prefix_caching_and_a_useless_one_is_refused() -> None:
    """As many saved states as running sequences by default, none without prefix caching
    (``--no-enable-prefix-caching`` turns both off); a pool asked for beside it, or negative,
    is refused by name."""
    assert EngineConfig(max_num_seqs=6).num_state_snapshots() == 6
    assert EngineConfig(max_num_seqs=6, state_snapshots=0).num_state_snapshots() == 0
    assert EngineConfig(enable_prefix_caching=False).num_state_snapshots() == 0
    for bad in ({"state_snapshots": 4, "enable_prefix_caching": False}, {"state_snapshots": -1}):
        with pytest.raises(ValueError, match="--state-snapshots"):
            EngineConfig(**bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "--state-snapshots" in parser.format_help()
    flags = parser.parse_args(["--state-snapshots", "3"])
    assert engine_config_from_args(flags).num_state_snapshots() == 3


def test_a_plans_state_copies_made_in_runs_land_as_one_by_one() -> None:
    """Random plans of saves and restores among 4 slots and 6 saved rows (decode saves of many
    requests, then restores reading some of them, a slot saved and restored into): copied in
    ``independent_runs`` (gathers and scatters where a run is long) the rows end as copies
    made one by one in plan order would leave them."""
    rng = random.Random(0)
    for _ in range(50):
        moves = []
        for _ in range(rng.randint(1, 10)):
            slot, saved = rng.randrange(4), 4 + rng.randrange(6)
            moves.append((slot, saved) if rng.random() < 0.6 else (saved, slot))
        tensors = [torch.randn(10, 3, 2), torch.randn(10, 5)]
        want = [t.clone() for t in tensors]
        for src, dst in moves:
            for tensor in want:
                tensor[dst] = tensor[src].clone()
        runs = independent_runs(moves)
        assert [m for run in runs for m in run] == moves
        for run in runs:
            copy_state_rows(tensors, run)
        for got, expected in zip(tensors, want, strict=True):
            assert torch.equal(got, expected), moves
    # a row read and then written is no conflict; one written then read, or written twice, is
    pairs = [(0, 4), (4, 1), (2, 5), (5, 3), (1, 6), (3, 6)]
    assert independent_runs(pairs) == [[(0, 4)], [(4, 1), (2, 5)], [(5, 3), (1, 6)], [(3, 6)]]
