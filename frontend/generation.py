"""One HTTP request's engine requests, driven to their end: the core of completions and chat.

One HTTP request becomes ``len(prompts) * n`` engine requests sharing one queue (a RequestGroup).
Each choice owns a TextStream (incremental detokenizer + stop strings); a matched stop string ends
the choice and aborts it in the engine.

Streaming costs per chunk, not per token or per step. One rule (protocol/output_interval.py:
a first token and an end at once, otherwise every N tokens) is applied at three stages with the
same N: the engine sends a choice's tokens by it, the request group wakes this task by it, and a
choice is flushed by it (``--stream-interval``), so the interval never delays the time to first
token and no stage handles a choice at the steps in between. The metrics use each output's
arrival time, not the wake-up's. Text is decoded once per flush; only a choice with stop
strings decodes each step's output as it comes, so that a match aborts the engine request as
early as it can and the usage counts the same tokens however the outputs were batched. A
non-streamed response flushes each choice once, at its end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from frontend.constraints import check_end_not_held_off, constraint_of
from frontend.detokenizer import TextStream
from frontend.errors import OpenAIError, as_openai_error, bad_request
from frontend.openai_schemas import SamplingFields, UsageInfo, random_id
from frontend.serving_context import ServingContext
from protocol.client import Delivery, EngineDeadError, EngineRequest, RequestGroup
from protocol.codec import ProtocolError, validate_sampling_params
from protocol.messages import (
    Constraint,
    FinishReason,
    ImageInput,
    LoraRef,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from protocol.output_interval import OutputInterval

# The longest run of tokens the engine is asked for (and what a non-streamed choice, which
# needs its tokens only at its end, asks for). An engine that dies loses no more than this many
# tokens' work to the resume. And a step's runs travel in one frame, which has a size limit
# (protocol/codec.py): 64 tokens with 20 top logprobs are 16 KB a request, 16 MB at 1,024
# requests, where 1,024 tokens would have been about 260 MB.
MAX_OUTPUT_INTERVAL = 64

logger = logging.getLogger("tandem.frontend")

# ---- per-choice state -------------------------------------------------------------------------


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become text (the request's vLLM fields)."""

    skip_special_tokens: bool = True
    include_stop: bool = False  # include_stop_str_in_output


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0  # when its latest output with tokens came (inter-token latency)
    ended: FinishReason | None = None  # the engine finished it; the text is not flushed yet
    decoded: int = 0  # token_ids[:decoded] went through the detokenizer
    sent: int = 0  # token_ids[:sent] (and their logprobs) went out in a flush
    unsent_text: str = ""  # text the detokenizer released since the last flush
    prompt_logprobs: list[TokenLogprobs] | None = None  # with its first output, when asked
    # The token ids that stop it (EOS unless ignore_eos, stop_token_ids) whose text its output
    # leaves out when one ends it: all of them, unless include_stop_str_in_output (as vLLM).
    unshown_stop_ids: frozenset[int] = frozenset()


