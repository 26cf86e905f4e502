"""The start-up warm-up steps (engine_core/warm_up.py): they stay inside the step budget, the
rows and the KV cache, reach every sampler stage and shortcut, and change nothing a later
request generates.

On CUDA the runner runs them at start-up (their effect on the first token is measured on the
GPU: docs/design/cuda-graphs-and-warm-up.md, "The warm-up steps"); here the same steps run on
the CPU, called by hand, so that what they leave behind can be compared with an engine that
never ran them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_core.attention.base import (
    MIXED_DECODE_ROWS,
    ORDERED_DECODE_MIN_ROWS,
    SHARED_PREFIX_MIN_ROWS,
    SHARED_PREFIX_MIN_TOKENS,
    shared_prefix_tokens,
)
from engine_core.llm import LLM
from engine_core.memory_plan import ModelTooLargeError
from engine_core.request import SchedulerOutput
from engine_core.warm_up import StepLimits, warm_up_plans
from protocol.codec import MAX_LOGPROBS
from protocol.messages import SamplingParams
from tests.factories import write_tiny_llama

# Fields that stop a request or shape its output's length or text, not how a token is drawn;
# the structured-output constraint is the bitmask the runner passes beside the plan.
NOT_SAMPLER_STAGES = {"max_tokens", "stop_token_ids", "ignore_eos", "constraint"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-warm-up"))


LIMITS = [
    # budget, max_rows, max_model_len, block_size, num_blocks
    (8192, 256, 4096, 16, 100_000),  # the defaults: greedy prompts fill the rest
    (8192, 256, 2048, 16, 300),  # the cache holds fewer tokens than the budget
    (8192, 3, 4096, 16, 100_000),  # rows run out before the budget
    (40, 256, 64, 16, 100),  # a small budget: the first row takes most of it
    (20, 256, 64, 16, 100),
    (1, 1, 64, 32, 1),
    (100, 256, 64, 32, 2),  # two blocks of 32
    (8192, 256, 8, 4, 1000),  # prompts shorter than the sampler rows want
    (8192, 256, 2, 16, 1000),  # one-token prompts only
    (8192, 8, 260, 4, 72),  # just room for the shared-prefix decodes
    (8192, 7, 4096, 16, 100_000),  # a row short of them
    (8192, 256, 257, 4, 100_000),  # a token short
    (8192, 256, 4096, 16, 23),  # a block short
    (8192, 256, 512, 4, 96),  # test_warm_up_changes_no_later_token's engine
    (64, 16, 260, 4, 96),  # test_tensor_parallel.py's warm-up test's engine
]
SCORED_CHUNK = 512


def plans_for(limits: tuple[int, int, int, int, int]) -> list[SchedulerOutput]:
    return warm_up_plans(StepLimits(*limits, vocab_size=50), scored_chunk=SCORED_CHUNK)


def shared_steps(limits: tuple[int, int, int, int, int]) -> int:
    """How many steps of shared-prefix decodes ``limits`` hold, by hand: 8 rows with a context
    of the whole blocks of 256 tokens, one more token in a block of each row's own, and the
    token it samples (a decode step); a prompt beside them where a row, a token and a block
    are left; and 192 such rows alone where they fit."""
    budget, max_rows, max_model_len, block_size, num_blocks = limits
    blocks = -(-SHARED_PREFIX_MIN_TOKENS // block_size)
    context = blocks * block_size

    def fit(rows: int) -> bool:
        return (
            min(budget, max_rows) >= rows
            and context + 2 <= max_model_len
            and (blocks + rows <= num_blocks)
        )

    rows = SHARED_PREFIX_MIN_ROWS
    if not fit(rows):
        return 0
    beside = min(budget, max_rows) > rows and blocks + rows < num_blocks
    # Then as many as launch longest first, alone, where they fit.
    return 1 + beside + fit(ORDERED_DECODE_MIN_ROWS)


@pytest.mark.parametrize("limits", LIMITS)
def test_plans_stay_inside_the_step_and_the_cache(limits: tuple[int, int, int, int, int]) -> None:
    budget, max_rows, max_model_len, block_size, num_blocks = limits
    for plan in plans_for(limits):
        assert 0 < plan.num_batched_tokens <= budget
        assert len(plan.scheduled) <= max_rows
        used: list[int] = []
        decodes = [s for s in plan.scheduled if s.start > 0]
        if decodes:
            used += check_shared_prefix_decodes(decodes, max_model_len, block_size)
        for s in plan.scheduled[len(decodes) :]:
            request = s.request
            assert s.start == 0 and s.samples and s.num_new_tokens == request.num_prompt_tokens
            assert 1 <= request.num_prompt_tokens <= max_model_len - 1
            assert len(s.block_ids) * block_size >= request.num_prompt_tokens
            assert (len(s.block_ids) - 1) * block_size < request.num_prompt_tokens
            assert all(0 <= t < 50 for t in request.prompt_token_ids)
            used += s.block_ids
        assert len(used) == len(set(used)) and all(0 <= b < num_blocks for b in used)
        scored = [i for i, s in enumerate(plan.scheduled) if s.request.wants_prompt_logprobs]
        assert plan.prompt_logprob_seqs == scored


def check_shared_prefix_decodes(decodes: list, max_model_len: int, block_size: int) -> list[int]:
    """The shared-prefix decodes lead their step: one token each past a context on the same
    leading blocks, enough of them for the input batch to find a shared prefix
    (base.shared_prefix_tokens, what it runs on a step's tables), the new token in a block of
    the row's own; the blocks they use, each once."""
    assert len(decodes) in (SHARED_PREFIX_MIN_ROWS, ORDERED_DECODE_MIN_ROWS)
    for s in decodes:
        assert s.num_new_tokens == 1 and s.samples and s.start == s.request.num_computed_tokens
        assert len(s.request.token_ids) == s.start + 1 <= max_model_len - 1
        assert s.start // block_size == len(s.block_ids) - 1  # the new token's block: the last
    tables = np.array([s.block_ids for s in decodes], dtype=np.int32)
    seq_lens = np.array([s.start + 1 for s in decodes], dtype=np.int32)
    assert shared_prefix_tokens(tables, seq_lens, block_size) >= SHARED_PREFIX_MIN_TOKENS
    assert len(set(tables[:, -1])) == len(decodes)
    return [*tables[0, :-1].tolist(), *tables[:, -1].tolist()]


@pytest.mark.parametrize("limits", LIMITS)
def test_the_first_two_plans_take_all_the_step_allows(
    limits: tuple[int, int, int, int, int],
) -> None:
    """The most tokens, then the most sampled rows: whatever the budget, the cache and the rows
    leave, each takes it all."""
    budget, max_rows, max_model_len, block_size, num_blocks = limits
    plans = plans_for(limits)
    assert len(plans) == 5 + shared_steps(limits)
    most_tokens, most_rows = plans[:2]
    for plan in (most_tokens, most_rows):
        blocks_left = num_blocks - sum(len(s.block_ids) for s in plan.scheduled)
        assert (
            min(budget - plan.num_batched_tokens, blocks_left, max_rows - len(plan.scheduled)) == 0
        )
    assert all(s.num_new_tokens == 1 for s in most_rows.scheduled)
    assert all(s.request.params.logprobs == MAX_LOGPROBS for s in most_rows.scheduled)
    # A whole chunk of scored rows (the runner's largest logits block) where the limits allow.
    for i, s in enumerate(most_tokens.scheduled):
        if s.request.wants_prompt_logprobs:
            assert s.request.params.prompt_logprobs == MAX_LOGPROBS
            before = most_tokens.scheduled[:i]
            tokens_left = budget - sum(b.num_new_tokens for b in before)
            blocks_left = num_blocks - sum(len(b.block_ids) for b in before)
            wanted = min(SCORED_CHUNK + 1, max_model_len - 1)
            assert s.num_new_tokens == min(wanted, tokens_left, blocks_left * block_size)


def test_a_step_leads_with_decode_rows_where_the_limits_allow() -> None:
    """The mixed step: MIXED_DECODE_ROWS one-token rows first (what the Triton backend gives to
    its decode kernel), then prompts up to the budget."""
    budget = LIMITS[0][0]
    mixed = plans_for(LIMITS[0])[4]
    meta_lens = [s.num_new_tokens for s in mixed.scheduled]
    assert meta_lens[:MIXED_DECODE_ROWS] == [1] * MIXED_DECODE_ROWS
    assert min(meta_lens[MIXED_DECODE_ROWS:]) > 1 and sum(meta_lens) == budget


@pytest.mark.parametrize("limits", [s for s in LIMITS if shared_steps(s) >= 2])
def test_two_steps_lead_with_decodes_over_a_shared_prefix_where_the_limits_allow(
    limits: tuple[int, int, int, int, int],
) -> None:
    """The decode attention's shared-prefix pass runs in the warm-up (a decode step, and
    beside prompts up to the budget, and where they fit as many rows as launch longest
    first), not in the first conversations over a system prompt."""
    budget = limits[0]
    decode_step, mixed, *ordered = plans_for(limits)[5:]
    for step in ordered:
        assert [s.start > 0 for s in step.scheduled] == [True] * ORDERED_DECODE_MIN_ROWS
    assert [s.start > 0 for s in decode_step.scheduled] == [True] * SHARED_PREFIX_MIN_ROWS
    lens = [s.num_new_tokens for s in mixed.scheduled]
    assert lens[:SHARED_PREFIX_MIN_ROWS] == [1] * SHARED_PREFIX_MIN_ROWS
    assert min(lens[SHARED_PREFIX_MIN_ROWS:]) > 1 and sum(lens) <= budget
    assert [s.start > 0 for s in mixed.scheduled].count(True) == SHARED_PREFIX_MIN_ROWS


def test_no_step_where_no_prompt_fits(tiny_llama: Path) -> None:
    """--max-model-len 1 leaves no room for a prompt and a token: nothing to run (the engine
    refuses every request of such a server anyway), and the runner's warm-up does nothing."""
    assert plans_for((8192, 256, 1, 16, 1000)) == []
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=1)
    llm.engine.runner.warm_up()


