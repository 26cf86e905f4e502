"""Wire codec and addresses: round trips, the frame layout, and rejection of malformed frames."""

from __future__ import annotations

import dataclasses
import math
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import codec
from protocol.address import EngineAddress, check_identity, is_loopback, new_identity
from protocol.codec import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_ID_LEN,
    MAX_TOKEN_IDS,
    ParamsLayout,
    ProtocolError,
    StepOutputsFrame,
    decode_client_message,
    decode_engine_message,
    encode,
    validate_sampling_params,
)
from protocol.messages import (
    PROTOCOL_VERSION,
    STEP_TOKEN_BUCKETS,
    Abort,
    AddRequest,
    Constraint,
    ConstraintKind,
    Control,
    ControlKind,
    ControlReply,
    EmbeddingModel,
    EngineCounts,
    FinishReason,
    Heartbeat,
    Hello,
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
    TokenLogprobs,
)

CLIENT_TYPES = (Hello, AddRequest, Abort, Control)
INT32_MAX = 2**31 - 1
STEPS = tuple(range(len(STEP_TOKEN_BUCKETS) + 1))  # one count per step-token bucket

EXAMPLES = [
    Hello(),
    Hello("frontend-1"),
    AddRequest("r", [0]),
    AddRequest("é日🙂" * 64, [1, 2, INT32_MAX, 0], SamplingParams()),
    AddRequest(
        "all-params",
        list(range(300)),
        SamplingParams(
            max_tokens=INT32_MAX,
            min_tokens=5,
            temperature=0.0,
            top_p=0.5,
            top_k=40,
            min_p=1.0,
            seed=2**64 - 1,
            presence_penalty=-2.0,
            frequency_penalty=2.0,
            repetition_penalty=1e-6,
            stop_token_ids=(2, 13, INT32_MAX),
            ignore_eos=True,
            logprobs=20,
            logit_bias=((0, -100.0), (INT32_MAX, 100.0), (7, 0.5)),
            constraint=Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'),
            prompt_logprobs=20,
        ),
    ),
    AddRequest("json", [1], SamplingParams(constraint=Constraint(ConstraintKind.JSON_OBJECT))),
    AddRequest("resumed", [5, 6, 7, 8], SamplingParams(max_tokens=9), num_output_tokens=3),
    AddRequest("held", [5, 6], SamplingParams(max_tokens=9), output_interval=16),
    AddRequest("held-long", [5], output_interval=INT32_MAX),
    AddRequest(
        "choice", [1], SamplingParams(constraint=Constraint(ConstraintKind.CHOICE, '["a"]'))
    ),
    Abort([]),
    Abort(["a", "b" * MAX_REQUEST_ID_LEN]),
    Control(ControlKind.STATS),
    Control(ControlKind.SHUTDOWN, 2**64 - 1),
    AddRequest("embed", [1, 2, 3], pooling=PoolingParams()),
    AddRequest("embed-mean", [1], pooling=PoolingParams(PoolingKind.MEAN, False, 65536)),
    AddRequest("lora", [1, 2], lora=LoraRef("sql", "/adapters/sql")),
    AddRequest("lora-resumed", [5, 6], SamplingParams(max_tokens=9), 1, 4, lora=LoraRef("a", "b")),
    AddRequest("lora-pooled", [1], pooling=PoolingParams(), lora=LoraRef("a", "b")),
    Ready("default", 2048, 49152, [2], 16, 1000, 256),
    Ready("/models/x", 1, 1, [], 1, 0, 1),
    Ready("e", 8, 9, [], 16, 4, 2, EmbeddingModel(PoolingKind.MEAN, True, 1, True, (1,))),
    Ready("e", 8, 9, [2], 16, 4, 2, EmbeddingModel(PoolingKind.LAST, False, 65536, True)),
    StepOutputs([]),
    StepOutputs([RequestOutput("a", [5])]),
    StepOutputs(
        [
            RequestOutput("a", [5, 6], FinishReason.STOP),
            RequestOutput("b", [], FinishReason.LENGTH),
            RequestOutput(
                "c",
                [7, 8],
                None,
                [TokenLogprobs(-0.25, [7, 9], [-0.25, -1.5]), TokenLogprobs(-math.inf, [], [])],
            ),
        ],
        {"d": FinishReason.ABORT, "e": FinishReason.ERROR},
    ),
    StepOutputs(
        [
            RequestOutput("p", [3], None, None, [TokenLogprobs(-1.5, [4, 3], [-0.5, -1.5])]),
            RequestOutput("q", [], FinishReason.DEAD_END, None, []),  # a one-token prompt
            # Prompt logprobs with each prompt token's rank in the vocabulary.
            RequestOutput(
                "r",
                [3],
                None,
                None,
                [TokenLogprobs(-1.5, [4, 3], [-0.5, -1.5], 2), TokenLogprobs(-9.0, [], [], 700)],
            ),  # fmt: skip
        ]
    ),
    StepOutputs(
        [
            RequestOutput(
                "v", [], FinishReason.POOLED, embedding=[0.5, -(2.0**127), 2.0**-149, 0.0]
            ),
            RequestOutput("w", [7]),
            RequestOutput("x", [], FinishReason.POOLED, embedding=[1.0] * 4096),
        ]
    ),
    StepOutputs(
        [
            RequestOutput("s", [4]),
            RequestOutput("t", [5], FinishReason.LENGTH, timings=RequestTimings(0.0, 0.25, 1.5)),
        ]
    ),
    RequestError("r", "prompt too long", 400),
    RequestError("r", "", 500),
    ControlReply(ControlKind.STATS, 3, Stats(1, 2, 3, 4, 10, 2**40)),
    ControlReply(
        ControlKind.STATS,
        4,
        Stats(1, 2, 3, 4, 10, 7, EngineCounts(2**62 - 1, 300, 128, 2, STEPS, 2**40)),
    ),
    ControlReply(ControlKind.CHECK_INTEGRITY, 0, None, False, "block 7 leaked"),
    Heartbeat(0),
    Heartbeat(123456789),
    Heartbeat(7, 12.25),
]


def decoder_for(msg: Any) -> Callable[[bytes], Any]:
    return decode_client_message if isinstance(msg, CLIENT_TYPES) else decode_engine_message


def unpack(frame: bytes) -> list[Any]:
    return msgpack.unpackb(frame, raw=False)


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_example_round_trips(msg: Any) -> None:
    frame = encode(msg)
    assert unpack(frame)[:2] == [int(_TAGS[type(msg)]), PROTOCOL_VERSION]
    assert decoder_for(msg)(frame) == msg


def test_random_messages_round_trip() -> None:
    rng = random.Random(1234)
    for _ in range(600):
        msg = random_message(rng)
        assert decoder_for(msg)(encode(msg)) == msg, msg


