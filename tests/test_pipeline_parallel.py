"""Pipeline parallelism over gloo on the CPU: PP=2 and TP=2 x PP=2 give HF's greedy tokens.

Tiny random models written by the tests (tests/test_tensor_parallel.py's sizes, vocabulary 387):
a 5-layer Llama with an untied head (an uneven split, 3 + 2 layers), a Qwen2 with a tied
embedding (the last stage holds the embedding as its head) and a Qwen3-MoE. Block size 4 and a
16-token step budget make the batches mix prefills, prompt chunks, a prefix-cache hit and
decodes; a small KV pool adds preemptions. Rank 0, the engine process, is stage 0: what it holds
is checked in-process; the last stage's part shows in the tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

from engine_core.args import add_engine_args, engine_config_from_args
from engine_core.config import EngineConfig
from engine_core.llm import LLM, CompletionOutput
from engine_core.models import model_config_from_hf
from engine_core.models.pipeline import MissingLayer
from engine_core.parallel import (
    PipelineStage,
    check_pipeline_parallel,
    get_pipeline_stage,
    split_layers,
)
from protocol.messages import SamplingParams
from tests.paged_harness import hf_greedy
from tests.test_tensor_parallel import (
    CONFIGS,
    NEW_TOKENS,
    PROMPTS,
    SIZES,
    children_running_spawn,
    write_model,
)

BLOCK_SIZE = 4
KV_GIB = 0.001  # the CPU cache's budget: 1,073,741 bytes
# name -> (config, the layers stage 0 holds, the most layers a stage holds) at PP=2.
MODELS: dict[str, tuple[Callable[[], PretrainedConfig], int, int]] = {
    "llama_5_layers": (
        lambda: LlamaConfig(**(SIZES | {"num_hidden_layers": 5}), tie_word_embeddings=False),
        3,
        3,
    ),
    "qwen2_tied": (CONFIGS["qwen2_tied"], 1, 1),
    "qwen3_moe": (CONFIGS["qwen3_moe"], 2, 2),  # 3 layers: a sparse and the dense one on stage 0
}


@pytest.fixture(scope="module")
def llama_5_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """MODELS["llama_5_layers"] saved once for the tests that only read it, and HF's greedy
    tokens for PROMPTS on it."""
    folder = tmp_path_factory.mktemp("llama-5-layers")
    hf_model = write_model("llama", folder, MODELS["llama_5_layers"][0]())
    return folder, [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def six_layers_busy(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A 6-layer Llama, fourteen prompts of 3 to 40 tokens and HF's greedy tokens for each:
    written and computed once for both pipeline depths that run them."""
    folder = tmp_path_factory.mktemp("llama-6-layers")
    config = LlamaConfig(**(SIZES | {"num_hidden_layers": 6}), tie_word_embeddings=False)
    hf_model = write_model("llama", folder, config)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 41, (14,), generator=gen).tolist()
    prompts = [torch.randint(0, 387, (n,), generator=gen).tolist() for n in lengths]
    return folder, prompts, [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]


def test_layers_split_evenly_with_the_remainder_on_the_stages_before_the_last() -> None:
    assert split_layers(4, 1) == [range(0, 4)]
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(7, 3) == [range(0, 2), range(2, 5), range(5, 7)]
    assert split_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert split_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 must be .* at most"):
        split_layers(2, 3)


def run(
    folder: Path, params: SamplingParams, prompts: list[list[int]] = PROMPTS, **engine: object
) -> tuple[list[CompletionOutput], LLM]:
    """``prompts`` through the offline API; the engine is shut down before returning (its
    runner, rank 0, stays readable)."""
    engine = {"block_size": BLOCK_SIZE, "max_model_len": 128, "max_num_batched_tokens": 16,
              "max_num_seqs": 16, **engine}  # fmt: skip
    llm = LLM(str(folder), **engine)
    try:
        return llm.generate(prompts, params, detokenize=False), llm
    finally:
        llm.engine.shutdown()


