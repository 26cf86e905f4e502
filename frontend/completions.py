"""/v1/completions: prompts (text or token ids) in, a response or an SSE stream out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from frontend.errors import bad_request
from frontend.generation import (
    Generation,
    check_context,
    check_stop_token_ids,
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
    ctx.check_engine()
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")
    check_stop_token_ids(ctx, req)
    prompts = await completion_prompts(ctx, req)
    max_tokens = req.max_tokens or 16
    for p in prompts:
        check_context(ctx, len(p), max_tokens, "prompt")
    return Generation.for_request(ctx, req, prompts, max_tokens, req.logprobs, "cmpl", arrival)


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


async def complete(ctx: ServingContext, req: CompletionRequest, gen: Generation) -> dict:
    """The whole response, once every choice has finished."""
    async for _ in gen.run():
        pass
    echo = echo_texts(ctx, req, gen)
    choices = []
    for c in gen.choices:
        prefix = echo[c.index // req.n] if echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx, c.token_ids, c.logprobs, len(prefix))
        choices.append(
            CompletionChoice(
                index=c.index,
                text=prefix + c.text.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
            )
        )
    resp = CompletionResponse(id=gen.id, model=ctx.served_model, choices=choices, usage=gen.usage())
    return resp.model_dump()


async def stream_completion(
    ctx: ServingContext, req: CompletionRequest, gen: Generation
) -> AsyncIterator[str]:
    writer = ChunkWriter(gen.id, "text_completion", ctx.served_model, req.include_usage)
    offsets = [0] * len(gen.choices)
    try:
        echo = echo_texts(ctx, req, gen)
        if echo:
            first = [completion_delta(c.index, echo[c.index // req.n]) for c in gen.choices]
            yield writer.chunk(first)
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
                parts.append(completion_delta(d.index, d.text, lp, d.finish_reason))
            if parts:
                yield writer.chunk(parts)
        if req.include_usage:
            yield writer.chunk([], gen.usage())
    except Exception as exc:
        yield sse_error(exc)
    yield DONE


def completion_delta(
    index: int, text: str, lp: CompletionLogprobs | None = None, finish: str | None = None
) -> dict[str, Any]:
    """CompletionChoice(...).model_dump(), built directly (see frontend/sse.py)."""
    logprobs = None if lp is None else lp.model_dump()
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


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