@pytest.mark.parametrize(
    "msg",
    [m for m in EXAMPLES if isinstance(m, StepOutputs) and not m.finished_without_tokens],
)
def test_a_frame_built_request_by_request_is_the_step_outputs_frame(msg: StepOutputs) -> None:
    """The engine's hot path (StepOutputsFrame, whose ``add`` takes RequestOutput's fields by
    name) writes a frame that the decoder reads back as the outputs added."""
    frame = StepOutputsFrame()
    for out in msg.outputs:
        frame.add(**{f.name: getattr(out, f.name) for f in dataclasses.fields(out)})
    assert decode_engine_message(frame.encode()) == msg


def test_decoded_enums_are_enum_members() -> None:
    step = decode_engine_message(encode(StepOutputs([RequestOutput("a", [1], FinishReason.STOP)])))
    assert step.outputs[0].finish_reason is FinishReason.STOP
    assert decode_client_message(encode(Control(ControlKind.SHUTDOWN))).kind is ControlKind.SHUTDOWN


def test_integral_floats_from_other_encoders_are_accepted() -> None:
    obj = unpack(encode(AddRequest("r", [1])))
    obj[4][2] = 1  # temperature packed as an int by some other encoder
    msg = decode_client_message(msgpack.packb(obj))
    assert msg.params.temperature == 1.0 and type(msg.params.temperature) is float


# ---- frame layout -------------------------------------------------------------------------------


def test_token_ids_travel_as_int32_bytes() -> None:
    ids = [1, INT32_MAX, 0, 49151]
    obj = unpack(encode(AddRequest("r", ids, SamplingParams(stop_token_ids=(7, 8)))))
    assert obj[2] == "r"
    assert obj[3] == struct.pack("<4i", *ids)
    assert obj[4][10] == struct.pack("<2i", 7, 8)
    step = unpack(
        encode(
            StepOutputs([RequestOutput("a", [3, 4], FinishReason.LENGTH), RequestOutput("b", [5])])
        )
    )
    # Columns: ids, counts, every new token, [[position, finish reason]], [[position, logprobs]].
    assert step[2:7] == [
        ["a", "b"],
        struct.pack("<2i", 2, 1),
        struct.pack("<3i", 3, 4, 5),
        [[0, int(FinishReason.LENGTH)]],
        [],
    ]
    ready = unpack(encode(Ready("m", 8, 9, [2, 3], 16, 4, 2)))
    assert ready[5] == struct.pack("<2i", 2, 3)


def test_token_ids_are_compact() -> None:
    # As msgpack ints, ids >= 2**16 take 5 bytes each; as int32 bytes they take 4.
    frame = encode(AddRequest("r", [2**30] * 1000))
    assert len(frame) < 4 * 1000 + 100


def test_numpy_and_list_ids_encode_alike() -> None:
    ids = [5, 0, INT32_MAX]
    as_list = encode(AddRequest("r", ids))
    assert encode(AddRequest("r", np.array(ids, dtype=np.int64))) == as_list  # type: ignore[arg-type]
    assert encode(AddRequest("r", tuple(ids))) == as_list  # type: ignore[arg-type]


# ---- the encoder refuses what the decoder would refuse -------------------------------------------


@pytest.mark.parametrize(
    ("ids", "params"),
    [
        ([], SamplingParams()),
        ([1, -1], SamplingParams()),
        ([2**31], SamplingParams()),
        ([1.5], SamplingParams()),
        ([1], SamplingParams(max_tokens=0)),
        ([1], SamplingParams(temperature=math.nan)),
        ([1], SamplingParams(stop_token_ids=(-3,))),
    ],
)
def test_encoder_rejects_invalid_add_request(ids: list[Any], params: SamplingParams) -> None:
    with pytest.raises(ProtocolError) as info:
        encode(AddRequest("mine", ids, params))
    assert info.value.request_id == "mine"


def test_encoder_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode(SamplingParams())  # type: ignore[arg-type]


# ---- malformed frames ---------------------------------------------------------------------------


