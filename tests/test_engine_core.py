"""EngineCore end to end in one process: mixed batches and preemption change no token.

The reference for every request is the same request run alone, with no prefix cache and a budget
large enough that nothing is chunked or preempted.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine_core.core import EngineCore
from engine_core.llm import LLM
from engine_core.request import Request, SchedulerOutput
from protocol.messages import FinishReason, SamplingParams
from tests.factories import write_tiny_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_prompts(n: int, length: int, seed: int, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_alone(model_dir: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    llm = LLM(
        str(model_dir), device="cpu", block_size=4, enable_prefix_caching=False, num_kv_blocks=256
    )
    return [llm.generate([p], params, detokenize=False)[0].token_ids for p in prompts]


def step_recording(core: EngineCore, plans: list[set[str]]) -> dict[str, list[int]]:
    """EngineCore.step, keeping what each step mixed (read before the step moves the requests)."""
    plan = core.scheduler.schedule()
    plans.append(_kinds(plan))
    result = core.runner.execute(plan)
    outs = core.scheduler.update_from_output(plan, result.sampled_token_ids)
    return {o.request.request_id: o.new_token_ids for o in outs}


def test_mixed_batch_equals_each_request_alone(tiny_llama: Path) -> None:
    """Prefills, prompt chunks, cached-prefix prefills and decodes in one batch: same tokens."""
    shared = make_prompts(1, 16, seed=1)[0]  # 4 full blocks of 4 tokens
    prompts = {
        "a": shared + make_prompts(1, 6, seed=2)[0],
        "b": make_prompts(1, 40, seed=3)[0],  # longer than the budget: chunked
        "c": shared + make_prompts(1, 9, seed=4)[0],  # shares a's first 4 blocks
        "d": make_prompts(1, 5, seed=5)[0],
    }
    expected = dict(
        zip(prompts, run_alone(tiny_llama, list(prompts.values()), GREEDY), strict=True)
    )

    llm = LLM(
        str(tiny_llama),
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    core = llm.engine
    got: dict[str, list[int]] = {k: [] for k in prompts}
    plans: list[set[str]] = []
    core.add_request(Request("a", prompts["a"], GREEDY))
    for _ in range(3):  # a is decoding by the time the others arrive
        for rid, toks in step_recording(core, plans).items():
            got[rid] += toks
    requests = {k: Request(k, prompts[k], GREEDY) for k in "bcd"}
    for r in requests.values():
        core.add_request(r)
    while core.has_unfinished():
        for rid, toks in step_recording(core, plans).items():
            got[rid] += toks

    assert got == expected
    assert requests["c"].num_cached_tokens == 16, "c should reuse a's four cached blocks"
    assert any(kinds >= {"decode", "chunk"} for kinds in plans), "no step mixed decode + chunk"
    assert any(kinds >= {"decode", "chunk", "prefill"} for kinds in plans)


def _kinds(plan: SchedulerOutput) -> set[str]:
    kinds = set()
    for s in plan.scheduled:
        if s.start >= s.request.num_prompt_tokens:
            kinds.add("decode")
        elif not s.samples:
            kinds.add("chunk")
        else:
            kinds.add("prefill")
    return kinds


def test_preemption_by_recompute_changes_no_token(tiny_llama: Path) -> None:
    """A KV pool too small for every request at once: preempted requests finish identically."""
    prompts = make_prompts(6, 14, seed=7)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = run_alone(tiny_llama, prompts, params)

    # Each request needs ceil((14 + 20) / 4) = 9 blocks; 20 blocks hold two at most.
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=20, max_model_len=64)
    outs = llm.generate(prompts, params, detokenize=False)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_seeded_sampling_survives_preemption_and_batching(tiny_llama: Path) -> None:
    """The same seed gives the same tokens alone, in a crowd, and when preempted."""
    prompts = make_prompts(5, 10, seed=11)
    params = [
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        for i in range(5)
    ]
    alone = [
        LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64)
        .generate([p], q, detokenize=False)[0]
        .token_ids
        for p, q in zip(prompts, params, strict=True)
    ]
    crowded = LLM(
        str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=16, max_model_len=32
    ).generate(prompts, params, detokenize=False)
    assert [o.token_ids for o in crowded] == alone


def test_prompt_ids_are_checked_against_the_vocabulary_at_its_bounds(tiny_llama: Path) -> None:
    core = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=16).engine
    vocab = core.model_config.vocab_size
    for bad in ([vocab], [1, -1], [3, vocab + 5, 2]):
        with pytest.raises(ValueError, match=rf"prompt token ids must lie in \[0, {vocab}\)"):
            core.add_request(Request("bad", bad, GREEDY))
    assert not core.has_unfinished()  # nothing of the refused ones was queued
    core.add_request(Request("edges", [0, vocab - 1], GREEDY))
    while core.has_unfinished():
        core.step()


def test_generate_that_fails_on_a_later_prompt_leaves_the_engine_as_it_was(
    tiny_llama: Path,
) -> None:
    """A prompt the engine refuses fails the whole call before anything runs: the prompts
    before it are not left behind for the next call to trip over, and no block is held."""
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    good = make_prompts(2, 6, seed=9)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([*good, [10**6]], GREEDY, detokenize=False)  # out of the vocabulary
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(good, [GREEDY, SamplingParams(top_p=0.0)], detokenize=False)
    assert not llm.engine.has_unfinished()
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    again = [o.token_ids for o in llm.generate(good, GREEDY, detokenize=False)]
    assert again == run_alone(tiny_llama, good, GREEDY)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_call_cut_by_ctrl_c_leaves_the_llm_serving_and_no_block_held(
    tiny_llama: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the middle of generate() (here: the third step raises KeyboardInterrupt, as a
    terminal's signal would between two bytecodes of it) aborts that call's requests; the next
    call gets each prompt's tokens as if run alone, and no block stays held. With overlap the
    cut call's last step was in flight: its outputs come in the next call and are dropped."""
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64,
              async_scheduling=overlap)  # fmt: skip
    prompts = make_prompts(3, 6, seed=21)
    real_step, calls = llm.engine.step, []

    def interrupted_step() -> list:
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, detokenize=False)
    assert llm.engine.scheduler.num_running == 0 and not llm.engine.scheduler.waiting
    again = [o.token_ids for o in llm.generate(prompts, GREEDY, detokenize=False)]
    assert again == run_alone(tiny_llama, prompts, GREEDY)
    assert not llm.engine.has_unfinished()
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_burst_sharing_a_prefix_reads_it_from_the_step_that_computes_it(
    tiny_llama: Path, overlap: bool
) -> None:
    """Prompts sharing 16 tokens arrive at once: the first computes the shared blocks and the
    others, admitted in the same step, attend to them as that step writes them (every layer
    writes the step's K/V before any row attends). Same tokens as each request alone."""
    shared = make_prompts(1, 16, seed=12)[0]
    prompts = [shared + tail for tail in make_prompts(4, 5, seed=13)]
    expected = run_alone(tiny_llama, prompts, GREEDY)
    llm = LLM(
        str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=256, async_scheduling=overlap
    )
    core = llm.engine
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    outputs = core.step()  # one plan admits them all
    assert [r.num_cached_tokens for r in requests] == [0, 16, 16, 16]
    while core.has_unfinished():
        outputs += core.step()
    outputs += core.step()  # with overlap, the last step's tokens
    for out in outputs:
        got[out.request.request_id] += out.new_token_ids
    assert list(got.values()) == expected


