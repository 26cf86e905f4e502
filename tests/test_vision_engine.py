"""A tiny random Qwen2.5-VL through the real engine on the CPU (``engine_core.llm.LLM``), its
prompts placed by the API process's code (frontend/vision.py) with the real HF image processor,
against HF transformers' greedy tokens: one image, two images, an image in a prompt longer than
a prefill chunk (its placeholder run split across chunks), and the same image twice (an encoder
cache hit). Two prompts with the same text and different images share no KV block past the
first image; the same image twice takes the prefix cache's blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_core.llm import LLM
from frontend.vision import VisionProcessor
from protocol.messages import ImageInput, SamplingParams
from tests.vision_factories import (
    hf_vl_greedy,
    random_image,
    warm_up_with_its_image,
    write_tiny_qwen2_5_vl,
)

NEW_TOKENS = 8
BLOCK = 4
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_dir(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), default_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(vl_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    return model, AutoImageProcessor.from_pretrained(str(vl_dir))


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> VisionProcessor:
    loaded = VisionProcessor.load(vl_dir)
    assert loaded is not None
    return loaded


def prompt(
    vl_dir: Path, processor: VisionProcessor, parts: list[Any]
) -> tuple[list[int], tuple[ImageInput, ...], list[Any]]:
    """A user turn of text strings and PIL images, rendered by the chat template, tokenized and
    its images placed: (token ids, wire images, the PIL images)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    pil = [p for p in parts if not isinstance(p, str)]
    names = [f"image {i}" for i in range(len(pil))]
    ids, images = processor.place(ids, processor.process(pil, names))
    return ids, images, pil


def make_llm(vl_dir: Path, **overrides: Any) -> LLM:
    config: dict[str, Any] = dict(
        block_size=BLOCK, num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=16,
        max_num_seqs=4,
    )  # fmt: skip
    config.update(overrides)
    return LLM(str(vl_dir), **config)


LONG_TEXT = " ".join(["a long question about the picture"] * 6)


