"""The bytes on the wire, pinned: each message below encodes to exactly the frame stored here (and
the frame decodes back to it). A change to the codec that moves a byte of any of them changes the
protocol, and must come with a new PROTOCOL_VERSION and new frames here.

The frames were written by the codec of protocol version 14; ``python -m tests.test_wire_golden``
prints the table for the codec as it is now. Version 8 added a request's LoRA adapter and a
prompt's images as trailing fields that only such frames carry; version 9 a request's priority
as a trailing field that only a frame with a priority other than 0 carries, and the engine's
scheduling policy to READY; version 10 the host KV tier's gauges and counts to a STATS reply;
version 11 moved an image's pixels out of the frame, into a frame of their own after it;
version 12 added the engine's pixel dtype to READY; version 13 each prompt token's rank, a fifth
column of prompt logprobs (``step prompt logprobs and timings``); version 14 a heartbeat's
announced step time, a trailing field that only a heartbeat announcing a step carries.
Every other frame of version 8 is the same here but for its version byte
(``test_frames_without_a_priority_changed_only_their_version``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import msgpack
import pytest

from protocol.codec import StepOutputsFrame, decode_client_message, decode_engine_message, encode
from protocol.messages import (
    PROTOCOL_VERSION,
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
    ImageInput,
    LoraRef,
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

INT32_MAX = 2**31 - 1

EVERY_PARAM = SamplingParams(
    max_tokens=INT32_MAX,
    min_tokens=5,
    temperature=0.7,
    top_p=0.5,
    top_k=40,
    min_p=0.05,
    seed=2**64 - 1,
    presence_penalty=-2.0,
    frequency_penalty=1.5,
    repetition_penalty=1.1,
    stop_token_ids=(2, 13, INT32_MAX),
    ignore_eos=True,
    logprobs=20,
    logit_bias=((0, -100.0), (INT32_MAX, 100.0), (7, 0.5)),
    constraint=Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'),
    prompt_logprobs=3,
)

MESSAGES: dict[str, Any] = {
    "hello": Hello(),
    "hello named": Hello("frontend-1"),
    "add default params": AddRequest("r", [0]),
    "add greedy params": AddRequest("r1", [5, 49151], SamplingParams(256, temperature=0.0)),
    "add every param": AddRequest("all", [1, 2, INT32_MAX], EVERY_PARAM, 1, 4),
    "add stop ids": AddRequest("s", [1], SamplingParams(stop_token_ids=(7, 8))),
    "add logit bias": AddRequest("b", [1], SamplingParams(logit_bias=((3, -1.5),))),
    "add json object": AddRequest(
        "j", [1], SamplingParams(constraint=Constraint(ConstraintKind.JSON_OBJECT))
    ),
    "add regex": AddRequest(
        "x", [1], SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "a+"))
    ),
    "add llguidance grammar": AddRequest(
        "g",
        [1],
        SamplingParams(
            constraint=Constraint(
                ConstraintKind.LLGUIDANCE, '{"grammars": [{"lark_grammar": "start: /a+/"}]}'
            )
        ),
    ),
    "add optional ints": AddRequest("o", [1], SamplingParams(seed=0, logprobs=0)),
    "add resumed": AddRequest("z", [5, 6, 7, 8], SamplingParams(max_tokens=9), 3, 16),
    "add pooling last": AddRequest("e", [5, 6], pooling=PoolingParams()),
    "add images": AddRequest(
        "i",
        [1, 9, 9, 2, 9, 3],
        images=(
            ImageInput(
                bytes(range(32)), 1, 2, TensorBytes("float32", (2, 1), b"\0" * 8), (1, 2, 4)
            ),
            ImageInput(b"\xff" * 32, 4, 1, TensorBytes("bfloat16", (1,), b"\x80?"), (1, 2, 2)),
        ),
    ),
    "add pooling mean cut": AddRequest(
        "m", [7], pooling=PoolingParams(PoolingKind.MEAN, False, 256)
    ),
    "add lora": AddRequest("l", [1, 2], lora=LoraRef("sql", "/adapters/sql")),
    "add lora resumed": AddRequest(
        "lr", [5, 6, 7], SamplingParams(max_tokens=9), 1, 16, lora=LoraRef("a", "/x")
    ),
    "add lora images": AddRequest(
        "li",
        [1, 9, 2],
        lora=LoraRef("v", "/v"),
        images=(ImageInput(b"\x01" * 32, 1, 1, TensorBytes("float16", (1,), b"\0<"), (1, 1, 1)),),
    ),
    "add priority": AddRequest("pr", [1], priority=-(2**63)),
    "add pooling priority": AddRequest("pp", [1], pooling=PoolingParams(), priority=2**63 - 1),
    "add lora priority": AddRequest("lp", [1], lora=LoraRef("a", "/a"), priority=7),
    "abort none": Abort([]),
    "abort two": Abort(["a", "b"]),
    "control stats": Control(ControlKind.STATS, 7),
    "control shutdown": Control(ControlKind.SHUTDOWN, 2**64 - 1),
    "ready": Ready("default", 2048, 49152, [2, 0], 16, 1000, 256),
    "ready priority": Ready(
        "p", 2048, 49152, [2], 16, 1000, 256, scheduling_policy=SchedulingPolicy.PRIORITY
    ),
    "ready bfloat16": Ready("vl", 4096, 151936, [2], 16, 1000, 256, pixel_dtype="bfloat16"),
    "ready embedding": Ready(
        "embed", 512, 49152, [2], 16, 64, 8, EmbeddingModel(PoolingKind.LAST, True, 1024)
    ),
    "ready mrl": Ready(
        "mrl",
        512,
        49152,
        [],
        16,
        64,
        8,
        EmbeddingModel(PoolingKind.MEAN, False, 64, True, (16, 32, 64)),
    ),  # fmt: skip
    "step empty": StepOutputs([]),
    "step one token": StepOutputs([RequestOutput("a", [5])]),
    "step finishes and logprobs": StepOutputs(
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
    "step prompt logprobs and timings": StepOutputs(
        [
            RequestOutput("p", [3], None, None, [TokenLogprobs(-1.5, [4, 3], [-0.5, -1.5], 2)]),
            RequestOutput("q", [], FinishReason.DEAD_END, None, []),
            RequestOutput(
                "t", [5], FinishReason.LENGTH, timings=RequestTimings(0.0, 0.25, 1.5, 8, 5)
            ),
        ]
    ),
    "step pooled": StepOutputs(
        [
            RequestOutput("a", [5]),
            RequestOutput("e", [], FinishReason.POOLED, embedding=[0.5, -0.25, 1.0]),
            RequestOutput(
                "f", [], FinishReason.POOLED, timings=RequestTimings(0.0, 0.5, 0.0), embedding=[2.0]
            ),
        ]
    ),
    "request error": RequestError("r", "prompt too long", 413),
    "control reply stats": ControlReply(
        ControlKind.STATS,
        3,
        Stats(
            1,
            2,
            3,
            4,
            10,
            2**40,
            EngineCounts(2**62 - 1, 300, 128, 2, tuple(range(14)), 99, 5, 20, 15, 40, 12, 300, 192),
            num_host_blocks=64,
            num_host_used_blocks=33,
        ),
    ),
    "control reply failed": ControlReply(ControlKind.CHECK_INTEGRITY, 0, None, False, "leak"),
    "heartbeat": Heartbeat(123456789),
    "heartbeat before a long step": Heartbeat(123456789, 42.5),
}

FRAMES: dict[str, str] = {
    "hello": "93010ea0",
    "hello named": "93010eaa66726f6e74656e642d31",
    "add default params": (
        "97020ea172c40400000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400c4"
        "00c0c00001"
    ),
    "add greedy params": (
        "97020ea27231c40805000000ffbf0000dc0010cd010000cb0000000000000000cb3ff00000000000"
        "0000cb0000000000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c4"
        "00c2c092c400c400c0c00001"
    ),
    "add every param": (
        "97020ea3616c6cc40c0100000002000000ffffff7fdc0010ce7fffffff05cb3fe6666666666666cb"
        "3fe000000000000028cb3fa999999999999acfffffffffffffffffcbc000000000000000cb3ff800"
        "0000000000cb3ff199999999999ac40c020000000d000000ffffff7fc31492c40c00000000ffffff"
        "7f07000000c41800000000000059c00000000000005940000000000000e03f9201b27b2274797065"
        "223a20226f626a656374227d030104"
    ),
    "add stop ids": (
        "97020ea173c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c408070000000800"
        "0000c2c092c400c400c0c00001"
    ),
    "add logit bias": (
        "97020ea162c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c40403"
        "000000c408000000000000f8bfc0c00001"
    ),
    "add json object": (
        "97020ea16ac40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400c4"
        "009202a0c00001"
    ),
    "add regex": (
        "97020ea178c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400c4"
        "009203a2612bc00001"
    ),
    "add llguidance grammar": (
        "97020ea167c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400c4"
        "009206d92f7b226772616d6d617273223a205b7b226c61726b5f6772616d6d6172223a2022737461"
        "72743a202f612b2f227d5d7dc00001"
    ),
    "add optional ints": (
        "97020ea16fc40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "0000000000cb0000000000000000cb0000000000000000cb3ff0000000000000c400c20092c400c4"
        "00c0c00001"
    ),
    "add resumed": (
        "97020ea17ac41005000000060000000700000008000000dc00100900cb3ff0000000000000cb3ff0"
        "00000000000000cb0000000000000000c0cb0000000000000000cb0000000000000000cb3ff00000"
        "00000000c400c2c092c400c400c0c00310"
    ),
    "add pooling last": (
        "98020ea165c4080500000006000000dc00101000cb3ff0000000000000cb3ff000000000000000cb"
        "0000000000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c0"
        "92c400c400c0c000019301c3c0"
    ),
    "add images": (
        "9a020ea169c418010000000900000009000000020000000900000003000000dc00101000cb3ff000"
        "0000000000cb3ff000000000000000cb0000000000000000c0cb0000000000000000cb0000000000"
        "000000cb3ff0000000000000c400c2c092c400c400c0c00001c0c09297c420000102030405060708"
        "090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f0102a7666c6f6174333292020108930102"
        "0497c420ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff0401a862"
        "666c6f6174313691010293010202"
    ),
    "add pooling mean cut": (
        "98020ea16dc40407000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400c4"
        "00c0c000019302c2cd0100"
    ),
    "add lora": (
        "99020ea16cc4080100000002000000dc00101000cb3ff0000000000000cb3ff000000000000000cb"
        "0000000000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c0"
        "92c400c400c0c00001c092a373716cad2f61646170746572732f73716c"
    ),
    "add lora resumed": (
        "99020ea26c72c40c050000000600000007000000dc00100900cb3ff0000000000000cb3ff0000000"
        "00000000cb0000000000000000c0cb0000000000000000cb0000000000000000cb3ff00000000000"
        "00c400c2c092c400c400c0c00110c092a161a22f78"
    ),
    "add lora images": (
        "9a020ea26c69c40c010000000900000002000000dc00101000cb3ff0000000000000cb3ff0000000"
        "00000000cb0000000000000000c0cb0000000000000000cb0000000000000000cb3ff00000000000"
        "00c400c2c092c400c400c0c00001c092a176a22f769197c420010101010101010101010101010101"
        "01010101010101010101010101010101010101a7666c6f6174313691010293010101"
    ),
    "add priority": (
        "9b020ea27072c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb000000"
        "0000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400"
        "c400c0c00001c0c0c0d38000000000000000"
    ),
    "add pooling priority": (
        "9b020ea27070c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb000000"
        "0000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400"
        "c400c0c000019301c3c0c0c0cf7fffffffffffffff"
    ),
    "add lora priority": (
        "9b020ea26c70c40401000000dc00101000cb3ff0000000000000cb3ff000000000000000cb000000"
        "0000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400"
        "c400c0c00001c092a161a22f61c007"
    ),
    "abort none": "93030e90",
    "abort two": "93030e92a161a162",
    "control stats": "94040e0107",
    "control shutdown": "94040e02cfffffffffffffffff",
    "ready": (
        "9b100ea764656661756c74cd0800cdc000c408020000000000000010cd03e8cd010000a7666c6f61743332"
    ),
    "ready priority": "9b100ea170cd0800cdc000c4040200000010cd03e8cd010001a7666c6f61743332",
    "ready bfloat16": "9b100ea2766ccd1000ce00025180c4040200000010cd03e8cd010000a862666c6f61743136",
    "ready embedding": (
        "9c100ea5656d626564cd0200cdc000c4040200000010400800a7666c6f617433329501c3cd0400c2c400"
    ),
    "ready mrl": (
        "9c100ea36d726ccd0200cdc000c40010400800a7666c6f617433329502c240c3c40c100000002000"
        "000040000000"
    ),
    "step empty": "9a110e90c400c4009090809090",
    "step one token": "9a110e91a161c40401000000c404050000009090809090",
    "step finishes and logprobs": (
        "9a110e93a161a162a163c40c020000000000000002000000c4100500000006000000070000000800"
        "00009292000092010191920294c410000000000000d0bf000000000000f0ffc40802000000000000"
        "00c4080700000009000000c410000000000000d0bf000000000000f8bf82a16402a165039090"
    ),
    "step prompt logprobs and timings": (
        "9a110e93a170a171a174c40c010000000000000001000000c4080300000005000000929201049202"
        "0190809293000195c408000000000000f8bfc40402000000c4080400000003000000c41000000000"
        "0000e0bf000000000000f8bfc4040200000093010094c400c400c400c400919602cb000000000000"
        "0000cb3fd0000000000000cb3ff80000000000000805"
    ),
    "step pooled": (
        "9b110e93a161a165a166c40c010000000000000000000000c4040500000092920105920205908090"
        "919602cb0000000000000000cb3fe0000000000000cb00000000000000000000929201c40c000000"
        "3f000080be0000803f9202c40400000040"
    ),
    "request error": "95120ea172af70726f6d707420746f6f206c6f6e67cd019d",
    "control reply stats": (
        "97130e010399010203040acf000001000000000040219dcf3fffffffffffffffcd012ccc80026305"
        "140f280ccd012cccc09e000102030405060708090a0b0c0dc3a0"
    ),
    "control reply failed": "97130e0300c0c2a46c65616b",
    "heartbeat": "93140ece075bcd15",
    "heartbeat before a long step": "94140ece075bcd15cb4045400000000000",
}


CLIENT_TYPES = (Hello, AddRequest, Abort, Control)


@pytest.mark.parametrize("name", list(MESSAGES))
def test_a_message_encodes_to_its_stored_frame(name: str) -> None:
    assert encode(MESSAGES[name]).hex() == FRAMES[name]


@pytest.mark.parametrize("name", list(MESSAGES))
def test_a_stored_frame_decodes_to_its_message(name: str) -> None:
    msg = MESSAGES[name]
    frame = bytes.fromhex(FRAMES[name])
    if isinstance(msg, CLIENT_TYPES):
        pixels = [image.pixels.data for image in getattr(msg, "images", ())]
        assert decode_client_message(frame, pixels) == msg
    else:
        assert decode_engine_message(frame) == msg


# StepOutputsFrame.encode is the engine's frame of outputs alone (no request ended without one).
BUILT_STEPS = [
    name
    for name, msg in MESSAGES.items()
    if isinstance(msg, StepOutputs) and not msg.finished_without_tokens
]


@pytest.mark.parametrize("name", BUILT_STEPS)
def test_a_frame_built_request_by_request_is_the_stored_frame(name: str) -> None:
    msg = MESSAGES[name]
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
    assert frame.encode().hex() == FRAMES[name]


def test_the_frames_are_of_this_protocol_version() -> None:
    assert PROTOCOL_VERSION == 14, "a new protocol version: write the frames anew"


# The frames of protocol version 8, byte for byte: version 9 only added a trailing priority that
# frames without one leave out, version 10 changed only the STATS reply and version 11 only
# frames with images, so these must be the same but for the version byte...
VERSION_8_FRAMES = {
    "add default params": (
        "970208a172c40400000000dc00101000cb3ff0000000000000cb3ff000000000000000cb00000000"
        "00000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c092c400c4"
        "00c0c00001"
    ),
    "add every param": (
        "970208a3616c6cc40c0100000002000000ffffff7fdc0010ce7fffffff05cb3fe6666666666666cb"
        "3fe000000000000028cb3fa999999999999acfffffffffffffffffcbc000000000000000cb3ff800"
        "0000000000cb3ff199999999999ac40c020000000d000000ffffff7fc31492c40c00000000ffffff"
        "7f07000000c41800000000000059c00000000000005940000000000000e03f9201b27b2274797065"
        "223a20226f626a656374227d030104"
    ),
    "add pooling last": (
        "980208a165c4080500000006000000dc00101000cb3ff0000000000000cb3ff000000000000000cb"
        "0000000000000000c0cb0000000000000000cb0000000000000000cb3ff0000000000000c400c2c0"
        "92c400c400c0c000019301c3c0"
    ),
    "step one token": "9a110891a161c40401000000c404050000009090809090",
    "step pooled": (
        "9b110893a161a165a166c40c010000000000000000000000c4040500000092920105920205908090"
        "919602cb0000000000000000cb3fe0000000000000cb00000000000000000000929201c40c000000"
        "3f000080be0000803f9202c40400000040"
    ),
    "request error": "951208a172af70726f6d707420746f6f206c6f6e67cd019d",
}


@pytest.mark.parametrize("name", list(VERSION_8_FRAMES))
def test_frames_without_a_priority_changed_only_their_version(name: str) -> None:
    old, new = bytes.fromhex(VERSION_8_FRAMES[name]), bytes.fromhex(FRAMES[name])
    # After the array's header byte: the type tag, then the version (each a positive fixint).
    assert old[2] == 8 and new[2] == PROTOCOL_VERSION
    assert old[:2] + old[3:] == new[:2] + new[3:]


# ...but a frame with images, where version 11 put each image's byte count in the place of its
# pixels (which follow as frames of their own).
VERSION_8_IMAGES_FRAME = (
    "9a0208a26c69c40c010000000900000002000000dc00101000cb3ff0000000000000cb3ff0000000"
    "00000000cb0000000000000000c0cb0000000000000000cb0000000000000000cb3ff00000000000"
    "00c400c2c092c400c400c0c00001c092a176a22f769197c420010101010101010101010101010101"
    "01010101010101010101010101010101010101a7666c6f617431369101c402003c93010101"
)


def test_frames_with_images_changed_only_their_pixels_place() -> None:
    old = msgpack.unpackb(bytes.fromhex(VERSION_8_IMAGES_FRAME))
    new = msgpack.unpackb(bytes.fromhex(FRAMES["add lora images"]))
    old_images, new_images = old[-1], new[-1]
    assert old[1] == 8 and new[1] == PROTOCOL_VERSION
    assert [len(image[5]) for image in old_images] == [image[5] for image in new_images] == [2]
    for image in old_images:
        image[5] = len(image[5])
    assert new[:1] + new[2:] == old[:1] + old[2:]


# ...and READY gained the scheduling policy after max_num_seqs (0, FCFS, for these engines), and
# after it (version 12) the pixel dtype ("float32" for these engines).
VERSION_8_READY_FRAMES = {
    "ready": "991008a764656661756c74cd0800cdc000c408020000000000000010cd03e8cd0100",
    "ready embedding": "9a1008a5656d626564cd0200cdc000c404020000001040089501c3cd0400c2c400",
    "ready mrl": "9a1008a36d726ccd0200cdc000c4001040089502c240c3c40c100000002000000040000000",
}


@pytest.mark.parametrize("name", list(VERSION_8_READY_FRAMES))
def test_ready_frames_gained_only_the_scheduling_policy_and_pixel_dtype(name: str) -> None:
    old = msgpack.unpackb(bytes.fromhex(VERSION_8_READY_FRAMES[name]))
    new = msgpack.unpackb(bytes.fromhex(FRAMES[name]))
    assert old[1] == 8 and new[1] == PROTOCOL_VERSION
    added = [int(SchedulingPolicy.FCFS), "float32"]
    assert new[:1] + new[2:] == [*old[:1], *old[2:9], *added, *old[9:]]


def print_frames() -> None:
    """The FRAMES table as the codec writes it now, wrapped at 100 columns."""
    print("FRAMES: dict[str, str] = {")
    for name, msg in MESSAGES.items():
        text = encode(msg).hex()
        chunks = [text[i : i + 80] for i in range(0, len(text), 80)]
        if len(chunks) == 1:
            print(f'    "{name}": "{text}",')
            continue
        print(f'    "{name}": (')
        for chunk in chunks:
            print(f'        "{chunk}"')
        print("    ),")
    print("}")


if __name__ == "__main__":
    print_frames()
    sys.exit(0)
