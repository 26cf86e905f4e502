"""/v1/completions: prompts (text or token ids) in, a response or an SSE stream out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from frontend.errors import bad_request
from frontend.generation import (
    Generation,
    check_context,
    check_decoding,
    check_stop_token_ids,
    engine_extras,
)
from frontend.openai_schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from frontend.serving_context import ServingContext
from frontend.sse import DONE, ChunkWriter, sse_error
from protocol.messages import TokenLogprobs


async def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> Generation:
    """Check and tokenize; nothing reaches the engine until the Generation runs."""
    arrival = time.monotonic()
    ctx.check_model(req.model)
    await ctx.wait_for_engine()
    check_stop_token_ids(ctx, req)
    check_decoding(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1, or 0 with echo", "max_tokens")
    # echo with logprobs reports the prompt's tokens too: the engine scores them.
    echo_logprobs = req.logprobs if req.echo else None
    extras = await engine_extras(ctx, req, echo_logprobs)
    prompts = await completion_prompts(ctx, req)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    for p in prompts:
        check_context(ctx, len(p), max_tokens, "prompt")
    return Generation.for_request(
        ctx, req, prompts, max_tokens, req.logprobs, extras, "cmpl", arrival
    )


async def completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt; text prompts are encoded on the tokenizer thread, with the
    other requests' waiting texts (Tokenizer.encode)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    texts = [p for p in items if isinstance(p, str)]
    encoded = iter(await ctx.tokenizer.encode(texts) if texts else [])
    prompts = [next(encoded) if isinstance(p, str) else p for p in items]
    for p in prompts:
        ctx.check_token_ids(p, "prompt")
    return prompts


async def complete(ctx: ServingContext, req: CompletionRequest, gen: Generation) -> dict:
    """The whole response, once every choice has finished."""
    async for _ in gen.run():
        pass
    echo = echo_texts(ctx, req, gen)
    hidden = HiddenTokens.of(ctx, req)
    choices = []
    for c in gen.choices:
        prefix = echo[c.index // req.n] if echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs, _ = completion_logprobs(
                ctx, c.token_ids, c.logprobs, len(prefix), hidden.output
            )
            if req.echo:
                logprobs = echoed_logprobs(
                    ctx, c.prompt_ids, c.prompt_logprobs, logprobs, hidden.prompt
                )
        choice = CompletionChoice(
            index=c.index,
            text=prefix + c.text.text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
        )
        if req.prompt_logprobs is not None:
            choice.prompt_logprobs = vllm_prompt_logprobs(ctx, c.prompt_ids, c.prompt_logprobs)
        choices.append(choice)
    resp = CompletionResponse(id=gen.id, model=gen.model, choices=choices, usage=gen.usage())
    body = resp.model_dump(exclude_none=False)
    body["usage"] = resp.usage.model_dump(exclude_none=True)  # no reasoning counts here
    return body


async def stream_completion(
    ctx: ServingContext, req: CompletionRequest, gen: Generation
) -> AsyncIterator[str]:
    """SSE chunks. The echo goes out first; with logprobs it waits for the choice's first output,
    which brings the prompt's logprobs."""
    writer = ChunkWriter(gen.id, "text_completion", gen.model, req.include_usage)
    offsets = [0] * len(gen.choices)
    echo = echo_texts(ctx, req, gen)
    hidden = HiddenTokens.of(ctx, req)
    echo_due = [bool(echo)] * len(gen.choices)  # choices whose echo is still to be sent
    last = ""  # the stream's end, sent in one write (see AdmittedStreamingResponse)
    try:
        if echo and req.logprobs is None:
            yield writer.chunks(
                [completion_delta(c.index, echo[c.index // req.n]) for c in gen.choices]
            )
            offsets = [len(echo[c.index // req.n]) for c in gen.choices]
            echo_due = [False] * len(gen.choices)
        async for deltas in gen.run():
            parts = []
            for d in deltas:
                text, lp = d.text, None
                if req.logprobs is not None:
                    start = offsets[d.index]
                    if echo_due[d.index]:
                        start = len(echo[d.index // req.n])
                    lp, offsets[d.index] = completion_logprobs(
                        ctx, d.token_ids, d.logprobs, start, hidden.output
                    )
                if echo_due[d.index]:
                    choice = gen.choices[d.index]
                    if lp is not None:
                        lp = echoed_logprobs(
                            ctx, choice.prompt_ids, choice.prompt_logprobs, lp, hidden.prompt
                        )
                    text, echo_due[d.index] = echo[d.index // req.n] + text, False
                if text or d.finish_reason or (lp is not None and lp.tokens):
                    parts.append(completion_delta(d.index, text, lp, d.finish_reason))
            if parts:
                if gen.finished:  # the last chunk: it goes out with what ends the stream
                    last = writer.chunks(parts)
                else:
                    yield writer.chunks(parts)
        if req.include_usage:
            last += writer.chunk([], gen.usage())
    except Exception as exc:
        last += sse_error(exc)
    yield last + DONE


def completion_delta(
    index: int, text: str, lp: CompletionLogprobs | None = None, finish: str | None = None
) -> dict[str, Any]:
    """CompletionChoice(...).model_dump(), built directly (see frontend/sse.py)."""
    logprobs = None if lp is None else lp.model_dump()
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def prompt_is_text(req: CompletionRequest) -> bool:
    return isinstance(req.prompt, str) or all(isinstance(p, str) for p in req.prompt)


def echo_texts(ctx: ServingContext, req: CompletionRequest, gen: Generation) -> list[str]:
    """Each prompt as the echo shows it: as sent, or token ids decoded as the output is."""
    if not req.echo:
        return []
    if isinstance(req.prompt, str):
        return [req.prompt]
    if prompt_is_text(req):
        return list(req.prompt)  # type: ignore[arg-type]
    return [ctx.tokenizer.decode(p, req.skip_special_tokens) for p in gen.prompts]


@dataclass(frozen=True)
class HiddenTokens:
    """The token ids whose text a response leaves out (special tokens, where
    skip_special_tokens asks), in the output and in an echoed prompt: such a token keeps its
    place in ``tokens`` but moves no ``text_offset`` on, so every offset points into the text
    the response holds. A prompt sent as text is echoed as sent, special tokens' text and all."""

    output: frozenset[int]
    prompt: frozenset[int]

    @classmethod
    def of(cls, ctx: ServingContext, req: CompletionRequest) -> HiddenTokens:
        skipped = ctx.tokenizer.special_ids if req.skip_special_tokens else frozenset()
        return cls(skipped, frozenset() if prompt_is_text(req) else skipped)


def completion_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    logprobs: list[TokenLogprobs],
    offset: int,
    hidden: frozenset[int],
) -> tuple[CompletionLogprobs, int]:
    """The tokens' logprobs with their offsets from ``offset``, and the offset after them.
    Each token's ``top_logprobs`` holds the most likely ones asked for and always the token
    itself, as OpenAI's legacy completions do (up to logprobs + 1 entries)."""
    out = CompletionLogprobs()
    text = ctx.tokenizer.token_text
    for tid, lp in zip(token_ids, logprobs, strict=False):
        token = text(tid)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top = {text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        if tid not in hidden:
            offset += len(token)
    return out, offset


def echoed_logprobs(
    ctx: ServingContext,
    prompt_ids: list[int],
    prompt_logprobs: list[TokenLogprobs] | None,
    generated: CompletionLogprobs,
    hidden: frozenset[int],
) -> CompletionLogprobs:
    """OpenAI's echo with logprobs: the prompt's tokens first (the first one has no logprob, as
    nothing precedes it), then the generated ones, offsets counted from the prompt's start."""
    first = ctx.tokenizer.token_text(prompt_ids[0])
    shift = 0 if prompt_ids[0] in hidden else len(first)
    prompt, _ = completion_logprobs(ctx, prompt_ids[1:], prompt_logprobs or [], shift, hidden)
    out = CompletionLogprobs(
        tokens=[first, *prompt.tokens],
        token_logprobs=[None, *prompt.token_logprobs],
        top_logprobs=[None, *prompt.top_logprobs],
        text_offset=[0, *prompt.text_offset],
    )
    out.tokens += generated.tokens
    out.token_logprobs += generated.token_logprobs
    out.top_logprobs += generated.top_logprobs
    out.text_offset += generated.text_offset
    return out


def vllm_prompt_logprobs(
    ctx: ServingContext, prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs] | None
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first token, then for each later prompt token a map
    token id -> {logprob, decoded_token} holding that token and the top N at its position."""
    return [None] + [
        prompt_logprob_entry(ctx, tid, lp)
        for tid, lp in zip(prompt_ids[1:], prompt_logprobs or [], strict=False)
    ]


def prompt_logprob_entry(
    ctx: ServingContext, token_id: int, lp: TokenLogprobs
) -> dict[str, dict[str, Any]]:
    text = ctx.tokenizer.token_text
    entry: dict[str, dict[str, Any]] = {
        str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(token_id)}
    }
    for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
        entry.setdefault(str(tid), {"logprob": value, "decoded_token": text(tid)})
        entry[str(tid)]["rank"] = rank
    return entry