def i32(*ids: int) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def f64(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def add_frame(**replace: Any) -> bytes:
    """A valid ADD_REQUEST frame for id "r", with the elements at some indexes replaced."""
    obj = unpack(encode(AddRequest("r", [1, 2])))
    for index, value in replace.items():
        obj[int(index.lstrip("_"))] = value
    return msgpack.packb(obj)


def with_param(index: int, value: Any) -> bytes:
    return with_param_of(add_frame(), index, value)


def with_param_of(frame: bytes, index: int, value: Any) -> bytes:
    """An ADD_REQUEST frame with its sampling param at ``index`` replaced."""
    obj = unpack(frame)
    obj[4][index] = value
    return msgpack.packb(obj)


BAD_PARAMS = [
    (0, 0),  # max_tokens >= 1
    (0, True),  # a bool is not an int
    (0, 2**31),
    (0, 16.0),
    (1, -1),  # min_tokens
    (1, 17),  # above max_tokens (16)
    (2, -0.1),  # temperature
    (2, math.nan),
    (2, math.inf),
    (2, "1.0"),
    (3, 0.0),  # top_p in (0, 1]
    (3, 1.01),
    (3, -math.inf),
    (4, -1),  # top_k
    (4, 1.5),
    (5, -0.01),  # min_p
    (5, 1.5),
    (6, -1),  # seed
    (6, 1.0),
    (6, "7"),
    (7, 2.5),  # presence_penalty
    (7, -2.01),
    (8, 3.0),  # frequency_penalty
    (9, 0.0),  # repetition_penalty > 0
    (9, -1.0),
    (10, b"\x01\x00\x00"),  # stop ids: not a multiple of 4 bytes
    (10, struct.pack("<i", -1)),
    (10, [1, 2]),  # a list, not int32 bytes
    (10, b"\x00" * 4 * 1025),  # more than 1024 stop ids
    (11, 1),  # ignore_eos must be a bool
    (11, None),
    (12, 21),  # logprobs
    (12, -1),
    (12, True),
    (13, [i32(1), f64(100.5)]),  # a logit bias beyond [-100, 100]
    (13, [i32(1), f64(math.nan)]),
    (13, [i32(1, 1), f64(1.0, 2.0)]),  # one token twice
    (13, [i32(1, 2), f64(1.0)]),  # fewer biases than ids
    (13, [i32(-3), f64(1.0)]),
    (13, None),
    (14, [9, "x"]),  # an unknown constraint kind
    (14, [int(ConstraintKind.REGEX), ""]),  # a regex constraint without its regex
    (14, [int(ConstraintKind.REGEX), b"a+"]),  # bytes, not str
    (14, [int(ConstraintKind.REGEX)]),
    (14, "a+"),
    (15, 21),  # prompt_logprobs
    (15, -1),
]


@pytest.mark.parametrize(("index", "value"), BAD_PARAMS)
def test_bad_sampling_param_is_an_error_for_that_request(index: int, value: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(with_param(index, value))
    assert info.value.request_id == "r"


# ---- the params array is laid out from SamplingParams' fields ------------------------------------


def test_each_params_position_is_the_field_at_that_position() -> None:
    params = SamplingParams(max_tokens=7, top_k=3, seed=5, ignore_eos=True, prompt_logprobs=2)
    wire = unpack(encode(AddRequest("r", [1], params)))[4]
    scalars = {
        i: getattr(params, f.name)
        for i, f in enumerate(dataclasses.fields(SamplingParams))
        if f.name not in ("stop_token_ids", "logit_bias", "constraint")
    }
    assert len(wire) == len(dataclasses.fields(SamplingParams))
    assert {i: wire[i] for i in scalars} == scalars


Knobbed = dataclasses.make_dataclass(
    "Knobbed",
    [("knob", float | None, None), ("flag", bool, False)],
    bases=(SamplingParams,),
    frozen=True,
)


@pytest.mark.parametrize("knob", [None, 2, 0.5])
def test_a_new_params_field_travels_with_no_change_to_the_codec(
    monkeypatch: pytest.MonkeyPatch, knob: float | None
) -> None:
    """Fields added to SamplingParams (here by a subclass) get the next positions of the
    params array, a float field packed as a float; both ends read them back."""
    monkeypatch.setattr(codec, "_SAMPLING_PARAMS", ParamsLayout(Knobbed))
    msg = AddRequest("r", [1], Knobbed(max_tokens=3, knob=knob, flag=True))
    for _ in range(2):  # the second time through the caches of plain params
        frame = encode(msg)
        assert unpack(frame)[4][-2:] == [knob if knob is None else float(knob), True]
        decoded = decode_client_message(frame)
        assert isinstance(decoded, AddRequest) and decoded == msg
        assert type(decoded.params) is Knobbed
        assert type(decoded.params.knob) is type(unpack(frame)[4][-2])


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_params_field_is_validated(name: str) -> None:
    """A new SamplingParams field needs its check in validate_sampling_params (at least of its
    type): the codec sends what passes it as it is."""
    bad = dataclasses.replace(SamplingParams(), **{name: object()})
    with pytest.raises(ProtocolError, match=name):
        validate_sampling_params(bad)


# ---- repeated sampling params (the codec's cache of validated plain params) ---------------------


def decoded_params(frame: bytes) -> SamplingParams:
    msg = decode_client_message(frame)
    assert isinstance(msg, AddRequest)
    return msg.params


def test_repeated_plain_params_decode_once_to_a_shared_object() -> None:
    params = SamplingParams(max_tokens=77, temperature=0.25, top_k=5, seed=9, logprobs=2)
    first = decoded_params(encode(AddRequest("a", [1, 2], params)))
    second = decoded_params(encode(AddRequest("b", [3], params)))
    assert first == params
    assert second is first  # the second request's params came from the cache


def test_params_with_stop_ids_or_logit_bias_are_decoded_each_time() -> None:
    for params in [
        SamplingParams(max_tokens=78, stop_token_ids=(5, 6)),
        SamplingParams(max_tokens=78, logit_bias=((3, -1.5),)),
        SamplingParams(max_tokens=78, constraint=Constraint(ConstraintKind.REGEX, "a+")),
    ]:
        first = decoded_params(encode(AddRequest("a", [1], params)))
        second = decoded_params(encode(AddRequest("b", [1], params)))
        assert first == second == params
        assert second is not first


@pytest.mark.parametrize(
    ("index", "lookalike"),
    [(0, True), (0, 1.0), (1, False), (2, True), (6, 4.0), (11, 0), (12, False), (15, 1.0)],
)
def test_a_cached_params_value_admits_no_lookalike(index: int, lookalike: Any) -> None:
    """A value equal to a cached valid one but of another type (True == 1 == 1.0 in Python)
    is still refused: the cache keys hold each field's type."""
    valid = SamplingParams(max_tokens=1, temperature=1.0, seed=4, logprobs=0, prompt_logprobs=1)
    frame = encode(AddRequest("r", [1], valid))
    assert decoded_params(frame) == decoded_params(frame) == valid  # now cached
    params = unpack(frame)[4]
    assert params[index] == lookalike and type(params[index]) is not type(lookalike)
    with pytest.raises(ProtocolError) as info:
        decode_client_message(with_param_of(frame, index, lookalike))
    assert info.value.request_id == "r"


@pytest.mark.parametrize(
    "lookalike",
    [
        SamplingParams(max_tokens=True, seed=2),  # type: ignore[arg-type]
        SamplingParams(max_tokens=1, ignore_eos=0, seed=2),  # type: ignore[arg-type]
        SamplingParams(max_tokens=1, seed=2.0),  # type: ignore[arg-type]
    ],
)
def test_the_encoder_refuses_lookalikes_of_cached_params(lookalike: SamplingParams) -> None:
    valid = SamplingParams(max_tokens=1, ignore_eos=False, seed=2)
    encode(AddRequest("r", [1], valid))
    encode(AddRequest("r", [1], valid))  # its wire form is cached
    assert lookalike == valid  # equal as Python compares them, field by field
    with pytest.raises(ProtocolError):
        encode(AddRequest("r", [1], lookalike))


def test_invalid_params_are_refused_every_time() -> None:
    for _ in range(3):
        with pytest.raises(ProtocolError):
            encode(AddRequest("r", [1], SamplingParams(max_tokens=0)))
        with pytest.raises(ProtocolError):
            decode_client_message(with_param(0, 0))


def test_many_distinct_params_all_decode_right() -> None:
    """More distinct params than the cache holds: each decodes to itself (the cache empties
    itself when full rather than growing)."""
    for n in range(1, 200):
        params = SamplingParams(max_tokens=n, temperature=n / 200)
        assert decoded_params(encode(AddRequest("r", [1], params))) == params
        assert decoded_params(encode(AddRequest("r", [2], params))) == params


def test_bad_request_fields_carry_the_request_id() -> None:
    params = unpack(encode(AddRequest("r", [1])))[4]
    for frame in [
        add_frame(_3=[1, 2, 3]),  # ids as a list of ints
        add_frame(_3=b"\x01\x00\x00\x00\x02"),  # 5 bytes
        add_frame(_3=b""),  # empty prompt
        add_frame(_3=struct.pack("<2i", 5, -7)),
        add_frame(_4=params[:12]),  # 12 params
        add_frame(_4=[*params, 0]),
        add_frame(_4=None),
        msgpack.packb([int(MsgType.ADD_REQUEST), PROTOCOL_VERSION, "r", b"\x01\x00\x00\x00"]),
        msgpack.packb([int(MsgType.ADD_REQUEST), PROTOCOL_VERSION, "r", b"", params, 0, 1]),
    ]:
        with pytest.raises(ProtocolError) as info:
            decode_client_message(frame)
        assert info.value.request_id == "r", unpack(frame)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"


BAD_RESUMES = [
    add_frame(_5=-1),  # num_output_tokens
    add_frame(_5=2),  # the whole prompt (of 2 ids) would be output
    add_frame(_5=True),
    add_frame(_3=struct.pack("<20i", *range(20)), _5=16),  # max_tokens (16) already reached
    msgpack.packb(unpack(encode(AddRequest("r", [1, 2])))[:5]),  # no num_output_tokens
]


@pytest.mark.parametrize("frame", BAD_RESUMES)
def test_bad_resume_is_an_error_for_that_request(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(frame)
    assert info.value.request_id == "r"


BAD_OUTPUT_INTERVALS = [
    add_frame(_6=0),
    add_frame(_6=-16),
    add_frame(_6=True),
    add_frame(_6=16.0),
    add_frame(_6=INT32_MAX + 1),
    msgpack.packb(unpack(encode(AddRequest("r", [1, 2])))[:6]),  # no output_interval
    msgpack.packb([*unpack(encode(AddRequest("r", [1, 2]))), 1]),  # a field too many
]


@pytest.mark.parametrize("frame", BAD_OUTPUT_INTERVALS)
def test_bad_output_interval_is_an_error_for_that_request(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(frame)
    assert info.value.request_id == "r"


@pytest.mark.parametrize("interval", [0, -1, True])
def test_encoder_rejects_a_bad_output_interval(interval: Any) -> None:
    with pytest.raises(ProtocolError, match="output_interval") as info:
        encode(AddRequest("mine", [1], output_interval=interval))
    assert info.value.request_id == "mine"


BAD_CLIENT_FRAMES = [
    b"",
    b"\xc1",  # a byte msgpack never uses
    b"\x93\x01",  # truncated array
    encode(Hello())[:-1],
    encode(Hello()) + b"\x00",  # trailing bytes
    msgpack.packb(5),
    msgpack.packb({"type": 2}),
    msgpack.packb([]),
    msgpack.packb([int(MsgType.HELLO)]),
    msgpack.packb([99, PROTOCOL_VERSION]),
    msgpack.packb([True, PROTOCOL_VERSION, ""]),  # True == 1 == HELLO, but is not an int
    msgpack.packb(["1", PROTOCOL_VERSION, ""]),
    msgpack.packb([int(MsgType.READY), PROTOCOL_VERSION, "m", 1, 1, b"", 1, 1, 1]),  # wrong way
    msgpack.packb([int(MsgType.HELLO), PROTOCOL_VERSION + 1, ""]),
    msgpack.packb([int(MsgType.HELLO), 1.0, ""]),
    msgpack.packb([int(MsgType.HELLO), PROTOCOL_VERSION]),
    msgpack.packb([int(MsgType.HELLO), PROTOCOL_VERSION, b"bytes"]),
    msgpack.packb([int(MsgType.HELLO), PROTOCOL_VERSION, "x" * 257]),
    add_frame(_2=""),  # empty request id
    add_frame(_2="x" * (MAX_REQUEST_ID_LEN + 1)),
    add_frame(_2=b"r"),
    add_frame(_2=7),
    add_frame(_1=PROTOCOL_VERSION + 1),
    msgpack.packb([int(MsgType.ABORT), PROTOCOL_VERSION, "not-a-list"]),
    msgpack.packb([int(MsgType.ABORT), PROTOCOL_VERSION, ["ok", 5]]),
    msgpack.packb([int(MsgType.ABORT), PROTOCOL_VERSION, [""]]),
    msgpack.packb([int(MsgType.CONTROL), PROTOCOL_VERSION, 99, 0]),
    msgpack.packb([int(MsgType.CONTROL), PROTOCOL_VERSION, 1, -1]),
    msgpack.packb([int(MsgType.CONTROL), PROTOCOL_VERSION, 1, True]),
    msgpack.packb([int(MsgType.CONTROL), PROTOCOL_VERSION, 1]),
    msgpack.packb([int(MsgType.HELLO), PROTOCOL_VERSION, msgpack.ExtType(1, b"x")]),
    msgpack.packb([int(MsgType.HELLO), PROTOCOL_VERSION, msgpack.Timestamp(1)]),
    b"\x93\x01\x01\xa2\xff\xfe",  # HELLO whose name is invalid UTF-8
    nested(5000),
    b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 billion elements
    b"\x95\x02\x01\xa1r\xc6\x7f\xff\xff\xff",  # a bin header claiming 2 GiB
    b"\x92\x02" + b"\xc6\x7f\xff\xff\xff" + b"\x00" * 64,
]


@pytest.mark.parametrize("frame", BAD_CLIENT_FRAMES)
def test_malformed_client_frame_is_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(frame)
    assert info.value.request_id is None


def step_frame(
    request_ids: Any = None,
    counts: Any = None,
    new_ids: Any = None,
    finish: Any = None,
    logprobs: Any = None,
    finished: Any = None,
    prompt_logprobs: Any = None,
    timings: Any = None,
) -> bytes:
    """A STEP_OUTPUTS frame from its columns; by default one request "a" with token 1."""
    tag = int(MsgType.STEP_OUTPUTS)
    fields = [
        ["a"] if request_ids is None else request_ids,
        i32(1) if counts is None else counts,
        i32(1) if new_ids is None else new_ids,
        [] if finish is None else finish,
        [] if logprobs is None else logprobs,
        {} if finished is None else finished,
        [] if prompt_logprobs is None else prompt_logprobs,
        [] if timings is None else timings,
    ]
    return msgpack.packb([tag, PROTOCOL_VERSION, *fields])


def stats_frame(stats: Any) -> bytes:
    return msgpack.packb([int(MsgType.CONTROL_REPLY), PROTOCOL_VERSION, 1, 0, stats, True, ""])


# ---- embeddings: the trailing pooling fields --------------------------------------------------


def pooled_add_frame(pooling: Any = None, **replace: Any) -> bytes:
    """A valid pooling ADD_REQUEST frame for id "r", its pooling (and other elements) replaced."""
    obj = unpack(encode(AddRequest("r", [1, 2], pooling=PoolingParams())))
    if pooling is not None:
        obj[7] = pooling
    for index, value in replace.items():
        obj[int(index.lstrip("_"))] = value
    return msgpack.packb(obj)


LAST, MEAN = int(PoolingKind.LAST), int(PoolingKind.MEAN)
BAD_POOLING_REQUESTS = [
    msgpack.packb([*unpack(encode(AddRequest("r", [1, 2]))), None]),  # a trailing nil
    pooled_add_frame([9, True, None]),  # an unknown kind
    pooled_add_frame([0, True, None]),
    pooled_add_frame([True, True, None]),
    pooled_add_frame([LAST, 1, None]),  # normalize must be a bool
    pooled_add_frame([LAST, True, 0]),  # dimensions in [1, 65536]
    pooled_add_frame([LAST, True, 65537]),
    pooled_add_frame([MEAN, True, 8.0]),
    pooled_add_frame([MEAN, True, True]),
    pooled_add_frame([LAST, True]),  # not 3 wide
    pooled_add_frame([LAST, True, None, 1]),
    pooled_add_frame("last"),
    pooled_add_frame({"kind": LAST}),
    pooled_add_frame(_4=unpack(encode(AddRequest("r", [1], SamplingParams(max_tokens=9))))[4]),
    pooled_add_frame(_5=1),  # a resumed embedding request: it has no output
    pooled_add_frame(_6=4),  # an output interval: it has no tokens to hold
    msgpack.packb([*unpack(encode(AddRequest("r", [1], pooling=PoolingParams()))), 1]),
]


@pytest.mark.parametrize("frame", BAD_POOLING_REQUESTS)
def test_malformed_pooling_is_an_error_for_that_request(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(frame)
    assert info.value.request_id == "r"


@pytest.mark.parametrize(
    "msg",
    [
        AddRequest("mine", [1], pooling=PoolingParams(3)),  # type: ignore[arg-type]
        AddRequest("mine", [1], pooling=PoolingParams(normalize=1)),  # type: ignore[arg-type]
        AddRequest("mine", [1], pooling=PoolingParams(dimensions=0)),
        AddRequest("mine", [1], pooling=PoolingParams(dimensions=True)),
        AddRequest("mine", [1], pooling="last"),  # type: ignore[arg-type]
        AddRequest("mine", [1], SamplingParams(temperature=0.0), pooling=PoolingParams()),
        AddRequest("mine", [1], output_interval=2, pooling=PoolingParams()),
    ],
)
def test_encoder_rejects_a_bad_pooling_request(msg: AddRequest) -> None:
    with pytest.raises(ProtocolError) as info:
        encode(msg)
    assert info.value.request_id == "mine"


def test_pooling_travels_as_a_trailing_field_of_its_own() -> None:
    """A generation's frame has no pooling field at all; an embedding request's has one more."""
    plain = unpack(encode(AddRequest("r", [1])))
    pooled = unpack(encode(AddRequest("r", [1], pooling=PoolingParams(PoolingKind.MEAN, False, 8))))
    assert len(pooled) == len(plain) + 1 == 8
    assert pooled[:7] == plain and pooled[7] == [MEAN, False, 8]
    step = unpack(
        encode(StepOutputs([RequestOutput("a", [], FinishReason.POOLED, embedding=[1.5])]))
    )
    assert len(step) == 11 and step[10] == [[0, struct.pack("<f", 1.5)]]


# ---- LoRA: a trailing field after the pooling ------------------------------------------------


def lora_add_frame(lora: Any) -> bytes:
    """A valid LoRA ADD_REQUEST frame for id "r", its adapter replaced by ``lora``."""
    obj = unpack(encode(AddRequest("r", [1, 2], lora=LoraRef("a", "/p"))))
    obj[8] = lora
    return msgpack.packb(obj)


@pytest.mark.parametrize(
    "frame",
    [
        lora_add_frame(None),
        lora_add_frame(["a"]),
        lora_add_frame(["a", "/p", "x"]),
        lora_add_frame(["", "/p"]),
        lora_add_frame(["a", ""]),
        lora_add_frame(["a", 5]),
        lora_add_frame(["a", "/p\0"]),
        lora_add_frame(["a" * 5000, "/p"]),
        lora_add_frame({"name": "a"}),
    ],
)
def test_malformed_lora_is_an_error_for_that_request(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(frame)
    assert info.value.request_id == "r"


def test_what_the_wire_refuses_in_a_lora_is_named_before_sending() -> None:
    """lora_text_problem, which the API process asks where a name or path is given, refuses
    what encoding an AddRequest would fail on: a NUL, over the length, not UTF-8 (a path read
    as bytes that are not, surrogate-escaped)."""
    from protocol.codec import lora_text_problem

    assert lora_text_problem("/adapters/sql", "path") is None
    for text, words in (("", "non-empty"), ("a\0b", "NUL"), ("a" * 4097, "longer than 4096"),
                        ("caf\udce9", "not valid UTF-8")):  # fmt: skip
        problem = lora_text_problem(text, "path")
        assert problem is not None and words in problem, (text[:10], problem)
        with pytest.raises((ProtocolError, UnicodeEncodeError)):
            encode(AddRequest("r", [1], lora=LoraRef("a", text)))


def test_lora_travels_after_a_nil_pooling() -> None:
    """A generation's frame has no LoRA field; a LoRA request's has the pooling as nil, then it."""
    plain = unpack(encode(AddRequest("r", [1])))
    lora = unpack(encode(AddRequest("r", [1], lora=LoraRef("sql", "/a/sql"))))
    assert len(lora) == len(plain) + 2 == 9
    assert lora[:7] == plain and lora[7] is None and lora[8] == ["sql", "/a/sql"]
    with pytest.raises(ProtocolError):
        encode(AddRequest("r", [1], lora=LoraRef("", "/a")))


# ---- priority: the last trailing field of ADD_REQUEST -----------------------------------------


def priority_add_frame(priority: Any) -> bytes:
    """A valid ADD_REQUEST frame for id "r" with a priority, its priority replaced."""
    obj = unpack(encode(AddRequest("r", [1, 2], priority=5)))
    obj[10] = priority
    return msgpack.packb(obj)


@pytest.mark.parametrize(
    "frame",
    [
        priority_add_frame(None),  # a trailing nil
        priority_add_frame(0),  # the default travels as no field at all
        priority_add_frame(True),
        priority_add_frame(1.0),
        priority_add_frame("1"),
        priority_add_frame([1]),
        priority_add_frame(2**63),  # past int64 (msgpack packs it as uint64)
        msgpack.packb([*unpack(encode(AddRequest("r", [1], priority=1))), 2]),  # a 10th field
    ],
)
def test_malformed_priority_is_an_error_for_that_request(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(frame)
    assert info.value.request_id == "r"


@pytest.mark.parametrize("priority", [True, 1.5, 2**63, -(2**63) - 1])
def test_encoder_rejects_a_bad_priority(priority: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        encode(AddRequest("mine", [1], priority=priority))
    assert info.value.request_id == "mine"


def test_priority_travels_after_nil_places_and_only_when_not_zero() -> None:
    plain = unpack(encode(AddRequest("r", [1])))
    assert unpack(encode(AddRequest("r", [1], priority=0))) == plain
    ranked = unpack(encode(AddRequest("r", [1], priority=-(2**63))))
    assert ranked == [*plain, None, None, None, -(2**63)]
    for msg in (
        AddRequest("r", [1], priority=3),
        AddRequest("r", [1, 2], lora=LoraRef("a", "/a"), priority=-1),
        AddRequest("r", [1, 2], pooling=PoolingParams(), priority=2**63 - 1),
    ):
        assert decode_client_message(encode(msg)) == msg


def test_ready_carries_the_scheduling_policy() -> None:
    for policy in SchedulingPolicy:
        msg = Ready("m", 8, 9, [2], 16, 4, 2, scheduling_policy=policy)
        assert decode_engine_message(encode(msg)) == msg
    frame = unpack(encode(Ready("m", 8, 9, [2], 16, 4, 2)))
    frame[9] = 2  # no such policy
    with pytest.raises(ProtocolError):
        decode_engine_message(msgpack.packb(frame))


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def pooled_step(column: Any, finish: Any = None, counts: Any = None, new_ids: Any = None) -> bytes:
    """A STEP_OUTPUTS frame of request "a" ending POOLED with no tokens, with ``column``."""
    finish = [[0, int(FinishReason.POOLED)]] if finish is None else finish
    counts = i32(0) if counts is None else counts
    frame = unpack(
        step_frame(finish=finish, counts=counts, new_ids=b"" if new_ids is None else new_ids)
    )
    return msgpack.packb([*frame, column])


def ready_frame(embedding: Any) -> bytes:
    return msgpack.packb([*unpack(encode(Ready("m", 8, 9, [2], 16, 4, 2))), embedding])


BAD_POOLED_ENGINE_FRAMES = [
    pooled_step(None),  # a trailing nil
    pooled_step([]),  # an empty column is left out
    step_frame(finish=[[0, int(FinishReason.POOLED)]], counts=i32(0), new_ids=b""),  # no vector
    pooled_step([[0, f32(1.0)]], finish=[]),  # a vector without the POOLED end
    pooled_step([[0, f32(1.0)]], finish=[[0, int(FinishReason.STOP)]]),
    pooled_step([[0, f32(1.0)]], counts=i32(1), new_ids=i32(5)),  # pooled, yet a token
    pooled_step([[0, f32(1.0)], [0, f32(2.0)]]),  # two vectors for one request
    pooled_step([[1, f32(1.0)]]),  # no request at that position
    pooled_step([[0, f32(math.nan)]]),
    pooled_step([[0, f32(1.0, math.inf)]]),
    pooled_step([[0, b""]]),  # no values
    pooled_step([[0, b"\x00\x00\x80"]]),  # not a multiple of 4 bytes
    pooled_step([[0, [1.0, 2.0]]]),  # a list, not float32 bytes
    pooled_step([[0, f32(0.0) * 65537]]),  # past MAX_EMBEDDING_DIMS
    pooled_step([[0, f32(1.0), 3]]),  # not a pair
    msgpack.packb([*unpack(pooled_step([[0, f32(1.0)]])), []]),  # a field too many
    step_frame(finished={"a": int(FinishReason.POOLED)}),  # pooled, yet without its output
    ready_frame(None),
    ready_frame([9, True, 8, False, b""]),  # an unknown pooling kind
    ready_frame([LAST, True, 0, False, b""]),  # size 0
    ready_frame([LAST, True, 65537, False, b""]),
    ready_frame([LAST, 1, 8, False, b""]),  # normalize not a bool
    ready_frame([LAST, True, 8, False, i32(4)]),  # dimensions, yet not Matryoshka
    ready_frame([LAST, True, 8, True, i32(9)]),  # a dimension beyond the size
    ready_frame([LAST, True, 8, True, i32(0)]),
    ready_frame([LAST, True, 8, True, [4]]),  # not int32 bytes
    ready_frame([LAST, True, 8, True]),  # not 5 wide
]


@pytest.mark.parametrize("frame", BAD_POOLED_ENGINE_FRAMES)
def test_malformed_pooled_engine_frame_is_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_engine_message(frame)


BAD_ENGINE_FRAMES = [
    encode(Hello()),  # a client message sent the wrong way
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, -1]),
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, False]),
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, 1, 0.0]),  # announces no step
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, 1, -2.0]),
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, 1, math.inf]),
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, 1, 1e9]),  # past MAX_BUSY_S
    msgpack.packb([int(MsgType.HEARTBEAT), PROTOCOL_VERSION, 1, 2.0, 3]),
    msgpack.packb([int(MsgType.READY), PROTOCOL_VERSION, "m", 8, 0, b"", 16, 4, 2]),  # vocab 0
    msgpack.packb([int(MsgType.READY), PROTOCOL_VERSION, "m", 8, 9, [2], 16, 4, 2]),
    step_frame("x"),
    msgpack.packb([int(MsgType.STEP_OUTPUTS), PROTOCOL_VERSION, ["a"], i32(1), i32(1), [], []]),
    step_frame(timings=[[0, 0.1, 0.2]]),  # not 4 wide
    step_frame(timings=[[0, -0.1, 0.2, 0.3]]),  # a negative duration
    step_frame(timings=[[0, 0.1, math.nan, 0.3]]),
    step_frame(timings=[[0, 0.1, 0.2, "0.3"]]),
    step_frame(timings=[[1, 0.1, 0.2, 0.3]]),  # no request at that position
    step_frame([""]),  # empty request id
    step_frame([7]),  # not a str
    step_frame(counts=i32(1, 1)),  # more counts than ids
    step_frame(counts=i32(2)),  # counts do not add up to the ids
    step_frame(counts=i32(-1), new_ids=b""),
    step_frame(new_ids=i32(-1)),
    step_frame(new_ids=[1]),  # not int32 bytes
    step_frame(new_ids=b"\x01\x00\x00"),  # not a multiple of 4 bytes
    step_frame(prompt_logprobs=[[0, 1, [f64(-1.0), i32(0), b"", b""]], [0, 1]]),  # not 3 wide
    step_frame(prompt_logprobs=[[0, 2, [f64(-1.0), i32(0), b"", b""]]]),  # 2 promised, 1 sent
    step_frame(prompt_logprobs=[[0, 1, [f64(math.nan), i32(0), b"", b""]]]),
    step_frame(prompt_logprobs=[[1, 1, [f64(-1.0), i32(0), b"", b""]]]),  # no such request
    step_frame(prompt_logprobs=[[0, 1, [f64(-1.0), i32(0), b"", b"", i32(0)]]]),  # rank below 1
    step_frame(prompt_logprobs=[[0, 1, [f64(-1.0), i32(0), b"", b"", i32(1, 2)]]]),  # 2 ranks
    step_frame(finish=[[0, 9]]),  # unknown finish reason
    step_frame(finish=[[1, 0]]),  # no request at that position
    step_frame(finish=[["a", 0]]),  # keyed by id, not position
    step_frame(finish=[[0, 0, 0]]),  # not a pair
    step_frame(finish={"0": 0}),  # not a list of pairs
    step_frame(finished={"a": 7}),
    step_frame(finished={b"a": 0}),  # bytes key
    step_frame(finished=[["a", 0]]),  # not a map
    msgpack.packb(
        [int(MsgType.STEP_OUTPUTS), PROTOCOL_VERSION, [], b"", b"", [], [], {1: 0}, []],
        strict_types=False,
    ),
    # logprobs: [sampled f64, top counts i32, top ids i32, top logprobs f64], one per token
    step_frame(logprobs=[[0, [f64(-1.0, -2.0), i32(0, 0), b"", b""]]]),
    step_frame(logprobs=[[0, [f64(-1.0), i32(1), i32(3), b""]]]),
    step_frame(logprobs=[[0, [f64(-1.0), i32(2), i32(3), f64(-1.0)]]]),
    step_frame(logprobs=[[0, [f64(-1.0), i32(21), i32(*range(21)), f64(*[0.0] * 21)]]]),
    step_frame(logprobs=[[0, [f64(math.nan), i32(0), b"", b""]]]),
    step_frame(logprobs=[[0, [f64(math.inf), i32(0), b"", b""]]]),
    step_frame(logprobs=[[0, [f64(-1.0), i32(-1), b"", b""]]]),
    step_frame(logprobs=[[0, [f64(-1.0), i32(0), b"", b"", 5]]]),
    step_frame(logprobs=[[1, [f64(-1.0), i32(0), b"", b""]]]),  # no request at that position
    msgpack.packb([int(MsgType.CONTROL_REPLY), PROTOCOL_VERSION, 1, 0, [1, 2, 3, 4, 5], True, ""]),
    msgpack.packb([int(MsgType.CONTROL_REPLY), PROTOCOL_VERSION, 1, 0, [1, 2, 3, 4, 5, -6], 1, ""]),
    msgpack.packb([int(MsgType.CONTROL_REPLY), PROTOCOL_VERSION, 1, 0, None, 1, ""]),
    stats_frame([1, 2, 3, 4, 5, 6]),  # no counts
    stats_frame([1, 2, 3, 4, 5, 6, [0, 1, 2, 3, 4]]),  # counts without step tokens
    stats_frame([1, 2, 3, 4, 5, 6, [0, 1, 2, 3, 4, [0] * 13]]),  # a bucket short
    stats_frame([1, 2, 3, 4, 5, 6, [0, 1, -2, 3, 4, list(STEPS)]]),
    stats_frame([1, 2, 3, 4, 5, 6, [0, 1, 2, 3, 4, [True] * 14]]),
    msgpack.packb([int(MsgType.REQUEST_ERROR), PROTOCOL_VERSION, "", "m", 400]),
    msgpack.packb([int(MsgType.REQUEST_ERROR), PROTOCOL_VERSION, "r", None, 400]),
]