@pytest.mark.parametrize("limits", [LIMITS[0], *LIMITS[-2:]])
def test_every_sampler_path_is_reached(limits: tuple[int, int, int, int, int]) -> None:
    """Each field that changes how a token is drawn differs from its default in some warm-up
    row, and the batch-wide shortcuts of engine_core/sampler.py each get a step of their own: a
    new stage or path needs a row here, or its first request pays for the kernels it loads.
    Also at the two engine tests' small limits, so that those tests run every path."""
    plans = plans_for(limits)
    params = [s.request.params for plan in plans for s in plan.scheduled]
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.name not in NOT_SAMPLER_STAGES:
            assert any(getattr(p, f.name) != getattr(defaults, f.name) for p in params), f.name
    steps = [[s.request for s in plan.scheduled] for plan in plans]
    # All rows argmax only: the sampler's shortcut.
    assert any(all(r.argmax_only for r in step) for step in steps)
    # Top-k without top-p: topk, not the sort.
    assert any(all(r.params.top_k > 0 and r.params.top_p == 1.0 for r in step) for step in steps)
    # One temperature for the whole batch, and several.
    temperatures = [{r.params.temperature for r in step if not r.params.greedy} for step in steps]
    assert {1, 2} <= {len(t) for t in temperatures}
    # Greedy and sampled rows in one batch.
    assert any(len({r.params.greedy for r in step}) == 2 for step in steps)


