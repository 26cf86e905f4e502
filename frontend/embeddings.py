"""/v1/embeddings: texts or token ids in, each input's vector out, for an embedding engine.

Every input of a request becomes one engine request carrying its ``PoolingParams`` (the model's
pooling and normalisation, as its Ready says, and the request's ``dimensions``), and they go to
the engine together as one group, so that its prefill steps batch them. The engine answers each
with its vector when its last prompt chunk has run (FinishReason.POOLED); nothing is sampled.
When the engine dies, the inputs still without a vector are sent again, as a generation resumes
(``--max-request-resumes``): a vector depends on its input alone. ``encoding_format: base64`` is
the float32 values' little-endian bytes, as OpenAI sends them (its Python client asks for it
by default).
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from frontend.errors import OpenAIError, as_openai_error, bad_request, engine_unavailable
from frontend.openai_schemas import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    random_id,
)
from frontend.serving_context import ServingContext
from protocol.client import EngineDeadError, EngineRequest, RequestGroup
from protocol.messages import EmbeddingModel, FinishReason, PoolingParams, SamplingParams

_PLAIN = SamplingParams()  # what an embedding request carries: it samples nothing


def check_embedding_request(ctx: ServingContext, req: EmbeddingRequest) -> PoolingParams:
    """The request's pooling; the 400 that names what the model cannot serve."""
    ctx.check_model(req.model)  # an unknown name is a 404 first, as on every other route
    model: EmbeddingModel = ctx.embedding_model()
    if req.dimensions is not None and (why := model.refuses_dimensions(req.dimensions)):
        raise bad_request(why, "dimensions", "invalid_value")
    return PoolingParams(model.pooling, model.normalize, req.dimensions)


def embedding_wave(ctx: ServingContext, num_inputs: int) -> int:
    """The sequences an embeddings request asks admission for: all its inputs where they fit
    the bound (all or none, as every request); past it, what is free now (at least one, else
    the usual 503), which its waves then reuse: never the whole bound held against others."""
    gate = ctx.admission
    if num_inputs <= gate.limit:
        return num_inputs
    return max(1, gate.limit - gate.in_use)


async def embed(
    ctx: ServingContext, req: EmbeddingRequest, pooling: PoolingParams, wave: int
) -> dict:
    """The whole response: every input's vector, in input order; ``wave`` inputs in flight at
    a time (the sequences admitted)."""
    arrival = time.monotonic()
    await ctx.wait_for_engine()
    prompts = await embedding_prompts(ctx, req)
    vectors = await Embedding(ctx, prompts, pooling, arrival, wave).run()
    form = req.encoding_format
    data = [EmbeddingData(index=i, embedding=encoded(v, form)) for i, v in enumerate(vectors)]
    tokens = sum(len(p) for p in prompts)
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingResponse(data=data, model=ctx.served_model, usage=usage).model_dump()


async def embedding_prompts(ctx: ServingContext, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids (texts encoded as the tokenizer does by default, with its
    special tokens: the checkpoint's pooling expects them, after the checkpoint's default
    prompt where it names one; token ids are taken as they are), each within the context."""
    inputs = req.inputs
    texts = [ctx.embedding_prompt + i for i in inputs if isinstance(i, str)]
    encoded = iter(await ctx.tokenizer.encode(texts) if texts else [])
    prompts = [next(encoded) if isinstance(i, str) else i for i in inputs]
    for prompt in prompts:
        ctx.check_token_ids(prompt, "input")
        if not prompt:
            raise bad_request("an input encodes to no tokens", "input")
        if len(prompt) > ctx.max_model_len:
            message = (
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
                f"an input has {len(prompt)} tokens. Please reduce its length."
            )
            raise bad_request(message, "input", "context_length_exceeded")
    return prompts


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class Embedding:
    """One request's engine requests, sent ``wave`` at a time (the whole request where it fits
    the admission bound, else in turns: OpenAI takes 2,048 inputs), until each has its vector;
    resumed on another engine (or the restarted one) when theirs dies."""

    def __init__(
        self,
        ctx: ServingContext,
        prompts: list[list[int]],
        pooling: PoolingParams,
        arrival: float,
        wave: int,
    ) -> None:
        self.ctx = ctx
        self.wave = wave
        self.prompts = prompts
        self.pooling = pooling
        self.arrival = arrival
        self.id = random_id("embd")
        self.vectors: list[list[float] | None] = [None] * len(prompts)
        self.resumes = 0
        self.lost = 0  # inputs of the wave an engine's death cut (those sent again)

    async def run(self) -> list[list[float]]:
        wait_left = self.ctx.resume_timeout_s
        while True:
            try:
                await self._send_unfinished()
                return [v for v in self.vectors if v is not None]
            except EngineDeadError as exc:
                if self.resumes >= self.ctx.max_resumes:
                    raise engine_unavailable(str(exc)) from None
                try:
                    wait_left -= await self.ctx.engine.wait_until_serving(wait_left)
                except EngineDeadError as dead:
                    raise engine_unavailable(str(dead)) from None
                self.resumes += 1
                self.ctx.metrics.record_resumed(self.lost)

    async def _send_unfinished(self) -> None:
        """Send the inputs still without a vector, a wave at a time."""
        pending = [i for i, v in enumerate(self.vectors) if v is None]
        for start in range(0, len(pending), self.wave):
            await self._send_wave(pending[start : start + self.wave])

    async def _send_wave(self, pending: list[int]) -> None:
        """Send these inputs (each under an id of its own for this attempt) and take their
        vectors; leaving early aborts what is unfinished."""
        requests = [self._engine_request(i) for i in pending]
        group = self.ctx.engine.open(requests, wake_every=None)  # woken by the ends only
        try:
            await group.send()
            while group.unfinished:
                dead = None
                for slot, item, _ in await group.next_batch():
                    if isinstance(item, EngineDeadError):
                        dead = item  # what the engine sent before it died counts first
                    else:
                        self._take(group, slot, pending[slot], item)
                if dead is not None and group.unfinished:
                    self.lost = len(group.unfinished)
                    raise dead
        finally:
            group.abort_unfinished()

    def _engine_request(self, index: int) -> EngineRequest:
        rid = f"{self.id}-{index}-r{self.resumes}"  # a new id each attempt: an old may linger
        return EngineRequest(rid, self.prompts[index], _PLAIN, pooling=self.pooling)

    def _take(self, group: RequestGroup, slot: int, index: int, item: Any) -> None:
        """One engine request's end: its vector, or the error it failed with."""
        if isinstance(item, Exception):
            raise as_openai_error(item)
        if item.finish_reason is None:
            return  # nothing comes before the end of a pooling request; nothing to take
        group.finished(slot)
        if item.finish_reason != FinishReason.POOLED or item.embedding is None:
            raise OpenAIError(500, "the engine failed to embed an input", "internal_error")
        self.vectors[index] = item.embedding
        elapsed = time.monotonic() - self.arrival
        self.ctx.metrics.record_finished("stop", len(self.prompts[index]), None, elapsed, 0)
