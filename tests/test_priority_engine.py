"""The priority policy on a real EngineCore (a tiny random Llama, with and without overlap): a
better-priority request finishes first where FCFS would finish the other first, its tokens are
what it gets alone, and no block is left held.

Deterministic by construction: the KV pool and the step in which each request arrives decide
who is preempted, never how fast a step runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.request import Request
from protocol.messages import SamplingParams
from tests.factories import write_tiny_llama

BLOCK = 4
VOCAB = 384
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB)


def make_core(model: Path, overlap: bool, policy: str, **config: object) -> EngineCore:
    options: dict[str, object] = {"num_kv_blocks": 64, "block_size": BLOCK}
    options.update(config)
    return EngineCore(
        EngineConfig(
            model=str(model),
            device="cpu",
            async_scheduling=overlap,
            scheduling_policy=policy,
            **options,
        )
    )


def finishing_order(core: EngineCore, arrivals: dict[int, list[Request]]) -> list[str]:
    """Step the core to the end, adding each request at its step; the ids in finishing order."""
    order: list[str] = []
    step = 0
    while core.has_unfinished() or step <= max(arrivals):
        for request in arrivals.get(step, []):
            core.add_request(request)
        order += [out.request.request_id for out in core.step() if out.finish_reason is not None]
        step += 1
    return order


def alone(model: Path, prompt: list[int]) -> list[int]:
    core = make_core(model, False, "fcfs")
    request = Request("alone", prompt, GREEDY)
    finishing_order(core, {0: [request]})
    return request.output_token_ids


LOW_PROMPT = list(range(10, 18))  # 8 tokens each: 2 blocks, growing to 6 with 16 outputs
HIGH_PROMPT = list(range(40, 48))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    ("policy", "low_priority", "first"), [("priority", 5, "high"), ("fcfs", 0, "low")]
)
def test_the_better_priority_finishes_first_when_blocks_run_out(
    tiny_llama: Path, overlap: bool, policy: str, low_priority: int, first: str
) -> None:
    """ "low" is admitted first and "high" a step later; their 12 blocks do not fit in 8, so one
    is preempted. Under FCFS that is the later admitted ("high"), and "low" finishes first; under
    the priority policy it is the worse ranked ("low", though it started first)."""
    core = make_core(tiny_llama, overlap, policy, num_kv_blocks=8, enable_prefix_caching=False)
    low = Request("low", LOW_PROMPT, GREEDY, priority=low_priority)
    high = Request("high", HIGH_PROMPT, GREEDY)
    order = finishing_order(core, {0: [low], 1: [high]})
    assert order == [first, "low" if first == "high" else "high"]
    preempted = low if first == "high" else high
    assert preempted.num_preemptions > 0
    # Recomputed after its preemption, each has the tokens it gets alone.
    assert low.output_token_ids == alone(tiny_llama, LOW_PROMPT)
    assert high.output_token_ids == alone(tiny_llama, HIGH_PROMPT)
    assert core.scheduler.block_manager.num_used_blocks == 0
    core.scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_full_batch_admits_the_better_priority_first(tiny_llama: Path, overlap: bool) -> None:
    """One running seat: "late" (priority -1) arrives after "early" (priority 3) while "first"
    runs, and takes the seat before it."""
    core = make_core(tiny_llama, overlap, "priority", max_num_seqs=1, max_num_batched_tokens=64)
    first = Request("first", [5, 6, 7], GREEDY)
    early = Request("early", [8, 9], GREEDY, priority=3)
    late = Request("late", [10, 11], GREEDY, priority=-1)
    assert finishing_order(core, {0: [first], 1: [early], 2: [late]}) == ["first", "late", "early"]
    assert core.scheduler.block_manager.num_used_blocks == 0
    core.scheduler.block_manager.check_integrity()


def test_fcfs_refuses_a_priority_and_holds_nothing(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, False, "fcfs")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        core.add_request(Request("r", [5, 6], GREEDY, priority=-2))
    assert not core.has_unfinished()
    assert core.scheduler.block_manager.num_used_blocks == 0
