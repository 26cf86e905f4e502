"""Completions and chat completions: from a validated request to a response or an SSE stream.

One HTTP request becomes ``len(prompts) * n`` engine requests sharing one queue. Each choice owns
a TextStream (incremental detokenizer + stop strings); a matched stop string ends the choice and
aborts it in the engine. Tokenization runs on a single worker thread, never on the event loop.

Streaming costs per chunk, not per token: each wake-up takes every step output already queued for
the request (a consumer that fell behind catches up in one chunk), and a choice is flushed only
once ``--stream-interval`` new tokens have gathered since its last chunk, when it ends, or for its
first token (so the interval never delays the time to first token). Text is decoded once per
flush; only a choice with stop strings decodes each step's output as it comes, so that a match
aborts the engine request as early as it can and the usage counts the same tokens however the
outputs were batched. A non-streamed response flushes each choice once, at its end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from frontend.admission import Admission, AdmissionGate, OverloadedError, TooManySequencesError
from frontend.detokenizer import TextStream
from frontend.engine_client import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineRequestError,
    RequestGroup,
)
from frontend.metrics import Metrics
from frontend.protocol_openai import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    random_id,
)
from protocol.messages import FinishReason, RequestOutput, SamplingParams, TokenLogprobs

logger = logging.getLogger("tandem.frontend")

ENGINE_DOWN_RETRY_AFTER_S = 5  # about what an engine restart takes on a small model


class OpenAIError(Exception):
    """An error answered in the OpenAI shape with an HTTP status (and headers, if any)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def engine_unavailable(reason: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"the engine core is unavailable: {reason}",
        "service_unavailable",
        None,
        "engine_down",
        {"Retry-After": str(ENGINE_DOWN_RETRY_AFTER_S)},
    )


def overloaded(exc: OverloadedError) -> OpenAIError:
    return OpenAIError(
        503,
        str(exc),
        "service_unavailable",
        None,
        "overloaded",
        {"Retry-After": str(exc.retry_after_s)},
    )


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, OverloadedError):
        return overloaded(exc)
    if isinstance(exc, TooManySequencesError):
        return bad_request(str(exc), "n", "too_many_sequences")
    if isinstance(exc, EngineRequestError):
        kind = "invalid_request_error" if exc.code < 500 else "internal_error"
        return OpenAIError(exc.code, exc.message, kind)
    return OpenAIError(500, "internal server error", "internal_error")


# ---- text <-> tokens --------------------------------------------------------------------------


class Tokenizer:
    """The HF tokenizer behind one worker thread (encode), plus fast decode for the loop."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer  # Rust tokenizers: decode is cheap
        # One thread: the HF wrapper is not safe to call from several threads at once.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    def decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=True)

    def _token_text(self, token_id: int) -> str:
        return self._backend.decode([token_id], skip_special_tokens=False)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a tokenizer call on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.hf.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """Apply the chat template; the text already holds special tokens, so add none."""
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja or a missing template: the client's messages or model
            raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
        return self.hf.encode(text, add_special_tokens=False)


# ---- shared state -----------------------------------------------------------------------------


@dataclass
class ServingContext:
    engine: AsyncEngine  # replaced by a new connection when the engine core is restarted
    tokenizer: Tokenizer
    served_model: str
    max_model_len: int
    vocab_size: int
    metrics: Metrics
    admission: AdmissionGate = field(default_factory=AdmissionGate.unbounded)
    stream_interval: int = 1  # tokens per SSE chunk and choice (--stream-interval)

    def admit(self, num_sequences: int) -> Admission:
        """Hold room for a request's sequences, or raise the 503 (or 400) that says why not."""
        try:
            return self.admission.admit(num_sequences)
        except OverloadedError as exc:
            self.metrics.record_rejected("overloaded")
            raise overloaded(exc) from None
        except TooManySequencesError as exc:
            raise as_openai_error(exc) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist. Served: `{self.served_model}`.",
                param="model",
                code="model_not_found",
            )

    def check_engine(self) -> None:
        reason = self.engine.dead_reason
        if reason is not None:
            raise engine_unavailable(reason)

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"token ids must lie in [0, {self.vocab_size})", param)


