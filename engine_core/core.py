"""EngineCore: scheduler + model runner behind add / abort / step, with no sockets.

The offline API (engine_core/llm.py) drives it directly; the engine process (engine_core/server.py)
drives it from its busy loop. One thread calls it; it takes no locks.

A step reads in order: schedule, forward, (grammar bitmask), sample, update. With overlap
(``async_scheduling``, the default with a GPU or pipeline stages; on the CPU alone the forward
runs on this thread and overlap would only send each step's tokens a step late) the update is
the previous step's: each ``step()`` schedules step N and enqueues its forward and sampler, and
while the GPU runs them it waits for step N-1's sampled ids (one event, one copy into pinned
memory), applies them to the scheduler and returns N-1's outputs. The scheduler plans N before
it knows N-1's tokens (placeholders, see engine_core/scheduler.py) and the runner feeds those
tokens to N on the device. Requests that stop or are aborted at N-1 have their row in N dropped.
A step where a live request uses penalties (which read the real previous tokens on the host)
settles the step in flight first and runs synchronously; so does every step with
``--no-async-scheduling``. Why: docs/design/overlap-scheduling.md.

Structured outputs (engine_core/grammar.py): a constrained request waits, unscheduled, while its
grammar compiles on a worker thread; a grammar that fails to compile fails its request. When
step N has constrained rows, their bitmask depends on step N-1's tokens, which are still on the
GPU when N is planned. So the bitmask is its own stage between N's forward and N's sampler: with
N's forward enqueued, the core settles step N-1 (the wait and update the overlapped loop does
anyway, now while N's forward runs), each constrained request's matcher takes its new token, the
rows' bitmask is filled, and then N's sampler is enqueued. Unconstrained steps skip the stage.

An embedding engine (``model_config.embedding``: engine_core/embedding.py) serves pooling
requests only, as a generative one serves no pooling request. Its steps are prompt chunks that
sample nothing: the runner pools the hidden states (engine_core/pooler.py), the scheduler ends a
request with the step that ran its last chunk (POOLED), and the core hands the vector to that
end. It runs without overlap: a request whose last chunk is planned has no token left to
compute, and only the update (which the next plan would otherwise precede) says it has ended.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import torch

from engine_core.config import EngineConfig, ModelConfig
from engine_core.embedding import check_pooling
from engine_core.grammar import BitmaskFiller, GrammarCompiler, RequestGrammar
from engine_core.model_runner import (
    ForwardStep,
    LaunchedStep,
    ModelRunner,
    RunnerOutput,
    resolve_device,
)
from engine_core.request import EngineOutput, Request, SchedulerOutput
from engine_core.scheduler import Scheduler
from engine_core.speculative import make_proposer
from engine_core.step_clock import StepClock, StepWork
from engine_core.step_stats import StepStats
from protocol.messages import FinishReason, Stats, TokenLogprobs

GRAMMAR_WAIT_S = 0.005  # an idle loop with only compiling requests naps this long per turn


def unsplit_image_tokens(config: ModelConfig) -> int:
    """The token count of an image whose run must fit one prefill chunk: a model whose image
    tokens attend to each other both ways (Gemma 3) needs the whole image in the cache when
    they attend (engine_core/multimodal.py); 0 for any other model."""
    vision = config.vision
    return vision.tokens_per_image if vision is not None and vision.bidirectional_images else 0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = make_runner(config)
        # What the runner decided from its device and model (--max-num-seqs left unset).
        self.config = config = self.runner.config
        self.model_config = self.runner.model_config
        self.embedding = self.model_config.embedding  # None: the engine generates
        on_cpu = resolve_device(config.device).type == "cpu"
        overlap = config.overlaps(on_cpu) and self.embedding is None
        self.config = config = dataclasses.replace(config, async_scheduling=overlap)
        self.scheduler = Scheduler(
            config,
            num_kv_blocks=self.runner.num_kv_blocks,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
            proposer=make_proposer(config.speculation(), self.runner.drafter),
            loras=self.runner.loras,
            kv_windows=self.runner.kv_layout.windows,
            kv_attention_chunks=self.runner.kv_layout.attention_chunks,
            state_slots=self.runner.num_state_slots,
            state_snapshots=self.runner.num_state_snapshots,
            host_kv_blocks=self.runner.num_host_kv_blocks,
            unsplit_image_tokens=unsplit_image_tokens(self.model_config),
        )
        # The scheduler may lower the limit to what the KV pool can hold for one sequence.
        self.max_model_len = self.scheduler.max_model_len
        self.num_steps = 0
        self.step_stats = StepStats(config.step_stats, config.nvtx)
        self.runner.stats = self.step_stats
        self._in_flight: LaunchedStep | None = None  # launched, not yet processed (overlap)
        # Pipeline stages with overlap: steps whose first stage ran, not yet sampled, oldest
        # first; at most one fewer than the stages (the newest is on rank 0's own stage).
        self._in_stages: deque[ForwardStep] = deque()
        self._pipelined = config.pipeline_parallel_size > 1
        # Launches by how many micro-batches were in flight while the launched one ran its
        # first stage, itself included (1..P): how many stages could be busy at once.
        self.pipeline_depths: Counter[int] = Counter()
        self._penalised: set[str] = set()  # ids of requests that use penalties (maybe finished)
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._bitmasks: BitmaskFiller | None = None
        self._compiling: list[Request] = []  # constrained requests whose grammar is not ready
        # On the CPU a step may run for minutes, silent: the clock expects each step's time,
        # and a step expected to be long is announced through ``announce_long_step`` (the
        # server's, which sends a heartbeat saying so; engine_core/step_clock.py). A GPU's
        # steps are milliseconds.
        self.step_clock = StepClock(StepWork.of(self.model_config)) if on_cpu else None
        self.announce_long_step: Callable[[float], None] | None = None
        self._step_flops = 0.0  # the work launched in this call of step(), for the clock

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (with a message fit for the client) if it cannot run."""
        vocab = self.model_config.vocab_size
        params = request.params
        ids = request.token_ids
        # Two C-level scans: a generator over the ids cost ~10 us per 128-token prompt.
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if (request.pooling is None) != (self.embedding is None):
            raise ValueError(self._runner_mismatch())
        if request.pooling is not None and self.embedding is not None:
            check_pooling(request.pooling, self.embedding)
        self._check_images(request)
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        if request.lora is not None and self.runner.loras is None:
            raise ValueError(
                f"LoRA adapter {request.lora.name!r}: this engine serves none (--enable-lora)"
            )
        self.scheduler.add_request(request)
        if request.lora is not None:
            assert self.runner.loras is not None
            self.runner.loras.prepare(request.lora)  # read on a worker thread, if it must be
        if request.uses_penalties:
            self._penalised.add(request.request_id)
        if params.constraint is not None:
            # A resumed request's matcher first takes the output it already has.
            prefix = request.output_token_ids
            request.grammar = self.grammar_compiler().start(params.constraint, prefix)
            self._compiling.append(request)

    def _check_images(self, request: Request) -> None:
        """A vision-language model checks every prompt's placeholders against its images; any
        other model refuses images."""
        multimodal = getattr(self.runner, "multimodal", None)
        if multimodal is not None:
            multimodal.check(request)
        elif request.images:
            raise ValueError(f"this model ({self.config.model}) takes no images")

    def _runner_mismatch(self) -> str:
        """Why a request of the other kind than this engine's cannot run here."""
        if self.embedding is None:
            return (
                "this engine serves a generative model: it does not embed (an embedding model, "
                "or --runner pooling, serves embeddings)"
            )
        return "this engine serves an embedding model (--runner pooling): it does not generate"

    def grammar_compiler(self) -> GrammarCompiler:
        """The model's grammar compiler, created (with its token table) when first needed."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self._load_tokenizer, self.model_config.vocab_size)
            pin = self.runner.device.type == "cuda"
            vocab, rows = self.model_config.vocab_size, self.config.max_num_seqs
            self._bitmasks = BitmaskFiller(vocab, pin, rows)
        return self._grammars

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        from engine_core.model_dir import tokenizer_dir_of

        return AutoTokenizer.from_pretrained(
            str(tokenizer_dir_of(self.config.model, self.runner.model_dir))
        )

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        """True while a request is live or a launched step still has to be processed."""
        in_flight = self._in_flight is not None or bool(self._in_stages)
        return in_flight or self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """One turn of the loop; returns what happened to each request touched.

        Without overlap: schedule, run and sample one step and return its outputs. With it:
        launch step N and return step N-1's outputs (so the first call returns none, and a
        request's tokens arrive one call later).
        """
        failed = self._settle_grammars() if self._compiling else []
        if self.runner.loras is not None and self.runner.loras.has_errors:
            failed += self._fail_unreadable_adapters()
        started, self._step_flops = time.perf_counter(), 0.0
        try:
            if self._must_sync():
                outputs = self._step_sync()
            elif self._pipelined:
                outputs = self._step_pipelined()
            else:
                outputs = self._step_overlapped()
            outputs += failed
        except BaseException:
            # The caller fails the live requests; nothing to settle.
            self.scheduler.step_failed()
            self._in_flight = None
            self._in_stages.clear()
            raise
        if self.step_clock is not None and self._step_flops:
            self.step_clock.observe(self._step_flops, time.perf_counter() - started)
        self.step_stats.end_step()
        if not self.has_unfinished():
            self.runner.mark_idle()  # the GPU's wait for new work is no overhead of the loop
            self.step_stats.log_window()  # the work that just ended, in a line of its own
        return outputs

    def _forward(self, plan: SchedulerOutput) -> ForwardStep:
        """The runner's forward of ``plan``; with a step clock, the plan's work counted first,
        and the step announced where the clock expects it to be long
        (engine_core/step_clock.py)."""
        if self.step_clock is not None:
            self._step_flops += self.step_clock.work.of_step(plan.scheduled)
            busy = self.step_clock.busy_for_s(self._step_flops)
            if busy and self.announce_long_step is not None:
                self.announce_long_step(busy)
        return self.runner.forward(plan)

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch between the overlapped and the simple loop; only while idle (benchmarks)."""
        if self.has_unfinished():
            raise RuntimeError("switch the loop only while no request is live")
        if enabled and self.embedding is not None:
            raise RuntimeError("an embedding engine runs without overlap (see the docstring)")
        self.config = dataclasses.replace(self.config, async_scheduling=enabled)

    def _must_sync(self) -> bool:
        if not self.config.async_scheduling or self.scheduler.proposer is not None:
            return True  # speculation: each step's kept drafts decide the next plan
        if self._penalised:
            self._penalised.intersection_update(self.scheduler.requests)
        return bool(self._penalised)

    def _step_sync(self) -> list[EngineOutput]:
        if self._in_stages:
            return self._process(self._sample(self._in_stages.popleft()))
        if self._in_flight is not None:
            # Settle the step in flight first: the next plan must see its tokens on the host.
            step, self._in_flight = self._in_flight, None
            return self._process(step)
        with self.step_stats.phase("schedule"):
            plan = self.scheduler.schedule(alone=True)
        if plan.is_empty:
            self._nap_if_only_compiling()
            return []
        forward = self._forward(plan)
        bitmask = draft_bitmask = None
        if self._constrained(forward):
            bitmask = self._bitmask(forward)
            if bitmask is not None and forward.drafted is not None:
                draft_bitmask = self._draft_bitmask(plan, bitmask)
        return self._process(self.runner.sample(forward, bitmask, draft_bitmask))

    def _step_overlapped(self) -> list[EngineOutput]:
        with self.step_stats.phase("schedule"):
            plan = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        outputs: list[EngineOutput] = []
        if plan.is_empty:
            if previous is None:
                self._nap_if_only_compiling()
        else:
            forward = self._forward(plan)
            bitmask = None
            if self._constrained(forward):
                # The rows' bitmask needs step N-1's tokens: settle it while N's forward runs.
                if previous is not None:
                    outputs += self._process(previous)
                    previous = None
                bitmask = self._bitmask(forward)
            self._in_flight = self.runner.sample(forward, bitmask)
        # The GPU runs step N (if any) while the host waits for and applies step N-1.
        if previous is not None:
            outputs += self._process(previous)
        return outputs

    def _step_pipelined(self) -> list[EngineOutput]:
        """Pipeline stages: up to P micro-batches in flight (vLLM's batch queue). Step N's first
        stage (rank 0's) runs while the later stages run steps N-1 ... N-P+1; with P - 1 of
        them waiting, the oldest's logits are taken, sampled and applied before N goes on to
        the next stage (so no stage is sent a step while every later one waits on rank 0:
        tp_runner.py); with fewer, N goes on at once. N holds no request of a step in flight
        (the scheduler keeps them apart), so nothing waits on a placeholder, and each
        request's tokens are on the host when its next step is planned. With nothing to plan,
        the oldest step in flight is settled."""
        with self.step_stats.phase("schedule"):
            plan = self.scheduler.schedule()
        forward = None if plan.is_empty else self._forward(plan)
        outputs: list[EngineOutput] = []
        full = len(self._in_stages) >= self.config.pipeline_parallel_size - 1
        if forward is not None:  # N on rank 0's stage, and those in the later stages
            self.pipeline_depths[len(self._in_stages) + 1] += 1
        if self._in_stages and (forward is None or full):
            outputs = self._process(self._sample(self._in_stages.popleft()))
        elif forward is None:
            self._nap_if_only_compiling()
        if forward is not None:
            self.runner.hand_on(forward)
            self._in_stages.append(forward)
        return outputs

    def _sample(self, step: ForwardStep) -> LaunchedStep:
        """A forwarded step's sampler, with the bitmask of its constrained rows."""
        bitmask = self._bitmask(step) if self._constrained(step) else None
        return self.runner.sample(step, bitmask)

    def _constrained(self, step: ForwardStep) -> bool:
        """Whether a row of the step samples under a structured-output constraint."""
        return self._bitmasks is not None and any(
            r.grammar is not None for r in step.sampling_requests
        )

    def _bitmask(self, step: ForwardStep) -> torch.Tensor | None:
        """The bitmask of the step's sampling rows, from their matchers' current states."""
        assert self._bitmasks is not None
        with self.step_stats.phase("bitmask"):
            return self._bitmasks.fill([r.grammar for r in step.sampling_requests])

    def _draft_bitmask(self, plan: SchedulerOutput, bitmask: torch.Tensor) -> torch.Tensor | None:
        """The masks of the step's drafted positions; a constrained drafted row's sampling row
        of ``bitmask`` becomes the mask after its drafts (engine_core/speculative.py)."""
        assert self._bitmasks is not None
        rows = []
        sampling_row = 0
        for s in plan.scheduled:
            if s.drafts:
                rows.append((s.request.grammar, s.drafts, sampling_row))
            sampling_row += s.samples
        with self.step_stats.phase("bitmask"):
            return self._bitmasks.fill_drafted(rows, bitmask)

    def _settle_grammars(self) -> list[EngineOutput]:
        """Fail the requests whose grammar did not compile; forget the ones that are ready."""
        failed = []
        still = []
        for request in self._compiling:
            grammar = request.grammar
            assert grammar is not None
            if not grammar.ready:
                still.append(request)
            elif grammar.matcher is None and not request.is_finished:
                self.scheduler.abort_requests([request.request_id], FinishReason.ERROR)
                message = f"invalid constraint: {grammar.error}"
                failed.append(EngineOutput(request, [], FinishReason.ERROR, error=message))
        self._compiling = still
        return failed

    def _fail_unreadable_adapters(self) -> list[EngineOutput]:
        """Fail the waiting requests whose adapter could not be read (a missing folder, a
        refused config), with why. Rare, so the waiting queue is scanned only then."""
        assert self.runner.loras is not None
        errors = self.runner.loras.take_errors()
        if not errors:
            return []  # the reads that ended all succeeded
        failed = []
        for request in [r for r in self.scheduler.waiting if r.lora in errors]:
            assert request.lora is not None
            self.scheduler.abort_requests([request.request_id], FinishReason.ERROR)
            error = errors[request.lora]
            failed.append(EngineOutput(request, [], FinishReason.ERROR, error=error))
        return failed

    def _nap_if_only_compiling(self) -> None:
        """Nothing to run but grammars or adapters to wait for: nap on them rather than spin
        on the loop."""
        futures: list[concurrent.futures.Future[Any]] = [
            r.grammar.future for r in self._compiling if r.grammar is not None
        ]
        if self.runner.loras is not None:
            futures += self.runner.loras.loading_futures()
        if futures:
            concurrent.futures.wait(futures, GRAMMAR_WAIT_S, concurrent.futures.FIRST_COMPLETED)

    def _process(self, step: LaunchedStep) -> list[EngineOutput]:
        """Wait for a launched step's sampled ids and apply them to the scheduler."""
        result = self.runner.collect(step)
        with self.step_stats.phase("update"):
            if step.prompt_logprobs:
                record_prompt_logprobs(step.plan, step.prompt_logprobs)
            if step.constrained and self._bitmasks is not None:
                self._bitmasks.advance(constrained_tokens(step.plan, result.sampled_token_ids))
            outputs = self.scheduler.update_from_output(
                step.plan, result.sampled_token_ids, result.draft_checks
            )
            if result.embeddings:
                attach_embeddings(outputs, result.embeddings)
            self._attach_logprobs(step, result, outputs)
            if step.plan.prompt_logprob_seqs:
                attach_prompt_logprobs(outputs)
        self.num_steps += 1
        return outputs

    @staticmethod
    def _attach_logprobs(
        step: LaunchedStep, result: RunnerOutput, outputs: list[EngineOutput]
    ) -> None:
        """Each output's tokens' logprobs, where its request asked: the sampled token's, after
        those of the drafts it kept (each drawn at its own position, engine_core/speculative.py)."""
        if not any(lp is not None for lp in result.logprobs):
            return
        by_request = {
            id(r): [lp] for r, lp in zip(step.sampling_requests, result.logprobs, strict=True)
        }
        drafted = [s.request for s in step.plan.scheduled if s.drafts]
        for request, checks in zip(drafted, result.draft_logprobs, strict=True):
            by_request[id(request)] = [*checks, *by_request[id(request)]]
        for out in outputs:
            lps = by_request.get(id(out.request))
            if lps is not None and lps[-1] is not None and out.new_token_ids:
                out.logprobs = lps[: len(out.new_token_ids)]

    def announce_stop(self) -> None:
        """This engine stops for good: no restart follows (ModelRunner.announce_stop)."""
        self.runner.announce_stop()

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
            num_total_blocks=bm.num_blocks,  # the pool (with a window group, less the null block)
            num_steps=self.num_steps,
            counts=self.scheduler.counts(),
            num_host_blocks=bm.num_host_blocks,
            num_host_used_blocks=bm.num_host_used_blocks,
        )


