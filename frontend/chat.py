"""/v1/chat/completions: messages rendered by the model's chat template, a response or a stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from frontend.generation import (
    Generation,
    check_context,
    check_stop_token_ids,
)
from frontend.openai_schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from frontend.serving_context import ServingContext
from frontend.sse import DONE, ChunkWriter, sse_error
from protocol.messages import TokenLogprobs


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> Generation:
    """Check, render and tokenize; nothing reaches the engine until the Generation runs."""
    arrival = time.monotonic()
    ctx.check_model(req.model)
    ctx.check_engine()
    check_stop_token_ids(ctx, req)
    messages = [m.as_template_dict() for m in req.messages]
    tok = ctx.tokenizer
    prompt = await tok.run(tok.render_chat, messages, req.add_generation_prompt)
    max_tokens = check_context(ctx, len(prompt), req.max_output_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Generation.for_request(ctx, req, [prompt], max_tokens, logprobs, "chatcmpl", arrival)


async def chat(ctx: ServingContext, req: ChatCompletionRequest, gen: Generation) -> dict:
    """The whole response, once every choice has finished."""
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
        id=gen.id, model=ctx.served_model, choices=choices, usage=gen.usage()
    )
    return resp.model_dump()


async def stream_chat(
    ctx: ServingContext, req: ChatCompletionRequest, gen: Generation
) -> AsyncIterator[str]:
    writer = ChunkWriter(gen.id, "chat.completion.chunk", ctx.served_model, req.include_usage)
    try:
        role = {"role": "assistant", "content": ""}
        yield writer.chunk([chat_delta(c.index, role) for c in gen.choices])
        async for deltas in gen.run():
            parts = [
                chat_delta(
                    d.index,
                    {"content": d.text} if d.text else {},  # OpenAI sends only the set fields
                    chat_logprobs(ctx, d.token_ids, d.logprobs) if req.logprobs else None,
                    d.finish_reason,
                )
                for d in deltas
                if d.text or d.finish_reason or (req.logprobs and d.logprobs)
            ]
            if parts:
                yield writer.chunk(parts)
        if req.include_usage:
            yield writer.chunk([], gen.usage())
    except Exception as exc:
        yield sse_error(exc)
    yield DONE


def chat_delta(
    index: int,
    delta: dict[str, Any],
    lp: ChatLogprobs | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    """ChatChunkChoice(...).model_dump(), built directly (see frontend/sse.py)."""
    logprobs = None if lp is None else lp.model_dump()
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


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