def block_bytes_per_layer(config: PretrainedConfig) -> int:
    """K and V of one block in one layer, float32: by hand from the config."""
    head_dim = config.hidden_size // config.num_attention_heads
    return BLOCK_SIZE * 2 * config.num_key_value_heads * head_dim * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_pp2_gives_hf_tokens_and_pp1_logprobs_holding_its_stage_only(
    name: str, tmp_path: Path
) -> None:
    make_config, stage0_layers, most_layers = MODELS[name]
    config = make_config()
    hf_model = write_model(name, tmp_path, config)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    one, _ = run(tmp_path, params, kv_cache_memory_gb=KV_GIB)
    two, llm = run(tmp_path, params, kv_cache_memory_gb=KV_GIB, pipeline_parallel_size=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one] == reference
    # The whole distribution came from the last stage, not just its argmax; prompt tokens too.
    for a, b in zip(one, two, strict=True):
        assert len(b.prompt_logprobs or []) == len(a.prompt_logprobs or []) > 0
        scored = [*b.logprobs, *b.prompt_logprobs]
        expected = [*a.logprobs, *a.prompt_logprobs]
        assert [lp.top_token_ids for lp in scored] == [lp.top_token_ids for lp in expected]
        got = torch.tensor([x for lp in scored for x in (lp.logprob, *lp.top_logprobs)])
        want = torch.tensor([x for lp in expected for x in (lp.logprob, *lp.top_logprobs)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    # Rank 0 is stage 0: its layers, the embedding, no final norm, no head of its own.
    runner = llm.engine.runner
    body = runner.model.model
    held = [not isinstance(layer, MissingLayer) for layer in body.layers]
    assert held == [i < stage0_layers for i in range(config.num_hidden_layers)]
    assert isinstance(body.norm, MissingLayer)
    assert not isinstance(body.embed_tokens, MissingLayer)
    tied = config.tie_word_embeddings
    assert runner.model.lm_head is None if tied else isinstance(runner.model.lm_head, MissingLayer)
    # Its cache holds its layers only, and every rank's as many blocks as the fullest stage's
    # layers fit in the budget: more than the whole model's would.
    assert runner.kv_cache.shape[0] == stage0_layers
    per_layer = block_bytes_per_layer(config)
    assert runner.num_kv_blocks == int(KV_GIB * 2**30 // (per_layer * most_layers))
    assert runner.num_kv_blocks > int(KV_GIB * 2**30 // (per_layer * config.num_hidden_layers))
    assert get_pipeline_stage().size == 1, "the stage outlived its engine"


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "stage0"), [(2, 2, 3), (1, 3, 2)], ids=["tp2xpp2", "pp3"])
def test_tp2_by_pp2_and_three_stages_give_hf_tokens(
    tp: int, pp: int, stage0: int, llama_5_layers: tuple[Path, list[list[int]]]
) -> None:
    """TP=2 x PP=2, 4 ranks: a tensor-parallel pair in each stage, each rank sending its
    activations to its own peer in the next stage and the last stage's shards gathered before
    rank 0 samples. PP=3: a middle stage (layers 2-3 of 5) that receives and sends."""
    folder, reference = llama_5_layers
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs, llm = run(
        folder, params, num_kv_blocks=96, tensor_parallel_size=tp, pipeline_parallel_size=pp
    )
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.runner.tp.size == tp
    assert llm.engine.runner.kv_cache.shape[0] == stage0  # rank 0 caches stage 0's layers


@pytest.mark.slow
def test_pp2_batch_with_chunks_and_preemptions_gives_hf_tokens(tmp_path: Path) -> None:
    """Prompts of 5 to 37 tokens at once, chunked by the 16-token budget, in a pool too small
    for all of them: requests are preempted and recomputed, every stage's cache rewritten."""
    make_config, _, _ = MODELS["llama_5_layers"]
    hf_model = write_model("llama", tmp_path, make_config())
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 387, (n,), generator=gen).tolist() for n in (5, 37, 13, 29, 21)]
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs, llm = run(
        tmp_path, params, prompts, num_kv_blocks=24, max_model_len=64, pipeline_parallel_size=2
    )
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.counts().preemptions > 0


