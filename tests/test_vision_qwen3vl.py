"""A tiny random Qwen3-VL (``Qwen3VLForConditionalGeneration``) through one real engine on the
CPU (``engine_core.llm.LLM``), its prompts placed by the API process's code (frontend/vision.py)
with the real HF image processor, against HF transformers' greedy tokens: one image, two
images, an image whose placeholders (and so its DeepStack additions) cross a chunk's end, the
same image twice (encoder-cache and prefix-cache hits, the hit past the image), a prefix hit
ending inside an image. Our vision tower (with its DeepStack features) against HF's, our
interleaved M-RoPE split against HF's; one server test with the official ``openai`` client (a
data URL image; a video part refused by name)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from engine_core.llm import LLM
from frontend.vision import VisionProcessor
from protocol.messages import ImageInput, SamplingParams
from tests.server_fixture import Server, start_server, stop_server
from tests.test_vision_engine import LONG_TEXT, prompt
from tests.test_vision_http import ask_about_image
from tests.vision_factories import (
    QWEN3_PATCH,
    hf_vl_greedy,
    random_image,
    warm_up_with_its_image,
    write_tiny_qwen3_vl,
)

NEW_TOKENS = 8
BLOCK = 4
CHUNK = 16
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_dir(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"), default_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(vl_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    return model, AutoImageProcessor.from_pretrained(str(vl_dir))


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> VisionProcessor:
    loaded = VisionProcessor.load(vl_dir)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def llm(vl_dir: Path) -> Iterator[LLM]:
    """The one engine this file's engine tests share: 4-token blocks, 16-token chunks."""
    engine = LLM(
        str(vl_dir), block_size=BLOCK, num_kv_blocks=128, max_model_len=512,
        max_num_batched_tokens=CHUNK, max_num_seqs=4,
    )  # fmt: skip
    try:
        yield engine
    finally:
        engine.engine.shutdown()


def without_deepstack(model: Any) -> Any:
    """A copy of HF's model whose DeepStack features are all zero (adding them changes
    nothing): what the tokens would be if the features were lost."""
    flat = copy.deepcopy(model)
    with torch.no_grad():
        for merger in flat.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    return flat


def generate(llm: LLM, ids: list[int], images: tuple[ImageInput, ...]) -> list[int]:
    return llm.generate([ids], PARAMS, detokenize=False, images=[images])[0].token_ids


def encoder_counts(llm: LLM) -> tuple[int, int]:
    """(images encoded, encoder-cache hits) so far."""
    multimodal = llm.engine.runner.multimodal
    return multimodal.encoded_images, multimodal.cache.hits