@pytest.mark.parametrize("frame", BAD_ENGINE_FRAMES)
def test_malformed_engine_frame_is_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_engine_message(frame)


def test_oversized_frames_are_rejected() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_client_message(b"\x00" * (MAX_FRAME_BYTES + 1))
    too_many = add_frame(_3=b"\x01\x00\x00\x00" * (MAX_TOKEN_IDS + 1))
    with pytest.raises(ProtocolError):
        decode_client_message(too_many)


# ---- fuzzing: nothing but ProtocolError escapes -------------------------------------------------

WEIRD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    17,
    2**31,
    2**63,
    2**64 - 1,
    -(2**63),
    0.5,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "r",
    "x" * 300,
    b"",
    b"\x01\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\x01\x02\x03",
    [],
    [1, 2],
    [None],
    {},
    {"a": 0},
    {"a": [1]},
]


def decode_or_protocol_error(frame: bytes, decode: Callable[[bytes], Any]) -> None:
    """Decoding either fails with ProtocolError or yields a message that round-trips."""
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert decode(encode(msg)) == msg


def both_directions(frame: bytes) -> None:
    decode_or_protocol_error(frame, decode_client_message)
    decode_or_protocol_error(frame, decode_engine_message)


def test_fuzz_random_bytes() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        both_directions(rng.randbytes(rng.randrange(0, 64)))
    for _ in range(1000):  # random bytes after a plausible header reach the field decoders
        tag = rng.choice(list(MsgType))
        both_directions(
            bytes([0x90 | rng.randrange(2, 9), tag, PROTOCOL_VERSION]) + rng.randbytes(40)
        )


