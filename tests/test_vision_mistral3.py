"""Mistral 3 with images (``Mistral3ForConditionalGeneration``) on the CPU: a tiny random model
written with ``save_pretrained``, Pixtral's real HF image processor (its PIL backend) and the
API process's placement (frontend/vision.py), through one real engine, against HF
transformers' greedy tokens: one image, two images of different sizes, an image whose run
crosses chunk ends, the same image again (an encoder-cache hit, the same tokens). The prompt's
ids are checked against HF's PixtralProcessor layout ([IMG] rows closed by [IMG_BREAK],
the last by [IMG_END]); config fields we do not implement are refused by name; one server test
with the official ``openai`` client sends a data-URL image and a bad one (a 400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from engine_core.llm import LLM
from engine_core.models import model_config_from_hf
from engine_core.multimodal import cell_positions, image_tokens
from frontend.vision import PixtralVisionProcessor, VisionProcessor
from protocol.messages import ImageInput, SamplingParams, TensorBytes
from tests.server_fixture import Server, start_server, stop_server
from tests.test_vision_http import (
    ask_about_image,
    assert_openai_400,
    chat,
    data_url,
    image_part,
)
from tests.vision_factories import (
    MERGE,
    PIXTRAL_PATCH,
    hf_generate,
    png_bytes,
    random_image,
    warm_up_with_its_image,
    write_tiny_mistral3,
)

NEW_TOKENS = 6
CHUNK = 16
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ENGINE_OPTIONS: dict[str, Any] = dict(
    block_size=4, num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=CHUNK,
    max_num_seqs=4,
)  # fmt: skip


class Case:
    """The tiny model's folder, HF's model, its tokenizer and image processor, and our
    engine over it."""

    def __init__(self, folder: Path, **llm_options: Any) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer
        from transformers import Mistral3ForConditionalGeneration as HFMistral3

        self.folder = folder
        self.hf = HFMistral3.from_pretrained(str(folder)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        processor = VisionProcessor.load(folder)
        assert isinstance(processor, PixtralVisionProcessor)
        self.processor = processor
        self.llm = LLM(str(folder), **(ENGINE_OPTIONS | llm_options))

    def hf_pixels(self, pil: list[Any]) -> dict[str, torch.Tensor]:
        """HF's processor's pixel_values (padded to the largest image) and image_sizes, with
        the patch size PixtralProcessor gives it (patch x merge)."""
        block = PIXTRAL_PATCH * MERGE
        patch = {"height": block, "width": block}
        return dict(self.image_processor(images=pil, patch_size=patch, return_tensors="pt"))

    def hf_ids(self, text: str, pil: list[Any]) -> list[int]:
        """The ids HF's PixtralProcessor gives the rendered ``text``: each [IMG] replaced, in
        text, by its image's rows as HF's replace_image_token writes them (height and width
        from HF's image processor over patch x merge: rows of [IMG] each closed by
        [IMG_BREAK], the last by [IMG_END]), then tokenized. Written out here because HF's
        processor module needs torchvision even to import."""
        block = PIXTRAL_PATCH * MERGE
        sizes = self.hf_pixels(pil)["image_sizes"].tolist() if pil else []
        pieces = text.split("[IMG]")
        out = pieces[0]
        for (height, width), piece in zip(sizes, pieces[1:], strict=True):
            rows = ["[IMG]" * (width // block) + "[IMG_BREAK]"] * (height // block)
            out += "".join(rows).removesuffix("[IMG_BREAK]") + "[IMG_END]" + piece
        return self.tokenizer.encode(out, add_special_tokens=False)

    def prompt(self, parts: list[Any]) -> tuple[list[int], tuple[ImageInput, ...], list[Any]]:
        """A user turn of text strings and PIL images, rendered by the chat template and
        placed as the API process does: (ids, wire images, the PIL images); the ids checked
        against HF's processor's."""
        content = [
            {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
        ]
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        pil = [p for p in parts if not isinstance(p, str)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        names = [f"image {i}" for i in range(len(pil))]
        ids, images = self.processor.place(ids, self.processor.process(pil, names))
        assert ids == self.hf_ids(text, pil)
        return ids, images, pil

    def hf_greedy(self, ids: list[int], pil: list[Any]) -> list[int]:
        return hf_generate(self.hf, ids, NEW_TOKENS, **(self.hf_pixels(pil) if pil else {}))

    def generate(self, built: list[tuple[list[int], tuple[ImageInput, ...], Any]]) -> list[Any]:
        outs = self.llm.generate(
            [ids for ids, _, _ in built],
            PARAMS,
            detokenize=False,
            images=[images for _, images, _ in built],
        )
        return [out.token_ids for out in outs]


@pytest.fixture(scope="module")
def case(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    folder = write_tiny_mistral3(tmp_path_factory.mktemp("tiny-mistral3"), default_tokenizer_dir)
    made = Case(folder)
    try:
        yield made
    finally:
        made.llm.engine.shutdown()


def test_one_image_and_two_of_different_sizes_give_hf_s_tokens(case: Case) -> None:
    """One image; two images of different sizes (6 x 5 and 6 x 2 merged cells) in one
    prompt, whose runs cross 16-token chunk ends; all in one batch. With the images' rows
    zeroed HF gives other tokens, so the test sees where the embeddings land."""
    wide, tall = random_image(1, width=100, height=80), random_image(2, width=60, height=150)
    built = [
        case.prompt(["What is in", wide, "this picture?"]),
        case.prompt([wide, "and", tall, "differ how?"]),
    ]
    grids = [image.grid_thw for image in built[1][1]]
    assert grids[0] != grids[1]
    assert all(i.offset // CHUNK != (i.offset + i.length) // CHUNK for i in built[1][1])
    expected = [case.hf_greedy(ids, pil) for ids, _, pil in built]
    assert case.generate(built) == expected
    blank = [p.point(lambda _: 0) for p in built[0][2]]
    assert case.hf_greedy(built[0][0], blank) != expected[0]


def test_the_same_image_again_is_an_encoder_cache_hit_with_the_same_tokens(case: Case) -> None:
    """The same image in a second request (other text before it, so no prefix-cache hit
    reaches it): encoded once, every chunk of the second taking its rows from the encoder
    cache, HF's tokens both times. The first prompt again hits the prefix cache past its
    image and still gives HF's tokens."""
    image = random_image(5, width=40, height=44)
    first = case.prompt(["Look:", image, "what now?"])
    again = case.prompt(["Now look again at", image, "what now?"])
    runner = case.llm.engine.runner.multimodal
    encoded = runner.encoded_images
    assert case.generate([first]) == [case.hf_greedy(first[0], first[2])]
    misses, hits = runner.cache.misses, runner.cache.hits
    assert case.generate([again]) == [case.hf_greedy(again[0], again[2])]
    assert runner.encoded_images - encoded == 1
    assert runner.cache.misses == misses and runner.cache.hits > hits
    prefix_hits = case.llm.engine.scheduler.counts().prefix_cache_hits
    assert case.generate([first]) == [case.hf_greedy(first[0], first[2])]
    # Every whole block of the prompt again, its image's blocks keyed by the image's hash.
    whole_blocks = (len(first[0]) - 1) // ENGINE_OPTIONS["block_size"]
    assert case.llm.engine.scheduler.counts().prefix_cache_hits - prefix_hits == whole_blocks * 4