def constrained_tokens(
    plan: SchedulerOutput, sampled: list[int]
) -> list[tuple[RequestGrammar, int]]:
    """The live constrained rows of a step, with the token each sampled (the scheduler's
    update would feed them to the matchers one by one; the engine feeds them all at once)."""
    pairs = []
    tokens = iter(sampled)
    for s in plan.scheduled:
        if not s.samples:
            continue
        token = next(tokens)
        grammar = s.request.grammar
        if s.drafts:
            continue  # its grammar takes its kept tokens in the scheduler's update
        if grammar is not None and grammar.matcher is not None and not s.request.is_finished:
            pairs.append((grammar, token))
    return pairs


def record_prompt_logprobs(
    plan: SchedulerOutput, scored: dict[str, tuple[int, list[TokenLogprobs]]]
) -> None:
    """Keep what a step scored of each prompt, by position (a chunk recomputed after a
    preemption overwrites the same entries rather than appending them again)."""
    for s in plan.scheduled:
        request = s.request
        if request.request_id in scored:
            first, entries = scored[request.request_id]
            if first <= len(request.prompt_logprobs):
                request.prompt_logprobs[first : first + len(entries)] = entries


def attach_prompt_logprobs(outputs: list[EngineOutput]) -> None:
    """A request's prompt logprobs go out with its first token, the prefill being done."""
    for out in outputs:
        request = out.request
        if request.needs_prompt_logprobs and (out.new_token_ids or out.finish_reason is not None):
            out.prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_sent = True


