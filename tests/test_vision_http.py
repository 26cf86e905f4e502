"""Images through the real server (`tandem serve` processes, the official `openai` client) on a
tiny random Qwen2.5-VL: data URLs give HF transformers' greedy tokens and count the image's
tokens in usage; every bad image is a 400 in OpenAI's error shape naming its part; a URL image
is refused unless --allowed-media-domains names its host (allowed: fetched from a loopback HTTP
server); a text-only model refuses image parts."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.server_fixture import Server, start_server, stop_server, tiny_server  # noqa: F401
from tests.test_vision_engine import prompt
from tests.vision_factories import (
    hf_vl_greedy,
    png_bytes,
    random_image,
    write_tiny_qwen2_5_vl,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
SERVE = ["--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-batched-tokens", "32"]
SERVE += ["--max-num-seqs", "8"]
SERVE += ["--served-model-name", "default", "--limit-mm-per-prompt", '{"image": 2}']


@pytest.fixture(scope="module")
def vl_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), default_model_dir)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A loopback HTTP server with /cat.png (the image of seed 7) and nothing else."""
    body = png_bytes(random_image(7))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@pytest.fixture(scope="module")
def vl_server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("serve-vl"), model=str(vl_dir), args=SERVE)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def fetching_server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [*SERVE, "--allowed-media-domains", "127.0.0.1"]
    srv = start_server(tmp_path_factory.mktemp("serve-vl-fetch"), model=str(vl_dir), args=args)
    try:
        yield srv
    finally:
        stop_server(srv)


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    image_url: dict[str, Any] = {"url": url}
    if detail is not None:
        image_url["detail"] = detail
    return {"type": "image_url", "image_url": image_url}


def ask_about_image(srv: Server, text: str, image: Any, max_tokens: int) -> Any:
    """The ``openai`` client's greedy reply (EOS ignored) to ``text`` and the PIL ``image`` sent
    as a PNG data URL, from the model served as ``default``."""
    content = [{"type": "text", "text": text}, image_part(data_url(png_bytes(image)))]
    return client_of(srv).chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip


def chat(srv: Server, content: list[dict[str, Any]]) -> Any:
    client = client_of(srv)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def expected_reply(vl_dir: Path, parts: list[Any]) -> tuple[str, int]:
    """HF transformers' greedy text for a user turn of ``parts`` (strings and PIL images), and
    its prompt's token count with every image's placeholders."""
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    from frontend.vision import VisionProcessor

    processor = VisionProcessor.load(vl_dir)
    assert processor is not None
    ids, _, pil = prompt(vl_dir, processor, parts)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    hf_processor = AutoImageProcessor.from_pretrained(str(vl_dir))
    tokens = hf_vl_greedy(model, hf_processor, ids, pil, MAX_TOKENS)
    text = AutoTokenizer.from_pretrained(str(vl_dir)).decode(tokens, skip_special_tokens=True)
    return text, len(ids)


def test_data_url_images_give_hf_greedy_tokens(vl_server: Server, vl_dir: Path) -> None:
    cat, dog = random_image(7), random_image(8, width=60, height=150)
    text, prompt_tokens = expected_reply(vl_dir, ["Compare", cat, "with", dog])
    reply = chat(
        vl_server,
        [
            {"type": "text", "text": "Compare"},
            image_part(data_url(png_bytes(cat))),
            {"type": "text", "text": "with"},
            image_part(data_url(png_bytes(dog, "WEBP"), "image/webp"), detail="auto"),
        ],
    )
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens  # the images' placeholders counted