def test_a_stage_is_planned_by_its_own_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-8b's 32 layers over 4 stages: a middle stage's ranks hold 8 layers, no embedding and
    no head, and cache 8 layers; a GPU budget that the whole model misses fits such a stage."""
    from engine_core.memory_plan import Budget, plan_memory
    from tests.test_memory_fit import GPU, meta_estimate

    whole, model_config = meta_estimate("random:llama-8b", torch.bfloat16)
    monkeypatch.setattr("engine_core.parallel._stage", PipelineStage(index=1, size=4))
    stage, _ = meta_estimate("random:llama-8b", torch.bfloat16)
    budget = Budget(10 * 2**30, "10 GiB")

    def plan(module: torch.nn.Module, pp: int) -> object:
        config = EngineConfig(
            model="random:llama-8b", max_model_len=4096, pipeline_parallel_size=pp
        ).with_max_num_seqs(large_gpu=False)
        return plan_memory(
            config, model_config, module, GPU, torch.bfloat16, torch.bfloat16, budget
        )

    staged = plan(stage, 4)
    # A layer: q and o 4096 x 4096, k and v 1024 x 4096, gate, up and down 14336 x 4096, two norms.
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096
    assert staged.weight_bytes == pytest.approx(8 * layer * 2, rel=0.01)
    assert staged.min_kv_bytes == 4096 * 8 * 2 * 8 * 128 * 2  # tokens x layers x K, V x heads
    assert staged.fits
    monkeypatch.setattr("engine_core.parallel._stage", PipelineStage())
    assert not plan(whole, 1).fits


# ---- micro-batches in flight --------------------------------------------------------------------


def test_two_micro_batches_alternate_and_each_request_gets_its_tokens() -> None:
    """The pipelined loop's order (core.py _step_pipelined): plan N while N-1 is in flight, then
    apply N-1. Each plan takes half the live requests and none of the one in flight, so the
    plans alternate between two disjoint halves; every request still gets the fake model's
    tokens, in order."""
    from tests.test_scheduler import fake_next_token, make_request, make_scheduler

    scheduler = make_scheduler(pipeline_parallel_size=2)
    prompts = {f"r{i}": [3 + i, 5, 7 + i] for i in range(5)}
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=6, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    plans: list[list[str]] = []
    in_flight = None
    while in_flight is not None or scheduler.has_unfinished():
        plan = scheduler.schedule()
        if plan.scheduled:
            plans.append([s.request.request_id for s in plan.scheduled])
        if in_flight is not None:  # the step before: the fake model's token for each row
            tokens = [fake_next_token(s.request.token_ids[: s.start + s.num_new_tokens])
                      for s in in_flight.scheduled]  # fmt: skip
            for out in scheduler.update_from_output(in_flight, tokens):
                got[out.request.request_id] += out.new_token_ids
        in_flight = plan if plan.scheduled else None
    assert plans[:4] == [["r0", "r1", "r2"], ["r3", "r4"], ["r0", "r1", "r2"], ["r3", "r4"]]
    assert all(not set(a) & set(b) for a, b in zip(plans, plans[1:], strict=False))
    for rid, prompt in prompts.items():
        context = list(prompt)
        for _ in range(6):
            context.append(fake_next_token(context))
        assert got[rid] == context[len(prompt) :]


# (stages, KV blocks, seed): pools and prompts where, without that rule, a request preempted
# while its plan is in flight would be admitted again before the plan is applied.
@pytest.mark.parametrize(("stages", "num_blocks", "seed"), [(3, 24, 2), (4, 24, 0)])
def test_p_micro_batches_keep_requests_apart_through_aborts_and_preemptions(
    stages: int, num_blocks: int, seed: int
) -> None:
    """The loop of core.py _step_pipelined on the scheduler alone, with the fake model: up to
    P plans in flight, applied oldest first. No request is in two plans in flight; a request
    preempted while its plan is in flight is not admitted again before that plan is applied
    (its context would hold a placeholder); aborts land while their plans are in flight;
    every request that is not aborted gets the fake model's tokens, and every block comes
    back."""
    from collections import deque

    from engine_core.request import SchedulerOutput
    from engine_core.scheduler import PLACEHOLDER
    from tests.test_scheduler import (
        fake_next_token,
        make_request,
        make_scheduler,
        reference_outputs,
    )

    scheduler = make_scheduler(
        num_blocks, pipeline_parallel_size=stages, max_num_batched_tokens=16, max_num_seqs=16
    )
    gen = torch.Generator().manual_seed(seed)
    prompts = {
        f"r{i}": torch.randint(3, 99, (int(n),), generator=gen).tolist()
        for i, n in enumerate(torch.randint(3, 30, (14,), generator=gen))
    }
    for rid, prompt in list(prompts.items())[:10]:
        scheduler.add_request(make_request(rid, prompt, max_tokens=10, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    in_flight: deque[SchedulerOutput] = deque()
    aborted: set[str] = set()
    preempted_in_flight = turn = 0
    most_in_flight = 0

    def apply_oldest() -> None:
        plan = in_flight.popleft()
        tokens = []
        for s in plan.scheduled:
            if s.samples:
                context = s.request.token_ids[: s.start + s.num_new_tokens]
                assert PLACEHOLDER not in context, "a row ran on a token it did not have"
                tokens.append(fake_next_token(context))
        for out in scheduler.update_from_output(plan, tokens):
            got[out.request.request_id] += out.new_token_ids

    while in_flight or scheduler.has_unfinished():
        turn += 1
        if turn == 4:  # arrivals while the pipeline is full
            for rid, prompt in list(prompts.items())[10:]:
                scheduler.add_request(make_request(rid, prompt, max_tokens=10, ignore_eos=True))
        if turn in (6, 9):  # abort a request whose plan is in flight
            victim = sorted(scheduler.in_flight_ids - aborted)[0]
            scheduler.abort_requests([victim])
            aborted.add(victim)
        plan = scheduler.schedule()
        planned = {s.request.request_id for s in plan.scheduled}
        earlier = {s.request.request_id for p in in_flight for s in p.scheduled}
        assert not planned & earlier, "a request in two micro-batches in flight"
        preempted_in_flight += len(set(plan.preempted_ids) & earlier)
        if in_flight and (plan.is_empty or len(in_flight) >= stages - 1):
            apply_oldest()
        if not plan.is_empty:
            in_flight.append(plan)
            most_in_flight = max(most_in_flight, len(in_flight))
        scheduler.block_manager.check_integrity()

    assert most_in_flight == stages - 1  # in the later stages, the newest on stage 0 besides
    assert preempted_in_flight > 0 and scheduler.counts().preemptions > 0
    for rid, prompt in prompts.items():
        want = reference_outputs(prompt, 10)
        if rid in aborted:
            assert got[rid] == want[: len(got[rid])] and len(got[rid]) < 10
        else:
            assert got[rid] == want, rid
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.in_flight_ids == frozenset()


@pytest.mark.slow
def test_rank_0_runs_a_step_while_the_last_stage_runs_the_one_before(
    llama_5_layers: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's first stage of step N is enqueued before step N-1's logits are taken: the
    stages overlap. Recorded on the real engine, which still gives HF's tokens."""
    folder, reference = llama_5_layers
    llm = LLM(str(folder), pipeline_parallel_size=2, block_size=BLOCK_SIZE, num_kv_blocks=96,
              max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16)  # fmt: skip
    runner = llm.engine.runner
    events: list[tuple[str, int]] = []
    forward, sample = runner.forward, runner.sample

    def record_forward(plan: object) -> object:
        events.append(("forward", id(plan)))
        return forward(plan)

    def record_sample(step: object, *args: object) -> object:
        events.append(("sample", id(step.plan)))  # type: ignore[attr-defined]
        return sample(step, *args)

    monkeypatch.setattr(runner, "forward", record_forward)
    monkeypatch.setattr(runner, "sample", record_sample)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outs] == reference
    overlapped = [
        (a, b) for a, b in zip(events, events[1:], strict=False)
        if a[0] == "forward" and b[0] == "sample" and a[1] != b[1]
    ]  # fmt: skip
    assert len(overlapped) >= NEW_TOKENS, events  # a step's forward, then the one before's sample


