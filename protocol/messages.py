"""Wire types shared by the frontend, the engine core and the raw ZMQ client.

Every frame is one msgpack array: ``[msg_type, PROTOCOL_VERSION, *fields]``. The type tag comes
first so a decoder can dispatch without reflection; the version comes second so a peer speaking
another version is rejected before its fields are read. Token ids travel as packed little-endian
int32 bytes, never as lists of Python ints. The codec lives in ``protocol/codec.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

# 4: AddRequest carries num_output_tokens (a resumed request)
# 5: a finished RequestOutput carries its engine timings; Stats carries EngineCounts
# 6: AddRequest carries output_interval (the engine holds a request's tokens back)
# 7: ConstraintKind.LLGUIDANCE (a composed llguidance grammar); EngineCounts counts speculative
#    decoding and RequestTimings a request's draft and accepted tokens; embeddings: AddRequest
#    may carry pooling, a step's output its pooled vector, Ready the engine's embedding model;
#    each a trailing field that a frame without it leaves out
# 8: AddRequest may carry a LoRA adapter (``lora``: name and folder) and images (processed
#    pixels, their grid, hash and placeholder run), trailing fields after pooling's place (nil
#    where a later one follows); every other frame is unchanged
# 9: AddRequest may carry a priority (a trailing field after the images' place, left out at 0);
#    Ready carries the engine's scheduling policy (after max_num_seqs)
# 10: Stats carries the host KV tier's gauges and EngineCounts its counts (--kv-offload-gb)
# 11: an image's pixels travel as a frame of their own after the AddRequest's frame (the
#    message holds their byte count), not inside the msgpack array
# 12: READY says the dtype an engine's vision tower takes its pixels in (``pixel_dtype``)
# 13: prompt logprobs carry each prompt token's rank, a fifth column after the top logprobs
# 14: HEARTBEAT may carry the time of a step the engine is starting (``busy_for_s``), a trailing
#    field that a heartbeat announcing no step leaves out
PROTOCOL_VERSION = 14
GREEDY_BELOW_TEMPERATURE = 1e-5
# A request's priority is a signed 64-bit int, as vLLM's.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


class MsgType(enum.IntEnum):
    # client -> engine
    HELLO = 1
    ADD_REQUEST = 2
    ABORT = 3
    CONTROL = 4
    # engine -> client
    READY = 16
    STEP_OUTPUTS = 17
    REQUEST_ERROR = 18
    CONTROL_REPLY = 19
    HEARTBEAT = 20


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS or a stop token id (the frontend also maps stop strings here)
    LENGTH = 1  # max_tokens or the model's context limit
    ABORT = 2  # aborted by the client
    ERROR = 3  # the engine could not serve the request
    DEAD_END = 4  # the request's constraint allowed no token (see engine_core/grammar.py)
    # A pooling (embedding) request's prompt has run: its output is the vector, not a token
    # (RequestOutput.embedding). Its own reason, not LENGTH or STOP, so that no reader takes
    # it for the end of a generation.
    POOLED = 5

    @property
    def openai_name(self) -> str:
        return _OPENAI_FINISH_NAMES[self]


_OPENAI_FINISH_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.DEAD_END: "constraint_dead_end",
    FinishReason.POOLED: "stop",  # as vLLM reports a finished pooling request
}


class ConstraintKind(enum.IntEnum):
    """What a request's output must match (structured outputs); ``Constraint.spec`` holds it."""

    JSON_SCHEMA = 1  # spec: the JSON schema, as JSON text
    JSON_OBJECT = 2  # any JSON object; spec is empty
    REGEX = 3  # spec: a regular expression the whole output matches
    CHOICE = 4  # spec: a JSON list of strings, the output is one of them
    GRAMMAR = 5  # spec: a grammar in GBNF/EBNF or in llguidance's Lark syntax
    # spec: an llguidance top-level grammar as JSON ({"grammars": [...]}), several grammars that
    # reference each other: what the frontend composes for an answer after a model's reasoning
    LLGUIDANCE = 6