@dataclass
class ChoiceDelta:
    """What one choice gained in one flush: text to send, tokens, logprobs, maybe its end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    """Drives one HTTP request's engine requests and turns their outputs into choice deltas.

    ``stream_interval``: flush a choice once this many new tokens have gathered (its first token
    and its end are flushed at once); None flushes each choice only at its end (no streaming).
    ``keep_output=False``: the engine runs each prompt (for its prompt logprobs) but its one
    generated token is dropped: OpenAI's ``max_tokens: 0``, which ends with "length".
    """

    def __init__(
        self,
        ctx: ServingContext,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        stop: list[str],
        request_id: str,
        arrival: float,
        stream_interval: int | None = None,
        keep_output: bool = True,
        text: TextOptions = TextOptions(),
        lora: LoraRef | None = None,
        priority: int = 0,
    ) -> None:
        self.ctx = ctx
        # The name the response reports: the LoRA adapter's the request chose, or the base's.
        self.model = ctx.served_model if lora is None else lora.name
        self.keep_output = keep_output
        self.id = request_id  # the response id; engine requests are "{id}-{choice index}"
        self.arrival = arrival  # when the HTTP request came in: TTFT includes tokenization
        self.prompts = prompts
        self.stream_interval = stream_interval
        self.flush_rule = OutputInterval(stream_interval)  # when a choice's chunk goes out
        tok = ctx.tokenizer
        decode = tok.decode if text.skip_special_tokens else tok.decode_keeping_special_tokens
        self.choices = [
            Choice(
                i,
                prompts[i // n],
                TextStream(
                    decode, stop, tok.byte_level, text.include_stop, params[i % n].min_tokens
                ),
                unshown_stop_ids=frozenset()
                if text.include_stop
                else params[i % n].stopping_token_ids(ctx.eos_token_ids),
            )
            for i in range(len(prompts) * n)
        ]
        # Whether some choice decodes each output as it comes (stop strings; see _wake_every).
        self._stepwise = any(c.text.has_stop_strings for c in self.choices)
        interval = self._output_interval()
        self.requests = [
            EngineRequest(
                f"{request_id}-{c.index}",
                c.prompt_ids,
                params[c.index % n],
                0,
                interval,
                lora=lora,
                priority=priority,
            )
            for c in self.choices
        ]
        # The open engine group's members, by their index in it: all choices at first; after
        # an engine's death, the unfinished ones, resumed (``_resume``).
        self.members = [c.index for c in self.choices]
        self.resumes = 0
        self.resume_wait_left = ctx.resume_timeout_s  # seconds it may still wait for an engine
        self.resume_started: float | None = None  # when the last resume began, until output
        self._sent: RequestGroup | None = None  # sent by ``send``, not yet followed by ``run``

    @classmethod
    def for_request(
        cls,
        ctx: ServingContext,
        req: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int,
        logprobs: int | None,
        extras: EngineExtras,
        id_prefix: str,
        arrival: float,
    ) -> Generation:
        """The generation of a checked, tokenized request; nothing is sent until it runs.
        ``max_tokens`` 0 runs the prompts for one token and drops it (see ``keep_output``)."""
        ctx.check_priority(req.priority)
        engine_max = max(max_tokens, 1)
        params = params_per_choice(sampling_params(req, engine_max, logprobs, extras), req.n)
        interval = ctx.stream_interval if req.stream else None
        rid = random_id(id_prefix)
        stop = req.stop_strings
        keep = max_tokens > 0
        text = TextOptions(req.skip_special_tokens, req.include_stop_str_in_output)
        # Resolved here, once: an adapter unloaded since the request's first check is a 404
        # now, never a silent run on the base model.
        lora = ctx.lora_for(req.model)
        if lora is not None:
            ctx.metrics.record_lora_request(lora.name)
        # Logged under the client's X-Request-Id (frontend/request_id.py): the mapping to ours.
        logger.debug("engine requests %s-*", rid)
        options = (interval, keep, text, lora, req.priority)
        return cls(ctx, prompts, params, req.n, stop, rid, arrival, *options)

    def with_images(self, images: tuple[ImageInput, ...]) -> None:
        """The one prompt's images (a chat request's), on every choice's engine request."""
        self.requests = [replace(r, images=images) for r in self.requests]

    async def send(self) -> None:
        """Send the engine requests now; ``run`` then follows them. A streamed response sends
        before it sets up (see frontend/app.py ``start_stream``). If ``run`` never comes,
        ``close`` aborts them."""
        await self.ctx.wait_for_engine()
        # An engine that died meanwhile: ``run`` sends them, resuming as after any death.
        with contextlib.suppress(EngineDeadError):
            self._sent = await self._open([self.requests[i] for i in self.members])

    def close(self) -> None:
        """Abort what ``send`` sent, unless ``run`` took it over (which aborts on its own)."""
        group, self._sent = self._sent, None
        if group is not None:
            group.abort_unfinished()

    async def _open(self, requests: list[EngineRequest]) -> RequestGroup:
        """Send ``requests`` to an engine as one group (aborted there if the send fails)."""
        group = self.ctx.engine.open(requests, self._wake_every())
        await group.send()
        return group

    async def run(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yield the deltas of each flush until every choice has finished. When the engine dies
        the unfinished choices are resumed (``--max-request-resumes``): the stream goes on."""
        await self.ctx.wait_for_engine()
        cut = "abort"  # how choices that never finished count: the client left, unless...
        try:
            while True:
                try:
                    async for deltas in self._follow([self.requests[i] for i in self.members]):
                        yield deltas
                    return
                except EngineDeadError:
                    if self.resumes >= self.ctx.max_resumes:
                        raise
                    await self._resume()
        except (OpenAIError, EngineDeadError) as exc:
            cut = "error"  # ...the engine failed them
            raise as_openai_error(self._resumes_spent(exc)) from None
        finally:
            self._record_unfinished(cut)

    async def _follow(self, requests: list[EngineRequest]) -> AsyncIterator[list[ChoiceDelta]]:
        """Send ``requests`` (the members' engine requests; already sent if ``send`` was
        called) and flush their outputs; leaving, by any way, aborts what is unfinished."""
        group, self._sent = self._sent, None
        if group is None:
            group = await self._open(requests)
        try:
            while any(self.choices[i].finish_reason is None for i in self.members):
                items = await group.next_batch()
                if self.resume_started is not None:
                    self.ctx.metrics.record_resume_latency(time.monotonic() - self.resume_started)
                    self.resume_started = None
                dead = next(
                    (item for _, item, _ in items if isinstance(item, EngineDeadError)), None
                )
                deltas = self._apply_batch(group, items)
                if deltas:
                    yield deltas  # what came before the engine died, flushed first
                if dead is not None and not self.finished:
                    raise dead  # run() resumes the request if it may (not one already done)
        finally:
            group.abort_unfinished()

    def _output_interval(self) -> int:
        """How many tokens the engine gathers before it sends a choice's outputs: as many as
        a chunk needs, so neither process handles the choice at the steps in between."""
        if self._stepwise:
            return 1  # a stop string is matched at the step that completes it
        if self.stream_interval is None:
            return MAX_OUTPUT_INTERVAL
        return min(self.stream_interval, MAX_OUTPUT_INTERVAL)  # a longer chunk takes several

    def _wake_every(self) -> int | None:
        """How many tokens the group gathers before it wakes this task (see RequestGroup)."""
        if self._stepwise:
            return 1  # decoded step by step: a match aborts the engine request at once
        return self.stream_interval  # None (not streamed): woken only by the ends

    async def _resume(self) -> None:
        """The engine died: once one serves again, send every unfinished choice again with the
        tokens it has as output (a seeded choice then draws what it would have drawn). All the
        waits of one request together last at most --resume-timeout."""
        self.resume_started = time.monotonic()
        self.resume_wait_left -= await self.ctx.engine.wait_until_serving(self.resume_wait_left)
        self.resumes += 1
        self.members = [
            c.index for c in self.choices if c.finish_reason is None and c.ended is None
        ]
        for i in self.members:
            choice = self.choices[i]
            request = self.requests[i]
            rid = f"{self.id}-{i}-r{self.resumes}"  # a new id: the old one may linger somewhere
            resumed = request.resumed(rid, choice.token_ids[request.num_output_tokens :])
            if choice.prompt_logprobs is not None:  # they came already: do not ask again
                params = replace(resumed.params, prompt_logprobs=None)
                resumed = replace(resumed, params=params)
            self.requests[i] = resumed
        self.ctx.metrics.record_resumed(len(self.members))

    def _resumes_spent(self, exc: Exception) -> Exception:
        """The error a request fails with once it cannot be resumed (any more)."""
        if isinstance(exc, EngineDeadError) and self.ctx.max_resumes:
            return EngineDeadError(
                f"{exc} (resumed {self.resumes} of at most {self.ctx.max_resumes} times)"
            )
        return exc

    def _apply_batch(self, group: RequestGroup, items: list[Delivery]) -> list[ChoiceDelta]:
        """Take in every delivered output, then flush each choice they touched that is due."""
        touched: dict[int, Choice] = {}
        received = 0  # tokens taken in, counted once for the batch
        try:
            for slot, item, arrived in items:
                index = self.members[slot]
                choice = self.choices[index]
                if choice.finish_reason is not None:
                    continue  # outputs that raced the abort after a stop string
                if isinstance(item, EngineDeadError):
                    continue  # _follow raises it once the rest of the batch is flushed
                if isinstance(item, Exception):
                    raise as_openai_error(item)
                received += self._receive(group, choice, item, arrived)
                if self._stepwise and choice.text.has_stop_strings:
                    # Step by step: a match ends the choice before its later outputs count.
                    self._decode(group, choice)
                touched[index] = choice
        finally:
            self.ctx.metrics.record_tokens(received)
        deltas = (self._advance(group, c) for c in touched.values())
        return [d for d in deltas if d is not None]

    def _receive(self, group: RequestGroup, choice: Choice, out: RequestOutput, now: float) -> int:
        """Record one step's tokens, which arrived at ``now`` (no decoding here: that waits for
        the flush); returns how many."""
        new = out.new_token_ids if self.keep_output else []
        metrics = self.ctx.metrics
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = [finite_logprobs(lp) for lp in out.prompt_logprobs]
        if new:
            if choice.first_token_at is None:
                choice.first_token_at = now
                metrics.record_first_token(now - self.arrival)
            else:  # an output of several tokens (an output interval) spreads its gap over them
                metrics.record_inter_token(now - choice.last_token_at, len(new))
            choice.last_token_at = now
        choice.token_ids += new
        if out.logprobs and self.keep_output:
            choice.logprobs += map(finite_logprobs, out.logprobs)
        if out.finish_reason is not None:
            if out.timings is not None:
                metrics.record_engine_timings(out.timings)
                if self.ctx.tracer is not None:
                    self.ctx.tracer.record_engine_request(out.request_id, out.timings, now)
            group.finished(self.members.index(choice.index))
            if out.finish_reason == FinishReason.ERROR:
                raise OpenAIError(500, "the engine failed this request", "internal_error")
            choice.ended = out.finish_reason if self.keep_output else FinishReason.LENGTH
        return len(new)

    def _advance(self, group: RequestGroup, choice: Choice) -> ChoiceDelta | None:
        """The choice's flush, if one is due: decoded here, once for all its new tokens."""
        due = self._due(choice)
        if choice.finish_reason is None and (due or choice.ended is not None):
            self._decode(group, choice)
        if choice.finish_reason is None and not due:
            return None
        if choice.finish_reason is None:
            group.flushed(self.members.index(choice.index))
        return self._flush(choice)

    def _decode(self, group: RequestGroup, choice: Choice) -> None:
        """Detokenize the tokens not decoded yet; end the choice on its end or a stop string."""
        pending = choice.token_ids[choice.decoded :]
        choice.decoded = len(choice.token_ids)
        if choice.ended is not None:
            if (
                choice.ended == FinishReason.STOP
                and pending[-1:]
                and (pending[-1] in choice.unshown_stop_ids)
            ):
                pending = pending[:-1]  # the stop token's text: not part of the output
            choice.unsent_text += choice.text.finish(pending)
            # A stop string that the last tokens completed wins over the engine's reason.
            if choice.text.stopped:
                self._drop_past_stop(choice)
            self._finish(choice, "stop" if choice.text.stopped else choice.ended.openai_name)
            return
        choice.unsent_text += choice.text.push(pending)
        if choice.text.stopped:
            self._drop_past_stop(choice)
            group.stop(self.members.index(choice.index))
            self._finish(choice, "stop")

    @staticmethod
    def _drop_past_stop(choice: Choice) -> None:
        """Drop the tokens (and their logprobs) after the one that completed the stop string,
        decoded in the same run (speculative drafts): generated one at a time, the choice would
        have ended there. The detokenizer took every token before them (the stop token's id
        is its last, never pushed), and none of them was sent: each run is decoded before its
        flush."""
        kept = max(choice.text.tokens_to_stop, choice.sent)
        del choice.token_ids[kept:]
        del choice.logprobs[kept:]
        choice.decoded = min(choice.decoded, kept)

    def _due(self, choice: Choice) -> bool:
        """Whether a streamed choice has gathered enough tokens for a chunk (or its first)."""
        return self.flush_rule.due(len(choice.token_ids) - choice.sent, choice.sent > 0)

    @staticmethod
    def _flush(choice: Choice) -> ChoiceDelta:
        start, choice.sent = choice.sent, len(choice.token_ids)
        delta = ChoiceDelta(
            choice.index,
            choice.unsent_text,
            choice.token_ids[start:],
            choice.logprobs[start:],
            choice.finish_reason,
        )
        choice.unsent_text = ""
        return delta

    def _finish(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        first = choice.first_token_at
        self.ctx.metrics.record_finished(
            reason,
            len(choice.prompt_ids),
            None if first is None else first - self.arrival,
            time.monotonic() - self.arrival,
            len(choice.token_ids),
        )

    def _record_unfinished(self, reason: str) -> None:
        """Choices cut short (client gone, engine error) still count in the metrics."""
        for choice in self.choices:
            if choice.finish_reason is None:
                self.ctx.metrics.record_finished(
                    reason, len(choice.prompt_ids), None, time.monotonic() - self.arrival, 0
                )

    @property
    def finished(self) -> bool:
        """Every choice has flushed its finish: the stream's last chunk is the one just built."""
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in self.choices)
        )