def test_engine_matches_hf_with_images_and_deepstack(
    llm: LLM, vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """One batch: one image, two images, and an image after text whose placeholder run
    crosses a 16-token chunk's end (each chunk adds the DeepStack features of its own rows).
    Without DeepStack HF gives other tokens, so the features are what makes them match."""
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = {
        "one image": ["What is in", cat, "this picture?"],
        "two images": [cat, "and", dog, "differ how?"],
        "an image across chunks": [LONG_TEXT, dog, "what is it?"],
    }
    built = {name: prompt(vl_dir, processor, parts) for name, parts in cases.items()}
    crossing = built["an image across chunks"][1][0]
    assert crossing.offset // CHUNK != (crossing.offset + crossing.length - 1) // CHUNK
    expected = {name: hf_vl_greedy(*hf, i, pil, NEW_TOKENS) for name, (i, _, pil) in built.items()}
    flat = without_deepstack(hf[0])
    for name in ("one image", "an image across chunks"):
        ids, _, pil = built[name]
        assert hf_vl_greedy(flat, hf[1], ids, pil, NEW_TOKENS) != expected[name]
    outs = llm.generate(
        [ids for ids, _, _ in built.values()],
        PARAMS,
        detokenize=False,
        images=[images for _, images, _ in built.values()],
    )
    assert {name: o.token_ids for name, o in zip(built, outs, strict=True)} == expected


def test_same_image_twice_hits_both_caches_past_the_image(
    llm: LLM, vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """The same prompt twice: the second takes every whole block but the last token's from the
    prefix cache (a hit past the image: its rows need no embeddings and no DeepStack), and the
    image is encoded once."""
    ids, images, pil = prompt(vl_dir, processor, ["Look:", random_image(3), "what now?"])
    expected = hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
    encoded, _ = encoder_counts(llm)
    assert generate(llm, ids, images) == expected
    hits = llm.engine.scheduler.counts().prefix_cache_hits
    assert generate(llm, ids, images) == expected
    assert llm.engine.scheduler.counts().prefix_cache_hits - hits == (len(ids) - 1) // BLOCK * BLOCK
    assert encoder_counts(llm)[0] - encoded == 1


def test_a_prefix_hit_that_ends_inside_an_image_takes_the_rest_of_it(
    llm: LLM, vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """Two prompts with the same image and different text after it: the second's hit ends in a
    block of the image's run, so its first chunk starts inside the image and adds the
    embeddings and DeepStack features of the image's remaining rows (from the encoder
    cache)."""
    image = random_image(12)
    for prefix in ("Look", "Look here", "Look at this", "Now look at this"):
        first_ids, first_images, _ = prompt(vl_dir, processor, [prefix, image, "alpha"])
        end = first_images[0].offset + first_images[0].length  # then <|vision_end|>, then text
        if end % BLOCK in (1, 2):  # the block of the image's end holds text after it
            break
    else:
        pytest.fail("no prefix puts the image's end and the text in one block")
    ids, images, pil = prompt(vl_dir, processor, [prefix, image, "beta gamma"])
    generate(llm, first_ids, first_images)
    encoded, cache_hits = encoder_counts(llm)
    hits = llm.engine.scheduler.counts().prefix_cache_hits
    assert generate(llm, ids, images) == hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
    hit = llm.engine.scheduler.counts().prefix_cache_hits - hits
    assert images[0].offset < hit < end  # the hit ends inside the image's run
    assert encoder_counts(llm) == (encoded, cache_hits + 1)


def test_our_vision_tower_and_deepstack_features_are_hf_s(llm: LLM, hf: tuple[Any, Any]) -> None:
    """The engine's tower (models/qwen3_vl_vision.py) against HF's on random pixels of three
    images at once: one smaller than the 4x4 learned position grid, one two frames deep, one
    larger (the grid resampled up); the embeddings and every DeepStack feature."""
    grids = [(1, 2, 4), (2, 8, 4), (1, 10, 14)]
    patches = sum(t * h * w for t, h, w in grids)
    width = 3 * 2 * QWEN3_PATCH * QWEN3_PATCH
    pixels = torch.randn(patches, width, generator=torch.Generator().manual_seed(0))
    ours = llm.engine.runner.model.encode_images(pixels, grids)
    with torch.no_grad():
        out = hf[0].model.visual(pixels, grid_thw=torch.tensor(grids))
    theirs = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sections", [(24, 20, 20), (2, 3, 3)])
def test_interleaved_mrope_split_is_hf_s(sections: tuple[int, int, int]) -> None:
    """Which of the three positions turns each rotary frequency, against HF's
    recomposition_frequencies (fed frequencies equal to their axis' index): Qwen3-VL-8B's
    sections and the tiny model's."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from engine_core.models.qwen2_5_vl import section_of_each_frequency

    rotary = Qwen3VLTextRotaryEmbedding.__new__(Qwen3VLTextRotaryEmbedding)
    rotary.mrope_section = list(sections)
    half = sum(sections)
    axes = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, half).clone()
    theirs = rotary.recomposition_frequencies(axes)[0, 0, :half].long()
    assert section_of_each_frequency(sections, interleaved=True).tolist() == theirs.tolist()


@pytest.fixture(scope="module")
def vl_server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-batched-tokens", "32"]
    args += ["--max-num-seqs", "8", "--served-model-name", "default"]
    srv = start_server(tmp_path_factory.mktemp("serve-qwen3-vl"), model=str(vl_dir), args=args)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_server_takes_a_data_url_image_and_refuses_a_video_by_name(
    vl_server: Server, vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    from transformers import AutoTokenizer

    image = random_image(7)
    ids, _, pil = prompt(vl_dir, processor, ["Describe", image])
    tokens = hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
    text = AutoTokenizer.from_pretrained(str(vl_dir)).decode(tokens, skip_special_tokens=True)
    reply = ask_about_image(vl_server, "Describe", image, NEW_TOKENS)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(ids)  # the image's placeholders counted
    client = openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="unused", max_retries=0)
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": [video]}], max_tokens=4
        )
    assert refused.value.status_code == 400
    assert "video_url" in refused.value.message and "not supported" in refused.value.message


def test_the_warm_up_encodes_a_blank_image_and_keeps_nothing(
    llm: LLM, vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The start-up warm-up's image step runs the tower once on a square grid of whole merged
    cells, through a 16-token chunk that ends inside the image; afterwards the encoder cache and
    its counts are empty, and an image request still gets HF's tokens."""
    runner = llm.engine.runner
    grids: list[list[tuple[int, int, int]]] = []
    encode = runner.model.encode_images
    monkeypatch.setattr(
        runner.model, "encode_images", lambda pixels, g: grids.append(g) or encode(pixels, g)
    )
    blank = warm_up_with_its_image(runner)
    monkeypatch.undo()
    t, h, w = blank.grid_thw
    merge = runner.model_config.vision.spatial_merge_size
    assert grids == [[blank.grid_thw]] and t == 1 and h == w and h % merge == 0
    ids, images, pil = prompt(vl_dir, processor, ["After warming up:", random_image(5)])
    assert generate(llm, ids, images) == hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
