"""The verify step's shape (docs/design/speculative-decoding.md, "The verify step"): the input
batch marks a step whose every sequence has the same Q > 1 new tokens (``uniform_query_len``),
which the Triton backend attends with its verify kernel and the CUDA graphs replay as a verify
graph; and, through a speculating engine on the CPU, that every step a self-draft verifies is
marked so while the output stays the plain engine's. The kernel itself:
tests/test_verify_attention.py; the graphs on a GPU: tests/test_speculative_verify_gpu.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine_core.input_batch import InputBatch
from engine_core.llm import LLM
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from protocol.messages import SamplingParams
from tests.test_speculative_draft import draft_config

BLOCK = 4
K = 4


def chunk(name: str, known: int, new: int, drafts: int = 0) -> ScheduledRequest:
    """A request of ``known`` tokens whose step computes its last ``new`` (with ``drafts`` of
    them drafts after its last known token)."""
    request = Request(name, list(range(3, 3 + known)), SamplingParams(max_tokens=8))
    request.token_ids += [5] * drafts
    total = known + drafts
    blocks = list(range(-(-total // BLOCK)))
    start = total - new
    return ScheduledRequest(request, new, blocks, start, True, tuple([5] * drafts))


def packed_uniform(rows: list[ScheduledRequest], mark: bool = True) -> int:
    batch = InputBatch(torch.device("cpu"), BLOCK, 256, 8, 64, mark_uniform=mark)
    return batch.pack(SchedulerOutput(rows), [], None).meta.uniform_query_len


def test_a_step_of_equal_chunks_is_marked_with_their_length() -> None:
    verify = [chunk(f"r{i}", 9 + 7 * i, K + 1, drafts=K) for i in range(3)]
    assert packed_uniform(verify) == K + 1
    # One row with fewer drafts: rows differ, the prefill kernel's shape.
    assert packed_uniform([*verify[:2], chunk("short", 20, 3, drafts=2)]) == 0
    # A prompt row beside verify rows: the same.
    assert packed_uniform([*verify, chunk("prompt", 30, 30)]) == 0
    # Decodes are the decode kernel's (one query each), not the verify kernel's.
    assert packed_uniform([chunk(f"d{i}", 10 + i, 1) for i in range(3)]) == 0
    # The mark is the shape alone: prompt chunks as long as each other attend the same way.
    assert packed_uniform([chunk("p", 5, 5), chunk("q", 12, 5)]) == 5
    # A plain engine's input batch marks nothing (its runner asks for no marks).
    assert packed_uniform(verify, mark=False) == 0


def record_steps(llm: LLM) -> list[tuple[int, list[int]]]:
    """Each target forward's (uniform_query_len, query lengths), recorded as it runs."""
    runner = llm.engine.runner
    steps: list[tuple[int, list[int]]] = []
    forward = runner._forward

    def recorded(inputs: Any) -> torch.Tensor:
        starts = inputs.meta.query_start_loc_cpu
        lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        steps.append((inputs.meta.uniform_query_len, lengths))
        return forward(inputs)

    runner._forward = recorded
    return steps


def test_a_self_draft_verifies_in_marked_steps_and_gives_the_plain_tokens(
    tmp_path: Path,
) -> None:
    from tests.factories import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", vocab_size=384)
    options = {"device": "cpu", "dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 256}
    prompts = [[7 + i, 40, 12 + 3 * i, 99] * (1 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(model), **options)
    want = [o.token_ids for o in plain.generate(prompts, params, detokenize=False)]
    assert not plain.engine.runner.input_batch.mark_uniform
    spec = LLM(str(model), speculative_config=draft_config(model, K), **options)
    steps = record_steps(spec)
    products = count_logit_products(spec)
    got = [o.token_ids for o in spec.generate(prompts, params, detokenize=False)]
    assert got == want
    for uniform, lengths in steps:
        equal = len(set(lengths)) == 1 and lengths[0] > 1
        assert uniform == (lengths[0] if equal else 0), (uniform, lengths)
    assert sum(uniform == K + 1 for uniform, _ in steps) >= 3
    # Every step samples; a verify step's drafted and sampling rows share one LM-head product.
    assert products["calls"] == len(steps)


def count_logit_products(llm: LLM) -> dict[str, int]:
    """Count the target's LM-head products (the draft has its own model)."""
    model = llm.engine.runner.model
    counts = {"calls": 0}
    compute = model.compute_logits

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts["calls"] += 1
        return compute(*args, **kwargs)

    model.compute_logits = counted
    return counts