# ---- request -> engine requests ---------------------------------------------------------------


@dataclass(frozen=True)
class EngineExtras:
    """What a request asks of the engine beyond sampling: checked, in the engine's terms."""

    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    constraint_param: str = ""  # the request field the constraint came from, for 400s


async def engine_extras(
    ctx: ServingContext, req: SamplingFields, prompt_logprobs: int | None = None
) -> EngineExtras:
    """The request's constraint (compiled once to prove it valid), logit_bias and prompt
    logprobs; a 400 naming the parameter when one is wrong."""
    found = constraint_of(req)
    constraint, param = None, ""
    if found is not None:
        constraint, param = found
        check_end_not_held_off(req, param)
        await ctx.check_constraint(constraint, param)
    bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    ctx.check_token_ids([t for t, _ in bias], "logit_bias")
    if len({t for t, _ in bias}) != len(bias):
        raise bad_request("logit_bias names a token twice", "logit_bias")
    asked = [n for n in (prompt_logprobs, req.prompt_logprobs) if n is not None]
    return EngineExtras(constraint, bias, max(asked) if asked else None, param)


def sampling_params(
    req: SamplingFields, max_tokens: int, logprobs: int | None, extras: EngineExtras
) -> SamplingParams:
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=engine_seed(req.seed),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=extras.logit_bias,
        constraint=extras.constraint,
        prompt_logprobs=extras.prompt_logprobs,
    )


