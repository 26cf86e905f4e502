"""Continuous batching: which requests compute how many tokens in the next step.

The scheduler owns requests and their status. Each step has one token budget
(``max_num_batched_tokens``) and a cap on running sequences (``max_num_seqs``). Running requests
go first, in admission order (one token per decode; a prompt still being chunked continues with
what budget is left), then waiting requests are admitted first come, first served, at most
``max_prefills_per_step`` of them, their prompts split into chunks when longer than the budget.

When the KV pool runs out, the most recently admitted running request is preempted by recompute:
its blocks are freed and it goes back to the front of the waiting queue, to recompute its prompt
and the outputs it already has (cheaply, where the prefix cache still holds them).

Under ``--scheduling-policy priority`` (vLLM's policy) the waiting queue is ordered by each
request's (priority, arrival), lower first, a preempted request going back to its place in that
order; and the running request preempted is the worst by the same order, even one already planned
in this step (its row is taken back out of the plan). As in vLLM, a waiting request never
preempts a running one: priority decides who is admitted and who gives up blocks, not who runs.

A step is planned before its tokens are known: ``schedule`` advances each request's
``num_computed_tokens`` at once and appends a placeholder (``PLACEHOLDER``) for each row that
samples, so that the engine core may plan step N+1 while step N still runs (overlap, see
docs/design/overlap-scheduling.md). The model runner feeds a placeholder's real id from the
previous step's sampled tensor on the device, and ``update_from_output`` replaces it when the id
reaches the host. Stop conditions are checked there, possibly one step late: a request that
stops at step N has its step-N+1 row dropped, and a request whose pending tokens already reach
max_tokens or max_model_len is not scheduled again. Each plan keeps the start and sampling flag
it was made with (``ScheduledRequest.start``, ``.samples``), since the request moves on before
its update. Without overlap the same bookkeeping holds; the update simply comes before the next
plan. There is one update rule (``_update_row``); ``_update_decodes`` is its common case written
out inline, and tests check the two agree.

Counts (``counts()``, for the /metrics of the frontend) cost a few additions per step and per
admission: prefix-cache lookups and hits at admission (the device pool's and the host KV tier's
apart), preemptions, and the tokens of each step in a fixed set of buckets. A request's
timeline (first scheduled, first token, finish) is stamped once each; only requests still
waiting for their first token are looked at per step.
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine_core.block_manager import BlockManager
from engine_core.config import EngineConfig
from engine_core.multimodal import whole_image_chunk
from engine_core.request import (
    EngineOutput,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
)
from engine_core.speculative import BatchProposer, DraftRow, Proposer, accepted_run
from protocol.messages import STEP_TOKEN_BUCKETS, EngineCounts, FinishReason, SchedulingPolicy

if TYPE_CHECKING:
    from engine_core.lora.manager import LoraManager

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # a sampled id not yet on the host; never a real token id


def priority_rank(request: Request) -> tuple[int, float]:
    """A request's place under the priority policy: lower first, then the earlier arrival."""
    return request.priority, request.arrival_time


