"""Speculative decoding on a model with linear-attention layers (Qwen3-Next), on the CPU against
HF transformers: a verify step writes the state after each of its positions to a row of its own,
and a step that keeps some drafts but not all copies the state after the last kept one into the
slot (state_snapshots.py ``KeptDraftState``) before the next step reads it or a save copies it.

Greedy outputs equal HF's with drafts kept, rejected and half kept (scripted drafts: HF's own
next tokens with one changed at a chosen index), alone, batched beside a chunked prompt, under
preemption, and on a later turn resuming at a state its first turn saved while it speculated;
and with the real proposers: n-gram prompt lookup, a random draft model (the checkpoint's MTP
layer: tests/test_speculative_qwen3_next_mtp.py). EAGLE-3 is refused by name on such models."""

# The tiny model's fixture comes from tests/test_models_qwen3_next.py, as a parameter named like
# the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.llm import LLM
from engine_core.memory_plan import Budget, MemoryPlan, plan_memory, state_slot_bytes
from engine_core.models import build_model, model_config_from_hf
from engine_core.state_snapshots import KeptDraftState
from protocol.messages import SamplingParams
from tests.factories import write_tiny_llama
from tests.paged_harness import hf_greedy, random_prompts
from tests.test_models_qwen3_next import VOCAB, hf_dict, qwen3_next  # noqa: F401
from tests.test_models_qwen3_next import make_llm as qwen3_next_llm

K = 3
NGRAM = f'{{"method": "ngram", "num_speculative_tokens": {K}, "prompt_lookup_min": 1}}'


