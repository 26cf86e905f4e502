"""The engine core's view of a request, and the scheduler's per-step plan.

The scheduler owns Request objects and their status; the block manager owns their KV blocks; the
model runner only reads what a SchedulerOutput hands it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.messages import (
    FinishReason,
    ImageInput,
    LoraRef,
    PoolingKind,
    PoolingParams,
    RequestTimings,
    SamplingParams,
    TokenLogprobs,
)
from protocol.output_interval import IntervalCounter

if TYPE_CHECKING:
    from engine_core.grammar import RequestGrammar
    from engine_core.kv_offload import KVMoves
    from engine_core.state_snapshots import StateCopy


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, not yet admitted (or preempted and queued again)
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True)
class HeldTokens:
    """A request's tokens (and their logprobs) that the engine process holds back until its
    client's output interval says they are due (protocol/output_interval.py)."""

    counter: IntervalCounter
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One request inside the engine core. Each group of fields below has one writer."""

    # What the request is, fixed when it is made (engine_core/server.py, engine_core/llm.py).
    request_id: str  # unique inside this engine (the engine scopes client ids by client)
    prompt_token_ids: list[int]
    params: SamplingParams
    client_id: bytes = b""  # whom outputs go to
    client_request_id: str = ""  # the id the client chose
    arrival_time: float = field(default_factory=time.monotonic)
    # An embedding request: its prompt runs, nothing is sampled, and it ends (POOLED) with the
    # step that ran its last prompt token, its vector pooled by the runner (engine_core/pooler.py).
    pooling: PoolingParams | None = None
    lora: LoraRef | None = None  # its LoRA adapter (engine_core/lora/); None: the base model
    # Its prompt's images (processed by the API process), in prompt order: their embeddings
    # replace the placeholder runs they name (engine_core/multimodal.py).
    images: tuple[ImageInput, ...] = ()
    # Lower runs sooner under --scheduling-policy priority (ties by arrival_time); 0 otherwise.
    priority: int = 0

    # Written by the scheduler (engine_core/scheduler.py) only.
    # token_ids = prompt + outputs; the tokens [0, num_computed_tokens) have K/V in the cache.
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    # Its stopping rules as checked at every token, set when the request is added: the ids that
    # stop it (its stop ids, and EOS unless ignore_eos) and the length at which it stops
    # (prompt + max_tokens, or the model's limit if lower).
    stop_ids: frozenset[int] = frozenset()
    length_limit: int = 0
    # Its timeline on time.monotonic() (0: not yet), for the timings its last output carries.
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    first_token_index: int = 0  # where its first new token goes: len(token_ids) when admitted
    # Speculation (engine_core/speculative.py): the drafts planned for it, and those it kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    # Written by the engine core (engine_core/core.py) only.
    grammar: RequestGrammar | None = None  # the matcher of its constraint (structured output)
    # With params.prompt_logprobs: the logprobs of prompt tokens 1.. as the prefill computes them
    # (a prefix-cache hit would skip their logits, so such a request takes none until complete).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they went out with the request's first token

    # Written by the engine process (engine_core/server.py) only: what it holds back for the
    # request's output interval, or None where every step's tokens go out at once.
    held: HeldTokens | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Read by the sampler for every row of every step, so derived once here; they cannot go
        # stale: SamplingParams is frozen and a request's params are never replaced.
        self.uses_penalties = has_penalties(self.params)
        self.wants_prompt_logprobs = self.params.prompt_logprobs is not None
        # Its chunks take the scheduler's general planning, never the inline common case of a
        # running request (Scheduler._schedule_running): it scores or pools its prompt tokens.
        self.planned_apart = self.wants_prompt_logprobs or self.pooling is not None
        # Its vector needs every prompt token's hidden state: no prefix-cache hit may skip one.
        self.pools_every_token = self.pooling is not None and self.pooling.kind == PoolingKind.MEAN
        # Its token is the argmax of the raw logits: greedy, and no penalty, min_tokens mask or
        # logprobs to compute on the way.
        self.argmax_only = (
            self.params.greedy
            and not self.uses_penalties
            and self.params.min_tokens == 0
            and self.params.logprobs is None
            and not self.params.logit_bias
            and self.params.constraint is None
        )
        # Speculative decoding draws each drafted position's token as a plain step would, under
        # its grammar's mask there (engine_core/speculative.py); prompt scoring and pooling
        # plan their chunks apart.
        self.speculates = not self.planned_apart

    @classmethod
    def resumed(
        cls,
        request_id: str,
        token_ids: list[int],
        num_output_tokens: int,
        params: SamplingParams,
        **fields: Any,
    ) -> Request:
        """A request whose last ``num_output_tokens`` tokens an earlier engine generated: they
        count as its output (a preempted request is in the same state, and recomputes them)."""
        split = len(token_ids) - num_output_tokens
        request = cls(request_id, token_ids[:split], params, **fields)
        request.token_ids.extend(token_ids[split:])
        return request

    @property
    def shown_id(self) -> str:
        """The id its client knows it by, for messages it reads (``request_id`` is scoped by
        client inside the engine)."""
        return self.client_request_id or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def timings(self) -> RequestTimings:
        """Queue, prefill and decode time of a finished request (a request that ended before
        a step or a token was its own has them end at its finish)."""
        end = self.finish_time
        scheduled = self.first_scheduled_time or end
        first = min(self.first_token_time or end, end)
        return RequestTimings(
            scheduled - self.arrival_time,
            first - scheduled,
            end - first,
            self.num_draft_tokens,
            self.num_accepted_tokens,
        )

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and they have not gone out yet (with its first token)."""
        return self.wants_prompt_logprobs and not self.prompt_logprobs_sent