class Scheduler:
    """Owns the waiting queue and the running batch; asks its BlockManager for KV room."""

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        proposer: Proposer | BatchProposer | None = None,
        loras: LoraManager | None = None,
        kv_windows: Sequence[int | None] = (None,),
        kv_attention_chunks: Sequence[int | None] = (),
        state_slots: int = 0,
        host_kv_blocks: int = 0,
        unsplit_image_tokens: int = 0,
        state_snapshots: int = 0,
    ) -> None:
        """``proposer``: speculative decoding's (engine_core/speculative.py), drafting the
        next tokens of the requests that decode (a BatchProposer for all of a step's at once,
        after their slots are reserved). ``loras``: the adapter slots
        (engine_core/lora/manager.py), which a request with an adapter needs one of to run.
        ``kv_windows``: each KV layer group's sliding window (engine_core/kv_groups.py), None
        for full attention; ``kv_attention_chunks`` its attention chunk (empty: none).
        ``state_slots``: linear-attention state slots, 0 where the model has no such layers
        (block_manager.py); ``state_snapshots`` their saved states for prefix hits
        (engine_core/state_snapshots.py, 0: none). ``host_kv_blocks``: slots of the host KV
        tier (--kv-offload-gb; engine_core/kv_offload.py), 0 for none.
        ``unsplit_image_tokens``: where an image's tokens attend to each other both ways
        (Gemma 3), the longest image's token count: a chunk never ends inside an image's run
        (0: chunks may cut images); the budget must hold one beside a decode token of every
        other running sequence, or a request could wait on an image forever.
        ``config``: as the runner resolved it (its ``max_num_seqs`` set)."""
        if config.max_num_seqs is None:
            raise ValueError("the scheduler needs max_num_seqs resolved (ModelRunner.config)")
        least = unsplit_image_tokens + config.max_num_seqs - 1
        if unsplit_image_tokens and least > config.token_budget:
            raise ValueError(
                f"--max-num-batched-tokens {config.token_budget} cannot hold an "
                f"image's {unsplit_image_tokens} tokens, which this model prefills in one chunk, "
                f"beside a decode of each other sequence (--max-num-seqs "
                f"{config.max_num_seqs}): give it at least {least}"
            )
        self._whole_images = unsplit_image_tokens > 0
        self.config = config
        self.proposer = proposer
        self.loras = loras
        self.max_drafts = proposer.max_drafts if proposer is not None else 0
        # A draft model drafts for the whole step at once; prompt lookup request by request.
        self._batch_proposer = proposer if isinstance(proposer, BatchProposer) else None
        self._lookup = proposer if not isinstance(proposer, BatchProposer) else None
        self.block_manager = BlockManager(
            num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            windows=kv_windows,
            attention_chunks=kv_attention_chunks,
            state_slots=state_slots,
            host_blocks=host_kv_blocks,
            state_snapshots=state_snapshots,
        )
        # Plans carry the tables of groups 1.. too (ScheduledRequest.group_block_ids), and
        # the request's state slot where the model has linear-attention layers.
        self._grouped = self.block_manager.num_groups > 1
        self._stateful = state_slots > 0
        # Saved states for prefix hits: a prompt chunk ends where one is saved.
        self._snapshots = self.block_manager.snapshots is not None
        # A prompt chunk's full blocks join the prefix cache as its step is planned, not when
        # its tokens come back (vLLM's allocate_slots does the same): with overlap the next
        # plan is made before this step's update, and prompts sharing a prefix admitted in
        # one plan would each compute it. A request admitted later in the same plan may hit
        # them: every layer writes the whole step's K/V before any row attends, and such a
        # plan is never decode-only (whose fused launch writes and reads at once). Not with
        # a host tier (its copies out assume a cached block's step is over), saved states
        # (a hit needs one, saved by the step) or speculation (drafts' caches follow the
        # target's step); there blocks join at the update.
        self._caches_at_plan = (
            config.enable_prefix_caching
            and host_kv_blocks == 0
            and not self._snapshots
            and proposer is None
        )
        # A sequence can never outgrow the whole pool, so the pool caps the context too; without
        # the cap a lone request that fills every block would preempt itself forever.
        self.max_model_len = self.block_manager.max_tokens_per_sequence(
            config.token_budget, max_model_len
        )
        if self.max_model_len < max_model_len:
            fits = (
                f"the KV cache's {num_kv_blocks} blocks hold {self.max_model_len} tokens of "
                "one sequence"
            )
            if config.max_model_len is not None:  # asked for: refused, not cut
                raise ValueError(
                    f"{fits}, fewer than --max-model-len {config.max_model_len}: give the cache "
                    "more blocks or memory, or a smaller --max-model-len"
                )
            logger.warning(
                "%s: max_model_len is %d, not the model's %d (give the cache more blocks or "
                "memory to serve it)", fits, self.max_model_len, max_model_len,
            )  # fmt: skip
        self._block_size = config.block_size
        # Pipeline stages with overlap (engine_core/core.py _step_pipelined): up to one
        # micro-batch in flight per stage, each about 1/P of the live requests and none of the
        # requests another in-flight plan holds (``_in_flight``: their ids, from the plan until
        # its update), so the running requests rotate through P disjoint groups.
        # (With stages the device does not decide overlap: EngineConfig.overlaps.)
        pipelined = config.pipeline_parallel_size > 1 and config.overlaps(on_cpu=True)
        self._micro_batches = config.pipeline_parallel_size if pipelined else 1
        self._in_flight: set[str] = set()
        self._plans_in_flight = 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests by id
        # Arrival order, or (priority, arrival) order under the priority policy.
        self.waiting: deque[Request] = deque()
        self._by_priority = config.policy == SchedulingPolicy.PRIORITY
        self.running: list[Request] = []  # in admission order: preemption takes from the end
        self._awaiting_first_token: list[Request] = []  # admitted, no token of theirs yet
        self._run_id = random.getrandbits(62)
        self._prefix_queries = self._prefix_hits = self._preemptions = 0
        # Tokens looked up in the host KV tier at admissions, and those it served.
        self._host_queries = self._host_hits = 0
        # Speculative decoding: rows planned with drafts, their drafts, the drafts kept.
        self._spec_drafts = self._drafted = self._accepted = 0
        self._step_tokens = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        self._step_tokens_sum = 0

    # ------------------------------------------------------------------------ request intake

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError when it can never be served or its id is live."""
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.shown_id!r}: the prompt is empty")
        self._check_length(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.shown_id!r} is already in use")
        if request.priority != 0 and not self._by_priority:
            raise ValueError(
                f"priority {request.priority}: this engine schedules first come, first served "
                "(--scheduling-policy fcfs) and takes only priority 0; start it with "
                "--scheduling-policy priority to rank requests"
            )
        params = request.params
        request.stop_ids = params.stopping_token_ids(self.eos_token_ids)
        request.length_limit = min(
            request.num_prompt_tokens + params.max_tokens, self.max_model_len
        )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if self._by_priority:
            bisect.insort(self.waiting, request, key=priority_rank)  # after its equals
        else:
            self.waiting.append(request)

    def _check_length(self, request: Request) -> None:
        """ValueError unless the request fits the context: a generation needs room for a token
        after its prompt (and what a resumed request already has), an embedding request only
        for its prompt."""
        num_tokens, limit, rid = request.num_tokens, self.max_model_len, request.shown_id
        if request.pooling is not None and num_tokens > limit:
            raise ValueError(
                f"request {rid!r}: prompt of {num_tokens} tokens exceeds max_model_len={limit}"
            )
        if request.pooling is None and num_tokens >= limit:
            raise ValueError(
                f"request {rid!r}: prompt of {num_tokens} tokens leaves no room to generate "
                f"within max_model_len={limit}"
            )

    def abort_requests(
        self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT
    ) -> list[Request]:
        """Finish the given live requests (with ``reason``: an abort, or the engine's error)
        and free their blocks now; ids that are not live are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, reason)
            aborted.append(request)
        if not self.has_unfinished():
            self._awaiting_first_token.clear()  # no step may come soon to drop them
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def in_flight_ids(self) -> frozenset[str]:
        """With micro-batches: the requests of plans not yet updated (none otherwise)."""
        return frozenset(self._in_flight)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def counts(self) -> EngineCounts:
        """What this scheduler counted since it started (see EngineCounts)."""
        return EngineCounts(
            self._run_id,
            self._prefix_queries,
            self._prefix_hits,
            self._preemptions,
            tuple(self._step_tokens),
            self._step_tokens_sum,
            self._spec_drafts,
            self._drafted,
            self._accepted,
            self.block_manager.num_host_stored_blocks,
            self.block_manager.num_host_restored_blocks,
            self._host_queries,
            self._host_hits,
        )

    # ---------------------------------------------------------------------------- scheduling

    def schedule(self, alone: bool = False) -> SchedulerOutput:
        """Plan one step: running requests first, then new admissions, within the budgets.
        ``alone``: no other plan will be in flight beside this one (the loop settles each step
        before the next), so with micro-batches it takes all it can, not its share."""
        output = SchedulerOutput(scheduled=[])
        max_rows = self.config.max_num_seqs if alone else self._micro_batch_rows()
        budget = self._schedule_running(output, self.config.token_budget, max_rows)
        if self._batch_proposer is not None:
            self._fill_drafts(output)
        # Right after a preemption the pool is full: admitting now would only thrash.
        if not output.preempted_ids:
            budget = self._schedule_waiting(output, budget, max_rows)
        scheduled = output.scheduled
        if scheduled:
            num_tokens = self.config.token_budget - budget
            self._count_step(num_tokens)
            # Every row has at least one token: as many tokens as rows is one each.
            output.decode_only = num_tokens == len(scheduled) and all(s.samples for s in scheduled)
            # The host tier's copies go with the next step that runs (none runs an empty plan).
            output.kv_moves = self.block_manager.take_moves()
            if self._snapshots:
                output.state_copies = self.block_manager.take_state_copies()
            if self._micro_batches > 1:
                self._in_flight.update(s.request.request_id for s in scheduled)
                self._plans_in_flight += 1
        return output

    def _micro_batch_rows(self) -> int:
        """The most rows a plan takes: all it can, or with micro-batches its share of the live
        requests that no plan in flight holds, over the micro-batches still to fill (rounded
        up): 1/P of them when none is in flight, all of them with P - 1 in flight, so every
        request not in flight (a waiting one too) has a place in the pipeline."""
        if self._micro_batches == 1:
            return self.config.max_num_seqs
        # Ids of requests that ended in flight stay until their update: a share a little low.
        free = len(self.running) + len(self.waiting) - len(self._in_flight)
        to_fill = self._micro_batches - self._plans_in_flight
        return max(1, -(-free // max(1, to_fill)))

    def _count_step(self, num_tokens: int) -> None:
        self._step_tokens[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        self._step_tokens_sum += num_tokens

    def _schedule_running(self, output: SchedulerOutput, budget: int, max_rows: int) -> int:
        # Only the last admitted request can be mid-prompt (it took the budget that was left),
        # so walking in admission order schedules the decodes before any prompt chunk. This
        # loop runs once per running request per step, so its common case (a request whose
        # table covers its chunk, grown by a block if its last one filled, with nothing to
        # score) is written out inline: what _add_scheduled and ScheduledRequest.plan do for
        # it, in one place. Where the pool has too few blocks, _preempt_for makes room.
        running = self.running
        allocate = self.block_manager.allocate_slots
        table_covering = self.block_manager.table_covering
        group_tables = self.block_manager.group_tables
        grouped, stateful = self._grouped, self._stateful
        state_slot = self.block_manager.state_slot
        scheduled = output.scheduled
        micro, in_flight = self._micro_batches > 1, self._in_flight
        chunks: list[tuple[Request, int]] = []  # prompt chunks planned: (request, end)
        index = 0
        while index < len(running) and budget > 0 and len(scheduled) < max_rows:
            request = running[index]
            token_ids = request.token_ids
            num_tokens = len(token_ids)
            if (micro and request.request_id in in_flight) or (
                token_ids[-1] == PLACEHOLDER and num_tokens >= request.length_limit
            ):
                # With micro-batches a request in a plan still in flight waits for its update
                # (a prompt chunk too: one request in one micro-batch at a time). Otherwise its
                # pending token (a step still in flight) finishes it by length: another step
                # would be wasted and could ask for a block past max_model_len. Without a
                # pending token a request is never skipped (else it could wait forever).
                index += 1
                continue
            start = request.num_computed_tokens
            if self.max_drafts and request.speculates and num_tokens - start == 1:
                drafted = self._plan_drafts(output, request, budget)
                if drafted:
                    budget -= drafted
                    index += 1
                    continue
            num_new = min(num_tokens - start, budget)
            if self._whole_images and request.images:
                num_new = whole_image_chunk(request.images, start, num_new)
                if not num_new:  # the rest of an image it is inside: next step's budget
                    index += 1
                    continue
            if self._snapshots and num_new > 1:  # a prompt chunk ends where a state is saved
                num_new = self.block_manager.snapshot_chunk(request, start, num_new)
            end = start + num_new
            block_ids = table_covering(request, num_new)
            if block_ids is None or request.planned_apart:
                if not allocate(request, num_new):
                    given_back = self._preempt_for(request, num_new, output)
                    if given_back is None:
                        break  # it preempted itself (FCFS: everything after it is gone too)
                    budget += given_back
                    index = running.index(request)  # victims planned before it have left
                self._add_scheduled(output, request, num_new)
            else:
                samples = end == num_tokens
                scheduled.append(ScheduledRequest(request, num_new, block_ids, start, samples))
                if grouped:
                    scheduled[-1].group_block_ids = group_tables(request.request_id)
                if stateful:
                    scheduled[-1].state_slot = state_slot(request.request_id)
                request.num_computed_tokens = end
                if samples:
                    token_ids.append(PLACEHOLDER)
            if num_new > 1 and self._caches_at_plan:
                chunks.append((request, end))
            budget -= num_new
            index += 1
        for request, end in chunks:  # those a later row's preemption did not take out
            if request.status == RequestStatus.RUNNING:
                self._cache_planned(request, end)
        return budget

    def _plan_drafts(self, output: SchedulerOutput, request: Request, budget: int) -> int:
        """Plan a decode with the proposer's drafts after the last known token (at most what
        the budget, the pool and the request's length limit leave room for): the tokens it
        computes, or 0 where nothing was drafted (the request then decodes as usual)."""
        room = min(self.max_drafts, budget - 1, request.length_limit - request.num_tokens - 1)
        if room < 1:
            return 0
        if self._batch_proposer is not None:
            return self._reserve_drafts(output, request, room)
        assert self._lookup is not None
        drafts = self._lookup.propose(request.token_ids, room)
        num_new = 1 + len(drafts)
        if not drafts or not self.block_manager.allocate_slots(request, num_new):
            return 0  # no room for the drafts' KV: decode one token, preempting if it must
        request.token_ids.extend(drafts)
        self._add_scheduled(output, request, num_new)
        self._count_drafts(output.scheduled[-1], drafts)
        return num_new

    def _reserve_drafts(self, output: SchedulerOutput, request: Request, room: int) -> int:
        """Plan a decode with ``room`` drafts still to come (``_fill_drafts`` asks the batch
        proposer for every such row of the step at once, the KV slots it writes reserved
        here): PLACEHOLDERs stand for them until then. 0 where the pool has no room."""
        num_new = 1 + room
        if not self.block_manager.allocate_slots(request, num_new):
            return 0
        request.token_ids.extend([PLACEHOLDER] * room)
        self._add_scheduled(output, request, num_new)
        output.scheduled[-1].drafts = (PLACEHOLDER,) * room
        return num_new

    def _fill_drafts(self, output: SchedulerOutput) -> None:
        """The batch proposer's drafts for the rows ``_reserve_drafts`` planned, in their
        places (a later row's preemption never takes an earlier row's blocks)."""
        assert self._batch_proposer is not None
        rows = [s for s in output.scheduled if s.drafts]
        if not rows:
            return
        drafted = self._batch_proposer.propose_batch(
            [
                DraftRow(
                    s.request.token_ids[s.start],
                    s.start,
                    s.block_ids,
                    len(s.drafts),
                    s.request.request_id,
                )
                for s in rows
            ]
        )
        for s, drafts in zip(rows, drafted, strict=True):
            if len(drafts) != len(s.drafts):
                raise ValueError(f"{len(drafts)} drafts proposed for {len(s.drafts)} slots")
            s.request.token_ids[s.start + 1 : s.start + 1 + len(drafts)] = drafts
            self._count_drafts(s, drafts)

    def _count_drafts(self, row: ScheduledRequest, drafts: list[int]) -> None:
        row.drafts = tuple(drafts)
        self._spec_drafts += 1
        self._drafted += len(drafts)
        row.request.num_draft_tokens += len(drafts)

    def _preempt_for(self, request: Request, num_new: int, output: SchedulerOutput) -> int | None:
        """Make room for ``request`` (its allocation just failed) by preempting running
        requests: the latest admitted first, or the worst ranked under the priority policy.
        Returns the tokens that victims already planned in this step give back to the budget,
        or None when ``request`` had to go itself."""
        given_back = 0
        while not self.block_manager.allocate_slots(request, num_new):
            if self._by_priority:
                victim = max(self.running, key=priority_rank)
                self.running.remove(victim)
                given_back += self._unplan(output, victim)
            else:
                victim = self.running.pop()  # after ``request``: not planned in this step
            self._preempt(victim)
            output.preempted_ids.append(victim.request_id)
            if victim is request:
                return None
        return given_back

    def _unplan(self, output: SchedulerOutput, request: Request) -> int:
        """Take ``request``'s row, if this step planned one, back out of the plan, with the
        drafts and the placeholder planning appended to its tokens; the row's token count."""
        position = next((i for i, s in enumerate(output.scheduled) if s.request is request), None)
        if position is None:
            return 0
        row = output.scheduled.pop(position)
        output.prompt_logprob_seqs = [
            p - (p > position) for p in output.prompt_logprob_seqs if p != position
        ]
        del request.token_ids[len(request.token_ids) - len(row.drafts) - row.samples :]
        if row.drafts:
            self._spec_drafts -= 1
            self._drafted -= len(row.drafts)
            request.num_draft_tokens -= len(row.drafts)
        return row.num_new_tokens

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        if self.loras is not None:
            self.loras.release(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._preemptions += 1
        if self._by_priority:
            bisect.insort_left(self.waiting, request, key=priority_rank)  # before its equals
        else:
            self.waiting.appendleft(request)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, max_rows: int) -> int:
        """Admit waiting requests within ``budget`` and ``max_rows``; returns the budget left."""
        num_admitted = 0
        while (
            self.waiting
            and budget > 0
            and num_admitted < self.config.max_prefills_per_step
            and len(self.running) < self.config.max_num_seqs
            and len(output.scheduled) < max_rows
        ):
            request = self._next_to_admit()
            if request is None:
                break  # every waiting request still waits for its grammar to compile
            num_new = self._admit(request, budget)
            if num_new == 0:
                break  # no room in the KV pool: those behind it wait too (no overtaking)
            self._add_scheduled(output, request, num_new)
            if num_new > 1 and self._caches_at_plan:
                self._cache_planned(request, request.num_computed_tokens)
            budget -= num_new
            num_admitted += 1
            if self._whole_images and not output.scheduled[-1].samples:
                break  # its chunk stopped before an image: it stays the one mid-prompt request
        return budget

    def _next_to_admit(self) -> Request | None:
        """The first waiting request that can run: one whose grammar still compiles, or whose
        LoRA adapter is still loading or finds no free slot, waits without holding up those
        behind it."""
        for request in self.waiting:
            if request.grammar is not None and not request.grammar.ready:
                continue
            if request.request_id in self._in_flight:
                continue  # preempted while its micro-batch runs: readmitted once it is applied
            if request.lora is None or self._holds_adapter(request):
                return request
        return None

    def _holds_adapter(self, request: Request) -> bool:
        """Whether the request's adapter is in a slot it holds (taking one if it can)."""
        assert request.lora is not None and self.loras is not None  # EngineCore checked
        return self.loras.acquire(request.request_id, request.lora)

    def _admit(self, request: Request, budget: int) -> int:
        """Move a waiting request into the batch; the tokens it computes now, or 0."""
        use_cache = not request.needs_prompt_logprobs and not request.pools_every_token
        host_hits = self.block_manager.num_host_hit_blocks
        request.num_computed_tokens = self.block_manager.allocate_prefix(request, use_cache)
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if self._whole_images and request.images:
            num_new = whole_image_chunk(request.images, request.num_computed_tokens, num_new)
        if self._snapshots:  # a prompt chunk ends where a state is saved
            start = request.num_computed_tokens
            num_new = self.block_manager.snapshot_chunk(request, start, num_new)
        if not num_new or not self.block_manager.allocate_slots(request, num_new):
            self.block_manager.free(request.request_id)  # give the prefix hits back
            request.num_computed_tokens = 0
            return 0
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if use_cache and self.block_manager.enable_prefix_caching:
            # Tokens restored from the host tier count apart from the device pool's hits.
            from_host = (self.block_manager.num_host_hit_blocks - host_hits) * self._block_size
            self._prefix_queries += request.num_tokens
            self._prefix_hits += request.num_computed_tokens - from_host
            if self.block_manager.host_tier is not None:
                self._host_queries += request.num_tokens
                self._host_hits += from_host
        if not request.first_scheduled_time:
            request.first_scheduled_time = time.monotonic()
            request.first_token_index = request.num_tokens  # no placeholder of its own yet
            self._awaiting_first_token.append(request)
        return num_new

    def _cache_planned(self, request: Request, end: int) -> None:
        """Register with the prefix cache the blocks that tokens up to ``end`` fill, as their
        step is planned (see ``_caches_at_plan``); a pending sample (a placeholder at the end,
        a readmitted request's) is not a known token."""
        token_ids = request.token_ids
        while end and token_ids[end - 1] == PLACEHOLDER:
            end -= 1
        self.block_manager.cache_computed_blocks(request, end)

    def step_failed(self) -> None:
        """A step raised: the blocks its plan registered may never have been written, so the
        prefix cache forgets every prefix (the server fails the live requests)."""
        if self._caches_at_plan:
            self.block_manager.forget_prefixes()

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        block_ids = self.block_manager.block_table(request.request_id)
        scheduled = ScheduledRequest.plan(request, num_new, block_ids)
        if self._grouped:
            scheduled.group_block_ids = self.block_manager.group_tables(request.request_id)
        if self._stateful:
            scheduled.state_slot = self.block_manager.state_slot(request.request_id)
        if request.wants_prompt_logprobs and request.needs_prompt_logprobs:
            output.prompt_logprob_seqs.append(len(output.scheduled))
        output.scheduled.append(scheduled)
        request.num_computed_tokens = scheduled.start + num_new
        if scheduled.samples:
            request.token_ids.append(PLACEHOLDER)

    # ------------------------------------------------------------------------------ updates

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: list[int],
        draft_checks: list[list[int]] | None = None,
    ) -> list[EngineOutput]:
        """Apply one step's results: cache full blocks, fill placeholders, finish.

        ``sampled_token_ids`` holds one id per scheduled request whose chunk samples, in order.
        ``draft_checks`` holds, for each row with drafts in order, the target's token after its
        last known token and after each draft but the last (the sampled id is the one after
        the last). Returns one event per row that produced tokens; finished requests are
        already freed.
        """
        scheduled = output.scheduled
        if draft_checks:
            events, any_finished = self._update_rows(scheduled, sampled_token_ids, draft_checks)
        elif len(sampled_token_ids) == len(scheduled):
            events, any_finished = self._update_decodes(scheduled, sampled_token_ids)
        else:
            events, any_finished = self._update_rows(scheduled, sampled_token_ids)
        if self._micro_batches > 1 and scheduled:  # a plan that schedule() counted in flight
            self._in_flight.difference_update(s.request.request_id for s in scheduled)
            self._plans_in_flight -= 1
        if self._awaiting_first_token:
            self._stamp_first_tokens()
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            if any(r.is_finished for r in self.waiting):  # preempted while its step ran
                self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return events

    def _update_rows(
        self,
        scheduled: list[ScheduledRequest],
        sampled_token_ids: list[int],
        draft_checks: list[list[int]] | None = None,
    ) -> tuple[list[EngineOutput], bool]:
        """Every row's update, sampling or not: the events and whether any finished."""
        num_sampling = sum(s.samples for s in scheduled)
        if num_sampling != len(sampled_token_ids):
            raise ValueError(
                f"{len(sampled_token_ids)} sampled tokens for {num_sampling} sampling requests"
            )
        tokens = iter(sampled_token_ids)
        checks = iter(draft_checks or ())
        events = []
        for row in scheduled:
            token = next(tokens) if row.samples else None
            if row.drafts:
                check = next(checks, None)
                if check is None or token is None:
                    raise ValueError("a row with drafts needs the target's tokens after them")
                event = self._update_drafted(row, [*check, token])
            else:
                event = self._update_row(row, token)
            if event is not None:
                events.append(event)
        return events, any(event.finish_reason is not None for event in events)

    def _update_drafted(self, row: ScheduledRequest, target: list[int]) -> EngineOutput | None:
        """A speculating row's update: keep the drafts the target agrees with and its own token
        after them (engine_core/speculative.py), checking the stop rules at each kept token;
        the computed tokens move back to the last kept draft, whose KV is the last right one."""
        request = row.request
        if request.is_finished:
            return None
        kept = accepted_run(row.drafts, target)
        self._accepted += len(kept) - 1
        request.num_accepted_tokens += len(kept) - 1
        first = row.start + 1  # where the drafts began
        del request.token_ids[first:]
        reason = None
        for token in kept:
            if request.grammar is not None and not request.grammar.accept(token):
                reason = self._dead_end(request).finish_reason
                return EngineOutput(request, request.token_ids[first:], reason)
            request.token_ids.append(token)
            reason = self._check_stop(request, token, request.num_tokens)
            if reason is not None:
                break
        output = request.token_ids[first:]
        request.num_computed_tokens = first + len(output) - 1
        if reason is not None:
            self._finish(request, reason)
            return EngineOutput(request, output, reason)
        self._cache_full_blocks(request, row.start, request.num_computed_tokens)
        if len(kept) <= len(row.drafts):  # a draft was rejected: the state after the last kept
            self.block_manager.keep_draft_state(request, len(kept) - 1)
        return EngineOutput(request, output, reason)

    def _update_decodes(
        self, scheduled: list[ScheduledRequest], sampled_token_ids: list[int]
    ) -> tuple[list[EngineOutput], bool]:
        """The update of a step in which every row sampled one token, with ``_update_row``'s
        common case (a running request with no grammar) written out inline: this runs once
        per request per step. Anything else takes ``_update_row`` itself."""
        events = []
        any_finished = False
        block_size = self._block_size
        running = RequestStatus.RUNNING
        cache_blocks = self.block_manager.cache_computed_blocks
        for row, token in zip(scheduled, sampled_token_ids, strict=True):
            request = row.request
            start = row.start
            end = start + row.num_new_tokens
            if request.status != running or request.grammar is not None:
                event = self._update_row(row, token)
                if event is not None:
                    events.append(event)
                    any_finished = any_finished or event.finish_reason is not None
                continue
            if end // block_size > start // block_size:  # a block filled: register it
                cache_blocks(request, end)
            request.token_ids[end] = token
            reason = self._check_stop(request, token, end + 1)
            if reason is not None:
                del request.token_ids[end + 1 :]  # placeholders of steps that are now void
                self._finish(request, reason)
                any_finished = True
            events.append(EngineOutput(request, [token], reason))
        return events, any_finished

    def _stamp_first_tokens(self) -> None:
        """Time the first token of each request that got it in this step (sampled and known:
        a placeholder stands in its place until then)."""
        now = time.monotonic()
        waiting = []
        for request in self._awaiting_first_token:
            token_ids, first = request.token_ids, request.first_token_index
            if request.is_finished:
                continue  # finished at its first token (or without one): its finish says when
            if len(token_ids) > first and token_ids[first] != PLACEHOLDER:
                request.first_token_time = now
            else:
                waiting.append(request)
        self._awaiting_first_token = waiting

    def _cache_full_blocks(self, request: Request, start: int, end: int) -> None:
        """Register the blocks that tokens [start, end) filled, with the prefix cache. A block
        can only have filled if the chunk reached a block's end: a decode step asks the block
        manager once every block_size steps, not every step (a skipped call could only delay a
        registration to the next one, which registers every full block it finds)."""
        if end // self._block_size > start // self._block_size:
            self.block_manager.cache_computed_blocks(request, end)

    def _update_row(self, scheduled: ScheduledRequest, token: int | None) -> EngineOutput | None:
        """One row's update (the request advanced already, when it was planned).

        Fill the placeholder this step sampled, register the blocks now full of known tokens,
        and check the stop conditions at the token's own position (later placeholders may
        follow it). A request preempted while this step ran keeps the token, which is real, and
        recomputes its KV when it is admitted again.
        """
        request = scheduled.request
        status = request.status
        if status == RequestStatus.FINISHED:
            return None  # finished or aborted while this step ran: its row is void
        end = scheduled.start + scheduled.num_new_tokens
        # Tokens [0, end) are real and their KV is in (or on its way to) the cache.
        if status == RequestStatus.RUNNING:
            self._cache_full_blocks(request, scheduled.start, end)
        if token is None:
            pooled = request.pooling is not None and end == request.num_tokens
            return self._pooled(request) if pooled and status == RequestStatus.RUNNING else None
        if request.grammar is not None and not request.grammar.accept(token):
            del request.token_ids[end:]  # its placeholder and those of later, void, steps
            return self._dead_end(request)
        request.token_ids[end] = token
        reason = self._check_stop(request, token, end + 1)
        if reason is not None:
            del request.token_ids[end + 1 :]  # placeholders of steps that are now void
            self._finish(request, reason)
        return EngineOutput(request, [token], reason)

    def _pooled(self, request: Request) -> EngineOutput:
        """A pooling request whose last prompt chunk ran: it is done (the engine core attaches
        the vector the runner pooled) and its blocks go back now."""
        self._finish(request, FinishReason.POOLED)
        return EngineOutput(request, [], FinishReason.POOLED)

    def _dead_end(self, request: Request) -> EngineOutput:
        """The request's constraint refused the token sampled for it (no token was allowed):
        end it with what it has, rather than emit text that breaks the constraint."""
        assert request.grammar is not None
        logger.warning(
            "request %s: its constraint allows no token after %d output tokens (%s); ending it",
            request.request_id, request.num_output_tokens, request.grammar.error,
        )  # fmt: skip
        self._finish(request, FinishReason.DEAD_END)  # update_from_output drops it from the queues
        return EngineOutput(request, [], FinishReason.DEAD_END)

    def _check_stop(self, request: Request, token: int, num_tokens: int) -> FinishReason | None:
        """Stop conditions for ``token``, the last of the first ``num_tokens`` tokens (the rules
        themselves were derived once, in ``add_request``)."""
        if request.grammar is not None and request.grammar.terminated:
            return FinishReason.STOP  # the output is complete: only EOS could follow
        if (
            token in request.stop_ids
            and num_tokens - request.num_prompt_tokens >= request.params.min_tokens
        ):
            return FinishReason.STOP
        if num_tokens >= request.length_limit:
            return FinishReason.LENGTH  # max_tokens, or the model's context
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Free the request's blocks and forget it; removing it from `running` is the caller's.

        With overlap a step that still runs may write KV into these blocks. That is safe: every
        step is enqueued on one CUDA stream, so a later step that is given a freed block (or
        reads it as a prefix-cache hit) runs after those writes; and the in-flight step writes
        only slots at or after the request's last known token, never a block registered in the
        prefix cache (those hold known tokens only, see ``_update_row``).
        """
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        self.block_manager.free(request.request_id)
        if self.loras is not None:
            self.loras.release(request.request_id)
        del self.requests[request.request_id]