def test_fuzz_mutated_frames() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        frame = bytearray(encode(random_message(rng)))
        for _ in range(rng.randint(1, 4)):
            mutate_bytes(rng, frame)
        both_directions(bytes(frame))


def test_fuzz_replaced_fields() -> None:
    rng = random.Random(13)
    for _ in range(3000):
        msg = random_message(rng)
        obj = unpack(encode(msg))
        obj = replace_random_node(rng, obj, rng.choice(WEIRD_VALUES))
        decode_or_protocol_error(msgpack.packb(obj), decoder_for(msg))


def mutate_bytes(rng: random.Random, frame: bytearray) -> None:
    if not frame:
        frame.append(rng.randrange(256))
        return
    i = rng.randrange(len(frame))
    action = rng.randrange(4)
    if action == 0:
        frame[i] = rng.randrange(256)
    elif action == 1:
        del frame[i:]
    elif action == 2:
        frame.insert(i, rng.randrange(256))
    else:
        del frame[i]


def replace_random_node(rng: random.Random, obj: Any, value: Any) -> Any:
    """Replace one randomly chosen node of a nested list/dict structure (maybe the root)."""
    if rng.random() < 0.15 or not isinstance(obj, (list, dict)) or not obj:
        return value
    if isinstance(obj, list):
        i = rng.randrange(len(obj))
        obj[i] = replace_random_node(rng, obj[i], value)
    else:
        key = rng.choice(list(obj))
        obj[key] = replace_random_node(rng, obj[key], value)
    return obj


