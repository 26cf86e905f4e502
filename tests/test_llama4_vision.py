"""Llama 4 with images: the vision tower and projector (engine_core/models/llama4_vision.py)
against HF transformers' modules, and the engine (models/llama4_mm.py) against HF's greedy
tokens, on one tiny random ``Llama4ForConditionalGeneration`` written with ``save_pretrained``.

Each image here is one tile of the tower's size, its run ``<|image_start|><|image|>`` then
``tokens_per_tile`` ``<|patch|>`` then ``<|image_end|>``, as HF's processor writes an image
that needs no more tiles."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Llama4Config, Llama4ForConditionalGeneration

from engine_core.llm import LLM
from engine_core.models import llama4_vision
from engine_core.models.llama4_vision import Llama4VisionTower, tokens_per_tile
from protocol.messages import ImageInput, SamplingParams, TensorBytes
from tests.paged_harness import random_prompts, randomize
from tests.test_models_llama4 import VOCAB, text_config
from tests.vision_factories import warm_up_with_its_image

PATCH_ID, IMAGE_START, IMAGE_ID, IMAGE_END = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1
TOKENS = 16  # an 8x8 patch grid, pixel-shuffled by 0.5
NEW_TOKENS = 8
SIZE = 32
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def vision_config() -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "vision_output_dim": 24,
        "image_size": SIZE,
        "patch_size": 4,
        "pixel_shuffle_ratio": 0.5,
        "projector_input_dim": 24,
        "projector_output_dim": 24,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def random_llama4_vl(patch_id: int = PATCH_ID, vocab: int = VOCAB) -> Any:
    """The tiny random Llama4ForConditionalGeneration the tests serve."""
    config = Llama4Config(
        text_config=text_config(vocab_size=vocab).to_dict(),
        vision_config=vision_config(),
        image_token_index=patch_id,
    )
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(config).eval()
    randomize(model, 3)
    with torch.no_grad():
        # Image rows as large as text embeddings, and sharper vision attention, so that the
        # image and its patches' positions (the 2D rotary) change what comes out.
        model.multi_modal_projector.linear_1.weight.mul_(30.0)
        for layer in model.vision_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(5.0)
            layer.self_attn.k_proj.weight.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def hf_and_dir(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Llama4ForConditionalGeneration, Path]:
    model = random_llama4_vl()
    folder = tmp_path_factory.mktemp("llama4v")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def llm(hf_and_dir: tuple[Llama4ForConditionalGeneration, Path]) -> Any:
    engine = LLM(
        str(hf_and_dir[1]),
        block_size=4,
        num_kv_blocks=200,
        max_model_len=256,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    yield engine
    engine.engine.shutdown()


def tile(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def with_images(
    texts: list[list[int]], tiles: list[torch.Tensor]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """texts[0], tile 0's run, texts[1], ...: (token ids, wire images)."""
    ids, images = list(texts[0]), []
    for pixels, text in zip(tiles, texts[1:], strict=True):
        ids += [IMAGE_START, IMAGE_ID]
        data = pixels.numpy().tobytes()
        wire = TensorBytes("float32", tuple(pixels.shape), data)
        digest = hashlib.sha256(data).digest()
        images.append(ImageInput(digest, len(ids), TOKENS, wire, (1, SIZE // 4, SIZE // 4)))
        ids += [PATCH_ID] * TOKENS + [IMAGE_END] + text
    return ids, tuple(images)


def hf_tokens(
    model: Llama4ForConditionalGeneration,
    ids: list[int],
    tiles: list[Any],
    patch_id: int = PATCH_ID,
    new_tokens: int = NEW_TOKENS,
) -> list[int]:
    """HF's greedy tokens, each from a full forward without a cache: the prompt's embeddings
    with HF's tower and projector rows at the patch tokens, through HF's language model.
    (transformers 5.24's Llama4ForConditionalGeneration.forward fails on its own output
    type, so its pieces are called as its forward calls them.)"""
    with torch.no_grad():
        features = model.vision_model(torch.cat(tiles)).last_hidden_state
        rows = model.multi_modal_projector(features.flatten(0, 1))
        out: list[int] = []
        for _ in range(new_tokens):
            seq = torch.tensor([ids + out])
            embeds = model.language_model.get_input_embeddings()(seq)
            embeds[seq == patch_id] = rows
            logits = model.language_model(inputs_embeds=embeds).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def test_the_tower_and_projector_are_hf_s(
    hf_and_dir: tuple[Llama4ForConditionalGeneration, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hf_and_dir[0]
    ours = Llama4VisionTower(vision_config(), text_config().hidden_size)
    state = {f"vision_model.{k}": v for k, v in model.vision_model.state_dict().items()}
    state |= {
        f"multi_modal_projector.{k}": v for k, v in model.multi_modal_projector.state_dict().items()
    }
    ours.load_state_dict(state, strict=True)
    pixels = torch.cat([tile(1), tile(2), tile(3)])
    with torch.no_grad():
        theirs = model.multi_modal_projector(model.vision_model(pixels).last_hidden_state)
    assert tokens_per_tile(vision_config()) == TOKENS
    torch.testing.assert_close(ours.encode_tiles(pixels), theirs.flatten(0, 1))
    # Without the 2D rotary the rows are not HF's: the comparison sees positions.
    monkeypatch.setattr(
        llama4_vision, "rotary_angles", lambda side, dim, _: torch.zeros(1, dim // 2)
    )
    assert not torch.allclose(ours.encode_tiles(pixels), theirs.flatten(0, 1), atol=1e-2)


def test_one_and_two_images_give_hf_s_tokens(
    hf_and_dir: tuple[Llama4ForConditionalGeneration, Path], llm: Any
) -> None:
    model = hf_and_dir[0]
    a, b, c = random_prompts(VOCAB - 4, (5, 7, 9))
    cases = [([a, b], [tile(1)]), ([a, b], [tile(2)]), ([a, b, c], [tile(1), tile(2)])]
    built = [with_images(texts, tiles) for texts, tiles in cases]
    expected = [
        hf_tokens(model, ids, tiles) for (ids, _), (_, tiles) in zip(built, cases, strict=True)
    ]
    assert expected[0] != expected[1]  # the image changes the tokens
    before = llm.engine.runner.multimodal.encoded_images
    outs = llm.generate([ids for ids, _ in built], PARAMS, detokenize=False,
                        images=[images for _, images in built])  # fmt: skip
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.runner.multimodal.encoded_images - before <= 2  # tiles 1 and 2, once each


def test_a_repeated_image_is_encoded_once(
    hf_and_dir: tuple[Llama4ForConditionalGeneration, Path], llm: Any
) -> None:
    """The same tile twice in one prompt, then that prompt again: HF's tokens, one encoding."""
    model = hf_and_dir[0]
    a, b, c = random_prompts(VOCAB - 4, (6, 8, 10))
    ids, images = with_images([a, b, c], [tile(7), tile(7)])
    expected = hf_tokens(model, ids, [tile(7), tile(7)])
    warm_up_with_its_image(llm.engine.runner)
    before = llm.engine.runner.multimodal.encoded_images
    for _ in range(2):
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert out[0].token_ids == expected
    assert llm.engine.runner.multimodal.encoded_images - before == 1


def tiled(
    image: Any, first: list[int], last: list[int]
) -> tuple[list[int], tuple[ImageInput, ...], list[torch.Tensor]]:
    """``first``, the API process's tiling of ``image`` (frontend/llama4_images.py: its prompt
    layout and its tiles), ``last``: (token ids, wire images, the tiles in prompt order)."""
    from frontend.llama4_images import Llama4Tiling
    from frontend.vision import placeholder_runs

    tiling = Llama4Tiling(SIZE, 4, TOKENS)
    pixels, grid = tiling.tiles(image)
    # Any text ids stand in for the separators: the model reads no token's name.
    ids_of = {"patch": PATCH_ID, "image_start": IMAGE_START, "image": IMAGE_ID,
              "image_end": IMAGE_END, "tile_x_separator": 7, "tile_y_separator": 8}  # fmt: skip
    names = tiling.prompt_text(*grid).removeprefix("<|").removesuffix("|>").split("|><|")
    ids = first + [ids_of[name] for name in names] + last
    tiles = [torch.from_numpy(tile[None]) for tile in pixels]
    images = tuple(
        ImageInput(hashlib.sha256(t.numpy().tobytes()).digest(), at, n,
                   TensorBytes("float32", tuple(t.shape), t.numpy().tobytes()),
                   (1, SIZE // 4, SIZE // 4))
        for (at, n), t in zip(placeholder_runs(ids, PATCH_ID), tiles, strict=True)
    )  # fmt: skip
    return ids, images, tiles


def test_a_multi_tile_image_from_the_port_gives_hf_s_tokens_and_is_encoded_once(
    hf_and_dir: tuple[Llama4ForConditionalGeneration, Path], llm: Any
) -> None:
    """The API process's tiling of an image of 2x2 tiles: its prompt layout (four tile runs
    between separators, then the global view's) and its five tiles, in two prompts that share
    no block: HF's tokens both times, the second prompt's tiles all from the encoder cache."""
    from tests.vision_factories import random_image

    before = llm.engine.runner.multimodal.encoded_images
    for first, last in random_prompts(VOCAB - 4, (6, 9)), random_prompts(VOCAB - 4, (10, 11)):
        ids, images, tiles = tiled(random_image(2, 70, 40), first, last)
        assert [image.length for image in images] == [TOKENS] * 5
        out = llm.generate([ids], PARAMS, detokenize=False, images=[images])
        assert out[0].token_ids == hf_tokens(hf_and_dir[0], ids, tiles)
    assert llm.engine.runner.multimodal.encoded_images - before == 5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_act", "silu"),
        ("norm_eps", 1e-6),
        ("multi_modal_projector_bias", True),
        ("projector_output_dim", 48),
        ("pixel_shuffle_ratio", 0.25),
    ],
)
def test_refuses_what_hf_would_ignore(field: str, value: object) -> None:
    config = vision_config() | {field: value}
    with pytest.raises(ValueError, match=field):
        Llama4VisionTower(config, 64)