# ---- per-choice state -------------------------------------------------------------------------


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None
    ended: FinishReason | None = None  # the engine finished it; the text is not flushed yet
    decoded: int = 0  # token_ids[:decoded] went through the detokenizer
    sent: int = 0  # token_ids[:sent] (and their logprobs) went out in a flush
    unsent_text: str = ""  # text the detokenizer released since the last flush


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
    ) -> None:
        self.ctx = ctx
        self.id = request_id  # the response id; engine requests are "{id}-{choice index}"
        self.arrival = arrival  # when the HTTP request came in: TTFT includes tokenization
        self.prompts = prompts
        self.stream_interval = stream_interval
        self.choices = [
            Choice(i, prompts[i // n], TextStream(ctx.tokenizer.decode, stop))
            for i in range(len(prompts) * n)
        ]
        self.requests = [
            EngineRequest(f"{request_id}-{c.index}", c.prompt_ids, params[c.index % n])
            for c in self.choices
        ]

    async def run(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yield the deltas of each flush until every choice has finished."""
        self.ctx.check_engine()
        cut = "abort"  # how choices that never finished count: the client left, unless...
        try:
            async with self.ctx.engine.open(self.requests) as group:
                pending = len(self.choices)
                while pending:
                    deltas = self._apply_batch(group, await group.next_batch())
                    if deltas:
                        pending -= sum(d.finish_reason is not None for d in deltas)
                        yield deltas
        except (OpenAIError, EngineDeadError) as exc:
            cut = "error"  # ...the engine failed them
            raise as_openai_error(exc) from None
        finally:
            self._record_unfinished(cut)

    def _apply_batch(
        self, group: RequestGroup, items: list[tuple[int, RequestOutput | Exception]]
    ) -> list[ChoiceDelta]:
        """Take in every queued output, then flush each choice they touched that is due."""
        touched: dict[int, Choice] = {}
        for index, item in items:
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # outputs that raced the abort after a stop string
            if isinstance(item, Exception):
                raise as_openai_error(item)
            self._receive(group, choice, item)
            if choice.text.has_stop_strings:
                # Step by step: a match ends the choice before its later outputs count.
                self._decode(group, choice)
            touched[index] = choice
        deltas = (self._advance(group, c) for c in touched.values())
        return [d for d in deltas if d is not None]

    def _receive(self, group: RequestGroup, choice: Choice, out: RequestOutput) -> None:
        """Record one step's tokens (no decoding here: that waits for the flush)."""
        new = out.new_token_ids
        if new and choice.first_token_at is None:
            choice.first_token_at = time.monotonic()
            self.ctx.metrics.record_first_token(choice.first_token_at - self.arrival)
        self.ctx.metrics.record_tokens(len(new))
        choice.token_ids += new
        choice.logprobs += out.logprobs or []
        if out.finish_reason is not None:
            group.finished(choice.index)
            if out.finish_reason == FinishReason.ERROR:
                raise OpenAIError(500, "the engine failed this request", "internal_error")
            choice.ended = out.finish_reason

    def _advance(self, group: RequestGroup, choice: Choice) -> ChoiceDelta | None:
        """The choice's flush, if one is due: decoded here, once for all its new tokens."""
        due = self._due(choice)
        if choice.finish_reason is None and (due or choice.ended is not None):
            self._decode(group, choice)
        if choice.finish_reason is None and not due:
            return None
        return self._flush(choice)

    def _decode(self, group: RequestGroup, choice: Choice) -> None:
        """Detokenize the tokens not decoded yet; end the choice on its end or a stop string."""
        pending = choice.token_ids[choice.decoded :]
        choice.decoded = len(choice.token_ids)
        if choice.ended is not None:
            choice.unsent_text += choice.text.finish(pending)
            # A stop string that the last tokens completed wins over the engine's reason.
            self._finish(choice, "stop" if choice.text.stopped else choice.ended.openai_name)
            return
        choice.unsent_text += choice.text.push(pending)
        if choice.text.stopped:
            group.stop(choice.index)
            self._finish(choice, "stop")

    def _due(self, choice: Choice) -> bool:
        """Whether a streamed choice has gathered enough tokens for a chunk (or its first)."""
        interval = self.stream_interval
        if interval is None:
            return False
        unsent = len(choice.token_ids) - choice.sent
        return unsent >= interval or (choice.sent == 0 and unsent > 0)

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

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in self.choices)
        )


# ---- request -> engine requests ---------------------------------------------------------------


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )


