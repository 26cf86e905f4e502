"""The start-up step that a first request would otherwise pay for (CUDA).

The first time a process runs a torch kernel, CUDA loads it (lazy loading, CUDA's default); the
first step of the largest size grows the caching allocator; the first eager step of a size tier
builds the MoE kernels' variant for it. Measured on an H100 (docs/benchmarks.md, twenty-sixth
session): the first 3,000-token prompt after start-up took 27-28 ms to its first token on
smollm2-135m where the next took 8-11, and 45-55 ms on llama-1b where the next took 15-17; a
profile put most of it in the first calls of the eager tail's ``index``, ``argmax`` and ``mm``.

So the runner runs one dummy step before it serves (``warm_up_plan``): prompts that fill the
step budget (the largest step the scheduler can plan, eager where the prefill graphs stop short
of it), one row through every stage of the sampler (temperature, top-k/top-p/min-p, the three
penalties, logit bias, min_tokens, logprobs, a seeded and an unseeded draw, a structured-output
bitmask) and prompt logprobs. It writes K/V into blocks that no request holds yet: whatever
request gets them later writes its own K/V before it reads any (the prefix cache registers only
blocks a request has computed).
"""

from __future__ import annotations

from itertools import chain, repeat

from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from protocol.messages import SamplingParams

# Short prompts for the rows that exercise the sampler; the rest of the budget goes to greedy.
SAMPLER_PROMPT_TOKENS = 16

# Every stage of the sampler and of prompt scoring at once (engine_core/sampler.py).
EVERY_SAMPLER_STAGE = SamplingParams(
    max_tokens=2,
    min_tokens=1,
    temperature=0.8,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    repetition_penalty=1.1,
    logprobs=2,
    logit_bias=((0, 0.5),),
    prompt_logprobs=1,
)
SEEDED = SamplingParams(max_tokens=2, temperature=1.0, seed=1)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def warm_up_plan(
    budget: int,
    max_rows: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
) -> SchedulerOutput:
    """One step of at most ``budget`` tokens and ``max_rows`` requests (fewer tokens where the KV
    cache holds fewer): a row with every sampler stage, a seeded row, then greedy prompts of at
    most ``max_model_len - 1`` tokens each; every request on blocks of its own from block 0."""
    tokens_left, blocks_left = budget, num_blocks
    scheduled: list[ScheduledRequest] = []
    for i, params in enumerate(chain((EVERY_SAMPLER_STAGE, SEEDED), repeat(GREEDY))):
        if len(scheduled) == max_rows or tokens_left <= 0 or blocks_left <= 0:
            break
        wanted = max_model_len - 1 if params is GREEDY else SAMPLER_PROMPT_TOKENS
        length = min(wanted, tokens_left, blocks_left * block_size)
        blocks = -(-length // block_size)
        prompt = [(i * 7919 + t * 104729) % vocab_size for t in range(length)]
        first_block = num_blocks - blocks_left
        block_ids = list(range(first_block, first_block + blocks))
        scheduled.append(
            ScheduledRequest.plan(Request(f"warm-up-{i}", prompt, params), length, block_ids)
        )
        tokens_left -= length
        blocks_left -= blocks
    return SchedulerOutput(scheduled, prompt_logprob_seqs=[0])
