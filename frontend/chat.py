"""/v1/chat/completions: messages rendered by the chat template, a response or a stream; a
reasoning model's reasoning split from its answer (frontend/reasoning.py), tool calls parsed
out of the answer (frontend/tools.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from frontend.completions import vllm_prompt_logprobs
from frontend.constraints import check_end_not_held_off
from frontend.errors import bad_request
from frontend.generation import (
    Choice,
    Generation,
    check_context,
    check_decoding,
    check_stop_token_ids,
    engine_extras,
)
from frontend.openai_schemas import (
    UNSUPPORTED,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionTokensDetails,
    FunctionCallOut,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from frontend.reasoning import ReasoningParser, Splitter, after_reasoning
from frontend.serving_context import ServingContext
from frontend.sse import DONE, ChunkWriter, sse_error
from frontend.tokenizer import ChatRender
from frontend.tool_parsers import ToolCall, ToolCallStreamer
from frontend.tools import NO_TOOLS, ToolPlan, plan_tools
from frontend.vision import BadImage, ImagePartRef, ProcessedImage, chat_images
from protocol.messages import ImageInput, TokenLogprobs

logger = logging.getLogger("tandem.frontend")


@dataclass(frozen=True)
class ReasoningPlan:
    """How a chat request's output is split: the parser, whether the output starts inside the
    reasoning (the rendered prompt says), and whether the reasoning is sent."""

    parser: ReasoningParser
    in_reasoning: bool
    include: bool

    def splitter(self) -> Splitter:
        return self.parser.splitter(self.in_reasoning)


class ChatGeneration(Generation):
    """A chat request's Generation with its tool plan (what parses the output, if anything),
    its reasoning plan and the text it echoes."""

    tools: ToolPlan = NO_TOOLS
    reasoning: ReasoningPlan | None = None
    echo: str = ""  # the last message's text, which the answer continues (echo)

    def usage(self) -> UsageInfo:
        usage = super().usage()
        plan = self.reasoning
        if plan is not None:
            count = plan.parser.reasoning_tokens
            tokens = sum(count(c.token_ids, plan.in_reasoning) for c in self.choices)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=tokens)
        return usage


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> ChatGeneration:
    """Check, render and tokenize; nothing reaches the engine until the Generation runs."""
    arrival = time.monotonic()
    ctx.check_model(req.model)
    await ctx.wait_for_engine()
    for name in req.unsupported:
        raise bad_request(UNSUPPORTED[name], name, "unsupported_parameter")
    check_stop_token_ids(ctx, req)
    check_decoding(req)
    log_user(req)
    extras = await engine_extras(ctx, req)
    tools = plan_tools(req, ctx.tool_support, extras.constraint)
    constraint_param = "tools"
    if tools.constraint is not None:  # the calls' grammar, the answer format inside it
        check_end_not_held_off(req, "tools")
        await ctx.check_constraint(tools.constraint, "tools")
        extras = replace(extras, constraint=tools.constraint)
    elif extras.constraint is not None:
        constraint_param = extras.constraint_param
    images = await load_images(ctx, req.messages)
    support = ctx.tool_support
    if images and tools.template is not None and support and not support.writes_images:
        raise bad_request(
            "images beside tools are not supported for this model: the server could not read "
            "its chat template's image marker for the tool template",
            "messages",
        )
    tok = ctx.tokenizer
    render = replace(chat_render(ctx, req, tools), image_text=image_text(ctx, images))
    rendered = await tok.run(tok.render_chat, render)
    reasoning = reasoning_plan(ctx, req, await output_opening(ctx, req, render, rendered.text))
    if composes_after_reasoning(reasoning, tools, req, extras.constraint is not None):
        if extras.constraint is None:  # the budget's grammar alone, which EOS completes
            check_end_not_held_off(req, "thinking_token_budget", ("ignore_eos",))
            constraint_param = "thinking_token_budget"
        try:
            constraint = after_reasoning(
                reasoning.parser, reasoning.in_reasoning, extras.constraint,
                req.thinking_token_budget,
            )  # fmt: skip
        except ValueError as exc:  # the model's tokenizer cannot mark where reasoning ends
            raise bad_request(
                f"{exc} (--reasoning-parser {reasoning.parser.name})", constraint_param
            ) from None
        await ctx.check_constraint(constraint, constraint_param)
        extras = replace(extras, constraint=constraint)
    prompt, wire_images = place_images(ctx, rendered.token_ids, images)
    max_tokens = check_context(ctx, len(prompt), req.max_output_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if keeps_special_tokens(tools, reasoning):
        req = req.model_copy(update={"skip_special_tokens": False})
    gen = ChatGeneration.for_request(
        ctx, req, [prompt], max_tokens, logprobs, extras, "chatcmpl", arrival
    )
    gen.tools = tools
    gen.reasoning = reasoning
    if wire_images:
        gen.with_images(wire_images)
    gen.echo = req.messages[-1].text() if req.echo else ""
    return gen


async def load_images(ctx: ServingContext, messages: list[ChatMessage]) -> list[ProcessedImage]:
    """The messages' image parts, fetched, decoded and processed; a 400 naming the part for
    one the server cannot take (a text-only model takes none)."""
    parts = [
        ImagePartRef(f"messages[{m}].content[{i}]", part.image_url.url, part.image_url.detail)
        for m, message in enumerate(messages)
        for i, part in message.image_parts()
    ]
    try:
        return await chat_images(ctx.vision, ctx.media, parts)
    except BadImage as exc:
        raise bad_request(str(exc), exc.param, "invalid_image") from None


def image_text(
    ctx: ServingContext, images: list[ProcessedImage]
) -> tuple[str, tuple[str, ...]] | None:
    """How the rendered prompt's image markers expand before tokenizing, where the model's
    processor expands them in text (Gemma 3, Llama 4); None without images or for a model
    whose placeholders are repeated after tokenizing (Qwen2.5-VL)."""
    if not images or ctx.vision is None:
        return None
    return ctx.vision.image_text(images)


def place_images(
    ctx: ServingContext, token_ids: list[int], images: list[ProcessedImage]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt with each image's placeholder run, and the images as the engine takes them;
    the prompt's tokens count each image's placeholders (usage.prompt_tokens)."""
    if not images:
        return token_ids, ()
    assert ctx.vision is not None
    try:
        return ctx.vision.place(token_ids, images)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