# ---- random valid messages ----------------------------------------------------------------------

_CHARS = "abcXYZ019-_/é日🙂"


def rand_id(rng: random.Random) -> str:
    n = rng.choice([1, 2, 8, 36, MAX_REQUEST_ID_LEN])
    return "".join(rng.choice(_CHARS) for _ in range(n))


def rand_ids(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.choice([0, INT32_MAX, rng.randrange(50000)]) for _ in range(rng.randint(lo, hi))]


def rand_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 4096)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens),
        temperature=rng.choice([0.0, 1.0, rng.uniform(0, 5)]),
        top_p=rng.choice([1.0, rng.uniform(1e-6, 1)]),
        top_k=rng.choice([0, rng.randint(1, 1000)]),
        min_p=rng.uniform(0, 1),
        seed=rng.choice([None, 0, rng.randrange(2**64)]),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.uniform(0.01, 3),
        stop_token_ids=tuple(rand_ids(rng, 0, 5)),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, rng.randint(1, 20)]),
        logit_bias=tuple((tid, rng.uniform(-100, 100)) for tid in set(rand_ids(rng, 0, 4))),
        constraint=rng.choice(
            [
                None,
                Constraint(ConstraintKind.REGEX, "[a-z]+"),
                Constraint(ConstraintKind.JSON_OBJECT),
            ]
        ),
        prompt_logprobs=rng.choice([None, 0, rng.randint(1, 20)]),
    )