@pytest.mark.slow
@pytest.mark.parametrize("stages", [3, 4])
def test_p_stages_keep_p_micro_batches_in_flight_and_give_hf_tokens(
    stages: int, six_layers_busy: tuple[Path, list[list[int]], list[list[int]]]
) -> None:
    """PP=3 (2 + 2 + 2 layers) and PP=4 (1 + 2 + 2 + 1) on a 6-layer Llama: fourteen requests
    of 3 to 40 tokens, four of them arriving once the pipeline is full, two aborted while
    their micro-batch is in the stages, a KV pool small enough to preempt. Every stage is busy
    at once (P micro-batches in flight, the engine's count), the requests not aborted get HF's
    greedy tokens, the aborted ones a prefix of them, and every block comes back."""
    from engine_core.request import Request

    folder, prompts, reference = six_layers_busy
    llm = LLM(str(folder), pipeline_parallel_size=stages, block_size=BLOCK_SIZE,
              num_kv_blocks=48, max_model_len=64, max_num_batched_tokens=16,
              max_num_seqs=16)  # fmt: skip
    core = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    got: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    aborted: list[str] = []
    try:
        for i, prompt in enumerate(prompts[:10]):
            core.add_request(Request(f"p{i}", prompt, params))
        turn = 0
        while core.has_unfinished():
            turn += 1
            if turn == 6:
                for i, prompt in enumerate(prompts[10:], start=10):
                    core.add_request(Request(f"p{i}", prompt, params))
            if turn in (8, 12):
                victim = sorted(core.scheduler.in_flight_ids - set(aborted))[0]
                core.abort([victim])
                aborted.append(victim)
            for out in core.step():
                got[out.request.request_id] += out.new_token_ids
        bm = core.scheduler.block_manager
        bm.check_integrity()
        assert bm.num_used_blocks == 0
        assert core.scheduler.counts().preemptions > 0
        assert max(core.pipeline_depths) == stages, core.pipeline_depths
    finally:
        core.shutdown()
    assert len(aborted) == 2
    for i, want in enumerate(reference):
        tokens = got[f"p{i}"]
        if f"p{i}" in aborted:
            assert tokens == want[: len(tokens)] and len(tokens) < NEW_TOKENS
        else:
            assert tokens == want, i