def has_penalties(params: SamplingParams) -> bool:
    """True when the request's logits depend on its previous tokens (read on the host)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part in a step: compute ``num_new_tokens`` tokens from ``start``.

    ``start`` and ``samples`` are fixed when the step is planned: with overlap the request moves
    on (num_computed_tokens, a placeholder token) before this step's update reads them.
    """

    request: Request
    num_new_tokens: int
    block_ids: Sequence[int]  # the request's whole block table, a copy (int32 array or list)
    start: int  # where the chunk begins: the request's num_computed_tokens when planned
    # The chunk reaches the end of the known tokens, so a token is sampled (never for a pooling
    # request: its last chunk ends it instead).
    samples: bool
    # Speculation: the drafts that follow the request's last known token in this chunk (the
    # chunk is that token and them); the target's tokens after each decide which are kept.
    drafts: tuple[int, ...] = ()
    # With more than one KV layer group (engine_core/kv_groups.py): the tables of groups 1..,
    # copies, as long as ``block_ids`` (group 0's); empty with one group.
    group_block_ids: tuple[Sequence[int], ...] = ()
    # With linear-attention layers (Qwen3-Next): the state slot the request holds, whose
    # tensors its chunk reads and writes (zeroed first where ``start`` is 0); -1 without.
    state_slot: int = -1

    @classmethod
    def plan(
        cls, request: Request, num_new_tokens: int, block_ids: Sequence[int]
    ) -> ScheduledRequest:
        """The chunk of ``num_new_tokens`` tokens that starts at the request's computed ones."""
        start = request.num_computed_tokens
        samples = start + num_new_tokens == len(request.token_ids) and request.pooling is None
        return cls(request, num_new_tokens, block_ids, start, samples)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefills (in FCFS order)
    preempted_ids: list[str] = field(default_factory=list)
    # Positions in ``scheduled`` of prompt chunks whose logits score prompt tokens (requests that
    # asked for prompt logprobs); almost always empty.
    prompt_logprob_seqs: list[int] = field(default_factory=list)
    # Set by the scheduler: every row computes one token and samples (a decode step), which
    # lets the input batch advance the last step's inputs instead of packing anew.
    decode_only: bool = False
    # Copies between the KV cache and the host KV tier that the runner makes before this step's
    # forward (engine_core/kv_offload.py); None: none.
    kv_moves: KVMoves | None = None
    # Copies between linear-attention state slots and saved states (engine_core/
    # state_snapshots.py) that the runner makes, in order, before this step's forward.
    state_copies: tuple[StateCopy, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class EngineOutput:
    """What one step did to one request: tokens appended, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # attached by the engine core when asked for
    error: str | None = None  # with FinishReason.ERROR: why (told to the client as a 400)
    prompt_logprobs: list[TokenLogprobs] | None = None  # in the request's first output
    embedding: list[float] | None = None  # a pooling request's vector, with its end (POOLED)