def rand_logprobs(rng: random.Random, n: int) -> list[TokenLogprobs]:
    out = []
    for _ in range(n):
        k = rng.randint(0, 5)
        lps = [rng.choice([-math.inf, rng.uniform(-30, 0)]) for _ in range(k)]
        out.append(TokenLogprobs(rng.uniform(-30, 0), rand_ids(rng, k, k), lps))
    return out


def rand_output(rng: random.Random) -> RequestOutput:
    reason = rng.choice([None, *FinishReason])
    pooled = reason is FinishReason.POOLED
    ids = [] if pooled else rand_ids(rng, 0, 6)
    lps = rand_logprobs(rng, len(ids)) if rng.random() < 0.3 else None
    prompt_lps = rand_logprobs(rng, rng.randint(0, 8)) if rng.random() < 0.2 else None
    timings = None
    if reason is not None and rng.random() < 0.5:
        timings = RequestTimings(*(rng.uniform(0, 10) for _ in range(3)))
    vector = rand_vector(rng) if pooled else None
    return RequestOutput(rand_id(rng), ids, reason, lps, prompt_lps, timings, vector)


def rand_vector(rng: random.Random) -> list[float]:
    """Float32 values (as the wire carries them), 1 to 64 of them."""
    values = [rng.gauss(0.0, 1.0) for _ in range(rng.randint(1, 64))]
    return np.array(values, dtype=np.float32).tolist()