class PoolingKind(enum.IntEnum):
    """How an embedding request's vector is made from its prompt's final hidden states."""

    LAST = 1  # the last prompt token's (Qwen3-Embedding, e5-mistral)
    MEAN = 2  # the mean over every prompt token's


class SchedulingPolicy(enum.IntEnum):
    """How an engine orders its waiting requests and picks whom to preempt (Ready says)."""

    FCFS = 0  # arrival order; every request's priority is 0
    PRIORITY = 1  # (priority, arrival) order, lower first; preemption takes the worst first

    @property
    def flag_name(self) -> str:
        """Its spelling in --scheduling-policy."""
        return self.name.lower()


class ControlKind(enum.IntEnum):
    STATS = 1  # reply: CONTROL_REPLY with a Stats payload
    SHUTDOWN = 2  # the engine stops its loop and exits
    CHECK_INTEGRITY = 3  # reply: CONTROL_REPLY after the block manager's integrity check
    # torch.profiler in the engine (engine_core/profiler.py; needs --profile-dir). Replies: ok,
    # or not with the reason; START_PROFILE's message is the trace directory, STOP_PROFILE's
    # the written files' paths, one a line.
    START_PROFILE = 4
    STOP_PROFILE = 5


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules (OpenAI semantics where OpenAI defines them)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: also the top N
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None  # structured output: what the text must match
    # The logprobs of every prompt token after the first (and the top N at each position).
    prompt_logprobs: int | None = None

    def stopping_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The token ids that end a request with these params: its stop_token_ids, and the
        model's EOS ids unless it ignores them (the engine stops on them; the frontend leaves
        the one that ended an output out of its text)."""
        eos = () if self.ignore_eos else eos_token_ids
        return frozenset((*self.stop_token_ids, *eos))

    @property
    def greedy(self) -> bool:
        # As vLLM: below this a temperature only overflows the scaled logits (1e-50 is 0 in
        # float32), and the distribution it asks for is the argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: its prompt runs through the model with nothing sampled, and its
    vector comes back: pooled (``kind``), cut to its first ``dimensions`` values where given
    (Matryoshka), then scaled to unit L2 norm where ``normalize``."""

    kind: PoolingKind = PoolingKind.LAST
    normalize: bool = True
    dimensions: int | None = None


@dataclass(frozen=True)
class EmbeddingModel:
    """What an embedding engine's model gives, as its checkpoint says (Ready.embedding)."""

    pooling: PoolingKind
    normalize: bool
    size: int  # the vector's length: the hidden size
    matryoshka: bool = False  # trained so that a vector's first N values embed too
    # The only lengths it may be cut to, where the checkpoint names them; empty: any of 1..size.
    matryoshka_dimensions: tuple[int, ...] = ()

    def refuses_dimensions(self, dimensions: int) -> str | None:
        """Why its vectors cannot be cut to ``dimensions`` values (None: they can). Its own
        length always can: there is nothing to cut."""
        if dimensions == self.size:
            return None
        if not self.matryoshka:
            return (
                "this model does not support Matryoshka dimensions: its vectors cannot be cut "
                f"short of {self.size} values"
            )
        allowed = self.matryoshka_dimensions
        fits = dimensions in allowed if allowed else 1 <= dimensions <= self.size
        if fits:
            return None
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {self.size}"
        return f"dimensions must be one of {sizes}, got {dimensions}"