@pytest.mark.slow
def test_p_micro_batches_bring_back_each_steps_logprobs_and_prompt_logprobs(
    tmp_path: Path,
) -> None:
    """PP=4 on a 6-layer Llama: with several steps in the stages, each step's sampled and
    scored prompt rows come back from the last stage in the order rank 0 takes them, so every
    request's logprobs and prompt logprobs are PP=1's."""
    config = LlamaConfig(**(SIZES | {"num_hidden_layers": 6}), tie_word_embeddings=False)
    hf_model = write_model("llama", tmp_path, config)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    one, _ = run(tmp_path, params, num_kv_blocks=96)
    four, llm = run(tmp_path, params, num_kv_blocks=96, pipeline_parallel_size=4)
    assert [o.token_ids for o in four] == [o.token_ids for o in one] == reference
    for a, b in zip(one, four, strict=True):
        scored = [*b.logprobs, *(b.prompt_logprobs or [])]
        expected = [*a.logprobs, *(a.prompt_logprobs or [])]
        assert len(b.prompt_logprobs or []) == len(a.prompt_logprobs or []) > 0
        assert [lp.top_token_ids for lp in scored] == [lp.top_token_ids for lp in expected]
        got = torch.tensor([x for lp in scored for x in (lp.logprob, *lp.top_logprobs)])
        want = torch.tensor([x for lp in expected for x in (lp.logprob, *lp.top_logprobs)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert max(llm.engine.pipeline_depths) == 4


@pytest.mark.slow
def test_a_penalised_request_settles_every_micro_batch_then_runs_in_step(tmp_path: Path) -> None:
    """PP=4: a request with penalties arrives while micro-batches are in flight. The loop
    settles them one by one, oldest first, then plans each step after the last is applied (the
    penalties read real tokens), and pipelines again once it is gone: every request gets the
    tokens one stage gives it."""
    from engine_core.request import Request

    config = LlamaConfig(**(SIZES | {"num_hidden_layers": 4}), tie_word_embeddings=False)
    write_model("llama", tmp_path, config)
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    penalised = dataclasses.replace(plain, max_tokens=2, repetition_penalty=1.5,
                                    frequency_penalty=0.5)  # fmt: skip
    params = [plain] * len(PROMPTS) + [penalised]
    prompts = [*PROMPTS, PROMPTS[0]]
    llm = LLM(str(tmp_path), pipeline_parallel_size=4, block_size=BLOCK_SIZE, num_kv_blocks=96,
              max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16)  # fmt: skip
    core = llm.engine
    got: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    depths = []  # the launches' depths: before the penalised request, with it, after it
    try:
        for i, prompt in enumerate(PROMPTS):
            core.add_request(Request(f"p{i}", prompt, plain))
        turn = 0
        while core.has_unfinished():
            turn += 1
            if turn == 6:  # the pipeline is full by now
                depths.append(core.pipeline_depths.copy())
                core.add_request(Request(f"p{len(PROMPTS)}", prompts[-1], penalised))
            for out in core.step():
                got[out.request.request_id] += out.new_token_ids
                if out.finish_reason is not None and out.request.uses_penalties:
                    depths.append(core.pipeline_depths.copy())
        depths.append(core.pipeline_depths.copy())
    finally:
        core.shutdown()
    one = LLM(str(tmp_path), block_size=BLOCK_SIZE, num_kv_blocks=96, max_model_len=128)
    expected = [o.token_ids for o in one.generate(prompts, params, detokenize=False)]
    assert [got[f"p{i}"] for i in range(len(prompts))] == expected
    before, during, after = depths[0], depths[1] - depths[0], depths[2] - depths[1]
    assert max(before) == 4
    assert not during, "a step launched into the stages while a penalised request was live"
    assert max(after) == 4


# ---- what is refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"enable_lora": True}, "--enable-lora with --pipeline-parallel-size > 1"),
        ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
         "--speculative-config with --pipeline-parallel-size > 1"),
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True},
         "--enable-expert-parallel with --pipeline-parallel-size > 1"),
        ({"pipeline_parallel_size": 0}, "--pipeline-parallel-size 0 must both be at least 1"),
        ({"pipeline_parallel_size": 3, "nnodes": 2, "master_addr": "127.0.0.1"},
         "--tensor-parallel-size 1 x --pipeline-parallel-size 3 must be a multiple of --nnodes 2"),
    ],
)  # fmt: skip
def test_what_does_not_compose_with_stages_is_refused_by_name(
    fields: dict[str, object], said: str
) -> None:
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        EngineConfig(**({"pipeline_parallel_size": 2} | fields))