def truncated_png() -> bytes:
    raw = png_bytes(random_image(9))
    return raw[: len(raw) // 2]


def huge_png() -> bytes:
    """A 9,000 x 8,000 bilevel PNG: a few kilobytes that would decode to 72 million pixels."""
    from PIL import Image

    return png_bytes(Image.new("1", (9000, 8000)))


def thin_image() -> Any:
    from PIL import Image

    return Image.new("RGB", (201, 1))


BAD_IMAGES = {
    "truncated": (lambda: [image_part(data_url(truncated_png()))], "[0]", "does not decode"),
    "not an image": (
        lambda: [image_part(data_url(b"hello, not a picture"))],
        "[0]",
        "not a PNG, JPEG or WebP image",
    ),
    # Qwen2-VL's processor refuses an aspect ratio past 200 (a ValueError: it was a 500).
    "too narrow": (lambda: [image_part(data_url(png_bytes(thin_image())))], "[0]", "aspect"),
    "too many pixels": (lambda: [image_part(data_url(huge_png()))], "[0]", "pixels"),
    "too many images": (
        lambda: [image_part(data_url(png_bytes(random_image(i)))) for i in range(3)],
        "[2]",
        "--limit-mm-per-prompt",
    ),
    "not base64": (lambda: [image_part("data:image/png;base64,@@@")], "[0]", "base64"),
    "a gif": (lambda: [image_part(data_url(b"GIF89a", "image/gif"))], "[0]", "image/png"),
    "detail high": (
        lambda: [image_part(data_url(png_bytes(random_image(1))), "high")],
        "[0].image_url.detail",
        "detail",
    ),
    "url while fetching is off": (
        lambda: [image_part("http://127.0.0.1:9/cat.png")],
        "[0]",
        "--allowed-media-domains",
    ),
    "file url without a path": (lambda: [image_part("file:///etc/hostname")], "[0]", "file://"),
}


def assert_openai_400(err: openai.BadRequestError, param: str, words: str) -> None:
    assert err.status_code == 400
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert words in body["error"]["message"]


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_each_bad_image_is_a_400_naming_its_part(vl_server: Server, case: str) -> None:
    make, part, words = BAD_IMAGES[case]
    with pytest.raises(openai.BadRequestError) as info:
        chat(vl_server, [{"type": "text", "text": "Look"}, *make()])
    # The text part is content[0], so the first image part is content[1].
    index = int(part[1]) + 1
    assert_openai_400(info.value, f"messages[0].content[{index}]{part[3:]}", words)
    assert " object at 0x" not in info.value.response.json()["error"]["message"]


def test_a_transparent_image_gives_hfs_greedy_tokens(vl_server: Server, vl_dir: Path) -> None:
    """Transparent pixels are white to the model, as HF's processor composites them (their
    colours underneath, which a bare RGB conversion kept, must not show)."""
    from PIL import Image

    pixels = np.asarray(random_image(11)).copy()
    alpha = np.full(pixels.shape[:2] + (1,), 255, dtype=np.uint8)
    alpha[:40] = 0  # the top half transparent, over random colours
    image = Image.fromarray(np.concatenate([pixels, alpha], axis=2), "RGBA")
    text, _ = expected_reply(vl_dir, ["Look", image])
    reply = chat(
        vl_server, [{"type": "text", "text": "Look"}, image_part(data_url(png_bytes(image)))]
    )
    assert reply.choices[0].message.content == text


def test_the_server_still_serves_after_bad_images(vl_server: Server) -> None:
    reply = chat(vl_server, [{"type": "text", "text": "hi"}])
    assert reply.choices[0].finish_reason == "length"


def test_an_allowed_host_is_fetched(fetching_server: Server, vl_dir: Path, image_host: str) -> None:
    text, prompt_tokens = expected_reply(vl_dir, ["What is this?", random_image(7)])
    content = [{"type": "text", "text": "What is this?"}, image_part(f"{image_host}/cat.png")]
    reply = chat(fetching_server, content)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        chat(fetching_server, [image_part(f"{image_host}/missing.png")])
    assert_openai_400(info.value, "messages[0].content[0]", "HTTP 404")


def test_tools_beside_an_image_give_hf_greedy_tokens(vl_server: Server, vl_dir: Path) -> None:
    """Qwen2.5-VL's template ignores tools, so a request with tools renders through the packaged
    ChatML tool template, which writes an image part as the model's own template does (it was a
    400: the template joined a list of parts to a string). HF's greedy reply to that prompt,
    the marker written here by hand, is the oracle."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from frontend.tools import CHATML_TOOLS_TEMPLATE
    from frontend.vision import VisionProcessor

    tool = {"type": "function", "function": {"name": "colour", "parameters": {"type": "object"}}}
    cat = random_image(7)
    content = [{"type": "text", "text": "What colour?"}, image_part(data_url(png_bytes(cat)))]
    reply = client_of(vl_server).chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], tools=[tool],
        tool_choice="auto", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip

    marker = "{%- set image_marker = '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    parts = [{"type": "text", "text": "What colour?"}, {"type": "image"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tools=[tool], tokenize=False,
        add_generation_prompt=True, chat_template=marker + CHATML_TOOLS_TEMPLATE.read_text(),
    )  # fmt: skip
    assert text.count("<|image_pad|>") == 1 and '"name": "colour"' in text
    processor = VisionProcessor.load(vl_dir)
    assert processor is not None
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids, _ = processor.place(ids, processor.process([cat], ["image 0"]))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    hf_processor = AutoImageProcessor.from_pretrained(str(vl_dir))
    tokens = hf_vl_greedy(model, hf_processor, ids, [cat], MAX_TOKENS)
    assert reply.choices[0].message.content == tokenizer.decode(tokens, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(ids)


def test_a_text_model_refuses_image_parts(tiny_server: Server) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        chat(tiny_server, [{"type": "text", "text": "hi"}, image_part(data_url(b"x"))])
    assert_openai_400(info.value, "messages[0].content[1]", "takes no images")


def test_tokenize_counts_the_image_tokens(vl_server: Server, vl_dir: Path) -> None:
    import httpx

    _, prompt_tokens = expected_reply(vl_dir, ["What is this?", random_image(7)])
    content = [
        {"type": "text", "text": "What is this?"},
        image_part(data_url(png_bytes(random_image(7)))),
    ]
    body = {"messages": [{"role": "user", "content": content}]}
    reply = httpx.post(f"{vl_server.base_url}/tokenize", json=body, timeout=60).json()
    assert reply["count"] == prompt_tokens


def test_a_streamed_image_chat_with_two_choices(vl_server: Server, vl_dir: Path) -> None:
    import io

    from PIL import Image

    jpeg = png_bytes(random_image(11), "JPEG")
    # JPEG is lossy: HF gets the pixels the server decodes from it.
    decoded = Image.open(io.BytesIO(jpeg)).convert("RGB")
    text, _ = expected_reply(vl_dir, [decoded, "Describe it."])
    client = client_of(vl_server)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {
                "role": "user",
                "content": [
                    image_part(data_url(jpeg, "image/jpeg")),
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [text, text]


# ---- the Responses API's input_image parts --------------------------------------------------


def respond(srv: Server, content: list[dict[str, Any]]) -> Any:
    client = client_of(srv)
    return client.responses.create(
        model=client.models.list().data[0].id,
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )


def test_responses_input_images_are_the_chat_apis_image_parts(vl_server: Server) -> None:
    """input_image parts (data URLs, `detail` auto or left out) give the chat API's reply to the
    same image parts (whose tokens test_data_url_images_give_hf_greedy_tokens holds to HF's), the
    images' placeholders counted in the input tokens."""
    cat, dog = data_url(png_bytes(random_image(7))), data_url(png_bytes(random_image(8)))
    client = client_of(vl_server)
    want = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    image_part(cat),
                    {"type": "text", "text": "with"},
                    image_part(dog, detail="auto"),
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    reply = respond(
        vl_server,
        [
            {"type": "input_text", "text": "Compare"},
            {"type": "input_image", "image_url": cat},
            {"type": "input_text", "text": "with"},
            {"type": "input_image", "image_url": dog, "detail": "auto"},
        ],
    )
    assert reply.output_text == want.choices[0].message.content
    assert reply.usage.input_tokens == want.usage.prompt_tokens


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        ({"image_url": data_url(b"not an image")}, "input.0.content.1", "image"),
        ({"image_url": "data:,", "detail": "high"}, "input.0.content.1.detail", "detail"),
        # Not a detail at all: named by its item and part too (it was "input", "a valid string").
        ({"image_url": "data:,", "detail": "bogus"}, "input.0.content.1.detail", "'low'"),
        ({"file_id": "file-1"}, "input.0.content.1.file_id", "file_id"),
    ],
)
def test_a_bad_input_image_is_a_400_naming_its_part(
    vl_server: Server, part: dict[str, Any], param: str, words: str
) -> None:
    content = [{"type": "input_text", "text": "Look"}, {"type": "input_image", **part}]
    with pytest.raises(openai.BadRequestError) as info:
        respond(vl_server, content)
    assert_openai_400(info.value, param, words)
