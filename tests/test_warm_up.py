"""The start-up warm-up step (engine_core/warm_up.py): it stays inside the step budget and the KV
cache, reaches every sampler stage, and changes nothing a later request generates.

On CUDA the runner runs it at start-up (its effect on the first token is measured on the GPU,
docs/benchmarks.md); here the same step runs on the CPU, called by hand, so that what it leaves
behind can be compared with an engine that never ran it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_core.llm import LLM
from engine_core.memory_plan import ModelTooLargeError
from engine_core.warm_up import EVERY_SAMPLER_STAGE, SEEDED, warm_up_plan
from protocol.messages import SamplingParams
from tests.factories import write_tiny_llama

# Fields that stop a request or shape its output's length or text, not how a token is drawn;
# the structured-output constraint is the bitmask the runner passes beside the plan.
NOT_SAMPLER_STAGES = {"max_tokens", "stop_token_ids", "ignore_eos", "constraint"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-warm-up"))


@pytest.mark.parametrize(
    ("budget", "max_rows", "max_model_len", "block_size", "num_blocks"),
    [
        (8192, 256, 4096, 16, 100_000),  # the defaults: three greedy prompts fill the rest
        (8192, 256, 2048, 16, 300),  # the cache holds fewer tokens than the budget
        (8192, 3, 4096, 16, 100_000),  # rows run out before the budget
        (40, 256, 64, 16, 100),  # a small budget: the greedy row takes what is left
        (20, 256, 64, 16, 100),  # smaller than two sampler rows: the second is cut short
        (1, 1, 64, 32, 1),
        (100, 256, 64, 32, 2),  # two blocks of 32: the second row ends the step
    ],
)
def test_plan_stays_inside_the_step_and_the_cache(
    budget: int, max_rows: int, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    plan = warm_up_plan(budget, max_rows, max_model_len, block_size, num_blocks, vocab_size=50)
    assert 0 < plan.num_batched_tokens <= budget
    assert len(plan.scheduled) <= max_rows
    used: list[int] = []
    for s in plan.scheduled:
        request = s.request
        assert s.start == 0 and s.samples and s.num_new_tokens == request.num_prompt_tokens
        assert request.num_prompt_tokens <= max_model_len - 1
        assert len(s.block_ids) * block_size >= request.num_prompt_tokens
        assert (len(s.block_ids) - 1) * block_size < request.num_prompt_tokens
        assert all(0 <= t < 50 for t in request.prompt_token_ids)
        used += s.block_ids
    assert len(used) == len(set(used)) and all(0 <= b < num_blocks for b in used)
    assert plan.scheduled[0].request.params is EVERY_SAMPLER_STAGE
    assert plan.prompt_logprob_seqs == [0]
    # Whatever the budget, the cache and the rows leave, the plan takes it all.
    blocks_left = num_blocks - len(used)
    assert min(budget - plan.num_batched_tokens, blocks_left, max_rows - len(plan.scheduled)) == 0


def test_every_sampler_stage_is_reached() -> None:
    """Each field that changes how a token is drawn differs from its default in one of the
    warm-up's sampling rows: a new sampler stage needs a value here, or its first request
    pays for the kernels it loads."""
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.name in NOT_SAMPLER_STAGES:
            continue
        default = getattr(defaults, f.name)
        assert getattr(EVERY_SAMPLER_STAGE, f.name) != default or (
            getattr(SEEDED, f.name) != default
        ), f.name


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
        llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64, seed=0)
        if warm_up:
            llm.engine.runner.warm_up()
        outputs = llm.generate(prompts, params, detokenize=False)
        return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outputs]

    assert generate(warm_up=True) == generate(warm_up=False)


def test_a_step_that_runs_out_of_memory_is_refused_naming_the_flags(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up step is the largest step the scheduler can plan: where it runs out of GPU
    memory, start-up stops with the flags that help (tandem serve prints the message), rather
    than a request failing the same way later. The launch is made to fail as CUDA would."""
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64)
    runner = llm.engine.runner
    sampler = runner.sampler

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runner, "launch", out_of_memory)
    with pytest.raises(ModelTooLargeError, match="--max-num-batched-tokens 8192") as caught:
        runner.warm_up()
    assert "--gpu-memory-utilization" in str(caught.value)
    assert runner.sampler is sampler