@pytest.mark.parametrize(
    ("name", "size", "said"),
    [
        ("gemma3_groups", 2, "only Llama-family text models .* not this gemma3 model"),
        ("gpt2", 2, "only Llama-family text models .* not this gpt2 model"),
        ("llama", 3, "at most the model's number of decoder layers \\(2\\)"),
    ],
)
def test_models_that_do_not_split_are_refused_before_any_worker_starts(
    name: str, size: int, said: str, tmp_path: Path
) -> None:
    write_model(name, tmp_path)
    with pytest.raises(ValueError, match=f"--pipeline-parallel-size {size}.*{said}"):
        LLM(str(tmp_path), pipeline_parallel_size=size, num_kv_blocks=96, block_size=4)
    assert children_running_spawn(os.getpid()) == []


def test_layers_in_several_kv_groups_are_refused() -> None:
    """No Llama-family checkpoint has layer groups today; one that had would be refused: each
    stage would group its own layers differently from the scheduler's tables."""
    hf = CONFIGS["gemma3_groups"]().to_dict()
    grouped = dataclasses.replace(model_config_from_hf(hf), architecture="llama")
    check_pipeline_parallel(dataclasses.replace(grouped, layer_types=None), 2)  # one group
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2: .* several KV layer groups"):
        check_pipeline_parallel(grouped, 2)