def engine_seed(seed: int | None) -> int | None:
    """A request's seed (SEED_MIN..SEED_MAX) as the engine's unsigned 64-bit one: a negative
    seed's two's-complement bits."""
    return None if seed is None else seed % 2**64


def params_per_choice(base: SamplingParams, n: int) -> list[SamplingParams]:
    """With a seed, choice i uses seed + i (mod 2**64): the choices differ yet the request is
    repeatable."""
    out = [
        base if base.seed is None else replace(base, seed=engine_seed(base.seed + i))
        for i in range(n)
    ]
    try:
        for p in out:
            validate_sampling_params(p)
    except ProtocolError as exc:  # the wire's bounds, checked before the engine
        raise bad_request(str(exc), exc.field, "invalid_value") from None
    return out


def check_context(ctx: ServingContext, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """The output budget for one prompt; 400 when prompt + max_tokens exceeds the context."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param)
    asked_zero = max_tokens == 0  # echo's max_tokens 0, not a default that came to 0
    if max_tokens is None:
        max_tokens = ctx.max_model_len - prompt_len
    # max_tokens 0 (with echo) runs the prompt for one token and drops it: that one must fit.
    output = max(max_tokens, 1)
    if max_tokens < 0 or prompt_len + output > ctx.max_model_len:
        why = "that max_tokens 0 runs and drops" if asked_zero else "for the completion"
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
            f"requested {prompt_len + output} tokens ({prompt_len} in the prompt, {output} "
            f"{why}). Please reduce the prompt or max_tokens.",
            param,
            "context_length_exceeded",
        )
    return max_tokens


def check_stop_token_ids(ctx: ServingContext, req: SamplingFields) -> None:
    if req.stop_token_ids:
        ctx.check_token_ids(req.stop_token_ids, "stop_token_ids")


def check_decoding(req: SamplingFields) -> None:
    """The decoding fields this server cannot honour, refused by name."""
    if req.spaces_between_special_tokens:
        raise bad_request(
            "spaces_between_special_tokens: this server's (fast) tokenizers join special tokens "
            "as they decode them, without spaces; only false is accepted",
            "spaces_between_special_tokens",
        )


# JSON has no -inf, which a token the request's grammar masks has (top_logprobs under a
# constraint): such a logprob is reported at this floor, as vLLM's server reports it.
LOGPROB_FLOOR = -9999.0


def finite_logprobs(lp: TokenLogprobs) -> TokenLogprobs:
    """``lp`` with every logprob at LOGPROB_FLOOR or above (the same object where all are)."""
    if lp.logprob >= LOGPROB_FLOOR and all(v >= LOGPROB_FLOOR for v in lp.top_logprobs):
        return lp
    tops = [max(v, LOGPROB_FLOOR) for v in lp.top_logprobs]
    return TokenLogprobs(max(lp.logprob, LOGPROB_FLOOR), lp.top_token_ids, tops, lp.rank)
