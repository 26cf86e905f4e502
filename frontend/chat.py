"""/v1/chat/completions: messages rendered by the chat template, a response or a stream; tool
calls parsed out of the generated text (frontend/tools.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from frontend.completions import vllm_prompt_logprobs
from frontend.errors import bad_request
from frontend.generation import (
    Choice,
    Generation,
    check_context,
    check_stop_token_ids,
    engine_extras,
)
from frontend.openai_schemas import (
    UNSUPPORTED,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    FunctionCallOut,
    ToolCallOut,
    TopLogprob,
)
from frontend.serving_context import ServingContext
from frontend.sse import DONE, ChunkWriter, sse_error
from frontend.tool_parsers import ToolCall, ToolCallStreamer
from frontend.tools import NO_TOOLS, ToolPlan, plan_tools
from protocol.messages import TokenLogprobs


class ChatGeneration(Generation):
    """A chat request's Generation with its tool plan (what parses the output, if anything)."""

    tools: ToolPlan = NO_TOOLS


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> ChatGeneration:
    """Check, render and tokenize; nothing reaches the engine until the Generation runs."""
    arrival = time.monotonic()
    ctx.check_model(req.model)
    await ctx.wait_for_engine()
    for name in req.unsupported:
        raise bad_request(UNSUPPORTED[name], name, "unsupported_parameter")
    check_stop_token_ids(ctx, req)
    tools = plan_tools(req, ctx.tool_support)
    extras = await engine_extras(ctx, req)
    if tools.constraint is not None:
        if extras.constraint is not None:
            raise bad_request(
                "tool_choice forces a tool call: it cannot go with another structured-output "
                "constraint",
                "tool_choice",
            )
        await ctx.check_constraint(tools.constraint, "tools")
        extras = type(extras)(tools.constraint, extras.logit_bias, extras.prompt_logprobs)
    messages = [m.as_template_dict() for m in req.messages]
    tok = ctx.tokenizer
    prompt = await tok.run(
        tok.render_chat, messages, req.add_generation_prompt, tools.tools, tools.template
    )
    max_tokens = check_context(ctx, len(prompt), req.max_output_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    gen = ChatGeneration.for_request(
        ctx, req, [prompt], max_tokens, logprobs, extras, "chatcmpl", arrival
    )
    gen.tools = tools
    return gen


async def chat(ctx: ServingContext, req: ChatCompletionRequest, gen: ChatGeneration) -> dict:
    """The whole response, once every choice has finished."""
    async for _ in gen.run():
        pass
    choices = []
    for c in gen.choices:
        message = response_message(gen, req, c)
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(ctx, c.token_ids, c.logprobs) if req.logprobs else None,
                finish_reason=finish_reason(c.finish_reason, bool(message.tool_calls)),
            )
        )
    resp = ChatCompletionResponse(
        id=gen.id, model=ctx.served_model, choices=choices, usage=gen.usage()
    )
    if req.prompt_logprobs is not None:
        first = gen.choices[0]
        resp.prompt_logprobs = vllm_prompt_logprobs(ctx, first.prompt_ids, first.prompt_logprobs)
    body = resp.model_dump(exclude_none=False)
    for choice in body["choices"]:  # OpenAI leaves tool_calls out of a message without any
        if choice["message"]["tool_calls"] is None:
            del choice["message"]["tool_calls"]
    if body["prompt_logprobs"] is None:
        del body["prompt_logprobs"]
    return body


def response_message(
    gen: ChatGeneration, req: ChatCompletionRequest, choice: Choice
) -> ChatResponseMessage:
    parser = gen.tools.parser
    if parser is None:
        return ChatResponseMessage(content=choice.text.text)
    parsed = parser.extract(choice.text.text)
    calls = parsed.tool_calls[:1] if req.parallel_tool_calls is False else parsed.tool_calls
    if not calls:
        return ChatResponseMessage(content=parsed.content or "")
    return ChatResponseMessage(
        content=parsed.content or None, tool_calls=[tool_call_out(c) for c in calls]
    )


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments)
    )


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling a tool."""
    return "tool_calls" if called and reason == "stop" else reason


async def stream_chat(
    ctx: ServingContext, req: ChatCompletionRequest, gen: ChatGeneration
) -> AsyncIterator[str]:
    writer = ChunkWriter(gen.id, "chat.completion.chunk", ctx.served_model, req.include_usage)
    streams = [ChoiceStream(gen.tools, req) for _ in gen.choices]
    last = ""  # the stream's end, sent in one write (see AdmittedStreamingResponse)
    try:
        role = {"role": "assistant", "content": ""}
        yield writer.chunk([chat_delta(c.index, role) for c in gen.choices])
        async for deltas in gen.run():
            parts = []
            for d in deltas:
                stream = streams[d.index]
                delta = stream.delta(d.text, d.finish_reason is not None)
                lp = chat_logprobs(ctx, d.token_ids, d.logprobs) if req.logprobs else None
                finish = finish_reason(d.finish_reason, stream.called)
                if delta or finish or (lp is not None and lp.content):
                    parts.append(chat_delta(d.index, delta, lp, finish))
            if parts:
                if gen.finished:  # the last chunk: it goes out with what ends the stream
                    last = writer.chunk(parts)
                else:
                    yield writer.chunk(parts)
        if req.include_usage:
            last += writer.chunk([], gen.usage())
    except Exception as exc:
        last += sse_error(exc)
    yield last + DONE


class ChoiceStream:
    """One streamed choice's deltas: plain text, or (with tools) the parser's content and
    tool-call fragments in OpenAI's shape (index, id and name first, then argument pieces)."""

    def __init__(self, tools: ToolPlan, req: ChatCompletionRequest) -> None:
        self.streamer: ToolCallStreamer | None = (
            tools.parser.streamer() if tools.parser is not None else None
        )
        self.single = req.parallel_tool_calls is False
        self.called = False

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        if self.streamer is None:
            return {"content": text} if text else {}  # OpenAI sends only the set fields
        step = self.streamer.push(text)
        content, calls = step.content, list(step.tool_calls)
        if last:
            end = self.streamer.finish()
            content += end.content
            calls += end.tool_calls
        if self.single:
            calls = [c for c in calls if c["index"] == 0]
        self.called = self.called or bool(calls)
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out


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