def test_a_failed_step_leaves_no_prefix_behind(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises after its plan registered its prompt's blocks: the next request
    with that prompt finds no prefix (the blocks were never written) and gets the tokens it
    gets alone."""
    prompt = make_prompts(1, 18, seed=14)[0]
    expected = run_alone(tiny_llama, [prompt], GREEDY)
    core = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64).engine
    core.add_request(Request("doomed", prompt, GREEDY))

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(core.runner, "forward", fail)
        with pytest.raises(RuntimeError, match="out of memory"):
            core.step()
    core.abort(["doomed"])  # the server fails the live requests
    again = Request("again", prompt, GREEDY)
    core.add_request(again)
    tokens: list[int] = []
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    tokens += [t for out in core.step() for t in out.new_token_ids]  # overlap's last step
    assert again.num_cached_tokens == 0
    assert tokens == expected[0]
    core.scheduler.block_manager.check_integrity()


def test_offline_generate_takes_one_prompt_as_a_batch_of_one_and_refuses_what_is_no_prompt(
    tiny_model_dir: Path,
) -> None:
    """One text or one list of token ids is one prompt (a str was run as one prompt a
    character); numpy's ids are ids; what is not a prompt or SamplingParams is a TypeError
    naming it, before anything runs."""
    import numpy as np
    import torch

    llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [5, 17, 42]
    [one] = llm.generate(ids, params, detokenize=False)
    assert one.prompt_token_ids == ids
    [same] = llm.generate([ids], params, detokenize=False)
    assert same.token_ids == one.token_ids
    [from_numpy] = llm.generate(np.array(ids), params, detokenize=False)
    assert from_numpy.token_ids == one.token_ids
    # A tokenizer's return_tensors="pt" batch: each row a prompt, its scalars ids.
    rows = llm.generate(torch.tensor([ids, ids]), params, detokenize=False)
    assert [r.token_ids for r in rows] == [one.token_ids] * 2
    assert len(llm.generate(torch.tensor([[5], [17]]), params, detokenize=False)) == 2
    [text] = llm.generate("hello there", params, detokenize=False)
    assert text.prompt_token_ids == llm.tokenizer.encode("hello there")
    bad = [
        (lambda: llm.generate([[1.5, 2]], params), "token ids are ints, not float$"),
        (lambda: llm.generate([5, 1.5], params), "token ids are ints, not float$"),
        (lambda: llm.generate([[True, 5]], params), "token ids are ints, not bool$"),
        (lambda: llm.generate([iter([1.5])], params), "token ids are ints, not float$"),
        (lambda: llm.generate([{"a": 1}], params), "not dict"),
        (lambda: llm.generate(7, params), "not int"),
        (lambda: llm.generate(["a"], {"max_tokens": 3}), "SamplingParams .* not dict"),
        (
            lambda: llm.generate(["a", "b"], [params, {"max_tokens": 3}]),
            "SamplingParams, not dict$",
        ),
    ]
    for call, message in bad:
        with pytest.raises(TypeError, match=message):
            call()
    assert not llm.engine.has_unfinished()


def test_offline_generate_without_a_tokenizer_fails_before_running_unless_ids_stay_ids(
    tmp_path: Path,
) -> None:
    """A folder without a tokenizer: text out needs one, so generate fails at once, before any
    prompt runs (it had run them all, then lost the outputs to the decode), naming the way
    that needs none; with detokenize=False token ids run."""
    from common.hf_tokenizer import TokenizerError

    model_dir = write_tiny_llama(tmp_path / "no-tokenizer")
    llm = LLM(str(model_dir), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with pytest.raises(TokenizerError, match=r"detokenize=False"):
        llm.generate([[5, 17, 42]], params)
    assert llm.engine.num_steps == 0 and not llm.engine.has_unfinished()
    llm.engine.scheduler.block_manager.check_integrity()
    [out] = llm.generate([[5, 17, 42]], params, detokenize=False)
    assert len(out.token_ids) == 3 and out.text == ""
