"""EngineCore: scheduler + model runner behind add / abort / step, with no sockets.

The offline API (engine_core/llm.py) drives it directly; the engine process (engine_core/proc.py)
drives it from its busy loop. One thread calls it; it takes no locks.

Overlap (``async_scheduling``, the default): each ``step()`` schedules and launches step N, then,
while the GPU runs it, waits for step N-1's sampled ids (one event, one copy into pinned memory),
applies them to the scheduler and returns N-1's outputs. The scheduler plans N before it knows
N-1's tokens (placeholders, see engine_core/scheduler.py) and the runner feeds those tokens to N
on the device. Requests that stop or are aborted at N-1 have their row in N dropped. A step where
a live request uses penalties (which read the real previous tokens on the host) settles the step
in flight first and runs synchronously; so does every step with ``--no-async-scheduling``.
"""

from __future__ import annotations

import dataclasses
import logging

from engine_core.config import EngineConfig
from engine_core.model_runner import LaunchedStep, ModelRunner
from engine_core.request import EngineOutput, Request
from engine_core.scheduler import Scheduler
from engine_core.step_stats import StepStats
from protocol.messages import Stats, TokenLogprobs

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = make_runner(config)
        self.model_config = self.runner.model_config
        self.scheduler = Scheduler(
            config,
            num_kv_blocks=self.runner.num_kv_blocks,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
            async_scheduling=config.async_scheduling,
        )
        # The scheduler may lower the limit to what the KV pool can hold for one sequence.
        self.max_model_len = self.scheduler.max_model_len
        self.num_steps = 0
        self.step_stats = StepStats(config.step_stats, config.nvtx)
        self.runner.stats = self.step_stats
        self._in_flight: LaunchedStep | None = None  # launched, not yet processed (overlap)
        self._penalised: set[str] = set()  # ids of requests that use penalties (maybe finished)

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (with a message fit for the client) if it cannot run."""
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in request.params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        self.scheduler.add_request(request)
        if request.uses_penalties:
            self._penalised.add(request.request_id)

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        """True while a request is live or a launched step still has to be processed."""
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """One turn of the loop; returns what happened to each request touched.

        Without overlap: schedule, run and sample one step and return its outputs. With it:
        launch step N and return step N-1's outputs (so the first call returns none, and a
        request's tokens arrive one call later).
        """
        try:
            outputs = self._step_sync() if self._must_sync() else self._step_overlapped()
        except BaseException:
            self._in_flight = None  # the caller fails the live requests; nothing to settle
            raise
        if not self.has_unfinished():
            self.runner.mark_idle()  # the GPU's wait for new work is no overhead of the loop
        self.step_stats.end_step()
        return outputs

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch between the overlapped and the simple loop; only while idle (benchmarks)."""
        if self.has_unfinished():
            raise RuntimeError("switch the loop only while no request is live")
        self.config = dataclasses.replace(self.config, async_scheduling=enabled)
        self.scheduler.async_scheduling = enabled

    def _must_sync(self) -> bool:
        if not self.config.async_scheduling:
            return True
        if self._penalised:
            self._penalised.intersection_update(self.scheduler.requests)
        return bool(self._penalised)

    def _step_sync(self) -> list[EngineOutput]:
        if self._in_flight is not None:
            # Settle the step in flight first: the next plan must see its tokens on the host.
            step, self._in_flight = self._in_flight, None
            return self._process(step)
        with self.step_stats.phase("schedule"):
            plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        return self._process(self.runner.launch(plan))

    def _step_overlapped(self) -> list[EngineOutput]:
        with self.step_stats.phase("schedule"):
            plan = self.scheduler.schedule()
        launched = None if plan.is_empty else self.runner.launch(plan)
        previous, self._in_flight = self._in_flight, launched
        # The GPU runs step N (if any) while the host waits for and applies step N-1.
        return [] if previous is None else self._process(previous)

    def _process(self, step: LaunchedStep) -> list[EngineOutput]:
        """Wait for a launched step's sampled ids and apply them to the scheduler."""
        result = self.runner.collect(step)
        with self.step_stats.phase("update"):
            outputs = self.scheduler.update_from_output(step.plan, result.sampled_token_ids)
            self._attach_logprobs(step.sampling_requests, result.logprobs, outputs)
        self.num_steps += 1
        return outputs

    @staticmethod
    def _attach_logprobs(
        sampling: list[Request], logprobs: list[TokenLogprobs | None], outputs: list[EngineOutput]
    ) -> None:
        if not any(lp is not None for lp in logprobs):
            return
        by_request = {id(r): lp for r, lp in zip(sampling, logprobs, strict=True)}
        for out in outputs:
            lp = by_request.get(id(out.request))
            if lp is not None and out.new_token_ids:
                out.logprobs = [lp]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        self.runner.shutdown()

    def stats(self) -> Stats:
        bm = self.scheduler.block_manager
        return Stats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            num_total_blocks=self.runner.num_kv_blocks,
            num_steps=self.num_steps,
        )


def make_runner(config: EngineConfig) -> ModelRunner:
    """The plain runner, or rank 0 of a tensor-parallel group (which starts the other ranks)."""
    if config.data_parallel_size != 1:
        raise ValueError(
            "data_parallel_size is for `tandem serve`, which starts that many engine cores; "
            "one engine core is always one of them"
        )
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    from engine_core.tp_runner import TPModelRunner

    return TPModelRunner(config)
