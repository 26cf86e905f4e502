"""A tiny random Gemma 3 with images (``Gemma3ForConditionalGeneration``) through the real
engine on the CPU, its prompts placed by the API process's code (frontend/vision.py) and
checked token for token against HF's own Gemma3Processor, against HF transformers' greedy
tokens: one image, two images, an image in a prompt of several chunks, the same image twice
(an encoder-cache and prefix-cache hit). An image's tokens attend to each other both ways
(HF's ``token_type_ids`` mask): the tests fail with a causal mask, and a chunk never ends
inside an image's run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_core.llm import LLM
from engine_core.multimodal import image_key_ends, whole_image_chunk
from frontend.vision import VisionProcessor
from protocol.messages import ImageInput, SamplingParams
from tests.vision_factories import (
    GEMMA3_TOKENS_PER_IMAGE,
    hf_gemma3_greedy,
    random_image,
    warm_up_with_its_image,
    write_tiny_gemma3_vl,
)

NEW_TOKENS = 8
BLOCK = 4
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LONG_TEXT = " ".join(["a long question about the picture"] * 6)


@pytest.fixture(scope="module")
def vl_dir(default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_vl(tmp_path_factory.mktemp("tiny-gemma3-vl"), default_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(vl_dir: Path) -> tuple[Any, Any]:
    """HF's model and its full Gemma3Processor (tokenizer and image processor)."""
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )

    model = Gemma3ForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    processor = Gemma3Processor(
        AutoImageProcessor.from_pretrained(str(vl_dir)),
        AutoTokenizer.from_pretrained(str(vl_dir)),
        image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
    )
    return model, processor


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> VisionProcessor:
    loaded = VisionProcessor.load(vl_dir)
    assert loaded is not None
    return loaded


def prompt(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any], parts: list[Any]
) -> tuple[list[int], tuple[ImageInput, ...], list[Any]]:
    """A user turn of text strings and PIL images, rendered by the chat template, its image
    markers expanded and its images placed as the API process does: (token ids, wire images,
    the PIL images). The ids are checked against HF's Gemma3Processor on the same text."""
    tokenizer = hf[1].tokenizer
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    expansion = processor.marker.text_expansion
    assert expansion is not None
    ids = tokenizer.encode(text.replace(*expansion), add_special_tokens=False)
    pil = [p for p in parts if not isinstance(p, str)]
    names = [f"image {i}" for i in range(len(pil))]
    ids, images = processor.place(ids, processor.process(pil, names))
    theirs = hf[1](text=text, images=pil or None, add_special_tokens=False, return_tensors="np")
    assert ids == theirs["input_ids"][0].tolist()
    return ids, images, pil


def hf_greedy(
    hf: tuple[Any, Any], ids: list[int], pil: list[Any], n: int, bidirectional: bool = True
) -> list[int]:
    return hf_gemma3_greedy(hf[0], hf[1].image_processor, ids, pil, n, bidirectional)


def make_llm(vl_dir: Path, **overrides: Any) -> LLM:
    config: dict[str, Any] = dict(
        block_size=BLOCK, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24,
        max_num_seqs=4,
    )  # fmt: skip
    config.update(overrides)
    return LLM(str(vl_dir), **config)


