"""A prompt's images on the wire: they round-trip (the pixels as frames of their own after the
message's), and every malformed one is a ProtocolError naming the request (never another
exception, never a request that reaches the engine)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from protocol.codec import ProtocolError, decode_client_message, encode, encode_frames
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    ImageInput,
    MsgType,
    PoolingParams,
    TensorBytes,
)


def image(offset: int = 1, length: int = 2, **fields: Any) -> ImageInput:
    pixels = np.arange(6, dtype=np.float32).reshape(3, 2)
    values: dict[str, Any] = dict(
        hash=b"\x07" * 32,
        offset=offset,
        length=length,
        pixels=TensorBytes("float32", (3, 2), pixels.tobytes()),
        grid_thw=(1, 2, 4),
    )
    values.update(fields)
    return ImageInput(**values)


def request(*images: ImageInput) -> AddRequest:
    return AddRequest("r", [1, 9, 9, 2, 9, 3], images=images)


def round_trip(msg: AddRequest) -> Any:
    frame, *payloads = encode_frames(msg)
    return decode_client_message(frame, [bytes(p) for p in payloads])  # as a socket gives them


def test_images_round_trip() -> None:
    msg = request(image(), image(4, 1, hash=b"\x01" * 32))
    frames = encode_frames(msg)
    assert frames[1:] == [i.pixels.data for i in msg.images]  # one frame an image, in order
    decoded = round_trip(msg)
    assert decoded == msg
    assert np.frombuffer(decoded.images[0].pixels.data, np.float32).tolist() == [0, 1, 2, 3, 4, 5]


def test_an_arrays_memory_goes_out_uncopied_and_comes_back_equal() -> None:
    pixels = np.arange(6, dtype=np.float32).reshape(3, 2)
    view = memoryview(pixels).cast("B")
    msg = request(image(pixels=TensorBytes("float32", (3, 2), view)))
    frames = encode_frames(msg)
    assert frames[1] is view  # the array's buffer itself, for a send with copy=False
    assert round_trip(msg).images[0].pixels.data == pixels.tobytes()


def test_the_largest_pixels_the_api_sends_round_trip() -> None:
    """The API process sends up to MAX_PIXEL_BYTES of a prompt's pixels (one 1,024 x 1,024 image
    is 25.8 MB at Qwen2.5-VL's patches): a frame of them decodes, as the GPU benchmark's did not
    when every bin field was held to an id list's 16 MiB."""
    from frontend.vision import MAX_PIXEL_BYTES

    rows = MAX_PIXEL_BYTES // (1176 * 4)
    pixels = np.random.default_rng(0).standard_normal((rows, 1176), dtype=np.float32)
    big = image(
        pixels=TensorBytes("float32", pixels.shape, pixels.tobytes()), grid_thw=(1, 2, rows // 2)
    )
    decoded = round_trip(request(big))
    assert decoded.images[0].pixels.data == pixels.tobytes()


def frame_with_images(images: Any, pooling: Any = None) -> bytes:
    """An ADD_REQUEST frame built by hand around ``images`` (as another encoder might)."""
    fields = msgpack.unpackb(encode(request(image())))  # [..., pooling, lora, images]
    fields[-3], fields[-1] = pooling, images
    return msgpack.packb(fields, use_bin_type=True)


def wire_image(**changes: Any) -> list[Any]:
    fields = {
        "hash": b"\x07" * 32,
        "offset": 1,
        "length": 2,
        "dtype": "float32",
        "shape": [3, 2],
        "nbytes": 24,
        "grid": [1, 2, 4],
    }
    fields.update(changes)
    return list(fields.values())


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([], "1 to"),
        ([wire_image(hash=b"\x07" * 31)], "hash"),
        ([wire_image(offset=6)], "image offset"),
        ([wire_image(offset=5, length=2)], "image length"),
        ([wire_image(dtype="int8")], "dtype"),
        ([wire_image(nbytes=20)], "pixels"),
        ([wire_image(nbytes=b"24")], "pixels"),
        ([wire_image(shape=[3, 2, 1, 1, 1])], "dims"),
        ([wire_image(grid=[1, 0, 4])], "grid_thw"),
        ([wire_image(), wire_image(offset=2, length=1)], "prompt order"),
        ([wire_image(offset=True)], "int"),
        ("not a list", "array"),
    ],
)
def test_malformed_images_are_protocol_errors(images: Any, message: str) -> None:
    payloads = [bytes(24)] * len(images) if isinstance(images, list) else []
    with pytest.raises(ProtocolError, match=message) as caught:
        decode_client_message(frame_with_images(images), payloads)
    assert caught.value.request_id == "r"


@pytest.mark.parametrize(
    ("payloads", "message"),
    [
        ([], "without the frame"),
        ([bytes(20)], "holds 20 bytes, not 24"),
        ([bytes(24), bytes(24)], "2 frames after its own and takes 1"),
    ],
)
def test_pixel_frames_must_match_the_images(payloads: list[bytes], message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as caught:
        decode_client_message(frame_with_images([wire_image()]), payloads)
    assert caught.value.request_id == "r"


def test_frames_after_a_message_without_images_are_refused() -> None:
    with pytest.raises(ProtocolError, match="1 frames after its own and takes 0"):
        decode_client_message(encode(AddRequest("t", [1, 2])), [bytes(4)])
    with pytest.raises(ProtocolError, match="1 frames after its own and takes 0"):
        decode_client_message(encode(Abort(["t"])), [bytes(4)])


def test_images_never_go_with_pooling() -> None:
    with pytest.raises(ProtocolError, match="no images"):
        decode_client_message(
            frame_with_images([wire_image()], pooling=[1, True, None]), [bytes(24)]
        )
    with pytest.raises(ProtocolError, match="no images"):
        encode(AddRequest("e", [1, 9, 9], pooling=PoolingParams(), images=(image(),)))


def test_the_encoder_checks_images_as_the_decoder_does() -> None:
    with pytest.raises(ProtocolError, match="image length"):
        encode(request(image(offset=5, length=3)))
    assert msgpack.unpackb(encode(request(image())))[:2] == [MsgType.ADD_REQUEST, PROTOCOL_VERSION]


def test_a_frame_ending_in_an_absent_optional_field_is_refused() -> None:
    """Absent trailing fields are left out, never sent as nil (one spelling for each frame)."""
    fields = msgpack.unpackb(encode(request(image())))
    fields[-1] = None
    with pytest.raises(ProtocolError, match="last optional field"):
        decode_client_message(msgpack.packb(fields, use_bin_type=True), [bytes(24)])
    with pytest.raises(ProtocolError, match="last optional field"):
        decode_client_message(msgpack.packb(fields[:-1], use_bin_type=True), [bytes(24)])