def test_warm_up_changes_no_later_token(tiny_llama: Path) -> None:
    """Greedy, unseeded sampled (the engine's seeded generator), seeded, logprobs and prompt
    logprobs: the same after the warm-up as in an engine that never ran it, on the blocks the
    warm-up wrote."""
    prompts = [[5 + (7 * i + 3 * t) % 300 for t in range(9 + 4 * i)] for i in range(4)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, logprobs=3, ignore_eos=True),
    ]

    def generate(warm_up: bool) -> list[tuple[object, ...]]:
        llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=96, seed=0)
        assert len(llm.engine.runner.warm_up_plans()) == 7  # the shared-prefix steps too
        if warm_up:
            llm.engine.runner.warm_up()
        outputs = llm.generate(prompts, params, detokenize=False)
        return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outputs]

    assert generate(warm_up=True) == generate(warm_up=False)


def test_a_step_that_runs_out_of_memory_is_refused_naming_the_flags(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up's steps are the largest the scheduler can plan: where one runs out of GPU
    memory, start-up stops with the flags that help (tandem serve prints the message), rather
    than a request failing the same way later. The launch is made to fail as CUDA would."""
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64)
    runner = llm.engine.runner
    sampler = runner.sampler

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runner, "forward", out_of_memory)
    with pytest.raises(
        ModelTooLargeError, match="--max-num-batched-tokens 4096, --max-num-seqs"
    ) as caught:
        runner.warm_up()
    assert "--gpu-memory-utilization" in str(caught.value)
    assert runner.sampler is sampler
