"""The engine process's host work per steady decode step, without a model: what it costs the
busy loop to plan, pack, update and frame a step of B decoding requests.

    python scripts/bench_host_step.py [--batch 64 256] [--steps 600] [--warmup 100] [--full-pack]

Each batch size runs the engine's own code on this machine's CPU, with overlap on (placeholders
and all): ``Scheduler.schedule`` (plan), ``InputBatch.pack`` on a CPU device (the host buffer
and its numpy fill; on the GPU the copy and the gather launches come on top),
``Scheduler.update_from_output`` with the tokens a step sampled (every request decodes, none
stops), and ``proc.step_frames`` plus the frames' ``encode`` (the STEP_OUTPUTS bytes). It prints
the median microseconds of each phase per step and per request, over the steady steps and,
apart, over the block-boundary steps. The prompts are 128 tokens and every request has the
same length, so the block tables grow in step, as in bench_decode.py's runs: in one step of
every block_size (16) each request's token enters a new block, its table grows (the plan),
the inputs take the new block ids (the pack), and each request's filled block joins the
prefix cache (the update of the step before, in the same busy-loop step under overlap). On the
GPU machine the same code takes this host's CPU; launch_host_probe.py (scripts/device) times the
runner's launch with the GPU in the loop. ``--full-pack`` packs every step in full, where a
steady decode step would advance the last one (InputBatch._advance): the A/B of that path, in
the same process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.config import EngineConfig  # noqa: E402
from engine_core.input_batch import InputBatch  # noqa: E402
from engine_core.request import Request  # noqa: E402
from engine_core.scheduler import Scheduler  # noqa: E402
from engine_core.server import step_frames  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

PHASES = ("schedule", "pack", "update", "frames")
PROMPT_TOKENS = 128
MAX_MODEL_LEN = 8192


class DecodeLoop:
    """B requests decoding in step through the scheduler, the input batch and the frames."""

    def __init__(self, batch: int, advance: bool = True) -> None:
        config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=PROMPT_TOKENS * batch)
        blocks = batch * MAX_MODEL_LEN // config.block_size
        self.scheduler = Scheduler(config, blocks, MAX_MODEL_LEN, [0], async_scheduling=True)
        self.inputs = InputBatch(
            torch.device("cpu"),
            config.block_size,
            config.max_num_batched_tokens,
            batch,
            MAX_MODEL_LEN // config.block_size,
        )
        self.inputs.advance_steady = advance
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_TOKENS, ignore_eos=True)
        self.requests = []
        for i in range(batch):
            request = Request(f"r{i}", list(range(1, PROMPT_TOKENS + 1)), params)
            request.client_id, request.client_request_id = b"client", f"q{i}"
            self.scheduler.add_request(request)
            self.requests.append(request)
        self._prev_sampling: list[Request] = []
        self._prev_sampled: torch.Tensor | None = None
        self._in_flight = None  # the plan launched last step (overlap: updated one step later)
        self.num_steps = 0

    def at_boundary(self) -> bool:
        """Whether the next step is a block-boundary step: its plan grows every table (each
        request's last block is full) and its update registers the blocks just filled."""
        known = len(self.requests[0].token_ids)  # every request has as many (one a step)
        return known % self.scheduler.config.block_size == 1

    def step(self, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
        """One step: plan and pack step N, update step N-1 with its tokens, frame them."""
        t0 = clock()
        plan = self.scheduler.schedule()
        t1 = clock()
        packed = self.inputs.pack(plan, self._prev_sampling, self._prev_sampled)
        t2 = clock()
        # What the model would sample: a token that says where it goes (its row's seq_len,
        # the index of the request's next token), so a check can tell each one's place.
        sampled = packed.sample_ends.tolist()
        self._prev_sampling = packed.sampling_requests
        self._prev_sampled = torch.tensor(sampled, dtype=torch.int64)
        previous, self._in_flight = self._in_flight, (plan, sampled)
        t3 = clock()
        outputs = []
        if previous is not None:
            outputs = self.scheduler.update_from_output(*previous)
        t4 = clock()
        frames = [frame.encode() for frame in step_frames(outputs, []).values()]
        t5 = clock()
        assert frames or previous is None
        self.num_steps += 1
        return {"schedule": t1 - t0, "pack": t2 - t1, "update": t4 - t3, "frames": t5 - t4}


def run(batch: int, steps: int, warmup: int, advance: bool = True) -> dict[str, dict[str, float]]:
    """Median seconds of each phase over the ``steps`` steps after ``warmup``, apart for the
    steps at a block boundary (DecodeLoop.at_boundary) and the others."""
    loop = DecodeLoop(batch, advance)
    times = {kind: {phase: [] for phase in PHASES} for kind in ("steady", "boundary")}
    for i in range(warmup + steps):
        kind = "boundary" if loop.at_boundary() else "steady"
        timed = loop.step()
        if i >= warmup:
            for phase in PHASES:
                times[kind][phase].append(timed[phase])
    return {
        kind: {phase: statistics.median(values) for phase, values in phases.items()}
        for kind, phases in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=600, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the timed ones")
    parser.add_argument(
        "--full-pack",
        action="store_true",
        help="pack every step in full (no advancing of a steady decode step)",
    )
    args = parser.parse_args()
    print("# python " + " ".join(sys.argv))
    print(f"{'batch':>6} {'steps':>9} {'phase':>9} {'us/step':>9} {'us/request':>11}")
    for batch in args.batch:
        for kind, medians in run(batch, args.steps, args.warmup, not args.full_pack).items():
            for phase in PHASES:
                us = medians[phase] * 1e6
                print(f"{batch:6d} {kind:>9} {phase:>9} {us:9.1f} {us / batch:11.2f}")
            total = sum(medians.values()) * 1e6
            print(f"{batch:6d} {kind:>9} {'total':>9} {total:9.1f} {total / batch:11.2f}")


if __name__ == "__main__":
    main()