# The dtypes an image's pixels may travel in (what the API process's image processor gives).
PIXEL_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TensorBytes:
    """A tensor as raw little-endian bytes with its dtype (one of PIXEL_DTYPES) and shape.
    ``data`` is any C-contiguous buffer (a sender may hand a numpy array's memory over as it
    is: the bytes travel as their own frame, uncopied)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, processed by the API process (the model's HF image processor).

    Its embeddings replace the prompt's tokens ``[offset, offset + length)``, every one of them
    the model's image placeholder token. ``grid_thw`` is the patch grid (temporal, height,
    width) that the vision tower and M-RoPE positions read; ``hash`` (32 bytes, SHA-256 of the
    pixels, their dtype, shape and grid) names the image in the encoder cache and in the
    prefix-cache keys of the KV blocks its placeholders fill."""

    hash: bytes
    offset: int
    length: int
    pixels: TensorBytes
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class Hello:
    client_name: str = ""


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # A resumed request (its engine died): the last this-many of prompt_token_ids are tokens it
    # had already generated. The engine counts them as output (max_tokens, min_tokens,
    # penalties, the seeded draw at each position, the constraint's state), not as prompt.
    num_output_tokens: int = 0
    # Send this request's tokens once this many have gathered since its last output, besides
    # its first token and its end (which go out at once). 1: every step. A consumer that acts
    # only every N tokens (a stream with --stream-interval N) asks for N, so neither side
    # handles the request at the steps in between. A step's runs travel in one frame, so a
    # long run with many top logprobs makes a large frame (the decoder's limit: codec.py).
    output_interval: int = 1
    # An embedding request (params, num_output_tokens and output_interval at their defaults:
    # it samples nothing); None: a generation.
    pooling: PoolingParams | None = None
    # The LoRA adapter the request runs with; None: the base model.
    lora: LoraRef | None = None
    # The prompt's images in prompt order, their placeholder runs apart (a generation only).
    images: tuple[ImageInput, ...] = ()
    # Lower is scheduled sooner (vLLM's meaning); ties go by arrival. An engine whose policy is
    # FCFS refuses any priority but 0. A signed 64-bit int.
    priority: int = 0


