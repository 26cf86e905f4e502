"""What the completion and chat handlers share: the engines, the tokenizer, the model's limits,
the metrics and the admission gate, with the checks every request goes through."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from frontend.admission import Admission, AdmissionGate, OverloadedError, TooManySequencesError
from frontend.constraints import ConstraintChecker
from frontend.engine_pool import EnginePool
from frontend.errors import (
    OpenAIError,
    as_openai_error,
    bad_request,
    engine_unavailable,
    overloaded,
)
from frontend.metrics import Metrics
from frontend.reasoning import ReasoningParser
from frontend.response_store import ResponseStore
from frontend.tokenizer import Tokenizer
from frontend.tools import ToolSupport
from frontend.tracing import RequestTracer
from frontend.vision import MediaOptions, VisionProcessor
from protocol.client import EngineDeadError
from protocol.messages import Constraint, EmbeddingModel, LoraRef, SchedulingPolicy

if TYPE_CHECKING:
    from frontend.lora import LoraRegistry


@dataclass
class ServingContext:
    engine: EnginePool  # its connections are replaced when an engine core is restarted
    tokenizer: Tokenizer
    served_model: str
    max_model_len: int
    vocab_size: int
    metrics: Metrics
    # The engine's end-of-sequence ids (its Ready says): with a request's stop_token_ids, the
    # tokens whose text a stopped output leaves out unless include_stop_str_in_output.
    eos_token_ids: tuple[int, ...] = ()
    admission: AdmissionGate = field(default_factory=AdmissionGate.unbounded)
    stream_interval: int = 1  # tokens per SSE chunk and choice (--stream-interval)
    constraints: ConstraintChecker | None = None  # structured outputs' compile check
    tool_support: ToolSupport | None = None  # None: requests with tools are refused
    reasoning: ReasoningParser | None = None  # --reasoning-parser: splits reasoning from answer
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored /v1/responses
    max_resumes: int = 0  # times a request in flight is resumed after an engine dies
    resume_timeout_s: float = 120.0  # how long in all it may wait for an engine to resume on
    # The engine's embedding model (its Ready says): it serves /v1/embeddings and refuses to
    # generate. None: a generative model, which refuses /v1/embeddings.
    embedding: EmbeddingModel | None = None
    # Its sentence-transformers default prompt, put before every text input as
    # sentence-transformers' encode does (common/sentence_transformers.py).
    embedding_prompt: str = ""
    # The LoRA adapters served by name (frontend/lora.py); None: LoRA is off.
    loras: LoraRegistry | None = None
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint: the engine's spans go here
    # A vision-language model's image processor (None: the model takes no images), and how
    # the server may get images (--limit-mm-per-prompt, --allowed-media-domains, ...).
    vision: VisionProcessor | None = None
    media: MediaOptions = field(default_factory=MediaOptions)
    # The engines' policy (their Ready says): whether a request's priority is taken.
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # /v1/models' ``created``: when this server began serving (one time, so that listing a
    # model and retrieving it agree, whenever each is asked).
    started_at: int = field(default_factory=lambda: int(time.time()))

    def check_generates(self) -> None:
        """The 400 of completions and chat on an embedding model."""
        if self.embedding is not None:
            raise OpenAIError(
                400,
                f"The model `{self.served_model}` is an embedding model (served with --runner "
                "pooling): it does not generate text, so completions, chat and responses are not "
                "served; "
                "use /v1/embeddings",
                code="model_does_not_generate",
            )

    def embedding_model(self) -> EmbeddingModel:
        """The model's pooling; the 400 of /v1/embeddings on a generative model."""
        if self.embedding is None:
            raise OpenAIError(
                400,
                f"The model `{self.served_model}` generates text: it is not an embedding model, "
                "so /v1/embeddings is not served (start tandem serve with an embedding model, or "
                "with --runner pooling)",
                code="model_does_not_embed",
            )
        return self.embedding

    async def check_constraint(self, constraint: Constraint, param: str) -> None:
        if self.constraints is None:
            raise bad_request("structured outputs are not enabled on this server", param)
        await self.constraints.check(constraint, param)

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
        """404 unless ``model`` is the base model or a served LoRA adapter (or not given)."""
        self.lora_for(model)

    def lora_for(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a name
        that is not served."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model is not None and model != self.served_model:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist. Served: `{self.served_model}`.",
                param="model",
                code="model_not_found",
            )
        return None

    async def wait_for_engine(self) -> None:
        """Go on once an engine core serves. While the only one restarts, a new request waits
        for it as the resumed ones do (at most --resume-timeout s); with resumes off
        (--max-request-resumes 0) it gets 503 at once, as the requests in flight do."""
        reason = self.engine.dead_reason
        if reason is None:
            return
        if not self.max_resumes:
            raise engine_unavailable(reason)
        try:
            await self.engine.wait_until_serving(self.resume_timeout_s)
        except EngineDeadError as exc:
            raise engine_unavailable(str(exc)) from None

    def check_priority(self, priority: int) -> None:
        """The 400 of a priority other than 0 where the engines schedule first come, first
        served (as vLLM refuses it): taking it would promise an order nobody keeps."""
        if priority != 0 and self.scheduling_policy != SchedulingPolicy.PRIORITY:
            raise bad_request(
                f"priority {priority} is not taken: this server schedules first come, first "
                "served (start it with --scheduling-policy priority to rank requests)",
                "priority",
            )

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise bad_request(f"token ids must lie in [0, {self.vocab_size})", param)
