"""msgpack encoding and validating decoding of the wire types in ``protocol/messages.py``.

A frame is one msgpack array ``[msg_type, PROTOCOL_VERSION, *fields]``; a message is that frame,
and for an ADD_REQUEST with images one more frame per image holding its pixels, in image order
(``encode_frames``): megabytes of pixels then reach the socket and come off it without being
copied into or out of a msgpack buffer. Each message type has an
explicit encoder and decoder below, looked up by its type tag: no reflection, no pickle. Enums
travel as small ints, ``SamplingParams`` as a fixed-order array, token id lists as packed
little-endian int32 bytes and logprobs as packed float64 bytes (lossless).

Decoding treats every frame as untrusted input. Anything malformed (not msgpack, not an array,
an unknown tag, another protocol version, a wrong field count or type, a bool where an int
belongs, a non-finite float, an out-of-range sampling parameter, an oversized field) raises
``ProtocolError`` and nothing else; when the request id could be read, the error carries it so
the engine can answer ``RequestError`` for that request.

Field layouts (after the type tag and the version):

    HELLO           client_name
    ADD_REQUEST     request_id, prompt_ids: i32 bytes, params: [one per SamplingParams field,
                    in their order (ParamsLayout); stop_token_ids = i32 bytes,
                    constraint = nil | [kind, spec], logit_bias = [ids: i32 bytes, f64 bytes]],
                    num_output_tokens (the tail of prompt_ids already generated: a resume),
                    output_interval (tokens the engine gathers before it sends them; >= 1),
                    [pooling = [kind, normalize, dimensions | nil]] (an embedding request only),
                    [lora = [name, path]] (a LoRA request only), [images = [[hash: 32 bytes,
                    offset, length, dtype, shape: [ints], pixel byte count, [t, h, w]], ...]]
                    (a prompt with images; the pixels are the frames that follow),
                    [priority] (not 0): trailing, each absent one nil where a later one follows
    ABORT           [request_id, ...]
    CONTROL         kind, token
    READY           model, max_model_len, vocab_size, eos_ids: i32 bytes, block_size,
                    num_kv_blocks, max_num_seqs, scheduling_policy, pixel_dtype,
                    [embedding = [pooling kind, normalize, size, matryoshka,
                    matryoshka_dimensions: i32 bytes]] (an embedding engine only)
    STEP_OUTPUTS    [request_id, ...], counts: i32 bytes (new tokens per request),
                    new_ids: i32 bytes (every request's new tokens, in order),
                    [[index, finish_reason], ...], [[index, logprobs], ...],
                    {request_id: finish_reason, ...} (requests that ended with no token),
                    [[index, count, prompt logprobs], ...] (count = prompt tokens - 1),
                    [[index, queue_s, prefill_s, decode_s, draft_tokens, accepted_tokens], ...]
                    (timings of finished requests)
                    [[[index, vector: f32 bytes], ...]] (pooled vectors, only where any)
                    logprobs = [sampled: f64 bytes (one per new token), top_counts: i32 bytes
                    (one per new token), top_ids: i32 bytes, top_logprobs: f64 bytes,
                    [ranks: i32 bytes (one per token; prompt logprobs only)]]
                    Columns, not one array per request: a step carries up to max_num_seqs
                    outputs, and both ends pay per msgpack object (an index is a position in
                    the request id list; most steps finish few requests). Pairs, not maps:
                    the decoder admits only str map keys.
    REQUEST_ERROR   request_id, message, code
    CONTROL_REPLY   kind, token, stats: [Stats' int fields in their order, counts] | nil, ok,
                    message; counts = [EngineCounts' int fields in their order (run_id,
                    prefix_cache_queries, prefix_cache_hits, preemptions, step_tokens_sum,
                    the speculative and host KV tier counts),
                    [one count per STEP_TOKEN_BUCKETS bucket, + 1]]
    HEARTBEAT       num_steps, [busy_for_s]

Fields in [brackets] above are trailing ones that a frame carries only when it has them (an
embedding request, an embedding engine, a step that pooled): the frames of generation keep the
bytes they had before embeddings existed, and a decoder reads a missing one as none. Where one
is present it must hold something: one encoding per message (a frame's last field is never
nil, and a priority of 0 is left out; an absent field before a present one holds its place with
nil).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, get_type_hints

import msgpack
import numpy as np

from protocol.messages import (
    MAX_BUSY_S,
    PIXEL_DTYPES,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PROTOCOL_VERSION,
    STEP_TOKEN_BUCKETS,
    Abort,
    AddRequest,
    ClientMessage,
    Constraint,
    ConstraintKind,
    Control,
    ControlKind,
    ControlReply,
    EmbeddingModel,
    EngineCounts,
    EngineMessage,
    FinishReason,
    Heartbeat,
    Hello,
    ImageInput,
    LoraRef,
    MsgType,
    PoolingKind,
    PoolingParams,
    Ready,
    RequestError,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    SchedulingPolicy,
    Stats,
    StepOutputs,
    TensorBytes,
    TokenLogprobs,
)

# Size caps. A frame over MAX_FRAME_BYTES is refused before msgpack sees it; inside a frame the
# caps bound what one malicious or buggy peer can make the decoder allocate.
MAX_FRAME_BYTES = 64 << 20
MAX_TOKEN_IDS = 1 << 22  # per id list: 16 MiB of int32, far beyond any context window
MAX_STR_BYTES = 1 << 20  # model names and error messages
MAX_ARRAY_LEN = 1 << 20  # outputs per step, ids per abort
MAX_REQUEST_ID_LEN = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_CONSTRAINT_BYTES = 1 << 20  # a JSON schema or a grammar; compilation has its own bounds
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: [-100, 100]
MAX_EMBEDDING_DIMS = 1 << 16  # values of one pooled vector: beyond any model's hidden size
MAX_LORA_STR_LEN = 4096  # a LoRA adapter's name or folder path (PATH_MAX)
MAX_IMAGES = 256  # images of one prompt (the API process's --limit-mm-per-prompt is lower)
MAX_TENSOR_DIMS = 4
IMAGE_HASH_BYTES = 32
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1

_SMALL_IDS_BYTES = 1024
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_NATIVE_LITTLE = sys.byteorder == "little"
assert array("i").itemsize == 4, "array('i') must be 32-bit for the token id fast path"


class ProtocolError(ValueError):
    """A frame (or a message to be encoded) that breaks the protocol.

    ``request_id`` is set when the offending frame's request id could be read, so the receiver
    can answer with a ``RequestError`` for that request instead of dropping it silently.
    """

    def __init__(
        self, message: str, request_id: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.field = field  # the offending field's name where it has one (an API's "param")


# ---- public API -------------------------------------------------------------------------------


def encode(msg: ClientMessage | EngineMessage) -> bytes:
    """Encode one message as a frame (an AddRequest's pixels go apart: ``encode_frames``).
    Raises ProtocolError for an invalid AddRequest."""
    try:
        tag, encode_fields = _ENCODERS[type(msg)]
    except KeyError:
        raise TypeError(f"not a protocol message: {type(msg).__name__}") from None
    return msgpack.packb([int(tag), PROTOCOL_VERSION, *encode_fields(msg)], use_bin_type=True)


def encode_frames(msg: ClientMessage) -> list[bytes | memoryview]:
    """The frames of one message: its frame, then an AddRequest's images' pixels, one each."""
    frame = encode(msg)
    if type(msg) is not AddRequest or not msg.images:
        return [frame]
    return [frame, *(image.pixels.data for image in msg.images)]


def decode_client_message(
    frame: bytes | memoryview, payloads: Sequence[bytes | memoryview] = ()
) -> ClientMessage:
    """Decode a message sent by a client to the engine: its frame and the frames after it (an
    AddRequest's pixels); raises ProtocolError if malformed."""
    return _decode(frame, _CLIENT_DECODERS, "client", payloads)


def decode_engine_message(frame: bytes | memoryview) -> EngineMessage:
    """Decode a frame sent by the engine to a client; raises ProtocolError if malformed."""
    return _decode(frame, _ENGINE_DECODERS, "engine")


def validate_sampling_params(params: SamplingParams, request_id: str | None = None) -> None:
    """Check types and ranges of every field; raises ProtocolError naming the first bad one."""
    v = _Validator(request_id)
    if not isinstance(params, SamplingParams):
        raise v.fail(f"params must be SamplingParams, got {type(params).__name__}")
    v.int_(params.max_tokens, "max_tokens", 1, INT32_MAX)
    v.int_(params.min_tokens, "min_tokens", 0, params.max_tokens)
    v.float_(params.temperature, "temperature", 0.0, math.inf)
    v.float_(params.top_p, "top_p", 0.0, 1.0, lo_open=True)
    v.int_(params.top_k, "top_k", 0, INT32_MAX)
    v.float_(params.min_p, "min_p", 0.0, 1.0)
    if params.seed is not None:
        v.int_(params.seed, "seed", 0, UINT64_MAX)
    v.float_(params.presence_penalty, "presence_penalty", -2.0, 2.0)
    v.float_(params.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    v.float_(params.repetition_penalty, "repetition_penalty", 0.0, math.inf, lo_open=True)
    v.token_list(params.stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
    v.bool_(params.ignore_eos, "ignore_eos")
    if params.logprobs is not None:
        v.int_(params.logprobs, "logprobs", 0, MAX_LOGPROBS)
    if params.prompt_logprobs is not None:
        v.int_(params.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
    _validate_logit_bias(params.logit_bias, v)
    if params.constraint is not None:
        _validate_constraint(params.constraint, v)


def _validate_logit_bias(pairs: Any, v: _Validator) -> None:
    if not isinstance(pairs, tuple) or len(pairs) > MAX_LOGIT_BIAS:
        raise v.fail(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise v.fail("logit_bias must hold (token id, bias) pairs", "logit_bias")
        v.int_(pair[0], "a logit_bias token id", 0, INT32_MAX)
        v.float_(pair[1], "a logit_bias value", -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
    if len({tid for tid, _ in pairs}) != len(pairs):
        raise v.fail("logit_bias names a token id twice", "logit_bias")


def _validate_constraint(constraint: Any, v: _Validator) -> None:
    if not isinstance(constraint, Constraint):
        raise v.fail(f"constraint must be a Constraint, got {type(constraint).__name__}")
    if not isinstance(constraint.kind, ConstraintKind):
        raise v.fail(f"unknown constraint kind {constraint.kind!r}")
    v.str_(constraint.spec, "the constraint's spec", MAX_CONSTRAINT_BYTES)
    if not constraint.spec and constraint.kind != ConstraintKind.JSON_OBJECT:
        raise v.fail(f"a {constraint.kind.name.lower()} constraint needs a spec")


def validate_pooling_params(pooling: PoolingParams, request_id: str | None = None) -> None:
    """Check an embedding request's pooling; raises ProtocolError naming the bad field."""
    v = _Validator(request_id)
    if not isinstance(pooling, PoolingParams):
        raise v.fail(f"pooling must be PoolingParams, got {type(pooling).__name__}")
    if not isinstance(pooling.kind, PoolingKind):
        raise v.fail(f"unknown pooling kind {pooling.kind!r}")
    v.bool_(pooling.normalize, "pooling normalize")
    if pooling.dimensions is not None:
        v.int_(pooling.dimensions, "pooling dimensions", 1, MAX_EMBEDDING_DIMS)


def pack_token_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as packed little-endian int32; OverflowError/TypeError if they do not fit."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a {ids.dtype} array")
        if ids.dtype != _I32 and ids.size and (ids.min() < -(2**31) or ids.max() > INT32_MAX):
            raise OverflowError("token id out of int32 range")
        return ids.astype(_I32, copy=False).tobytes()
    packed = array("i", ids)
    if not _NATIVE_LITTLE:
        packed.byteswap()
    return packed.tobytes()


# ---- validation helpers -----------------------------------------------------------------------


class _Validator:
    """Type and range checks that raise ProtocolError tagged with the request id, if known."""

    def __init__(
        self, request_id: str | None = None, payloads: Sequence[bytes | memoryview] = ()
    ) -> None:
        self.request_id = request_id
        self.payloads = payloads  # the frames after the message's own, taken in order
        self.payloads_taken = 0

    def payload(self, nbytes: int, what: str) -> bytes | memoryview:
        """The next frame after the message's own, which must hold ``nbytes`` bytes."""
        if self.payloads_taken >= len(self.payloads):
            raise self.fail(f"{what}: the message came without the frame that holds them")
        data = self.payloads[self.payloads_taken]
        self.payloads_taken += 1
        held = memoryview(data).nbytes
        if held != nbytes:
            raise self.fail(f"{what}: the frame holds {held} bytes, not {nbytes}")
        return data

    def fail(self, message: str, what: str | None = None) -> ProtocolError:
        """The error; ``what``, the value's description, is its field where it is a name."""
        field = what if what is not None and what.isidentifier() else None
        return ProtocolError(message, self.request_id, field)

    def int_(self, value: Any, what: str, lo: int, hi: int) -> int:
        # type() rather than isinstance(): bool is an int subclass and must not pass as one.
        if type(value) is not int:
            raise self.fail(f"{what} must be an int, got {type(value).__name__}", what)
        if not lo <= value <= hi:
            raise self.fail(f"{what} must be in [{lo}, {hi}], got {value}", what)
        return value

    def float_(self, value: Any, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
        # Ints are accepted (another encoder may pack 1.0 as 1); bools and non-finite values not.
        if type(value) not in (float, int):
            raise self.fail(f"{what} must be a number, got {type(value).__name__}", what)
        value = float(value)
        if not math.isfinite(value):
            raise self.fail(f"{what} must be finite, got {value}", what)
        if not (lo < value if lo_open else lo <= value) or value > hi:
            bracket = "(" if lo_open else "["
            raise self.fail(f"{what} must be in {bracket}{lo}, {hi}], got {value}", what)
        return value

    def bool_(self, value: Any, what: str) -> bool:
        if type(value) is not bool:
            raise self.fail(f"{what} must be a bool, got {type(value).__name__}", what)
        return value

    def str_(self, value: Any, what: str, max_len: int) -> str:
        if type(value) is not str:
            raise self.fail(f"{what} must be a str, got {type(value).__name__}", what)
        if len(value) > max_len:
            raise self.fail(f"{what} is longer than {max_len} characters", what)
        return value

    def list_(self, value: Any, what: str, length: int | None = None) -> list[Any]:
        if type(value) is not list:
            raise self.fail(f"{what} must be an array, got {type(value).__name__}", what)
        if length is not None and len(value) != length:
            raise self.fail(f"{what} must have {length} elements, got {len(value)}", what)
        return value

    def enum_(self, value: Any, cls: type[Any], what: str) -> Any:
        self.int_(value, what, -(2**63), UINT64_MAX)
        try:
            return cls(value)
        except ValueError:
            raise self.fail(f"unknown {what} {value}") from None

    def token_list(self, value: Any, what: str, max_len: int) -> None:
        """Validate a Python sequence of token ids (the encoder's side of stop_token_ids)."""
        if not isinstance(value, (tuple, list)):
            raise self.fail(f"{what} must be a tuple of ints, got {type(value).__name__}", what)
        if len(value) > max_len:
            raise self.fail(f"{what} has more than {max_len} ids", what)
        for tid in value:
            self.int_(tid, what, 0, INT32_MAX)

    def ids(self, value: Any, what: str, max_len: int = MAX_TOKEN_IDS) -> list[int]:
        """Unpack int32 bytes into token ids, all of them >= 0."""
        if type(value) is bytes and len(value) <= _SMALL_IDS_BYTES and not len(value) % 4:
            # Decode steps carry a token or a few per request; array() is ~8x cheaper than
            # numpy's per-call overhead at that size.
            packed = array("i")
            packed.frombytes(value)
            if not _NATIVE_LITTLE:
                packed.byteswap()
            ids = packed.tolist()
            if len(ids) > max_len or (ids and min(ids) < 0):
                return self.i32(value, what, max_len, min_value=0).tolist()  # raises
            return ids
        return self.i32(value, what, max_len, min_value=0).tolist()

    def i32(self, value: Any, what: str, max_len: int, min_value: int) -> np.ndarray:
        if type(value) is not bytes:
            raise self.fail(f"{what} must be int32 bytes, got {type(value).__name__}")
        if len(value) % 4:
            raise self.fail(f"{what} has {len(value)} bytes, not a multiple of 4")
        if len(value) // 4 > max_len:
            raise self.fail(f"{what} has more than {max_len} ids")
        arr = np.frombuffer(value, dtype=_I32)
        if arr.size and arr.min() < min_value:
            raise self.fail(f"{what} contains a value below {min_value}")
        return arr

    def f64(self, value: Any, what: str, count: int) -> list[float]:
        """Unpack float64 bytes of logprobs: exactly ``count`` values, none NaN or +inf."""
        if type(value) is not bytes or len(value) != 8 * count:
            raise self.fail(f"{what} must be {count} float64 values as bytes")
        arr = np.frombuffer(value, dtype=_F64)
        if np.isnan(arr).any() or np.isposinf(arr).any():
            raise self.fail(f"{what} contains NaN or +inf")  # -inf is log(0), legitimate
        return arr.tolist()

    def f32(self, value: Any, what: str, max_len: int) -> list[float]:
        """Unpack float32 bytes (a pooled vector): 1 to ``max_len`` finite values."""
        if type(value) is not bytes or not value or len(value) % 4:
            raise self.fail(f"{what} must be float32 values as bytes")
        if len(value) // 4 > max_len:
            raise self.fail(f"{what} has more than {max_len} values")
        arr = np.frombuffer(value, dtype=_F32)
        if not np.isfinite(arr).all():
            raise self.fail(f"{what} contains NaN or an infinity")
        return arr.tolist()

    def rid(self, value: Any, what: str = "request_id") -> str:
        self.str_(value, what, MAX_REQUEST_ID_LEN)
        if not value:
            raise self.fail(f"{what} must not be empty")
        return value


# ---- frame level ------------------------------------------------------------------------------


def _unpack(frame: bytes | memoryview) -> list[Any]:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    n = len(frame)
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=min(n, MAX_STR_BYTES),
            max_bin_len=n,  # the frame bounds a bin; each field's validator bounds its own
            max_array_len=min(n, MAX_ARRAY_LEN),
            max_map_len=min(n, MAX_ARRAY_LEN),
            max_ext_len=0,  # no ext types (timestamps included) belong on this wire
        )
    except Exception as exc:  # msgpack raises a zoo of types on bad input; all mean "malformed"
        raise ProtocolError(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    if type(obj) is not list or len(obj) < 2:
        raise ProtocolError("frame must be an array [type, version, *fields]")
    return obj


_Decoder = Callable[[list[Any], _Validator], Any]


def _decode(
    frame: bytes | memoryview,
    decoders: dict[int, _Decoder],
    sender: str,
    payloads: Sequence[bytes | memoryview] = (),
) -> Any:
    obj = _unpack(frame)
    tag, version, fields = obj[0], obj[1], obj[2:]
    if type(tag) is not int or tag not in decoders:
        raise ProtocolError(f"unknown {sender} message type {tag!r}")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    v = _Validator(payloads=payloads)
    if tag in _REQUEST_ID_FIRST and fields and _is_request_id(fields[0]):
        v.request_id = fields[0]
    msg = decoders[tag](fields, v)
    if v.payloads_taken != len(payloads):
        raise v.fail(
            f"the message came with {len(payloads)} frames after its own and takes "
            f"{v.payloads_taken}"
        )
    return msg


def _is_request_id(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_REQUEST_ID_LEN


def _with_trailing(fields: Any, what: str, length: int, v: _Validator) -> tuple[list[Any], Any]:
    """A message's ``length`` fixed fields and its optional trailing one (None where the frame
    leaves it out; see the module docstring)."""
    if type(fields) is list and len(fields) == length + 1:
        if fields[length] is None:
            raise v.fail(f"{what}: a trailing field is left out, never nil")
        return fields[:length], fields[length]
    if type(fields) is not list or len(fields) != length:
        count = len(fields) if type(fields) is list else type(fields).__name__
        raise v.fail(f"{what} must have {length} or {length + 1} elements, got {count}")
    return fields, None


# ---- client -> engine -------------------------------------------------------------------------


def _encode_hello(msg: Hello) -> list[Any]:
    # Checked as the engine checks it: an engine drops a HELLO it cannot decode unanswered.
    return [_Validator(None).str_(msg.client_name, "client_name", MAX_REQUEST_ID_LEN)]


def _decode_hello(fields: list[Any], v: _Validator) -> Hello:
    v.list_(fields, "HELLO fields", 1)
    return Hello(v.str_(fields[0], "client_name", MAX_REQUEST_ID_LEN))


def _encode_add_request(msg: AddRequest) -> list[Any]:
    v = _Validator(msg.request_id if _is_request_id(msg.request_id) else None)
    rid = v.rid(msg.request_id)
    params = _SAMPLING_PARAMS.to_wire(msg.params, rid)
    try:
        ids = pack_token_ids(msg.prompt_token_ids)
    except (OverflowError, TypeError) as exc:
        raise ProtocolError(f"prompt_token_ids must be int32 ids: {exc}", rid) from None
    v.i32(ids, "prompt_token_ids", MAX_TOKEN_IDS, min_value=0)
    if not ids:
        raise ProtocolError("prompt_token_ids must not be empty", rid)
    _check_resumed(msg.num_output_tokens, len(ids) // 4, msg.params, v)
    v.int_(msg.output_interval, "output_interval", 1, INT32_MAX)
    fields = [rid, ids, params, msg.num_output_tokens, msg.output_interval]
    tail: list[Any] = [None, None, None, None]  # pooling, lora, images, priority
    if msg.pooling is not None:
        validate_pooling_params(msg.pooling, rid)
        _check_pooled(msg, v)
        tail[0] = _encode_pooling(msg.pooling)
    if msg.lora is not None:
        tail[1] = _encode_lora(msg.lora, v)
    if msg.images:
        if msg.pooling is not None:
            raise v.fail("an embedding request takes no images")
        images = [_encode_image(image) for image in msg.images]
        # The decoder's checks, before it goes out (over the pixels that will follow).
        _decode_images(images, len(ids) // 4, _Validator(rid, [i.pixels.data for i in msg.images]))
        tail[2] = images
    if msg.priority != 0:
        tail[3] = v.int_(msg.priority, "priority", PRIORITY_MIN, PRIORITY_MAX)
    while tail and tail[-1] is None:
        tail.pop()
    return fields + tail


def _encode_lora(lora: LoraRef, v: _Validator) -> list[Any]:
    if not isinstance(lora, LoraRef):
        raise v.fail(f"lora must be LoraRef, got {type(lora).__name__}")
    return [_lora_part(lora.name, "lora name", v), _lora_part(lora.path, "lora path", v)]


def _decode_lora(value: Any, v: _Validator) -> LoraRef:
    name, path = v.list_(value, "lora", 2)
    return LoraRef(_lora_part(name, "lora name", v), _lora_part(path, "lora path", v))


def _lora_part(value: Any, what: str, v: _Validator) -> str:
    text = v.str_(value, what, MAX_LORA_STR_LEN)
    problem = lora_text_problem(text, what)
    if problem is not None:
        raise v.fail(problem)
    return text


def lora_text_problem(text: str, what: str) -> str | None:
    """Why ``text`` cannot travel as a LoRA adapter's name or path (None: it can), for the API
    process to refuse it where it is given rather than when a request is sent."""
    if not text or "\0" in text:
        return f"{what} must be a non-empty string without NUL"
    if len(text) > MAX_LORA_STR_LEN:
        return f"{what} is longer than {MAX_LORA_STR_LEN} characters"
    try:
        text.encode("utf-8")  # a name or path read as bytes that are not UTF-8 (surrogates)
    except UnicodeEncodeError:
        return f"{what} is not valid UTF-8"
    return None


def _encode_image(image: ImageInput) -> list[Any]:
    pixels = image.pixels
    return [
        image.hash,
        image.offset,
        image.length,
        pixels.dtype,
        list(pixels.shape),
        memoryview(pixels.data).nbytes,
        list(image.grid_thw),
    ]


_PIXEL_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _decode_images(value: Any, num_ids: int, v: _Validator) -> tuple[ImageInput, ...]:
    """A prompt's images: 1 to MAX_IMAGES, each's placeholder run inside the prompt, in prompt
    order and apart, its bytes as many as its dtype and shape say."""
    v.list_(value, "images")
    if not 0 < len(value) <= MAX_IMAGES:
        raise v.fail(f"images must hold 1 to {MAX_IMAGES} images, got {len(value)}")
    images, end = [], 0
    for fields in value:
        image = _decode_image(fields, num_ids, v)
        if image.offset < end:
            raise v.fail("images' placeholder runs must be in prompt order and apart")
        end = image.offset + image.length
        images.append(image)
    return tuple(images)


def _decode_image(value: Any, num_ids: int, v: _Validator) -> ImageInput:
    hash_, offset, length, dtype, shape, nbytes, grid = v.list_(value, "image", 7)
    if type(hash_) is not bytes or len(hash_) != IMAGE_HASH_BYTES:
        raise v.fail(f"image hash must be {IMAGE_HASH_BYTES} bytes")
    offset = v.int_(offset, "image offset", 0, max(num_ids - 1, 0))
    length = v.int_(length, "image length", 1, num_ids - offset)
    if dtype not in PIXEL_DTYPES:
        raise v.fail(f"image dtype must be one of {', '.join(PIXEL_DTYPES)}, got {dtype!r}")
    v.list_(shape, "image shape")
    if not 1 <= len(shape) <= MAX_TENSOR_DIMS:
        raise v.fail(f"image shape must have 1 to {MAX_TENSOR_DIMS} dims, got {len(shape)}")
    dims = tuple(v.int_(d, "image shape", 1, INT32_MAX) for d in shape)
    expected = math.prod(dims) * _PIXEL_ITEM_BYTES[dtype]
    if type(nbytes) is not int or nbytes != expected:
        raise v.fail(f"image pixels must be {expected} {dtype} bytes of shape {list(dims)}")
    data = v.payload(nbytes, "image pixels")
    t, h, w = (v.int_(n, "image grid_thw", 1, INT32_MAX) for n in v.list_(grid, "grid_thw", 3))
    return ImageInput(hash_, offset, length, TensorBytes(dtype, dims, data), (t, h, w))


def _check_resumed(num_output: Any, num_ids: int, params: SamplingParams, v: _Validator) -> None:
    """A resumed request keeps at least one prompt token and has output left to generate."""
    v.int_(num_output, "num_output_tokens", 0, max(num_ids - 1, 0))
    if num_output >= params.max_tokens:
        raise v.fail(f"num_output_tokens ({num_output}) leaves nothing of max_tokens to generate")


def _check_pooled(msg: AddRequest, v: _Validator) -> None:
    """An embedding request samples nothing: what would steer sampling stays at its default,
    rather than travel and be ignored."""
    if msg.params != _DEFAULT_PARAMS:
        raise v.fail("an embedding request samples nothing: its params must be the defaults")
    if msg.num_output_tokens != 0 or msg.output_interval != 1:
        raise v.fail("an embedding request has no output tokens and no output interval")


def _encode_pooling(pooling: PoolingParams) -> list[Any]:
    return [int(pooling.kind), pooling.normalize, pooling.dimensions]


def _decode_pooling(value: Any, v: _Validator) -> PoolingParams:
    kind, normalize, dimensions = v.list_(value, "pooling", 3)
    if dimensions is not None:
        dimensions = v.int_(dimensions, "pooling dimensions", 1, MAX_EMBEDDING_DIMS)
    kind = v.enum_(kind, PoolingKind, "pooling kind")
    return PoolingParams(kind, v.bool_(normalize, "pooling normalize"), dimensions)


def _decode_add_request(fields: list[Any], v: _Validator) -> AddRequest:
    fixed, (pooling, lora, images, priority) = _add_request_fields(fields, v)
    rid, ids, params, num_output, interval = fixed
    rid = v.rid(rid)
    ids = v.ids(ids, "prompt_token_ids")
    if not ids:
        raise v.fail("prompt_token_ids must not be empty")
    params = _SAMPLING_PARAMS.from_wire(params, v)
    _check_resumed(num_output, len(ids), params, v)
    interval = v.int_(interval, "output_interval", 1, INT32_MAX)
    msg = AddRequest(
        rid,
        ids,
        params,
        num_output,
        interval,
        lora=None if lora is None else _decode_lora(lora, v),
        priority=0 if priority is None else _decode_priority(priority, v),
    )
    if images is not None:
        if pooling is not None:
            raise v.fail("an embedding request takes no images")
        return dataclasses.replace(msg, images=_decode_images(images, len(ids), v))
    if pooling is None:
        return msg
    msg = dataclasses.replace(msg, pooling=_decode_pooling(pooling, v))
    _check_pooled(msg, v)
    return msg


_ADD_REQUEST_FIXED = 5  # request_id, prompt ids, params, num_output_tokens, output_interval
_ADD_REQUEST_TRAILING = 4  # pooling, lora, images, priority


def _add_request_fields(fields: Any, v: _Validator) -> tuple[list[Any], list[Any]]:
    """An ADD_REQUEST's fixed fields and its trailing ones, None for each it leaves out (a
    frame ends at its last trailing field, which is never nil: one encoding per message)."""
    v.list_(fields, "ADD_REQUEST fields")
    most = _ADD_REQUEST_FIXED + _ADD_REQUEST_TRAILING
    if not _ADD_REQUEST_FIXED <= len(fields) <= most:
        raise v.fail(
            f"ADD_REQUEST fields must have {_ADD_REQUEST_FIXED} to {most} elements, "
            f"got {len(fields)}"
        )
    if len(fields) > _ADD_REQUEST_FIXED and fields[-1] is None:
        raise v.fail("ADD_REQUEST's last optional field must not be nil")
    tail = fields[_ADD_REQUEST_FIXED:] + [None] * (most - len(fields))
    return fields[:_ADD_REQUEST_FIXED], tail


def _decode_priority(value: Any, v: _Validator) -> int:
    priority = v.int_(value, "priority", PRIORITY_MIN, PRIORITY_MAX)
    if priority == 0:
        raise v.fail("priority 0 is the default: a frame leaves it out")
    return priority


# ---- sampling params --------------------------------------------------------------------------


class _WireForm(NamedTuple):
    """How one SamplingParams field travels: its encoder, and its decoder (which checks the
    wire value's shape; ranges are checked later, by validate_sampling_params)."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any, _Validator], Any]


def _decode_stop_token_ids(value: Any, v: _Validator) -> tuple[int, ...]:
    return tuple(v.ids(value, "stop_token_ids", MAX_STOP_TOKEN_IDS))


def _encode_logit_bias(pairs: tuple[tuple[int, float], ...]) -> list[bytes]:
    ids = pack_token_ids([tid for tid, _ in pairs])
    return [ids, np.array([bias for _, bias in pairs], dtype=_F64).tobytes()]


def _decode_logit_bias(value: Any, v: _Validator) -> tuple[tuple[int, float], ...]:
    f = v.list_(value, "logit_bias", 2)
    ids = v.ids(f[0], "logit_bias ids", MAX_LOGIT_BIAS)
    biases = v.f64(f[1], "logit_bias values", len(ids))
    return tuple(zip(ids, biases, strict=True))


def _encode_constraint(constraint: Constraint | None) -> list[Any] | None:
    return None if constraint is None else [int(constraint.kind), constraint.spec]


def _decode_constraint(value: Any, v: _Validator) -> Constraint | None:
    if value is None:
        return None
    f = v.list_(value, "constraint", 2)
    kind = v.enum_(f[0], ConstraintKind, "constraint kind")
    return Constraint(kind, v.str_(f[1], "the constraint's spec", MAX_CONSTRAINT_BYTES))


# The fields that do not travel as one msgpack scalar. Every other field does: a float field as a
# float, anything else (an int, a bool, an optional int) as the value it holds.
_PARAM_WIRE_FORMS = {
    "stop_token_ids": _WireForm(pack_token_ids, _decode_stop_token_ids),  # i32 bytes
    "logit_bias": _WireForm(_encode_logit_bias, _decode_logit_bias),  # [ids: i32, biases: f64]
    "constraint": _WireForm(_encode_constraint, _decode_constraint),  # nil | [kind, spec]
}


def _float_form(name: str) -> _WireForm:
    """Packed as a float whatever number the field holds; read back from any finite number
    (another encoder may pack 1.0 as 1)."""

    def decode(value: Any, v: _Validator) -> float:
        return v.float_(value, name, -math.inf, math.inf)

    return _WireForm(float, decode)


def _optional_form(form: _WireForm) -> _WireForm:
    def encode(value: Any) -> Any:
        return None if value is None else form.encode(value)

    def decode(value: Any, v: _Validator) -> Any:
        return None if value is None else form.decode(value, v)

    return _WireForm(encode, decode)


def _wire_form(name: str, hint: Any) -> _WireForm | None:
    """How the field ``name`` of type ``hint`` travels; None: as the value it holds."""
    if name in _PARAM_WIRE_FORMS:
        return _PARAM_WIRE_FORMS[name]
    if hint is float:
        return _float_form(name)
    if hint == float | None:
        return _optional_form(_float_form(name))
    return None


class _PlainParamsCache:
    """Plain sampling params (no stop ids, logit bias or constraint) that passed validation,
    kept by the values of their fields (``ParamsLayout``): their wire form on the encoding side,
    their decoded object on the decoding side. The requests of a burst mostly carry equal
    params, and checking and converting them field by field was most of an ADD_REQUEST's cost
    at either end. A key holds every field's type as well as its value, so a hit is a value
    that passed the same checks (True never stands in for 1, nor 1 for 1.0). Bounded: emptied
    when full. Its dict operations are atomic under the GIL, so the threads of one process may
    share it."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._entries: dict[tuple[Any, ...], Any] = {}

    def get(self, key: tuple[Any, ...]) -> Any:
        return self._entries.get(key)

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        if len(self._entries) >= self._size:
            self._entries.clear()
        self._entries[key] = value


def _typed_key(values: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The values and their types, or None where one is unhashable (a malformed field)."""
    key = (values, tuple(map(type, values)))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class ParamsLayout:
    """The wire form of a SamplingParams class, derived from its dataclass fields: an array with
    one position per field, in the fields' order, each field in its ``_wire_form``. Params whose
    stop ids, logit bias and constraint are all at their defaults (plain params) are cached on
    either side (``_PlainParamsCache``). A new field needs no change here: only its line in
    ``SamplingParams`` and its check in ``validate_sampling_params``."""

    def __init__(self, cls: type[SamplingParams]) -> None:
        self.cls = cls
        self.names = tuple(f.name for f in dataclasses.fields(cls))
        hints = get_type_hints(cls)
        forms = [_wire_form(name, hints[name]) for name in self.names]
        # (position, function) for each field whose wire value is not the value it holds
        converted = [(i, form) for i, form in enumerate(forms) if form is not None]
        self._encoders = [(i, form.encode) for i, form in converted]
        self._decoders = [(i, form.decode) for i, form in converted]
        self._fields_of = operator.attrgetter(*self.names)  # a tuple, in one C call
        scalars = [i for i, name in enumerate(self.names) if name not in _PARAM_WIRE_FORMS]
        others = [i for i, name in enumerate(self.names) if name in _PARAM_WIRE_FORMS]
        self._scalars_on_the_wire = operator.itemgetter(*scalars)
        self._others_on_the_wire = operator.itemgetter(*others)
        self._plain_others = self._others_on_the_wire(self.encode(cls()))
        self._plain_types = tuple(map(type, self._plain_others))
        self._wire_cache = _PlainParamsCache()
        self._decoded_cache = _PlainParamsCache()

    def encode(self, p: SamplingParams) -> list[Any]:
        """``p`` in its wire form, unchecked."""
        wire = list(self._fields_of(p))
        for i, encode in self._encoders:
            wire[i] = encode(wire[i])
        return wire

    def decode(self, f: list[Any], v: _Validator) -> SamplingParams:
        """The params of a wire array of the right length, every field checked."""
        values = list(f)
        for i, decode in self._decoders:
            values[i] = decode(f[i], v)
        params = self.cls(**dict(zip(self.names, values, strict=True)))
        validate_sampling_params(params, v.request_id)
        return params

    def plain_wire_key(self, f: list[Any]) -> tuple[Any, ...] | None:
        """The cache key of a wire array of plain params; None for others."""
        return _typed_key(self._scalars_on_the_wire(f)) if self._is_plain(f) else None

    def _is_plain(self, f: list[Any]) -> bool:
        others = self._others_on_the_wire(f)
        return tuple(map(type, others)) == self._plain_types and others == self._plain_others

    def to_wire(self, p: SamplingParams, request_id: str | None) -> list[Any]:
        """``p`` checked (ProtocolError naming its first bad field) and in its wire form."""
        if not isinstance(p, SamplingParams):
            validate_sampling_params(p, request_id)  # says what it is instead
        # Keyed by every field (the stop ids, logit bias and constraint are empty in a cached
        # key, so no tuple inside it can hold a lookalike).
        key = _typed_key(self._fields_of(p))
        if key is not None and (wire := self._wire_cache.get(key)) is not None:
            return wire  # never mutated: msgpack only reads it
        validate_sampling_params(p, request_id)
        wire = self.encode(p)
        if key is not None and self._is_plain(wire):
            self._wire_cache.put(key, wire)
        return wire

    def from_wire(self, value: Any, v: _Validator) -> SamplingParams:
        """The params a wire value holds; ProtocolError if it is not valid params."""
        f = v.list_(value, "sampling params", len(self.names))
        key = self.plain_wire_key(f)
        if key is not None and (params := self._decoded_cache.get(key)) is not None:
            return params  # frozen: requests may share it
        params = self.decode(f, v)
        if key is not None:
            self._decoded_cache.put(key, params)
        return params


_SAMPLING_PARAMS = ParamsLayout(SamplingParams)
_DEFAULT_PARAMS = SamplingParams()


def _encode_abort(msg: Abort) -> list[Any]:
    return [list(msg.request_ids)]


def _decode_abort(fields: list[Any], v: _Validator) -> Abort:
    v.list_(fields, "ABORT fields", 1)
    ids = v.list_(fields[0], "ABORT request_ids")
    return Abort([v.rid(rid) for rid in ids])


def _encode_control(msg: Control) -> list[Any]:
    return [int(msg.kind), int(msg.token)]


def _decode_control(fields: list[Any], v: _Validator) -> Control:
    v.list_(fields, "CONTROL fields", 2)
    return Control(v.enum_(fields[0], ControlKind, "control kind"), _token(fields[1], v))


def _token(value: Any, v: _Validator) -> int:
    return v.int_(value, "control token", 0, UINT64_MAX)


# ---- engine -> client -------------------------------------------------------------------------


def _encode_ready(msg: Ready) -> list[Any]:
    fields = [
        msg.model,
        int(msg.max_model_len),
        int(msg.vocab_size),
        pack_token_ids(msg.eos_token_ids),
        int(msg.block_size),
        int(msg.num_kv_blocks),
        int(msg.max_num_seqs),
        int(msg.scheduling_policy),
        msg.pixel_dtype,
    ]
    if msg.embedding is not None:
        fields.append(_encode_embedding_model(msg.embedding))
    return fields


def _encode_embedding_model(e: EmbeddingModel) -> list[Any]:
    dims = pack_token_ids(e.matryoshka_dimensions)
    return [int(e.pooling), bool(e.normalize), int(e.size), bool(e.matryoshka), dims]


def _decode_embedding_model(value: Any, v: _Validator) -> EmbeddingModel:
    pooling, normalize, size, matryoshka, dims = v.list_(value, "embedding model", 5)
    size = v.int_(size, "embedding size", 1, MAX_EMBEDDING_DIMS)
    matryoshka = v.bool_(matryoshka, "matryoshka")
    dims = v.ids(dims, "matryoshka_dimensions", MAX_EMBEDDING_DIMS)
    if any(not 1 <= d <= size for d in dims) or (dims and not matryoshka):
        raise v.fail(f"matryoshka_dimensions must lie in [1, {size}], for a Matryoshka model")
    kind = v.enum_(pooling, PoolingKind, "pooling kind")
    return EmbeddingModel(kind, v.bool_(normalize, "normalize"), size, matryoshka, tuple(dims))


def _decode_ready(fields: list[Any], v: _Validator) -> Ready:
    fixed, embedding = _with_trailing(fields, "READY fields", 9, v)
    if fixed[8] not in PIXEL_DTYPES:
        raise v.fail(f"pixel dtype must be one of {', '.join(PIXEL_DTYPES)}, got {fixed[8]!r}")
    model, max_model_len, vocab_size, eos_ids, block_size, num_kv_blocks, max_num_seqs = fixed[:7]
    return Ready(
        model=v.str_(model, "model", MAX_STR_BYTES),
        max_model_len=v.int_(max_model_len, "max_model_len", 1, INT32_MAX),
        vocab_size=v.int_(vocab_size, "vocab_size", 1, INT32_MAX),
        eos_token_ids=v.ids(eos_ids, "eos_token_ids", MAX_STOP_TOKEN_IDS),
        block_size=v.int_(block_size, "block_size", 1, INT32_MAX),
        num_kv_blocks=v.int_(num_kv_blocks, "num_kv_blocks", 0, INT32_MAX),
        max_num_seqs=v.int_(max_num_seqs, "max_num_seqs", 1, INT32_MAX),
        embedding=None if embedding is None else _decode_embedding_model(embedding, v),
        scheduling_policy=v.enum_(fixed[7], SchedulingPolicy, "scheduling policy"),
        pixel_dtype=fixed[8],
    )


class StepOutputsFrame:
    """A STEP_OUTPUTS frame built one request at a time: the engine's per-step hot path. Its
    ``encode`` gives the bytes ``encode(StepOutputs(...))`` gives for the same outputs, without
    a RequestOutput per request or a second pass over them."""

    __slots__ = (
        "request_ids", "counts", "new_ids", "finish", "logprobs", "prompt", "timings", "pooled",
    )  # fmt: skip

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.counts: list[int] = []
        self.new_ids: list[int] = []
        self.finish: list[list[Any]] = []
        self.logprobs: list[list[Any]] = []
        self.prompt: list[list[Any]] = []  # prompt logprobs
        self.timings: list[list[Any]] = []
        self.pooled: list[list[Any]] = []  # embeddings

    def add(
        self,
        request_id: str,
        new_token_ids: list[int],
        finish_reason: FinishReason | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
        timings: RequestTimings | None = None,
        embedding: list[float] | None = None,
    ) -> None:
        """One request's share of the step (RequestOutput's fields)."""
        i = len(self.request_ids)
        self.add_tokens(request_id, new_token_ids)
        if finish_reason is not None:
            self.finish.append([i, int(finish_reason)])
        if logprobs is not None:
            self.logprobs.append([i, _encode_logprobs(logprobs)])
        if prompt_logprobs is not None:
            self.prompt.append([i, len(prompt_logprobs), _encode_logprobs(prompt_logprobs)])
        if timings is not None:
            t = timings
            self.timings.append(
                [
                    i, float(t.queue_s), float(t.prefill_s), float(t.decode_s),
                    int(t.draft_tokens), int(t.accepted_tokens),
                ]
            )  # fmt: skip
        if embedding is not None:
            self.pooled.append([i, np.asarray(embedding, dtype=_F32).tobytes()])

    def add_tokens(self, request_id: str, new_token_ids: list[int]) -> None:
        """``add`` for an output of tokens only (no finish, logprobs or timings): most
        outputs of most steps, so the engine's hot loop takes this shorter call."""
        self.request_ids.append(request_id)
        self.counts.append(len(new_token_ids))
        self.new_ids += new_token_ids

    def fields(self, finished_without_tokens: dict[str, FinishReason]) -> list[Any]:
        finished = {rid: int(reason) for rid, reason in finished_without_tokens.items()}
        fields = [
            self.request_ids,
            pack_token_ids(self.counts),
            pack_token_ids(self.new_ids),
            self.finish,
            self.logprobs,
            finished,
            self.prompt,
            self.timings,
        ]
        if self.pooled:
            fields.append(self.pooled)
        return fields

    def encode(self) -> bytes:
        """The frame of the requests added (none finished without tokens)."""
        fields = self.fields({})
        return msgpack.packb(
            [int(MsgType.STEP_OUTPUTS), PROTOCOL_VERSION, *fields], use_bin_type=True
        )


def _encode_step_outputs(msg: StepOutputs) -> list[Any]:
    frame = StepOutputsFrame()
    for out in msg.outputs:
        frame.add(
            out.request_id,
            out.new_token_ids,
            out.finish_reason,
            out.logprobs,
            out.prompt_logprobs,
            out.timings,
            out.embedding,
        )
    return frame.fields(msg.finished_without_tokens)


def _decode_step_outputs(fields: list[Any], v: _Validator) -> StepOutputs:
    # The hot path of a client: one call per engine step, up to max_num_seqs requests in it.
    fixed, pooled = _with_trailing(fields, "STEP_OUTPUTS fields", 8, v)
    request_ids, counts, new_ids, finish, logprobs, finished, prompt, timings = fixed
    request_ids = _request_ids(request_ids, v)
    counts = v.i32(counts, "new token counts", MAX_TOKEN_IDS, min_value=0).tolist()
    if len(counts) != len(request_ids):
        raise v.fail(f"{len(counts)} new token counts for {len(request_ids)} request ids")
    new_ids = _new_ids(new_ids, v)
    if len(new_ids) != sum(counts):
        raise v.fail(f"{len(new_ids)} new token ids where the counts add up to {sum(counts)}")
    if len(new_ids) == len(request_ids) and all(n == 1 for n in counts):
        outputs = [RequestOutput(rid, [tid]) for rid, tid in zip(request_ids, new_ids, strict=True)]
    else:
        outputs, start = [], 0
        for rid, n in zip(request_ids, counts, strict=True):
            outputs.append(RequestOutput(rid, new_ids[start : start + n]))
            start += n
    ended_pooled = []
    for i, reason in _indexed(finish, len(outputs), "finish reasons", v):
        outputs[i].finish_reason = ended = _finish_reason(reason, v)
        if ended is FinishReason.POOLED:
            ended_pooled.append(i)
    if ended_pooled or pooled is not None:
        _attach_embeddings(outputs, ended_pooled, pooled, counts, v)
    for i, value in _indexed(logprobs, len(outputs), "logprobs", v):
        outputs[i].logprobs = _decode_logprobs(value, counts[i], v)
    for i, value in _indexed(prompt, len(outputs), "prompt logprobs", v, width=3):
        num = v.int_(value[0], "prompt logprobs count", 0, MAX_TOKEN_IDS)
        outputs[i].prompt_logprobs = _decode_logprobs(value[1], num, v)
    for i, value in _indexed(timings, len(outputs), "timings", v, width=6):
        seconds = (v.float_(x, "a timing", 0.0, math.inf) for x in value[:3])
        drafted = v.int_(value[3], "draft tokens", 0, 2**31 - 1)
        accepted = v.int_(value[4], "accepted tokens", 0, drafted)
        outputs[i].timings = RequestTimings(*seconds, drafted, accepted)
    if type(finished) is not dict:
        raise v.fail("finished_without_tokens must be a map")
    finished = {
        v.rid(rid): v.enum_(reason, FinishReason, "finish reason")
        for rid, reason in finished.items()
    }
    if FinishReason.POOLED in finished.values():
        raise v.fail("a pooled request ends with its vector, not without an output")
    return StepOutputs(outputs, finished)


def _attach_embeddings(
    outputs: list[RequestOutput],
    ended_pooled: list[int],
    column: Any,
    counts: list[int],
    v: _Validator,
) -> None:
    """Give each output that ended POOLED its vector: every such output has one and no
    tokens, and no other output has one."""
    rows = [] if column is None else _indexed(column, len(outputs), "embeddings", v)
    if column is not None and not rows:
        raise v.fail("an empty embeddings column is left out")
    if sorted(i for i, _ in rows) != sorted(ended_pooled):
        raise v.fail("each output that ends POOLED, and no other, carries one embedding")
    for i, vector in rows:
        if counts[i]:
            raise v.fail("a pooled output carries no tokens")
        outputs[i].embedding = v.f32(vector, "an embedding", MAX_EMBEDDING_DIMS)


def _request_ids(value: Any, v: _Validator) -> list[str]:
    ids = v.list_(value, "request ids")
    if not all(type(rid) is str and 0 < len(rid) <= MAX_REQUEST_ID_LEN for rid in ids):
        for rid in ids:
            v.rid(rid)  # raises with the precise reason
    return ids


def _new_ids(value: Any, v: _Validator) -> list[int]:
    if type(value) is not bytes or len(value) % 4:
        raise v.fail("new_token_ids must be int32 bytes")
    # array() then tolist(): cheaper than numpy at the usual size (one id per request).
    packed = array("i")
    packed.frombytes(value)
    if not _NATIVE_LITTLE:
        packed.byteswap()
    ids = packed.tolist()
    if ids and min(ids) < 0:
        raise v.fail("new_token_ids must be >= 0")
    return ids


def _indexed(
    value: Any, size: int, what: str, v: _Validator, width: int = 2
) -> list[tuple[int, Any]]:
    """[[position, value...], ...] with every position a request's in [0, size); returns
    (position, value) pairs, the value being a list when ``width`` > 2."""
    rows = v.list_(value, what)
    for row in rows:
        if type(row) is not list or len(row) != width:
            raise v.fail(f"{what} must be [position, ...] arrays of {width}")
        if type(row[0]) is not int or not 0 <= row[0] < size:
            raise v.fail(f"{what} must name request positions in [0, {size})")
    return [(row[0], row[1] if width == 2 else row[1:]) for row in rows]


def _finish_reason(value: Any, v: _Validator) -> FinishReason:
    reason = _FINISH_REASONS.get(value) if type(value) is int else None
    if reason is None:
        raise v.fail(f"unknown finish reason {value!r}")
    return reason


_FINISH_REASONS = {int(r): r for r in FinishReason}


def _encode_logprobs(entries: list[TokenLogprobs]) -> list[bytes]:
    sampled = np.array([e.logprob for e in entries], dtype=_F64)
    counts = [len(e.top_token_ids) for e in entries]
    top_ids = [tid for e in entries for tid in e.top_token_ids]
    top_lps = np.array([lp for e in entries for lp in e.top_logprobs], dtype=_F64)
    out = [sampled.tobytes(), pack_token_ids(counts), pack_token_ids(top_ids), top_lps.tobytes()]
    ranks = [e.rank for e in entries if e.rank is not None]
    if ranks:  # prompt logprobs: every entry has one
        if len(ranks) != len(entries):
            raise ValueError("prompt logprobs need a rank on every entry or on none")
        out.append(pack_token_ids(ranks))
    return out


def _decode_logprobs(value: Any, num_tokens: int, v: _Validator) -> list[TokenLogprobs]:
    f = v.list_(value, "logprobs")
    if len(f) not in (4, 5):
        raise v.fail(f"logprobs must have 4 or 5 elements, got {len(f)}")
    ranks: list[int | None] = [None] * num_tokens
    if len(f) == 5:
        got = v.i32(f[4], "logprob ranks", num_tokens, min_value=1)
        if len(got) != num_tokens:
            raise v.fail(f"logprob ranks must be {num_tokens} values")
        ranks = got.tolist()
    sampled = v.f64(f[0], "sampled logprobs", num_tokens)
    counts = v.i32(f[1], "top logprob counts", num_tokens, min_value=0)
    if len(counts) != num_tokens or (counts.size and counts.max() > MAX_LOGPROBS):
        raise v.fail(f"top logprob counts must be {num_tokens} values in [0, {MAX_LOGPROBS}]")
    total = int(counts.sum())
    top_ids = v.ids(f[2], "top logprob ids", total)
    if len(top_ids) != total:
        raise v.fail(f"top logprob ids must hold {total} ids")
    top_lps = v.f64(f[3], "top logprobs", total)
    entries, start = [], 0
    for lp, n, rank in zip(sampled, counts.tolist(), ranks, strict=True):
        top = top_lps[start : start + n]
        entries.append(TokenLogprobs(lp, top_ids[start : start + n], top, rank))
        start += n
    return entries


def _encode_request_error(msg: RequestError) -> list[Any]:
    return [msg.request_id, msg.message, int(msg.code)]


def _decode_request_error(fields: list[Any], v: _Validator) -> RequestError:
    v.list_(fields, "REQUEST_ERROR fields", 3)
    return RequestError(
        v.rid(fields[0]),
        v.str_(fields[1], "message", MAX_STR_BYTES),
        v.int_(fields[2], "code", 0, 999),
    )


# Stats travels as its gauges (every int field, in their order), then its counts; EngineCounts
# as its totals (every int field, in their order), then its step-token buckets.
_STATS_GAUGES = tuple(f.name for f in dataclasses.fields(Stats) if f.name != "counts")
_COUNT_TOTALS = tuple(f.name for f in dataclasses.fields(EngineCounts) if f.name != "step_tokens")
_gauges_of = operator.attrgetter(*_STATS_GAUGES)
_totals_of = operator.attrgetter(*_COUNT_TOTALS)


def _encode_control_reply(msg: ControlReply) -> list[Any]:
    stats = None
    if msg.stats is not None:
        stats = [*(int(x) for x in _gauges_of(msg.stats)), _encode_counts(msg.stats.counts)]
    return [int(msg.kind), int(msg.token), stats, bool(msg.ok), msg.message]


def _encode_counts(c: EngineCounts) -> list[Any]:
    return [*(int(x) for x in _totals_of(c)), [int(n) for n in c.step_tokens]]


def _decode_control_reply(fields: list[Any], v: _Validator) -> ControlReply:
    kind, token, stats, ok, message = v.list_(fields, "CONTROL_REPLY fields", 5)
    return ControlReply(
        kind=v.enum_(kind, ControlKind, "control kind"),
        token=_token(token, v),
        stats=None if stats is None else _decode_stats(stats, v),
        ok=v.bool_(ok, "ok"),
        message=v.str_(message, "message", MAX_STR_BYTES),
    )


def _decode_stats(value: Any, v: _Validator) -> Stats:
    *gauges, counts = v.list_(value, "stats", len(_STATS_GAUGES) + 1)
    gauges = [v.int_(x, "stats field", 0, UINT64_MAX) for x in gauges]
    return Stats(**dict(zip(_STATS_GAUGES, gauges, strict=True)), counts=_decode_counts(counts, v))


def _decode_counts(value: Any, v: _Validator) -> EngineCounts:
    *totals, buckets = v.list_(value, "engine counts", len(_COUNT_TOTALS) + 1)
    totals = [v.int_(x, "an engine count", 0, UINT64_MAX) for x in totals]
    buckets = v.list_(buckets, "step token counts", len(STEP_TOKEN_BUCKETS) + 1)
    steps = tuple(v.int_(n, "a step token count", 0, UINT64_MAX) for n in buckets)
    return EngineCounts(**dict(zip(_COUNT_TOTALS, totals, strict=True)), step_tokens=steps)


def _encode_heartbeat(msg: Heartbeat) -> list[Any]:
    if msg.busy_for_s:
        return [int(msg.num_steps), float(msg.busy_for_s)]
    return [int(msg.num_steps)]


def _decode_heartbeat(fields: list[Any], v: _Validator) -> Heartbeat:
    v.list_(fields, "HEARTBEAT fields")
    if len(fields) not in (1, 2):
        raise v.fail(f"HEARTBEAT fields must have 1 or 2 elements, got {len(fields)}", "fields")
    num_steps = v.int_(fields[0], "num_steps", 0, UINT64_MAX)
    if len(fields) == 1:
        return Heartbeat(num_steps)
    return Heartbeat(num_steps, v.float_(fields[1], "busy_for_s", 0.0, MAX_BUSY_S, lo_open=True))


# ---- dispatch tables --------------------------------------------------------------------------

_ENCODERS: dict[type, tuple[MsgType, Callable[[Any], list[Any]]]] = {
    Hello: (MsgType.HELLO, _encode_hello),
    AddRequest: (MsgType.ADD_REQUEST, _encode_add_request),
    Abort: (MsgType.ABORT, _encode_abort),
    Control: (MsgType.CONTROL, _encode_control),
    Ready: (MsgType.READY, _encode_ready),
    StepOutputs: (MsgType.STEP_OUTPUTS, _encode_step_outputs),
    RequestError: (MsgType.REQUEST_ERROR, _encode_request_error),
    ControlReply: (MsgType.CONTROL_REPLY, _encode_control_reply),
    Heartbeat: (MsgType.HEARTBEAT, _encode_heartbeat),
}

_CLIENT_DECODERS: dict[int, _Decoder] = {
    MsgType.HELLO: _decode_hello,
    MsgType.ADD_REQUEST: _decode_add_request,
    MsgType.ABORT: _decode_abort,
    MsgType.CONTROL: _decode_control,
}

_ENGINE_DECODERS: dict[int, _Decoder] = {
    MsgType.READY: _decode_ready,
    MsgType.STEP_OUTPUTS: _decode_step_outputs,
    MsgType.REQUEST_ERROR: _decode_request_error,
    MsgType.CONTROL_REPLY: _decode_control_reply,
    MsgType.HEARTBEAT: _decode_heartbeat,
}

# Messages whose first field is a request id worth reporting errors against.
_REQUEST_ID_FIRST = frozenset({MsgType.ADD_REQUEST, MsgType.REQUEST_ERROR})
