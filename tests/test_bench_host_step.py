"""scripts/bench_host_step.py drives the engine's real host path: after its steps every request
holds the tokens its steps sampled, each at its own place, and its block table covers them."""

from __future__ import annotations

import pytest

from engine_core.scheduler import PLACEHOLDER
from tests.script_modules import load_script


@pytest.mark.parametrize("advance", [True, False])
def test_decode_loop_gives_every_request_its_tokens_in_order(advance: bool) -> None:
    """Whether steady decode steps advance the last step's inputs or are packed in full."""
    bench = load_script("bench_host_step")
    loop = bench.DecodeLoop(batch=6, advance=advance)
    for _ in range(40):  # past two 16-token block boundaries
        timed = loop.step()
        assert set(timed) == set(bench.PHASES)
    prompt = bench.PROMPT_TOKENS
    for request in loop.requests:
        outputs = request.token_ids[prompt:]
        assert outputs[-1] == PLACEHOLDER  # the step still in flight (overlap)
        # The token sampled at seq_len n goes to index n: 128, 129, ... (the first at 128).
        assert outputs[:-1] == list(range(prompt, prompt + len(outputs) - 1))
        assert len(outputs) == 40
        table = loop.scheduler.block_manager.block_table(request.request_id)
        assert len(table) * 16 >= request.num_computed_tokens


def test_boundary_steps_are_those_whose_tables_grow() -> None:
    """The block-boundary steps that the script reports apart are exactly those in which every
    request's block table grows by a block: one step in every block_size."""
    bench = load_script("bench_host_step")
    loop = bench.DecodeLoop(batch=4)
    manager = loop.scheduler.block_manager
    for _ in range(3):  # the prefill and the first decodes
        loop.step()
    boundaries = 0
    for _ in range(48):
        before = [len(manager.block_table(r.request_id)) for r in loop.requests]
        boundary = loop.at_boundary()
        loop.step()
        after = [len(manager.block_table(r.request_id)) for r in loop.requests]
        assert after == [n + boundary for n in before]
        boundaries += boundary
    assert boundaries == 48 // loop.scheduler.config.block_size
