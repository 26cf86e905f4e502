"""EngineCore: scheduler + model runner behind add / abort / step, with no sockets.

The offline API (engine_core/llm.py) drives it directly; the engine process (engine_core/proc.py)
drives it from its busy loop. One thread calls it; it takes no locks.
"""

from __future__ import annotations

import logging

from engine_core.config import EngineConfig
from engine_core.model_runner import ModelRunner
from engine_core.request import EngineOutput, Request
from engine_core.scheduler import Scheduler
from protocol.messages import Stats, TokenLogprobs

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.scheduler = Scheduler(
            config,
            num_kv_blocks=self.runner.num_kv_blocks,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        # The scheduler may lower the limit to what the KV pool can hold for one sequence.
        self.max_model_len = self.scheduler.max_model_len
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (with a message fit for the client) if it cannot run."""
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in request.params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """Schedule, run and sample one step; returns what happened to each request touched."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.runner.execute(plan)
        # Read which rows sampled before the update moves num_computed_tokens.
        sampling = [s.request for s in plan.scheduled if s.samples]
        outputs = self.scheduler.update_from_output(plan, result.sampled_token_ids)
        self._attach_logprobs(sampling, result.logprobs, outputs)
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