def test_the_flag_is_on_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "pipeline stages the decoder layers split into" in parser.format_help()
    args = parser.parse_args(["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"])
    config = engine_config_from_args(args)
    assert (config.pipeline_parallel_size, config.world_size) == (2, 4)


# ---- a lost stage ------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_restarts_an_engine_that_lost_a_stage_and_the_stream_resumes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tandem serve --pipeline-parallel-size 2`: the last stage's worker is killed mid-stream;
    the engine core exits (code 70), the server starts a new one, and the stream goes on to
    the same text as an undisturbed run (the official client sees one unbroken stream)."""
    import openai

    from tests.server_fixture import start_server, stop_server
    from tests.test_resume import metric, wait_restarted

    flags = ["--pipeline-parallel-size", "2", "--max-model-len", "512", "--num-kv-blocks", "128",
             "--max-num-seqs", "4"]  # fmt: skip
    srv = start_server(tmp_path, model=str(tiny_model_dir), args=flags)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
        request = {"model": str(tiny_model_dir), "prompt": "Once upon a time", "max_tokens": 120,
                   "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        reference = client.completions.create(**request).choices[0].text
        (stage1,) = children_running_spawn(srv.engine_pid)
        text = ""
        for i, chunk in enumerate(client.completions.create(**request, stream=True)):
            text += chunk.choices[0].text if chunk.choices else ""
            if i == 10:
                os.kill(stage1, signal.SIGKILL)
        assert text == reference
        assert metric(srv, "tandem_requests_resumed_total") == 1, "resumed on the new engine"
        wait_restarted(srv, srv.engine_pid)
        assert "worker tandem-tp1" in srv.log_tail(10**6)
        assert client.completions.create(**request).choices[0].text == reference
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_serve_with_three_stages_streams_concurrent_requests_and_frees_the_disconnected(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """`tandem serve --pipeline-parallel-size 3` through the official client: twelve streams at
    once in a small KV pool (preemptions), four of them closed after a few chunks (the server
    aborts them while their micro-batches may be in the stages). Every stream read to its end
    has the text its prompt gets alone, and the engine ends with every block free and its
    integrity check passing."""
    import asyncio

    import openai

    from tests.factories import copy_tokenizer, write_tiny_llama
    from tests.server_fixture import start_server, stop_server, wait_engine_idle
    from tests.test_resume import metric

    model = copy_tokenizer(default_model_dir, write_tiny_llama(tmp_path / "m", num_layers=3,
                                                               vocab_size=49152))  # fmt: skip
    flags = ["--pipeline-parallel-size", "3", "--max-model-len", "256", "--num-kv-blocks", "48",
             "--block-size", "8", "--max-num-seqs", "12"]  # fmt: skip
    srv = start_server(tmp_path, model=str(model), args=flags)
    prompts = [f"Request {i}: " + "tell me more " * (i % 5) for i in range(12)]
    request = {"model": str(model), "max_tokens": 24, "temperature": 0,
               "extra_body": {"ignore_eos": True}}  # fmt: skip

    async def stream(client: openai.AsyncOpenAI, prompt: str, keep: int | None) -> str:
        text, chunks = "", 0
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **request):
            text += chunk.choices[0].text if chunk.choices else ""
            chunks += 1
            if keep is not None and chunks >= keep:
                break  # leaving the stream closes its connection: the server aborts it
        return text

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="unused") as client:
            keeps = [3 if i % 3 == 0 else None for i in range(len(prompts))]
            streams = [stream(client, p, k) for p, k in zip(prompts, keeps, strict=True)]
            return await asyncio.gather(*streams)

    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
        alone = [client.completions.create(prompt=p, **request).choices[0].text for p in prompts]
        together = asyncio.run(all_at_once())
        for i, (a, b) in enumerate(zip(alone, together, strict=True)):
            assert b == a if i % 3 else a.startswith(b), i
        wait_engine_idle(srv)
        # The counts reach /metrics periodically: the run's preemptions show within a while.
        deadline = time.monotonic() + 10
        while metric(srv, "tandem_num_preemptions_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(srv, "tandem_num_preemptions_total") > 0
    finally:
        stop_server(srv)
