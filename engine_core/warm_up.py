"""The start-up steps that a first request would otherwise pay for (CUDA).

The first time a process runs a torch kernel, CUDA loads it (lazy loading, CUDA's default); the
first step of the largest size grows the caching allocator; the first eager step of a size tier
builds the MoE kernels' variant for it. The first 3,000-token prompt after start-up took 27-28
ms to its first token on smollm2-135m where the next took 8-11, and 45-55 ms on llama-1b where
the next took 15-17; a profile put most of it in the first calls of the eager tail's ``index``,
``argmax`` and ``mm`` (docs/design/cuda-graphs-and-warm-up.md, "The warm-up steps").

So the runner runs a few dummy steps before it serves (``warm_up_plans``), which between them
reach the largest step the scheduler can plan in each dimension and each path of the sampler:

- the most tokens: prompts that fill the step budget (eager where the prefill graphs stop short
  of it): a seeded row and a greedy row (so temperatures differ per row, and greedy rows sit
  beside sampled ones), a row through every sampler stage with a whole chunk of scored prompt
  rows, then greedy prompts;
- the most sampled rows: ``max_num_seqs`` one-token prompts, each through every sampler stage
  with the most top logprobs (the sampler's [rows, vocab] temporaries at their largest);
- greedy alone (the argmax shortcut of an all-greedy batch);
- top-k alone at temperature 1 (the top-k filter without the sort);
- one-token rows ahead of prompts filling the budget: an eager step whose leading decodes the
  Triton backend attends through its decode kernel (``MIXED_DECODE_ROWS``).
- decodes over a shared system prompt (``shared_prefix_decodes``): SHARED_PREFIX_MIN_ROWS rows
  whose contexts open with the same blocks, alone (a decode step) and ahead of prompts filling
  the budget, then ORDERED_DECODE_MIN_ROWS of them alone (launched longest first), so that the
  decode attention's shared-prefix pass is built before the first conversations over one
  system prompt need it (eager steps, and decode steps under ``--enforce-eager``);
- a vision-language model's image (``image_warm_up_plan``): a blank image of a common size
  in a short prompt, through the tower and an eager step with M-RoPE positions; the first
  1,024-pixel image on a fresh qwen3-vl-8b server otherwise took 1.2 s longer to its first
  token than the next (docs/design/vision.md, "The image warm-up").

What no warm-up step covers: cuBLAS's first call at each new row count (an eager step's products
run at exactly its token count), 0.1-0.2 ms of host time a product and about 2.5 ms for some
shapes, per exact count (docs/design/cuda-graphs-and-warm-up.md, "What no warm-up covers").

An embedding engine samples nothing: its warm-up is ``pooling_warm_up_plans``, the most
tokens (mean pooling's float32 sums over a whole step) and the most rows (last-token pooling).

The runner adds a structured-output bitmask to each. The steps write K/V into blocks that no
request holds yet: whatever request gets them later writes its own K/V before it reads any (the
prefix cache registers only blocks a request has computed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from itertools import chain, repeat

from engine_core.attention.base import (
    MIXED_DECODE_ROWS,
    ORDERED_DECODE_MIN_ROWS,
    SHARED_PREFIX_MIN_ROWS,
    SHARED_PREFIX_MIN_TOKENS,
)
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from protocol.codec import MAX_LOGPROBS
from protocol.messages import ImageInput, PoolingKind, PoolingParams, SamplingParams

SHORT_PROMPT = 16  # the steps that only exercise the sampler

# Every stage of the sampler at once (engine_core/sampler.py).
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
    logprobs=MAX_LOGPROBS,
    logit_bias=((0, 0.5),),
)
EVERY_STAGE_AND_PROMPT_LOGPROBS = dataclasses.replace(
    EVERY_SAMPLER_STAGE, prompt_logprobs=MAX_LOGPROBS
)
SEEDED = SamplingParams(max_tokens=2, temperature=1.0, seed=1)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
TOP_K_ALONE = SamplingParams(max_tokens=2, temperature=1.0, top_k=20)


@dataclasses.dataclass(frozen=True)
class StepLimits:
    """What one step may hold: the scheduler's limits and the KV cache's blocks."""

    budget: int  # tokens (--max-num-batched-tokens)
    max_rows: int  # requests (--max-num-seqs)
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int

    def step(
        self,
        rows: Iterable[tuple[SamplingParams, int]],
        pooling: PoolingParams | None = None,
        lead: Sequence[ScheduledRequest] = (),
    ) -> SchedulerOutput:
        """``lead`` (rows on blocks 0.. in a run: ``shared_prefix_decodes``), then one prompt per
        (params, wanted length) in order, each cut to what is left, until a limit is reached;
        every prompt on blocks of its own after those (and pooled as ``pooling`` says, where
        given: an embedding engine's)."""
        tokens_left = self.budget - sum(s.num_new_tokens for s in lead)
        blocks_left = self.num_blocks - len({b for s in lead for b in s.block_ids})
        scheduled = list(lead)
        for i, (params, wanted) in enumerate(rows, start=len(lead)):
            longest = min(
                wanted, self.max_model_len - 1, tokens_left, blocks_left * self.block_size
            )
            if len(scheduled) == self.max_rows or longest < 1:
                break
            blocks = -(-longest // self.block_size)
            prompt = [(i * 7919 + t * 104729) % self.vocab_size for t in range(longest)]
            first = self.num_blocks - blocks_left
            request = Request(f"warm-up-{i}", prompt, params, pooling=pooling)
            scheduled.append(
                ScheduledRequest.plan(request, longest, list(range(first, first + blocks)))
            )
            tokens_left -= longest
            blocks_left -= blocks
        scored = [i for i, s in enumerate(scheduled) if s.request.wants_prompt_logprobs]
        return SchedulerOutput(scheduled, prompt_logprob_seqs=scored)

    def shared_prefix_decodes(self, rows: int = SHARED_PREFIX_MIN_ROWS) -> list[ScheduledRequest]:
        """``rows`` greedy decodes whose contexts open with the same blocks, at least
        SHARED_PREFIX_MIN_TOKENS tokens of them (a system prompt the prefix cache shares),
        each computing one token in a block of its own after those; none where the limits do
        not hold them."""
        shared_blocks = -(-SHARED_PREFIX_MIN_TOKENS // self.block_size)
        context = shared_blocks * self.block_size  # the new token opens a block of its own
        fits = (
            rows <= min(self.max_rows, self.budget)
            and context + 2 <= self.max_model_len  # the new token and the one it samples
            and shared_blocks + rows <= self.num_blocks
        )
        if not fits:
            return []
        system = [(t * 104729) % self.vocab_size for t in range(context)]
        decodes = []
        for i in range(rows):
            prompt = [*system, i % self.vocab_size]
            request = Request(f"warm-up-shared-{i}", prompt, GREEDY, num_computed_tokens=context)
            blocks = [*range(shared_blocks), shared_blocks + i]
            decodes.append(ScheduledRequest.plan(request, 1, blocks))
        return decodes


def warm_up_plans(limits: StepLimits, scored_chunk: int) -> list[SchedulerOutput]:
    """The warm-up's steps (see the module's docstring), each within ``limits``, prompts of at
    most ``max_model_len - 1`` tokens; ``scored_chunk``: how many prompt rows the runner scores
    at a time."""
    # The short rows first, so that a small budget or cache still holds a seeded, a greedy and
    # an every-stage row together (per-row temperatures, the seeded draw, greedy beside sampled).
    most_tokens = [
        (SEEDED, SHORT_PROMPT),
        (GREEDY, SHORT_PROMPT),
        (EVERY_STAGE_AND_PROMPT_LOGPROBS, scored_chunk + 1),
    ]
    long_prompts = repeat((GREEDY, limits.max_model_len - 1))
    plans = [
        limits.step(chain(most_tokens, long_prompts)),
        limits.step(repeat((EVERY_SAMPLER_STAGE, 1))),
        limits.step([(GREEDY, SHORT_PROMPT)]),
        limits.step([(TOP_K_ALONE, SHORT_PROMPT)]),
        limits.step(chain(repeat((GREEDY, 1), MIXED_DECODE_ROWS), long_prompts)),
    ]
    shared = limits.shared_prefix_decodes()
    if shared:
        plans.append(limits.step((), lead=shared))
        beside_prompts = limits.step(long_prompts, lead=shared)
        if len(beside_prompts.scheduled) > len(shared):  # a prompt fits after them
            plans.append(beside_prompts)
        # As many as launch longest first (the order's variant of the shared-prefix launch).
        ordered = limits.shared_prefix_decodes(ORDERED_DECODE_MIN_ROWS)
        if ordered:
            plans.append(limits.step((), lead=ordered))
    return [plan for plan in plans if not plan.is_empty]  # none where no prompt fits


def image_warm_up_plan(
    limits: StepLimits, image: ImageInput, run: list[int], whole: bool
) -> SchedulerOutput | None:
    """A vision-language model's image step: the first chunk of a greedy prompt of a few text
    tokens, the image's run (``run``: its ids, the placeholder first) and a few more, so that
    the first request with an image finds the tower's kernels loaded and an eager M-RoPE step
    run once. ``whole``: the image's run may not be cut (its tokens attend both ways, Gemma 3).
    None where it does not fit."""
    placeholder = run[0]
    text = [(t * 104729) % limits.vocab_size for t in range(SHORT_PROMPT)]
    text = [(t + 1) % limits.vocab_size if t == placeholder else t for t in text]
    half = SHORT_PROMPT // 2
    prompt = text[:half] + run + text[half:]
    chunk = min(len(prompt), limits.budget)
    blocks = -(-len(prompt) // limits.block_size)
    too_long = len(prompt) > limits.max_model_len - 1 or blocks > limits.num_blocks
    if too_long or (whole and chunk < len(prompt)):
        return None
    placed = dataclasses.replace(image, offset=half)
    request = Request("warm-up-image", prompt, GREEDY, images=(placed,))
    return SchedulerOutput([ScheduledRequest.plan(request, chunk, list(range(blocks)))])


def pooling_warm_up_plans(limits: StepLimits) -> list[SchedulerOutput]:
    """An embedding engine's warm-up steps: the most tokens, mean-pooled (a float32 sum over
    every row), then the most rows, one token each, last-token pooled."""
    plain = SamplingParams()
    plans = [
        limits.step(repeat((plain, limits.max_model_len - 1)), PoolingParams(PoolingKind.MEAN)),
        limits.step(repeat((plain, 1)), PoolingParams(PoolingKind.LAST)),
    ]
    return [plan for plan in plans if not plan.is_empty]