@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter as a request names it: the name it is served under and the PEFT folder
    the engine loads it from (on the engine's host) when it has no copy of it. The pair is the
    adapter's identity in the engine: its cached weights and its prefix-cache blocks."""

    name: str
    path: str


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Control:
    kind: ControlKind
    token: int = 0  # echoed in the reply so a client can match replies to calls


@dataclass(frozen=True)
class Ready:
    """The handshake: what a client needs to know before it sends requests."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    embedding: EmbeddingModel | None = None  # None: the engine generates; else it only embeds
    # Whether requests' priorities count (PRIORITY), or only 0 is taken (FCFS).
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # The dtype (one of PIXEL_DTYPES) the engine computes in, which its vision tower casts an
    # image's pixels to: pixels sent in it (half float32's bytes where 16-bit) lose nothing.
    pixel_dtype: str = "float32"


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs for one sampled token: its own, and the top-N alternatives."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    # A prompt token's rank among the whole vocabulary (1: the most likely; ties counted as
    # vLLM counts them, every token at least as likely); None for a sampled token.
    rank: int | None = None


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request spent its time in the engine core, in seconds of its clock."""

    queue_s: float  # arrival in the engine to first scheduled
    prefill_s: float  # first scheduled to first token (preemptions before it included)
    decode_s: float  # first token to finish
    # Speculative decoding: the draft tokens its steps scored, and how many of them it kept.
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """One request's share of one engine step (mutable only so the decoder can build it in
    columns; nothing changes it after that)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # one entry per new token when asked for
    # With prompt_logprobs: one entry per prompt token after the first, all in the request's
    # first output (the one that carries its first token).
    prompt_logprobs: list[TokenLogprobs] | None = None
    timings: RequestTimings | None = None  # in the output that finishes the request
    # A pooling request's vector (float32 values), in the output that ends it (POOLED).
    embedding: list[float] | None = None


@dataclass(frozen=True)
class StepOutputs:
    """Everything one engine step produced for one client."""

    outputs: list[RequestOutput]
    # Requests that ended without a token in this step (aborts, errors).
    finished_without_tokens: dict[str, FinishReason] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestError:
    request_id: str
    message: str
    code: int = 400


# RequestError.code of a request the engine dropped because it could not reach its client for a
# moment (a dropped connection that ZMQ then made again): the request never failed, so the
# client may send it again with what it generated, as after the engine's death.
DROPPED_UNREACHABLE = 503


# Upper bounds of the buckets of EngineCounts.step_tokens (as vLLM's iteration_tokens_total).
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _no_steps() -> tuple[int, ...]:
    return (0,) * (len(STEP_TOKEN_BUCKETS) + 1)


@dataclass(frozen=True)
class EngineCounts:
    """Counts an engine core keeps from its start, so a client may poll them at any rate; a new
    ``run_id`` means a new engine core, whose counts began again at zero."""

    run_id: int = 0  # random, drawn when the engine core starts
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admissions
    prefix_cache_hits: int = 0  # of those, tokens found there (not computed again)
    preemptions: int = 0
    # Steps by tokens scheduled: one count per bucket of STEP_TOKEN_BUCKETS (a step with n
    # tokens counts in the first bound >= n), then one for steps past the last bound.
    step_tokens: tuple[int, ...] = field(default_factory=_no_steps)
    step_tokens_sum: int = 0  # tokens scheduled, all steps together
    # Speculative decoding: rows that carried drafts, the drafts, and the drafts kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # The host KV tier (--kv-offload-gb): blocks copied to host memory as they were evicted,
    # blocks copied back for a prefix hit, and at admissions the tokens looked up (with a tier)
    # and those its hits served (not in prefix_cache_hits, the device pool's: vLLM's split of
    # local and external hits).
    kv_offload_stored_blocks: int = 0
    kv_offload_restored_blocks: int = 0
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0

    def __add__(self, other: EngineCounts) -> EngineCounts:
        """The sum of two engines' (or two runs') counts; the run id is meaningless in it."""
        return EngineCounts(
            0,
            self.prefix_cache_queries + other.prefix_cache_queries,
            self.prefix_cache_hits + other.prefix_cache_hits,
            self.preemptions + other.preemptions,
            tuple(a + b for a, b in zip(self.step_tokens, other.step_tokens, strict=True)),
            self.step_tokens_sum + other.step_tokens_sum,
            self.spec_drafts + other.spec_drafts,
            self.spec_draft_tokens + other.spec_draft_tokens,
            self.spec_accepted_tokens + other.spec_accepted_tokens,
            self.kv_offload_stored_blocks + other.kv_offload_stored_blocks,
            self.kv_offload_restored_blocks + other.kv_offload_restored_blocks,
            self.kv_offload_queries + other.kv_offload_queries,
            self.kv_offload_hits + other.kv_offload_hits,
        )


@dataclass(frozen=True)
class Stats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_cached_blocks: int
    num_total_blocks: int
    num_steps: int
    counts: EngineCounts = field(default_factory=EngineCounts)
    num_host_blocks: int = 0  # slots of the host KV tier (--kv-offload-gb), 0: none
    num_host_used_blocks: int = 0  # of those, slots that hold a block

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (cached free blocks count as free)."""
        used = self.num_total_blocks - self.num_free_blocks - self.num_cached_blocks
        return used / max(self.num_total_blocks, 1)

    @property
    def host_kv_usage(self) -> float:
        """Fraction of the host KV tier's slots that hold a block (0 without a tier)."""
        return self.num_host_used_blocks / max(self.num_host_blocks, 1)


@dataclass(frozen=True)
class ControlReply:
    kind: ControlKind
    token: int
    stats: Stats | None = None
    ok: bool = True
    message: str = ""


# An idle engine, or one between steps, sends a Heartbeat this often: a client that hears
# nothing for much longer has lost it (protocol/client.py).
HEARTBEAT_INTERVAL_S = 0.5
MAX_BUSY_S = 86400.0  # the longest step a heartbeat announces (longer ones announce this)


@dataclass(frozen=True)
class Heartbeat:
    """The engine lives. ``busy_for_s`` > 0: it is starting a step it expects to take about
    that long (a long prompt on the CPU), in which it sends nothing, so a client counts its
    silence from that step's expected end (engine_core/step_clock.py)."""

    num_steps: int
    busy_for_s: float = 0.0


ClientMessage = Hello | AddRequest | Abort | Control
EngineMessage = Ready | StepOutputs | RequestError | ControlReply | Heartbeat