def test_the_warm_up_s_blank_image_has_row_breaks_and_passes_the_checks(case: Case) -> None:
    """The start-up warm-up's image (run on CUDA before the first request) in Pixtral's
    layout: 2D patches, a run of rows each closed by a non-placeholder token."""
    blank = warm_up_with_its_image(case.llm.engine.runner)
    _, rows, cols = blank.grid_thw
    assert blank.pixels.shape == (rows * cols, 3 * PIXTRAL_PATCH**2)
    assert blank.length == (rows // MERGE) * (cols // MERGE + 1)


def test_our_tower_and_projector_are_hf_s(case: Case) -> None:
    """The engine's encoder on the API process's patches of two images against HF's
    get_image_features on its own padded pixels of the same images."""
    pil = [random_image(3, width=48, height=20), random_image(4, width=16, height=40)]
    processed = case.processor.process(pil, ["a", "b"])
    patches = torch.cat([torch.from_numpy(p.pixels) for p in processed])
    ours = case.llm.engine.runner.model.encode_images(patches, [p.grid_thw for p in processed])
    with torch.no_grad():
        theirs = case.hf.model.get_image_features(**case.hf_pixels(pil)).pooler_output
    torch.testing.assert_close(ours, torch.cat(theirs), rtol=1e-4, atol=1e-5)
    # The tiny tower's near-uniform attention hides its rotary frequencies from the features:
    # the loaded buffer (recomputed after the meta-device build) is checked against HF's.
    tower = case.llm.engine.runner.model.vision_tower
    rotary = case.hf.model.vision_tower.patch_positional_embedding
    torch.testing.assert_close(tower.inv_freq, rotary.inv_freq)


@pytest.mark.parametrize(
    ("field", "value"), [("vision_feature_layer", -2), ("projector_hidden_act", "relu")]
)
def test_fields_we_do_not_implement_are_refused_by_name(case: Case, field: str, value: Any) -> None:
    hf = json.loads((case.folder / "config.json").read_text()) | {field: value}
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(hf)


def test_a_processor_that_does_not_resize_is_refused_by_name(case: Case, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((case.folder / name).read_bytes())
    processor = json.loads((case.folder / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor | {"do_resize": False}))
    with pytest.raises(ValueError, match="do_resize"):
        VisionProcessor.load(tmp_path)


def test_a_run_without_its_row_breaks_is_refused(case: Case) -> None:
    """A client of the raw protocol sending an image's [IMG] tokens as one run (no breaks):
    the engine refuses it instead of writing the embeddings at the wrong rows."""
    ids, (image,), _ = case.prompt(["See", random_image(6, width=16, height=16), "?"])
    placeholder = case.processor.marker.placeholder_id
    bad = list(ids)
    bad[image.offset : image.offset + image.length] = [placeholder] * image.length
    with pytest.raises(ValueError, match="placeholder"):
        case.llm.generate([bad], PARAMS, detokenize=False, images=[(image,)])


@pytest.fixture(scope="module")
def server(case: Case, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-batched-tokens", "32"]
    args += ["--max-num-seqs", "4", "--served-model-name", "default"]
    folder = tmp_path_factory.mktemp("serve-mistral3")
    srv = start_server(folder, model=str(case.folder), args=args)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_the_openai_client_sends_a_data_url_image_and_a_bad_one_is_a_400(
    server: Server, case: Case
) -> None:
    """A PNG data URL gives HF's greedy text, usage counting the image's rows and breaks; an
    image that does not decode is a 400 in OpenAI's error shape naming its part."""
    image = random_image(7, width=70, height=30)
    ids, _, pil = case.prompt(["Describe", image])
    text = case.tokenizer.decode(case.hf_greedy(ids, pil), skip_special_tokens=True)
    reply = ask_about_image(server, "Describe", image, NEW_TOKENS)
    assert reply.choices[0].message.content == text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    truncated = data_url(png_bytes(image)[:60])
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, [{"type": "text", "text": "Look"}, image_part(truncated)])
    assert_openai_400(info.value, "messages[0].content[1]", "does not decode")


def test_cell_positions_skip_each_row_s_break_by_hand() -> None:
    """An image of 4 x 6 patches merged 2 x 2: two rows of three cells, each row closed by a
    break, 8 tokens. Tokens 2..6 of its run are cell 2, the first row's break, cells 3-5."""
    image = ImageInput(
        b"\0" * 32, 10, 8, TensorBytes("float32", (24, 48), b"\0" * 24 * 48 * 4), (1, 4, 6)
    )
    assert image_tokens(image, 2, row_breaks=True) == 8 and image_tokens(image, 2) == 6
    tokens, cells = cell_positions(image, 2, True, 2, 7)
    assert tokens.tolist() == [2, 4, 5, 6] and cells.tolist() == [2, 3, 4, 5]
    tokens, cells = cell_positions(image, 2, False, 2, 5)
    assert tokens.tolist() == cells.tolist() == [2, 3, 4]


def test_the_benchmark_s_encoder_table_for_mistral3(case: Case, tmp_path: Path) -> None:
    from benchmarks.__main__ import parse
    from benchmarks.vision import run

    folder = case.folder
    out = tmp_path / "vision.json"
    argv = [
        "vision", "--model", str(folder), "--device", "cpu", "--batches", "1,3",
        "--encoder-trials", "1", "--skip-http", "--json", str(out), "--image-size", "40",
    ]  # fmt: skip
    assert run(parse(argv)) == 0
    rows = json.loads(out.read_text())["results"]["encoder"]
    # A 40-pixel image fits 48 pixels as it is: 40 x 40 in 8-pixel blocks, 10 x 10 patches of
    # 4 pixels, 5 x 5 merged cells an image.
    assert [(r["batch"], r["patches_per_image"], r["tokens_per_image"]) for r in rows] == [
        (1, 100, 25),
        (3, 100, 25),
    ]
