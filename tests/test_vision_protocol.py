"""A prompt's images on the wire: they round-trip, and every malformed one is a ProtocolError
naming the request (never another exception, never a request that reaches the engine)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from protocol.codec import ProtocolError, decode_client_message, encode
from protocol.messages import (
    PROTOCOL_VERSION,
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


def test_images_round_trip() -> None:
    msg = request(image(), image(4, 1, hash=b"\x01" * 32))
    decoded = decode_client_message(encode(msg))
    assert decoded == msg
    assert np.frombuffer(decoded.images[0].pixels.data, np.float32).tolist() == [0, 1, 2, 3, 4, 5]


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
    decoded = decode_client_message(encode(request(big)))
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
        "data": bytes(24),
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
        ([wire_image(data=bytes(20))], "pixels"),
        ([wire_image(shape=[3, 2, 1, 1, 1])], "dims"),
        ([wire_image(grid=[1, 0, 4])], "grid_thw"),
        ([wire_image(), wire_image(offset=2, length=1)], "prompt order"),
        ([wire_image(offset=True)], "int"),
        ("not a list", "array"),
    ],
)
def test_malformed_images_are_protocol_errors(images: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as caught:
        decode_client_message(frame_with_images(images))
    assert caught.value.request_id == "r"


def test_images_never_go_with_pooling() -> None:
    with pytest.raises(ProtocolError, match="no images"):
        decode_client_message(frame_with_images([wire_image()], pooling=[1, True, None]))
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
        decode_client_message(msgpack.packb(fields, use_bin_type=True))
    with pytest.raises(ProtocolError, match="last optional field"):
        decode_client_message(msgpack.packb(fields[:-1], use_bin_type=True))