def make_llm(folder: Path, **kwargs: Any) -> LLM:
    """tests/test_models_qwen3_next.py's engine, speculating by prompt lookup unless told."""
    return qwen3_next_llm(folder, **({"speculative_config": NGRAM} | kwargs))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def repeating_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    """Each a random run of 9 tokens said again and again: prompt lookup drafts its next ones,
    which the model sometimes continues and sometimes not."""
    runs = [random_prompts(VOCAB, (10 + i,))[0][:9] for i in range(len(lengths))]
    return [(run * (length // 9 + 1))[:length] for run, length in zip(runs, lengths, strict=True)]


def hf_tokens(hf_model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [hf_greedy(hf_model, prompt, new).tokens[0] for prompt in prompts]


class KeptStates:
    """Counts the block manager's kept-draft copies (every plan's, as the runner takes them)."""

    def __init__(self, llm: LLM) -> None:
        self.positions: list[int] = []
        manager = llm.engine.scheduler.block_manager
        take = manager.take_state_copies

        def counted() -> tuple[Any, ...]:
            copies = take()
            self.positions += [c.position for c in copies if isinstance(c, KeptDraftState)]
            return copies

        manager.take_state_copies = counted  # type: ignore[method-assign]


def check_all_given_back(llm: LLM, slots: int) -> None:
    manager = llm.engine.scheduler.block_manager
    manager.check_integrity()
    assert manager.num_used_blocks == 0 and manager.num_free_state_slots == slots


class ScriptedDrafts:
    """A proposer in prompt lookup's place whose drafts are HF's next tokens with the one at
    index ``step % (K + 1)`` changed (none at K): steps keep 0, 1, ... K drafts in turn."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers
        self.steps = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        prompt = next(p for p in self.answers if tuple(token_ids[: len(p)]) == p)
        done = len(token_ids) - len(prompt)
        drafts = self.answers[prompt][done : done + k]
        wrong = self.steps % (K + 1)
        self.steps += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % VOCAB
        return drafts


def check_every_count_kept(llm: LLM, prompts: list[list[int]], want: list[list[int]]) -> None:
    """``llm`` (ScriptedDrafts of ``want``) gives ``want`` for ``prompts``, batched, keeping
    none, one and two of its three drafts at some step (each kept draft's state copied into its
    slot); every block and slot comes back. Shuts the engine down."""
    kept = KeptStates(llm)
    try:
        got = llm.generate(prompts, greedy(40), detokenize=False)
        assert [o.token_ids for o in got] == want
        counts = llm.engine.scheduler.counts()
        assert 0 < counts.spec_accepted_tokens < counts.spec_draft_tokens
        assert set(kept.positions) == set(range(K))  # none kept, one, two (of three)
        check_all_given_back(llm, 4)
    finally:
        llm.engine.shutdown()


def script(llm: LLM, prompts: list[list[int]], answers: list[list[int]]) -> None:
    """The engine's prompt lookup replaced by ScriptedDrafts of these answers."""
    scripted = ScriptedDrafts({tuple(p): a for p, a in zip(prompts, answers, strict=True)})
    llm.engine.scheduler._lookup = scripted  # type: ignore[assignment]


def test_kept_rejected_and_half_kept_drafts_give_hfs_tokens(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """Four prompts batched, one of them chunked: drafts kept in every count from none to all
    (a kept draft's state copied from each draft row) give HF's tokens."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (20, 45, 150, 31))
    want = hf_tokens(hf_model, prompts, 40)
    llm = make_llm(folder, max_num_batched_tokens=64)
    script(llm, prompts, want)
    check_every_count_kept(llm, prompts, want)


def test_prompt_lookup_on_repeating_prompts_gives_hfs_tokens(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """The real n-gram proposer on prompts that repeat themselves: what it drafts is mostly
    rejected by this random model, some kept; the tokens are HF's."""
    folder, hf_model = qwen3_next
    prompts = repeating_prompts((20, 45, 150, 31))
    llm = make_llm(folder, max_num_batched_tokens=64)
    try:
        got = llm.generate(prompts, greedy(40), detokenize=False)
        assert [o.token_ids for o in got] == hf_tokens(hf_model, prompts, 40)
        counts = llm.engine.scheduler.counts()
        assert 0 < counts.spec_accepted_tokens < counts.spec_draft_tokens
        check_all_given_back(llm, 4)
    finally:
        llm.engine.shutdown()


def test_preempted_speculating_requests_recompute_their_state(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """A pool too small for three long speculating requests: the preempted ones give their
    slot back (a kept draft's copy may still be on its way to it) and recompute from zero."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (150, 210, 97))
    want = hf_tokens(hf_model, prompts, 24)
    llm = make_llm(
        folder, num_kv_blocks=20, max_model_len=320, max_num_batched_tokens=48, max_num_seqs=3
    )
    script(llm, prompts, want)
    try:
        got = llm.generate(prompts, greedy(24), detokenize=False)
        assert [o.token_ids for o in got] == want
        counts = llm.engine.scheduler.counts()
        assert counts.preemptions > 0 and counts.spec_accepted_tokens > 0
        check_all_given_back(llm, 3)
    finally:
        llm.engine.shutdown()


def test_a_later_turn_resumes_at_a_state_saved_while_speculating(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """Turn 1 speculates through its answer, saving states at the block boundaries its steps
    land on (after a kept draft's copy); turn 2 (turn 1's prompt and answer, then more) hits
    past the prompt, at one of those, and still gives HF's tokens."""
    folder, hf_model = qwen3_next
    first = random_prompts(VOCAB, (40,))[0]
    want = hf_tokens(hf_model, [first], 60)[0]
    llm = make_llm(folder)
    script(llm, [first], [want])
    try:
        answer = llm.generate([first], greedy(60), detokenize=False)[0].token_ids
        assert answer == want
        second = first + answer + random_prompts(VOCAB, (5,))[0]
        before = llm.engine.scheduler.counts().prefix_cache_hits
        got = llm.generate([second], greedy(20), detokenize=False)[0].token_ids
        hits = llm.engine.scheduler.counts().prefix_cache_hits - before
        assert hits > 32  # past the prompt's last block boundary: a state saved while decoding
        assert got == hf_tokens(hf_model, [second], 20)[0]
    finally:
        llm.engine.shutdown()


def test_a_draft_model_drafting_for_a_hybrid_target_gives_hfs_tokens(
    qwen3_next: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """A random Llama of the same vocabulary drafts on the target's attention blocks: its
    drafts are nearly all rejected, so the slot takes the state after the first position step
    after step; the tokens are HF's."""
    folder, hf_model = qwen3_next
    draft = write_tiny_llama(tmp_path / "draft", vocab_size=VOCAB)
    spec = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 2}}'
    prompts = random_prompts(VOCAB, (30, 70))
    llm = make_llm(folder, speculative_config=spec)
    kept = KeptStates(llm)
    try:
        got = llm.generate(prompts, greedy(16), detokenize=False)
        assert [o.token_ids for o in got] == hf_tokens(hf_model, prompts, 16)
        assert 0 in kept.positions
        check_all_given_back(llm, 4)
    finally:
        llm.engine.shutdown()


def test_eagle3_is_refused_by_name(qwen3_next: tuple[Path, torch.nn.Module]) -> None:
    """Not tested on these layers (the checkpoint's MTP layer is:
    tests/test_speculative_qwen3_next_mtp.py)."""
    folder, _ = qwen3_next
    spec = f'{{"method": "eagle3", "model": "{folder}", "num_speculative_tokens": 2}}'
    with pytest.raises(ValueError, match="method 'eagle3' is not supported for models with"):
        make_llm(folder, speculative_config=spec)


def test_the_draft_rows_are_counted_in_the_memory_plan() -> None:
    """K draft rows per slot, beside the slots and the saved states (4 slots, K = 3)."""
    config = model_config_from_hf(hf_dict())
    slot = state_slot_bytes(config, torch.float32)
    with torch.device("meta"):
        module = build_model(config)
    cpu, f32 = torch.device("cpu"), torch.float32

    def plan(**kwargs: Any) -> MemoryPlan:
        engine = EngineConfig(
            max_num_seqs=4, max_model_len=256, num_kv_blocks=40, block_size=16, **kwargs
        )
        return plan_memory(engine, config, module, cpu, f32, f32, Budget(2**40, "test"))

    plain, speculating = plan(), plan(speculative_config=NGRAM)
    assert speculating.kv_bytes - plain.kv_bytes == 4 * K * slot
    assert speculating.min_kv_bytes - plain.min_kv_bytes == 4 * K * slot
