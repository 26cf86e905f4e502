"""A step longer than a client's silence limit is announced, not taken for death.

The engine sends nothing while a step runs; on the CPU a long prompt's step runs for seconds
(minutes for a larger model), past --engine-timeout. Before such a step the engine sends a
heartbeat with the time it expects (engine_core/step_clock.py), and its clients count silence
from then. Checked on the real engine of the default model: a 1,900-token prompt's step (seconds
on the CPU) under a one-second silence limit, through the sync client and the asyncio client
the API server uses; and the clock's arithmetic by hand.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import pytest

from engine_core.config import ModelConfig
from engine_core.request import ScheduledRequest
from engine_core.step_clock import (
    BUSY_MARGIN,
    BUSY_SLACK_S,
    PRIOR_FLOPS_PER_S,
    RATE_WEIGHT,
    StepClock,
    StepWork,
)
from protocol.client import AsyncEngineClient, EngineClient
from protocol.codec import decode_engine_message, encode
from protocol.messages import MAX_BUSY_S, FinishReason, Heartbeat, SamplingParams

# Fixtures are parameters named like the imported fixture, hence F811 off for this file.
# ruff: noqa: F811
from tests.server_fixture import Server, server, wait_engine_idle  # noqa: F401

PROMPT_TOKENS = 1900  # one step of seconds on two cores, within the fixture's 2,048
SILENCE_S = 1.0  # the shortest --engine-timeout there is (two heartbeats)
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)  # fresh ids: no prefix-cache hit shortens the step
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


@pytest.mark.slow
def test_a_long_step_is_no_death_to_the_sync_client(server: Server) -> None:
    """generate() with a one-second silence limit: the prompt's step is silent for seconds, yet
    the request ends with its tokens instead of a TimeoutError."""
    with EngineClient(server.engine_address) as client:
        client.connect(timeout=30)
        started = time.monotonic()
        outs = list(client.generate("long-sync", long_prompt(1), PARAMS, timeout=SILENCE_S))
        took = time.monotonic() - started
    assert sum(len(o.new_token_ids) for o in outs) == 2
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert took > 2 * SILENCE_S, f"{took:.1f} s: the step was too short to test anything"
    wait_engine_idle(server)


@pytest.mark.slow
def test_a_long_step_keeps_the_async_client_healthy(server: Server) -> None:
    """The asyncio client (the API server's) with a one-second death limit: through the long
    step it never declares the engine dead, and the request completes."""

    async def main() -> tuple[list[int], bool, float]:
        async with AsyncEngineClient(server.engine_address, dead_after_s=SILENCE_S) as client:
            await client.connect(timeout=30)
            tokens: list[int] = []
            healthy = True
            started = time.monotonic()

            async def watch() -> None:
                nonlocal healthy
                while True:
                    healthy = healthy and client.healthy
                    await asyncio.sleep(0.05)

            watcher = asyncio.ensure_future(watch())
            try:
                async for out in client.generate("long-async", long_prompt(2), PARAMS):
                    tokens += out.new_token_ids
            finally:
                watcher.cancel()
            return tokens, healthy, time.monotonic() - started

    tokens, healthy, took = asyncio.run(main())
    assert len(tokens) == 2 and healthy
    assert took > 2 * SILENCE_S, f"{took:.1f} s: the step was too short to test anything"
    wait_engine_idle(server)


def _model(**fields: int) -> ModelConfig:
    base = dict(
        architecture="llama", vocab_size=100, hidden_size=8, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, intermediate_size=16, max_position_embeddings=64,
    )  # fmt: skip
    return ModelConfig(**{**base, **fields})  # type: ignore[arg-type]


def _rows(*chunks: tuple[int, int]) -> Sequence[ScheduledRequest]:
    """Rows of (start, new tokens); only those two fields are read."""
    return [ScheduledRequest(None, new, [], start, True) for start, new in chunks]  # type: ignore[arg-type]


def test_step_work_by_hand() -> None:
    # Per layer: q, k, v, o projections 8 x (8 + 4 + 4 + 8) = 192; the MLP 3 x 8 x 16 = 384.
    work = StepWork.of(_model())
    assert work.per_token == 2.0 * 2 * (192 + 384)
    assert work.per_pair == 4.0 * 2 * 8  # QK^T and PV over the query heads' width
    # A prompt's first chunk of 3 (pairs 1 + 2 + 3), a decode at 10 (11 pairs), a chunk of 2
    # after 5 (6 + 7).
    pairs = 6 + 11 + 13
    assert (
        work.of_step(_rows((0, 3), (10, 1), (5, 2))) == work.per_token * 6 + work.per_pair * pairs
    )
    # Experts: the routed ones a token reaches, and the shared ones, in place of the MLP.
    moe = StepWork.of(_model(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                             n_shared_experts=1))  # fmt: skip
    assert moe.per_token == 2.0 * 2 * (192 + 3 * 8 * (2 + 1) * 4)


def test_the_clock_announces_long_steps_from_the_measured_rate() -> None:
    clock = StepClock(StepWork(per_token=1.0, per_pair=0.0))
    assert clock.busy_for_s(0.1 * PRIOR_FLOPS_PER_S) == 0.0  # shorter than a heartbeat's interval
    assert clock.busy_for_s(10 * PRIOR_FLOPS_PER_S) == BUSY_MARGIN * 10 + BUSY_SLACK_S
    clock.observe(1e9, 0.01)  # too short to say anything of the rate
    assert clock.flops_per_s == PRIOR_FLOPS_PER_S
    clock.observe(4e9, 2.0)  # the first measure replaces the assumed rate
    assert clock.flops_per_s == 2e9
    clock.observe(12e9, 2.0)
    assert clock.flops_per_s == pytest.approx(2e9 + RATE_WEIGHT * (6e9 - 2e9))
    assert clock.busy_for_s(clock.flops_per_s * 30) == pytest.approx(
        BUSY_MARGIN * 30 + BUSY_SLACK_S
    )
    # However large the step, no more than a heartbeat frame may carry.
    beat = Heartbeat(1, clock.busy_for_s(clock.flops_per_s * 10 * MAX_BUSY_S))
    assert beat.busy_for_s == MAX_BUSY_S
    assert decode_engine_message(encode(beat)) == beat