def test_engine_matches_hf_with_images(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = {
        "one image": ["What is in", cat, "this picture?"],
        "two images": [cat, "and", dog, "differ how?"],
        "long text and an image": [LONG_TEXT, dog, LONG_TEXT],
    }
    built = {name: prompt(vl_dir, processor, parts) for name, parts in cases.items()}
    assert len(built["long text and an image"][0]) > 16 * 4  # several chunks of 16 tokens
    expected = {
        name: hf_vl_greedy(*hf, ids, pil, NEW_TOKENS) for name, (ids, _, pil) in built.items()
    }
    llm = make_llm(vl_dir)
    try:
        outs = llm.generate(
            [ids for ids, _, _ in built.values()],
            PARAMS,
            detokenize=False,
            images=[images for _, images, _ in built.values()],
        )
        assert {name: o.token_ids for name, o in zip(built, outs, strict=True)} == expected
    finally:
        llm.engine.shutdown()


def test_same_image_twice_hits_the_encoder_cache_and_the_prefix_cache(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    image = random_image(3)
    ids, images, pil = prompt(vl_dir, processor, ["Look:", image, "what now?"])
    expected = hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
    llm = make_llm(vl_dir, max_num_batched_tokens=256)
    try:
        warm_up_with_its_image(llm.engine.runner)
        first = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        multimodal = llm.engine.runner.multimodal
        assert (multimodal.encoded_images, multimodal.cache.hits) == (1, 0)
        hits = llm.engine.scheduler.counts().prefix_cache_hits
        second = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert first[0].token_ids == second[0].token_ids == expected
        # The whole prompt but its last token came from the prefix cache, the image included.
        hit_tokens = llm.engine.scheduler.counts().prefix_cache_hits - hits
        assert hit_tokens == (len(ids) - 1) // BLOCK * BLOCK
    finally:
        llm.engine.shutdown()


def test_different_images_with_the_same_text_share_no_block_past_the_image(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    first_ids, first_images, _ = prompt(vl_dir, processor, ["Same words", random_image(4), "?"])
    ids, images, pil = prompt(vl_dir, processor, ["Same words", random_image(5), "?"])
    assert first_ids == ids and first_images[0].hash != images[0].hash
    llm = make_llm(vl_dir, max_num_batched_tokens=256)
    try:
        llm.generate([first_ids], PARAMS, detokenize=False, images=[first_images])
        hits = llm.engine.scheduler.counts().prefix_cache_hits
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        # Only the whole blocks before the image's first placeholder are shared.
        assert llm.engine.scheduler.counts().prefix_cache_hits - hits == (
            images[0].offset // BLOCK * BLOCK
        )
        assert out[0].token_ids == hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
        assert llm.engine.runner.multimodal.encoded_images == 2
    finally:
        llm.engine.shutdown()


def test_images_the_prompt_does_not_hold_are_refused(
    vl_dir: Path, processor: VisionProcessor
) -> None:
    ids, images, _ = prompt(vl_dir, processor, ["Look:", random_image(6)])
    llm = make_llm(vl_dir)
    try:
        with pytest.raises(ValueError, match="placeholder tokens"):
            llm.generate([ids], PARAMS, detokenize=False)  # the runs, without their images
        with pytest.raises(ValueError, match="not all"):
            shifted = [type(images[0])(**{**images[0].__dict__, "offset": 0})]
            llm.generate([ids], PARAMS, detokenize=False, images=[shifted])
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("cache_gb", "encoded", "hits"), [(0.5, 1, 1), (0.0, 2, 0)])
def test_an_image_split_across_chunks_takes_its_slices(
    vl_dir: Path,
    processor: VisionProcessor,
    hf: tuple[Any, Any],
    cache_gb: float,
    encoded: int,
    hits: int,
) -> None:
    """One prompt alone, in chunks of 16 tokens, its image's placeholders across a chunk's end:
    each chunk takes its rows of the whole image's embeddings, from the cache (one encoder
    run) or, with no room in the cache, from encoding the image again."""
    ids, images, pil = prompt(vl_dir, processor, [LONG_TEXT, random_image(2, 60, 150), "?"])
    start, end = images[0].offset, images[0].offset + images[0].length
    assert start // 16 != (end - 1) // 16  # the run crosses a chunk boundary
    llm = make_llm(vl_dir, encoder_cache_memory_gb=cache_gb)
    try:
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert out[0].token_ids == hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
        multimodal = llm.engine.runner.multimodal
        assert (multimodal.encoded_images, multimodal.cache.hits) == (encoded, hits)
    finally:
        llm.engine.shutdown()


def test_mrope_positions_are_hf_get_rope_index(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    import torch

    from engine_core.multimodal import mrope_positions

    parts = ["a", random_image(1), "b c", random_image(2, 60, 150), "d e f"]
    ids, images, _ = prompt(vl_dir, processor, parts)
    model = hf[0]
    tokens = torch.tensor([ids])
    grids = torch.tensor([image.grid_thw for image in images])
    types = (tokens == model.config.image_token_id).int()
    expected, delta = model.model.get_rope_index(tokens, types, image_grid_thw=grids)
    assert mrope_positions(images, 2, 0, len(ids)).tolist() == expected[:, 0].tolist()
    # A decode step's positions: its index plus HF's rope delta.
    after = mrope_positions(images, 2, len(ids), len(ids) + 1)
    assert after.tolist() == [[len(ids) + int(delta)]] * 3


def test_our_vision_tower_is_hf_s(vl_dir: Path, hf: tuple[Any, Any]) -> None:
    """Our encoder (models/qwen2_5_vl_vision.py) on the checkpoint's weights against HF's vision
    tower on random pixels of three images at once, one of them two frames deep and one with
    more than one window per side (window attention's reorder, its cut edges, full blocks)."""
    import torch

    from engine_core.loader import load_model

    loaded = load_model(str(vl_dir), "cpu", torch.float32)
    grids = [(1, 4, 6), (2, 8, 4), (1, 10, 14)]
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    ours = loaded.module.encode_images(pixels, grids)
    with torch.no_grad():
        theirs = hf[0].model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_prefix_hit_that_ends_inside_an_image_takes_the_rest_of_it(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """Two prompts with the same image and different text after it: the second's prefix-cache
    hit ends at a block that holds the image's last placeholders, so its first chunk starts
    inside the image and takes the rest of its embeddings (from the encoder cache)."""
    image = random_image(12)
    for prefix in ("Look", "Look here", "Look at this", "Now look at this"):
        first_ids, first_images, _ = prompt(vl_dir, processor, [prefix, image, "alpha"])
        end = first_images[0].offset + first_images[0].length  # then <|vision_end|>, then text
        if end % BLOCK in (1, 2):  # the block of the image's end holds text after it
            break
    else:
        pytest.fail("no prefix puts the image's end and the text in one block")
    ids, images, pil = prompt(vl_dir, processor, [prefix, image, "beta gamma"])
    assert ids[: end + 1] == first_ids[: end + 1] and ids[end + 1] != first_ids[end + 1]
    llm = make_llm(vl_dir, max_num_batched_tokens=256)
    try:
        llm.generate([first_ids], PARAMS, detokenize=False, images=[first_images])
        hits = llm.engine.scheduler.counts().prefix_cache_hits
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        hit = llm.engine.scheduler.counts().prefix_cache_hits - hits
        assert images[0].offset < hit < end  # the hit ends inside the image's run
        assert out[0].token_ids == hf_vl_greedy(*hf, ids, pil, NEW_TOKENS)
        multimodal = llm.engine.runner.multimodal
        assert (multimodal.encoded_images, multimodal.cache.hits) == (1, 1)
    finally:
        llm.engine.shutdown()


def test_image_requests_preempted_and_recomputed_keep_hf_tokens(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """Three image prompts in a KV pool too small for them together: requests are preempted
    and recomputed (their images encoded again or taken from the cache), with HF's tokens."""
    built = [prompt(vl_dir, processor, [f"Picture {i}:", random_image(20 + i)]) for i in range(3)]
    expected = [hf_vl_greedy(*hf, ids, pil, NEW_TOKENS) for ids, _, pil in built]
    llm = make_llm(vl_dir, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=64)
    try:
        outs = llm.generate(
            [ids for ids, _, _ in built],
            PARAMS,
            detokenize=False,
            images=[images for _, images, _ in built],
        )
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.counts().preemptions > 0
    finally:
        llm.engine.shutdown()


def test_a_bfloat16_engine_takes_its_pixels_in_bfloat16_losing_nothing(vl_dir: Path) -> None:
    """The API process sends a bfloat16 engine's pixels in bfloat16 (its Ready says so): half
    the bytes, and the tokens of the same engine sent float32 pixels (its tower casts them to
    bfloat16 first, rounding as the API process does)."""
    half = VisionProcessor.load(vl_dir, "bfloat16")
    full = VisionProcessor.load(vl_dir)
    assert half is not None and full is not None
    parts = ["What is in", random_image(1), "and", random_image(2, width=60), "?"]
    (ids, images, _), (same_ids, float_images, _) = (prompt(vl_dir, p, parts) for p in (half, full))
    assert ids == same_ids
    assert [i.pixels.dtype for i in images] == ["bfloat16"] * 2
    assert [2 * len(i.pixels.data) for i in images] == [len(i.pixels.data) for i in float_images]
    llm = make_llm(vl_dir, dtype="bfloat16")
    try:
        sent = [
            llm.generate([ids], PARAMS, detokenize=False, images=[i])[0]
            for i in (images, float_images)
        ]
        assert sent[0].token_ids == sent[1].token_ids
    finally:
        llm.engine.shutdown()