def test_engine_matches_hf_with_images(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """One image, two, and an image amid long text in chunks of at most 24 tokens (an image
    is 18 tokens with its markers): HF's tokens, which a causal mask over the images would not
    give."""
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    cases = {
        "one image": ["What is in", cat, "this picture?"],
        "two images": [cat, "and", dog, "differ how?"],
        "long text and an image": [LONG_TEXT, dog, LONG_TEXT],
    }
    built = {name: prompt(vl_dir, processor, hf, parts) for name, parts in cases.items()}
    assert len(built["long text and an image"][0]) > 24 * 4  # several chunks
    expected = {name: hf_greedy(hf, ids, pil, NEW_TOKENS) for name, (ids, _, pil) in built.items()}
    causal = {
        name: hf_greedy(hf, ids, pil, NEW_TOKENS, bidirectional=False)
        for name, (ids, _, pil) in built.items()
    }
    assert causal != expected  # the mask changes the tokens: a causal engine would fail here
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
    ids, images, pil = prompt(vl_dir, processor, hf, ["Look:", image, "what now?"])
    expected = hf_greedy(hf, ids, pil, NEW_TOKENS)
    llm = make_llm(vl_dir, max_num_batched_tokens=256)
    try:
        warm_up_with_its_image(llm.engine.runner)  # whole: a bidirectional image
        first = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        multimodal = llm.engine.runner.multimodal
        assert (multimodal.encoded_images, multimodal.cache.hits) == (1, 0)
        hits = llm.engine.scheduler.counts().prefix_cache_hits
        second = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert first[0].token_ids == second[0].token_ids == expected
        hit_tokens = llm.engine.scheduler.counts().prefix_cache_hits - hits
        assert hit_tokens == (len(ids) - 1) // BLOCK * BLOCK  # the image's blocks included
    finally:
        llm.engine.shutdown()


def test_same_image_twice_in_one_prompt_is_encoded_once(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    image = random_image(7)
    ids, images, pil = prompt(vl_dir, processor, hf, [image, "then again", image, "same?"])
    assert images[0].hash == images[1].hash
    llm = make_llm(vl_dir, max_num_batched_tokens=256)
    try:
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert out[0].token_ids == hf_greedy(hf, ids, pil, NEW_TOKENS)
        assert llm.engine.runner.multimodal.encoded_images == 1
    finally:
        llm.engine.shutdown()


def test_different_images_with_the_same_text_share_no_block_past_the_image(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    parts = ["Same words", random_image(4), "?"]
    first_ids, first_images, _ = prompt(vl_dir, processor, hf, parts)
    ids, images, pil = prompt(vl_dir, processor, hf, ["Same words", random_image(5), "?"])
    assert first_ids == ids and first_images[0].hash != images[0].hash
    llm = make_llm(vl_dir, max_num_batched_tokens=256)
    try:
        llm.generate([first_ids], PARAMS, detokenize=False, images=[first_images])
        hits = llm.engine.scheduler.counts().prefix_cache_hits
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert llm.engine.scheduler.counts().prefix_cache_hits - hits == (
            images[0].offset // BLOCK * BLOCK
        )
        assert out[0].token_ids == hf_greedy(hf, ids, pil, NEW_TOKENS)
        assert llm.engine.runner.multimodal.encoded_images == 2
    finally:
        llm.engine.shutdown()


def test_a_prefix_hit_that_ends_inside_an_image_takes_the_rest_of_it(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    """The second prompt's prefix-cache hit ends inside the image's run (its first tokens'
    KV was computed with the whole image in view): its first chunk is the rest of the image
    and what follows, with HF's tokens."""
    image = random_image(12)
    for prefix in (" ".join(["look"] * k) for k in range(1, 9)):  # one token more each
        first_ids, first_images, _ = prompt(vl_dir, processor, hf, [prefix, image, "alpha"])
        ids, images, pil = prompt(vl_dir, processor, hf, [prefix, image, "zulu yankee"])
        end = images[0].offset + images[0].length
        differ = next(i for i, (a, b) in enumerate(zip(ids, first_ids, strict=False)) if a != b)
        # Blocks of 8: <end_of_image> and two newlines stand between the image and the text.
        if (end - 1) // 8 == differ // 8:  # the image's last block holds the change
            break
    else:
        pytest.fail("no prefix puts the image's end and the differing text in one block")
    llm = make_llm(vl_dir, max_num_batched_tokens=256, block_size=8)
    try:
        llm.generate([first_ids], PARAMS, detokenize=False, images=[first_images])
        hits = llm.engine.scheduler.counts().prefix_cache_hits
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        hit = llm.engine.scheduler.counts().prefix_cache_hits - hits
        assert images[0].offset < hit < end
        assert out[0].token_ids == hf_greedy(hf, ids, pil, NEW_TOKENS)
    finally:
        llm.engine.shutdown()


def test_our_tower_and_projector_are_hf_s(vl_dir: Path, hf: tuple[Any, Any]) -> None:
    import torch

    from engine_core.loader import load_model

    loaded = load_model(str(vl_dir), "cpu", torch.float32)
    pixels = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    ours = loaded.module.encode_images(pixels, [(1, 8, 8)] * 3)
    with torch.no_grad():
        theirs = hf[0].model.get_image_features(pixels).pooler_output
    torch.testing.assert_close(ours, theirs.flatten(0, 1), rtol=1e-4, atol=1e-5)


def test_a_chunk_never_ends_inside_an_image() -> None:
    from protocol.messages import TensorBytes

    pixels = TensorBytes("float32", (1,), b"\0" * 4)
    image = ImageInput(b"\1" * 32, offset=10, length=16, pixels=pixels, grid_thw=(1, 8, 8))
    assert whole_image_chunk([image], 0, 8) == 8  # ends before the image
    assert whole_image_chunk([image], 0, 12) == 10  # would cut it: ends where it starts
    assert whole_image_chunk([image], 0, 26) == 26  # ends with it
    assert whole_image_chunk([image], 12, 8) == 0  # starts inside, cannot finish it: waits
    assert whole_image_chunk([image], 12, 20) == 20
    # Key ends: text rows see up to themselves, the image's rows up to its last token.
    ends = image_key_ends([image], 8, 28).tolist()
    assert ends == [9, 10] + [26] * 16 + [27, 28]


def test_an_image_longer_than_the_token_budget_is_refused_at_start(vl_dir: Path) -> None:
    with pytest.raises(ValueError, match="max-num-batched-tokens 8"):
        make_llm(vl_dir, max_num_batched_tokens=8)


def test_pan_and_scan_is_refused_by_name(vl_dir: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "pan-and-scan"
    shutil.copytree(vl_dir, folder)
    config_path = folder / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        VisionProcessor.load(folder)


def test_pixels_of_another_size_are_refused(
    vl_dir: Path, processor: VisionProcessor, hf: tuple[Any, Any]
) -> None:
    import dataclasses

    from protocol.messages import TensorBytes

    ids, images, _ = prompt(vl_dir, processor, hf, ["Look:", random_image(6)])
    small = TensorBytes("float32", (1, 3, 28, 28), b"\0" * 4 * 3 * 28 * 28)
    llm = make_llm(vl_dir)
    try:
        with pytest.raises(ValueError, match=r"must be \[1, 3, 56, 56\]"):
            bad = dataclasses.replace(images[0], pixels=small)
            llm.generate([ids], PARAMS, detokenize=False, images=[(bad,)])
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_the_openai_client_sends_a_data_url_through_a_real_server(
    vl_dir: Path,
    processor: VisionProcessor,
    hf: tuple[Any, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`tandem serve` on the tiny Gemma 3: a PNG data URL and text give HF's greedy text,
    the image's 16 soft tokens and markers counted in usage; a second image of a prompt
    limited to one is a 400 naming its part."""
    import base64

    import openai

    from tests.server_fixture import start_server, stop_server
    from tests.vision_factories import png_bytes

    image = random_image(9)
    ids, _, pil = prompt(vl_dir, processor, hf, ["Describe", image, "briefly."])
    expected = hf[1].tokenizer.decode(hf_greedy(hf, ids, pil, NEW_TOKENS), skip_special_tokens=True)
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-batched-tokens", "32"]
    args += ["--max-num-seqs", "8", "--served-model-name", "gemma"]
    args += ["--limit-mm-per-prompt", '{"image": 1}']
    srv = start_server(tmp_path_factory.mktemp("serve-gemma3"), model=str(vl_dir), args=args)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        url = f"data:image/png;base64,{base64.b64encode(png_bytes(image)).decode()}"
        part = {"type": "image_url", "image_url": {"url": url}}
        content = [{"type": "text", "text": "Describe"}, part, {"type": "text", "text": "briefly."}]
        reply = client.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": content}],
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == len(ids)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="gemma",
                messages=[{"role": "user", "content": [part, part]}],
                max_tokens=NEW_TOKENS,
            )
        assert caught.value.body["param"] == "messages[0].content[1]"
    finally:
        stop_server(srv)


@pytest.mark.parametrize("window", [None, 3])
def test_key_ends_in_both_cpu_backends_are_hf_s_mask(window: int | None) -> None:
    """The torch reference (the CPU's fallback and CUDA's for image steps) and the CPU backend
    with key ends, against dense attention under HF Gemma 3's mask written out by hand: causal
    OR same image, AND the window's lower bound. Two sequences: a whole prompt with an image at
    [2, 7), and a chunk from position 5 of a longer one (its image at [6, 10), a decode beside)."""
    import torch

    from engine_core.attention.base import AttentionMetadata
    from engine_core.attention.cpu_backend import CpuBackend
    from engine_core.attention.torch_ref import TorchReferenceBackend

    gen = torch.Generator().manual_seed(0)
    block, heads, kv_heads, dim = 4, 4, 2, 8
    seqs = [(0, 9, (2, 7)), (5, 12, (6, 10)), (6, 7, None)]  # (first new, length, image)
    caches = [torch.zeros(16, block, kv_heads, dim) for _ in range(2)]
    tables, slots, starts, ends, next_block = [], [], [0], [], 0
    for first, length, image in seqs:
        table = list(range(next_block, next_block + -(-length // block)))
        next_block += len(table)
        tables.append(table + [0] * (4 - len(table)))
        for p in range(length):  # the whole context's K/V in the cache
            slot = table[p // block] * block + p % block
            for cache in caches:
                cache.view(-1, kv_heads, dim)[slot] = torch.randn(kv_heads, dim, generator=gen)
        slots += [table[p // block] * block + p % block for p in range(first, length)]
        starts.append(starts[-1] + length - first)
        for p in range(first, length):
            inside = image is not None and image[0] <= p < image[1]
            ends.append(image[1] if inside else p + 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([n for _, n, _ in seqs]), block_tables=torch.tensor(tables),
        max_query_len=max(b - a for a, b in zip(starts, starts[1:], strict=False)),
        max_seq_len=12, query_start_loc_cpu=starts, seq_lens_cpu=[n for _, n, _ in seqs],
    )  # fmt: skip
    q = torch.randn(starts[-1], heads, dim, generator=gen)
    key_ends = torch.tensor(ends, dtype=torch.int32)
    expected = torch.empty_like(q)
    for i, (first, length, _) in enumerate(seqs):
        table = torch.tensor(tables[i])
        k, v = (c[table].flatten(0, 1)[:length].repeat_interleave(2, dim=1) for c in caches)
        for row, p in zip(range(starts[i], starts[i + 1]), range(first, length), strict=True):
            visible = torch.arange(length) < key_ends[row]
            if window is not None:
                visible &= torch.arange(length) > p - window
            scores = torch.einsum("hd,khd->hk", q[row], k) * 0.5
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            expected[row] = torch.einsum("hk,khd->hd", probs, v)
    for backend in (TorchReferenceBackend(), CpuBackend()):
        out = backend.forward(q, *caches, meta, 0.5, window, key_ends=key_ends)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