def rand_pooling(rng: random.Random) -> PoolingParams:
    dimensions = rng.choice([None, 1, rng.randint(1, 4096)])
    return PoolingParams(rng.choice(list(PoolingKind)), rng.random() < 0.5, dimensions)


def random_message(rng: random.Random) -> Any:
    kind = rng.randrange(9)
    if kind == 0:
        return Hello(rand_id(rng) if rng.random() < 0.5 else "")
    if kind == 1 and rng.random() < 0.2:
        return AddRequest(rand_id(rng), rand_ids(rng, 1, 200), pooling=rand_pooling(rng))
    if kind == 1:
        return AddRequest(rand_id(rng), rand_ids(rng, 1, 200), rand_params(rng))
    if kind == 2:
        return Abort([rand_id(rng) for _ in range(rng.randint(0, 5))])
    if kind == 3:
        return Control(rng.choice(list(ControlKind)), rng.randrange(2**64))
    if kind == 4:
        sizes = [rng.randint(1, 10**6) for _ in range(5)]
        size = rng.randint(1, 8192)
        dims = tuple(sorted(rng.sample(range(1, size + 1), min(size, 3))))
        embedding = EmbeddingModel(rng.choice(list(PoolingKind)), True, size, True, dims)
        embedding = embedding if rng.random() < 0.3 else None
        return Ready(rand_id(rng), sizes[0], sizes[1], rand_ids(rng, 0, 3), *sizes[2:], embedding)
    if kind == 5:
        outputs = [rand_output(rng) for _ in range(rng.randint(0, 8))]
        reasons = [r for r in FinishReason if r is not FinishReason.POOLED]  # it has an output
        finished = {rand_id(rng): rng.choice(reasons) for _ in range(rng.randint(0, 3))}
        return StepOutputs(outputs, finished)
    if kind == 6:
        return RequestError(rand_id(rng), rand_id(rng), rng.choice([400, 500]))
    if kind == 7:
        steps = tuple(rng.randrange(10**9) for _ in STEPS)
        counts = EngineCounts(*(rng.randrange(2**62) for _ in range(4)), steps, rng.randrange(9))
        gauges = (rng.randrange(10**9) for _ in range(6))
        stats = Stats(*gauges, counts) if rng.random() < 0.5 else None
        return ControlReply(
            rng.choice(list(ControlKind)),
            rng.randrange(2**64),
            stats,
            rng.random() < 0.5,
            rand_id(rng),
        )
    return Heartbeat(rng.randrange(2**64))


_TAGS = {
    Hello: MsgType.HELLO,
    AddRequest: MsgType.ADD_REQUEST,
    Abort: MsgType.ABORT,
    Control: MsgType.CONTROL,
    Ready: MsgType.READY,
    StepOutputs: MsgType.STEP_OUTPUTS,
    RequestError: MsgType.REQUEST_ERROR,
    ControlReply: MsgType.CONTROL_REPLY,
    Heartbeat: MsgType.HEARTBEAT,
}


# ---- addresses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "inp", "out"),
    [
        (
            "ipc:///run/user/1/tandem-x/engine",
            "ipc:///run/user/1/tandem-x/engine-in",
            "ipc:///run/user/1/tandem-x/engine-out",
        ),
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),
        ("tcp://[::1]:7000", "tcp://[::1]:7000", "tcp://[::1]:7001"),
        ("tcp://h:1,ipc:///x/y", "tcp://h:1", "ipc:///x/y"),
    ],
)
def test_address_parse_and_str_round_trip(text: str, inp: str, out: str) -> None:
    address = EngineAddress.parse(text)
    assert address == EngineAddress(inp, out)
    assert str(address) == text
    assert EngineAddress.parse(str(address)) == address


@pytest.mark.parametrize(
    "text", ["", "udp://h:1", "ipc://", "tcp://h", "tcp://:5", "tcp://h:x", "tcp://h:65535"]
)
def test_bad_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        EngineAddress.parse(text)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("ipc:///tmp/x", True),
        ("tcp://127.0.0.1:5", True),
        ("tcp://127.8.9.1:5", True),
        ("tcp://localhost:5", True),
        ("tcp://[::1]:5", True),
        ("tcp://0.0.0.0:5", False),
        ("tcp://*:5", False),
        ("tcp://10.0.0.2:5", False),
        ("tcp://example.com:5", False),
        (EngineAddress("tcp://127.0.0.1:5", "tcp://10.0.0.2:6"), False),
    ],
)
def test_is_loopback(address: Any, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_identities_are_valid_routing_ids() -> None:
    ids = {new_identity() for _ in range(500)}
    assert len(ids) == 500
    assert all(len(i) == 16 and i[0] != 0 for i in ids)
    for bad in (b"", b"\x00abc", b"x" * 256):
        with pytest.raises(ValueError):
            check_identity(bad)