# Variables every chat template is rendered with, which chat_template_kwargs may not replace.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


def chat_render(ctx: ServingContext, req: ChatCompletionRequest, tools: ToolPlan) -> ChatRender:
    """What the prompt is rendered from (reasoning_effort goes to the template too)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    return ChatRender(
        messages=[m.as_template_dict() for m in req.messages],
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=tools.tools,
        template=tools.template,
        template_kwargs=checked_template_kwargs(ctx, kwargs, tools.template),
    )


def checked_template_kwargs(
    ctx: ServingContext, kwargs: dict[str, Any], template: str | None = None
) -> dict[str, Any]:
    """``kwargs`` for the chat template; 400 for one the server sets itself, or that the
    template never reads (it could not change the prompt)."""
    variables = ctx.tokenizer.template_variables(template)
    for key in kwargs:
        param = "reasoning_effort" if key == "reasoning_effort" else "chat_template_kwargs"
        if key == "documents":  # apply_chat_template's own argument, which no field here sets
            raise bad_request(
                "documents (retrieval documents for the template) are not supported", param
            )
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise bad_request(f"{key} is set by the request itself, not by {param}", param)
        if key not in variables:
            raise bad_request(
                f"the chat template does not read {key!r}, so {param} could not change the prompt",
                param,
            )
    return kwargs


async def output_opening(
    ctx: ServingContext, req: ChatCompletionRequest, render: ChatRender, prompt: str
) -> str:
    """The text the output continues that no earlier message wrote: the template's generation
    prompt (what it adds after the messages), or with continue_final_message the message
    continued. "" where the reasoning parser does not read it for this prompt."""
    parser = ctx.reasoning
    if parser is None or not parser.reads_opening(prompt):
        return ""
    if req.continue_final_message:
        return req.messages[-1].text()
    tok = ctx.tokenizer
    messages_only = await tok.run(
        tok.render_chat_text, replace(render, add_generation_prompt=False)
    )
    # A template whose text before the generation prompt differs (none known): all of it.
    return prompt[len(messages_only) :] if prompt.startswith(messages_only) else prompt


def reasoning_plan(
    ctx: ServingContext, req: ChatCompletionRequest, opening: str
) -> ReasoningPlan | None:
    """The request's reasoning plan under --reasoning-parser; without one, the reasoning fields
    are refused (there is no reasoning to drop or to bound)."""
    parser = ctx.reasoning
    if parser is None:
        for name, given in (
            ("include_reasoning", not req.include_reasoning),
            ("thinking_token_budget", req.thinking_token_budget is not None),
        ):
            if given:
                raise bad_request(f"{name} needs a server with --reasoning-parser", name)
        return None
    return ReasoningPlan(parser, parser.in_reasoning(opening), req.include_reasoning)


def composes_after_reasoning(
    reasoning: ReasoningPlan | None,
    tools: ToolPlan,
    req: ChatCompletionRequest,
    constrained: bool,
) -> bool:
    """Whether the request's constraint (or its thinking budget) needs a grammar that starts
    after the reasoning. A harmony tool grammar (a forced call, or strict tools under "auto")
    already opens with an optional analysis message, which a budget cannot bound (refused)."""
    if reasoning is None:
        return False
    if tools.constraint is not None and reasoning.parser.needs_special_tokens:
        if req.thinking_token_budget is not None:
            raise bad_request(
                "thinking_token_budget cannot bound the analysis before a harmony tool call that "
                "a grammar writes (tool_choice required or named, or strict tools)",
                "thinking_token_budget",
            )
        return False
    return constrained or req.thinking_token_budget is not None


def keeps_special_tokens(tools: ToolPlan, reasoning: ReasoningPlan | None) -> bool:
    """Whether the output's text must keep special tokens: a parser's markers are some
    (harmony's), whatever skip_special_tokens asks."""
    parsers = [tools.parser, reasoning.parser if reasoning is not None else None]
    return any(p is not None and p.needs_special_tokens for p in parsers)


def log_user(req: ChatCompletionRequest) -> None:
    if req.user is not None:
        logger.info("chat request for user %r", req.user)


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
    resp = ChatCompletionResponse(id=gen.id, model=gen.model, choices=choices, usage=gen.usage())
    if req.prompt_logprobs is not None:
        first = gen.choices[0]
        resp.prompt_logprobs = vllm_prompt_logprobs(ctx, first.prompt_ids, first.prompt_logprobs)
    body = resp.model_dump(exclude_none=False)
    for choice in body["choices"]:  # OpenAI leaves out what a message does not have
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if choice["message"][key] is None:
                del choice["message"][key]
    if body["prompt_logprobs"] is None:
        del body["prompt_logprobs"]
    if body["usage"]["completion_tokens_details"] is None:
        del body["usage"]["completion_tokens_details"]
    return body


def response_message(
    gen: ChatGeneration, req: ChatCompletionRequest, choice: Choice
) -> ChatResponseMessage:
    text, reasoning = choice.text.text, None
    plan = gen.reasoning
    if plan is None:
        return answer_message(gen, req, gen.echo + text)
    split = plan.parser.split(text, plan.in_reasoning)
    if plan.splitter().reads_tool_calls:  # the split read the calls too (harmony)
        message = called_message(gen, req, gen.echo + split.content, list(split.tool_calls))
    else:
        message = answer_message(gen, req, gen.echo + split.content)
    reasoning = split.reasoning if plan.include else None
    message.reasoning_content = message.reasoning = reasoning
    return message


def called_message(
    gen: ChatGeneration, req: ChatCompletionRequest, content: str, calls: list[ToolCall]
) -> ChatResponseMessage:
    """The answer and the calls a reasoning parser read (kept only where tools were offered)."""
    if gen.tools.parser is None:
        calls = []
    if req.parallel_tool_calls is False:
        calls = calls[:1]
    if not calls:
        return ChatResponseMessage(content=content)
    out = [tool_call_out(c) for c in calls]
    return ChatResponseMessage(content=content or None, tool_calls=out)


def answer_message(
    gen: ChatGeneration, req: ChatCompletionRequest, text: str
) -> ChatResponseMessage:
    """The answer as a message: its content, and the tool calls parsed out of it."""
    parser = gen.tools.parser
    if parser is None:
        return ChatResponseMessage(content=text)
    parsed = parser.extract(text)
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
    writer = ChunkWriter(gen.id, "chat.completion.chunk", gen.model, req.include_usage)
    streams = [ChoiceStream(gen.tools, req, gen.reasoning) for _ in gen.choices]
    last = ""  # the stream's end, sent in one write (see AdmittedStreamingResponse)
    try:
        role = {"role": "assistant", "content": gen.echo}
        yield writer.chunks([chat_delta(c.index, role) for c in gen.choices])
        async for deltas in gen.run():
            parts = []
            for d in deltas:
                stream = streams[d.index]
                delta = stream.delta(d.text, d.finish_reason is not None)
                lp = chat_logprobs(ctx, d.token_ids, d.logprobs) if req.logprobs else None
                finish = finish_reason(d.finish_reason, stream.called)
                if delta or finish or (lp is not None and lp.content):
                    parts += one_call_a_chunk(d.index, delta, lp, finish)
            if parts:
                if gen.finished:  # the last chunks: they go out with what ends the stream
                    last = writer.chunks(parts)
                else:
                    yield writer.chunks(parts)
        if req.include_usage:
            last += writer.chunk([], gen.usage())
    except Exception as exc:
        last += sse_error(exc)
    yield last + DONE


class ChoiceStream:
    """One streamed choice's deltas: the reasoning (``reasoning_content``, and ``reasoning``)
    split from the answer where the request has a reasoning plan; the answer as plain text, or
    (with tools) the parser's content and tool calls in OpenAI's shape (index, id, name and
    arguments)."""

    def __init__(
        self, tools: ToolPlan, req: ChatCompletionRequest, reasoning: ReasoningPlan | None
    ) -> None:
        self.splitter = reasoning.splitter() if reasoning is not None else None
        # A splitter that reads the calls itself (harmony) takes the tool parser's place.
        self.split_calls = self.splitter is not None and self.splitter.reads_tool_calls
        self.streamer: ToolCallStreamer | None = (
            tools.parser.streamer() if tools.parser is not None and not self.split_calls else None
        )
        self.offered_tools = tools.parser is not None
        self.send_reasoning = reasoning is not None and reasoning.include
        self.single = req.parallel_tool_calls is False
        self.called = False
        # The end of the last delta's content that came after its calls (Responses items).
        self.after_calls = ""

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        reasoning = ""
        calls: list[dict[str, Any]] = []
        if self.splitter is not None:
            split = self.splitter.push(text)
            if last:
                split += self.splitter.finish()
            text, reasoning, calls = split.content, split.reasoning, split.tool_calls
        out: dict[str, Any] = {}
        if reasoning and self.send_reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning
        if self.split_calls:
            out.update(self.split_delta(text, calls if self.offered_tools else []))
        else:
            out.update(self.answer_delta(text, last))
        return out

    def split_delta(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The answer and call fragments a splitter read (harmony)."""
        if self.single:
            calls = [c for c in calls if c["index"] == 0]
        self.called = self.called or bool(calls)
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def answer_delta(self, text: str, last: bool) -> dict[str, Any]:
        if self.streamer is None:
            return {"content": text} if text else {}  # OpenAI sends only the set fields
        step = self.streamer.push(text)
        content, calls, after = step.content, list(step.tool_calls), step.after_calls
        if last:
            end = self.streamer.finish()
            after += end.content if calls else end.after_calls
            content += end.content
            calls += end.tool_calls
        self.after_calls = after
        if self.single:
            calls = [c for c in calls if c["index"] == 0]
        self.called = self.called or bool(calls)
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out


def one_call_a_chunk(
    index: int, delta: dict[str, Any], lp: ChatLogprobs | None, finish: str | None
) -> list[dict[str, Any]]:
    """A choice's delta as chunks' choices holding one tool call each, as OpenAI streams calls
    (clients such as LlamaIndex read only ``delta.tool_calls[0]``): the content and logprobs
    go with the first call, the finish reason with the last."""
    calls = delta.get("tool_calls", [])
    if len(calls) <= 1:
        return [chat_delta(index, delta, lp, finish)]
    deltas = [{**delta, "tool_calls": calls[:1]}, *({"tool_calls": [c]} for c in calls[1:])]
    last = len(deltas) - 1
    return [
        chat_delta(index, d, lp if i == 0 else None, finish if i == last else None)
        for i, d in enumerate(deltas)
    ]


def chat_delta(
    index: int,
    delta: dict[str, Any],
    lp: ChatLogprobs | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    """A chunk's choice as OpenAI's chat.completion.chunk has it, built as a dict (see
    frontend/sse.py)."""
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