def attach_embeddings(outputs: list[EngineOutput], vectors: dict[str, list[float] | None]) -> None:
    """Each pooled request's vector goes out with its end; one whose vector is not finite (a
    model that overflowed on it) fails instead, as the wire carries only finite values."""
    for out in outputs:
        if out.finish_reason != FinishReason.POOLED:
            continue
        vector = vectors[out.request.request_id]
        if vector is None:
            out.finish_reason = FinishReason.ERROR
            out.error = "the model's hidden states for this input are not finite"
        else:
            out.embedding = vector


def make_runner(config: EngineConfig) -> ModelRunner:
    """The plain runner, or rank 0 of a tensor-parallel group (which starts the other ranks),
    warmed up on CUDA (the other ranks follow its warm-up steps)."""
    if config.data_parallel_size != 1:
        raise ValueError(
            "data_parallel_size is for `tandem serve`, which starts that many engine cores; "
            "one engine core is always one of them"
        )
    if config.node_rank != 0:
        raise ValueError(
            f"--node-rank {config.node_rank} runs only that node's ranks, no engine core: it is "
            "for `tandem serve` / `tandem engine` on the other nodes"
        )
    if config.world_size == 1:
        runner = ModelRunner(config)
    else:
        from engine_core.tp_runner import TPModelRunner

        runner = TPModelRunner(config)
        if runner.model_config.embedding is not None:
            runner.shutdown()
            raise ValueError(
                "an embedding model runs on one GPU: --tensor-parallel-size 1 and "
                "--pipeline-parallel-size 1"
            )
    if runner.device.type == "cuda":
        runner.warm_up()
    return runner