def params_per_choice(base: SamplingParams, n: int) -> list[SamplingParams]:
    """With a seed, choice i uses seed + i: the choices differ yet the request is repeatable."""
    from dataclasses import replace

    from protocol.codec import ProtocolError, validate_sampling_params

    out = [base if base.seed is None else replace(base, seed=base.seed + i) for i in range(n)]
    try:
        for p in out:
            validate_sampling_params(p)
    except ProtocolError as exc:
        raise bad_request(str(exc)) from None
    return out


def check_context(ctx: ServingContext, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """The output budget for one prompt; 400 when prompt + max_tokens exceeds the context."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param)
    if max_tokens is None:
        max_tokens = ctx.max_model_len - prompt_len
    if max_tokens < 1 or prompt_len + max_tokens > ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
            f"requested {prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, "
            f"{max(max_tokens, 1)} for the completion). Please reduce the prompt or max_tokens.",
            param,
            "context_length_exceeded",
        )
    return max_tokens


async def completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt; text prompts are encoded on the tokenizer thread."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    texts = [p for p in items if isinstance(p, str)]
    encoded = iter(await ctx.tokenizer.run(ctx.tokenizer.encode_all, texts) if texts else [])
    prompts = [next(encoded) if isinstance(p, str) else p for p in items]
    for p in prompts:
        ctx.check_token_ids(p, "prompt")
    return prompts


def num_sequences(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Engine requests behind one HTTP request: one per prompt per choice."""
    if isinstance(req, ChatCompletionRequest) or isinstance(req.prompt, str):
        return req.n
    if req.prompt and not all(isinstance(t, int) for t in req.prompt):
        return len(req.prompt) * req.n  # a batch of prompts
    return req.n  # one prompt given as token ids


def stop_token_check(ctx: ServingContext, req: SamplingFields) -> None:
    if req.stop_token_ids:
        ctx.check_token_ids(req.stop_token_ids, "stop_token_ids")


# ---- /v1/completions --------------------------------------------------------------------------


async def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> Generation:
    arrival = time.monotonic()
    ctx.check_model(req.model)
    ctx.check_engine()
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")
    stop_token_check(ctx, req)
    prompts = await completion_prompts(ctx, req)
    max_tokens = req.max_tokens or 16
    for p in prompts:
        check_context(ctx, len(p), max_tokens, "prompt")
    params = params_per_choice(sampling_params(req, max_tokens, req.logprobs), req.n)
    rid = random_id("cmpl")
    interval = ctx.stream_interval if req.stream else None
    return Generation(ctx, prompts, params, req.n, req.stop_strings, rid, arrival, interval)


async def complete(ctx: ServingContext, req: CompletionRequest, gen: Generation) -> dict:
    async for _ in gen.run():
        pass
    echo = echo_texts(ctx, req, gen)
    choices = []
    for c in gen.choices:
        prefix = echo[c.index // req.n] if echo else ""
        choices.append(
            CompletionChoice(
                index=c.index,
                text=prefix + c.text.text,
                logprobs=completion_logprobs(ctx, c.token_ids, c.logprobs, len(prefix))
                if req.logprobs is not None
                else None,
                finish_reason=c.finish_reason,
            )
        )
    resp = CompletionResponse(
        id=gen.id,
        model=ctx.served_model,
        choices=choices,
        usage=gen.usage(),
    )
    return resp.model_dump()


def echo_texts(ctx: ServingContext, req: CompletionRequest, gen: Generation) -> list[str]:
    if not req.echo:
        return []
    if isinstance(req.prompt, str):
        return [req.prompt]
    if isinstance(req.prompt, list) and all(isinstance(p, str) for p in req.prompt):
        return list(req.prompt)  # type: ignore[arg-type]
    return [ctx.tokenizer.decode(p) for p in gen.prompts]


def completion_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[TokenLogprobs], offset: int
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    text = ctx.tokenizer.token_text
    for tid, lp in zip(token_ids, logprobs, strict=False):
        token = text(tid)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(
            {text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
        )
        out.text_offset.append(offset)
        offset += len(token)
    return out


async def stream_completion(
    ctx: ServingContext, req: CompletionRequest, gen: Generation
) -> AsyncIterator[str]:
    rid = gen.id
    created = int(time.time())
    offsets = [0] * len(gen.choices)

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        body: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": ctx.served_model,
            "choices": choices,
        }
        if req.include_usage:
            body["usage"] = usage.model_dump() if usage else None
        return sse(body)

    try:
        echo = echo_texts(ctx, req, gen)
        if echo:
            first = [_completion_delta(c.index, echo[c.index // req.n]) for c in gen.choices]
            yield chunk(first)
            offsets = [len(echo[c.index // req.n]) for c in gen.choices]
        async for deltas in gen.run():
            parts = []
            for d in deltas:
                if not (d.text or d.finish_reason or d.logprobs):
                    continue
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(ctx, d.token_ids, d.logprobs, offsets[d.index])
                    offsets[d.index] += sum(len(t) for t in lp.tokens)
                parts.append(_completion_delta(d.index, d.text, lp, d.finish_reason))
            if parts:
                yield chunk(parts)
        if req.include_usage:
            yield chunk([], gen.usage())
    except Exception as exc:
        yield sse_error(exc)
    yield "data: [DONE]\n\n"


def _completion_delta(
    index: int, text: str, lp: CompletionLogprobs | None = None, finish: str | None = None
) -> dict:
    """CompletionChoice(...).model_dump() built directly: pydantic costs ~10 us a chunk."""
    logprobs = None if lp is None else lp.model_dump()
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


# ---- /v1/chat/completions ---------------------------------------------------------------------


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> Generation:
    arrival = time.monotonic()
    ctx.check_model(req.model)
    ctx.check_engine()
    stop_token_check(ctx, req)
    messages = [m.as_template_dict() for m in req.messages]
    tok = ctx.tokenizer
    prompt = await tok.run(tok.render_chat, messages, req.add_generation_prompt)
    max_tokens = check_context(ctx, len(prompt), req.max_output_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = params_per_choice(sampling_params(req, max_tokens, logprobs), req.n)
    rid = random_id("chatcmpl")
    interval = ctx.stream_interval if req.stream else None
    return Generation(ctx, [prompt], params, req.n, req.stop_strings, rid, arrival, interval)


async def chat(ctx: ServingContext, req: ChatCompletionRequest, gen: Generation) -> dict:
    async for _ in gen.run():
        pass
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text.text),
            logprobs=chat_logprobs(ctx, c.token_ids, c.logprobs) if req.logprobs else None,
            finish_reason=c.finish_reason,
        )
        for c in gen.choices
    ]
    resp = ChatCompletionResponse(
        id=gen.id,
        model=ctx.served_model,
        choices=choices,
        usage=gen.usage(),
    )
    return resp.model_dump()


def chat_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[TokenLogprobs]
) -> ChatLogprobs:
    def entry(tid: int, value: float) -> TopLogprob:
        token = ctx.tokenizer.token_text(tid)
        return TopLogprob(token=token, logprob=value, bytes=list(token.encode()))

    content = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        e = entry(tid, lp.logprob)
        tops = [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(**e.model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)


async def stream_chat(
    ctx: ServingContext, req: ChatCompletionRequest, gen: Generation
) -> AsyncIterator[str]:
    rid = gen.id
    created = int(time.time())

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        # ChatCompletionChunk(...).model_dump() built directly: pydantic costs ~10 us a chunk.
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": ctx.served_model,
            "choices": choices,
        }
        if req.include_usage:
            body["usage"] = usage.model_dump() if usage else None
        return sse(body)

    def part(index: int, delta: dict, lp: ChatLogprobs | None, finish: str | None) -> dict:
        logprobs = None if lp is None else lp.model_dump()
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    try:
        role = {"role": "assistant", "content": ""}
        yield chunk([part(c.index, role, None, None) for c in gen.choices])
        async for deltas in gen.run():
            parts = [
                part(
                    d.index,
                    {"content": d.text} if d.text else {},  # OpenAI sends only the set fields
                    chat_logprobs(ctx, d.token_ids, d.logprobs) if req.logprobs else None,
                    d.finish_reason,
                )
                for d in deltas
                if d.text or d.finish_reason or (req.logprobs and d.logprobs)
            ]
            if parts:
                yield chunk(parts)
        if req.include_usage:
            yield chunk([], gen.usage())
    except Exception as exc:
        yield sse_error(exc)
    yield "data: [DONE]\n\n"


# ---- SSE --------------------------------------------------------------------------------------


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(exc: Exception) -> str:
    """An error after the 200 header went out: one OpenAI error event, then [DONE]."""
    if not isinstance(exc, OpenAIError | EngineDeadError | EngineRequestError):
        logger.error("unexpected error while streaming", exc_info=exc)
    err = as_openai_error(exc)
    return sse({"error": {**err.info.model_dump(), "status": err.status}})
