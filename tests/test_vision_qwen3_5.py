"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration`` and the MoE one) on the CPU: tiny
random models written with ``save_pretrained``, the real HF image processor and the API
process's placement (frontend/vision.py), through one real engine each, against HF
transformers' greedy tokens: one image, two images (one crossing a chunk's end), the same
image again (an encoder-cache hit, the same tokens), a prompt again (a prefix hit past its
image). Our tower against HF's; ``--quantization`` refused by name; one server test with the
official ``openai`` client sending a data URL image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.llm import LLM
from frontend.vision import VisionProcessor
from protocol.messages import ImageInput, SamplingParams
from tests.paged_harness import randomize
from tests.server_fixture import Server, start_server, stop_server
from tests.test_models_qwen3_5 import text_fields
from tests.test_vision_engine import prompt
from tests.test_vision_http import ask_about_image
from tests.vision_factories import (
    MERGE,
    QWEN3_PATCH,
    hf_vl_greedy,
    random_image,
    write_qwen3_vl_inputs,
)

NEW_TOKENS = 6
CHUNK = 16
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# The engine of each test model: 16-token chunks (a GPU test overrides the device and budget).
ENGINE_OPTIONS: dict[str, Any] = dict(
    block_size=16, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=CHUNK,
    max_num_seqs=4,
)  # fmt: skip


def vl_text_fields(vocab: int, moe: bool) -> dict[str, Any]:
    """tests/test_models_qwen3_5.py's four layers, but half of each 32-dim head rotates, its
    eight frequencies split 2/3/3 among M-RoPE's three positions (interleaved), so that every
    position turns some; two query heads, one KV head."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 3, 3], "mrope_interleaved": True}  # fmt: skip
    return text_fields(moe, vocab) | {
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        # Top-level too: transformers releases before 5.24 read it there, not from the rope
        # parameters (the GPU machine's 5.17 wrote its default 0.25 over ours).
        "partial_rotary_factor": 0.5,
        "rope_parameters": rope, "eos_token_id": 2, "bos_token_id": 1,
    }  # fmt: skip


def write_tiny_qwen3_5_vl(path: Path, tokenizer_source: Path, moe: bool) -> Path:
    """A two-block vision tower (no DeepStack: Qwen3.5 has none), 16-pixel patches and a 4x4
    learned position grid; images resized to 2x2 to 8x8 merged tokens."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    ids = write_qwen3_vl_inputs(path, tokenizer_source)
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    config = config_class(
        text_config=vl_text_fields(max(ids.values()) + 1, moe),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            patch_size=QWEN3_PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
            num_position_embeddings=16,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = model_class(config).eval()
    randomize(model, 0)
    with torch.no_grad():
        # Sharp attention (q/k norms scale each head's query and key), so that positions
        # (M-RoPE's three) change the tokens.
        for layer in model.model.language_model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.q_norm.weight.fill_(4.0)
                layer.self_attn.k_norm.weight.fill_(4.0)
    model.save_pretrained(path)
    return path


class Case:
    """A tiny model's folder, HF's model and image processor, and our engine over it."""

    def __init__(self, folder: Path, **llm_options: Any) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        self.folder = folder
        self.hf = AutoModelForImageTextToText.from_pretrained(str(folder)).eval()
        self.hf_processor = AutoImageProcessor.from_pretrained(str(folder))
        processor = VisionProcessor.load(folder)
        assert processor is not None
        self.processor = processor
        options = ENGINE_OPTIONS | llm_options
        self.llm = LLM(str(folder), **options)

    def prompt(self, parts: list[Any]) -> tuple[list[int], tuple[ImageInput, ...], list[Any]]:
        return prompt(self.folder, self.processor, parts)

    def hf_greedy(self, ids: list[int], pil: list[Any], mrope: bool = True) -> list[int]:
        """HF's tokens; ``mrope=False``: rotated by the plain positions instead."""
        if mrope:
            return hf_vl_greedy(self.hf, self.hf_processor, ids, pil, NEW_TOKENS)
        return plain_position_greedy(self.hf, self.hf_processor, ids, pil)

    def generate(
        self, built: list[tuple[list[int], tuple[ImageInput, ...], Any]]
    ) -> list[list[int]]:
        outs = self.llm.generate(
            [ids for ids, _, _ in built], PARAMS, detokenize=False,
            images=[images for _, images, _ in built],
        )  # fmt: skip
        return [o.token_ids for o in outs]


def plain_position_greedy(model: Any, processor: Any, ids: list[int], pil: list[Any]) -> list[int]:
    """HF's greedy tokens with the images but without ``mm_token_type_ids``: HF then rotates by
    the plain positions (what the tokens would be if M-RoPE were lost)."""
    kwargs = dict(processor(images=pil, return_tensors="pt"))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def case_fixture(moe: bool) -> Any:
    @pytest.fixture(scope="module")
    def fixture(
        default_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Case]:
        folder = tmp_path_factory.mktemp("qwen3.5-moe-vl" if moe else "qwen3.5-vl")
        case = Case(write_tiny_qwen3_5_vl(folder, default_tokenizer_dir, moe))
        try:
            yield case
        finally:
            case.llm.engine.shutdown()

    return fixture


dense = case_fixture(moe=False)
moe = case_fixture(moe=True)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_one_and_two_images_give_hf_s_tokens(request: pytest.FixtureRequest, name: str) -> None:
    """One batch: one image, and two images of which the second's placeholders cross a
    16-token chunk's end. HF with plain positions gives other tokens, so M-RoPE is what
    makes them match."""
    case: Case = request.getfixturevalue(name)
    cat, dog = random_image(1), random_image(2, width=60, height=150)
    built = [
        case.prompt(["What is in", cat, "this picture?"]),
        case.prompt([cat, "and", dog, "differ how?"]),
    ]
    second = built[1][1][1]
    assert second.offset // CHUNK != (second.offset + second.length - 1) // CHUNK
    expected = [case.hf_greedy(ids, pil) for ids, _, pil in built]
    assert case.hf_greedy(*built[0][::2], mrope=False) != expected[0]
    assert case.generate(built) == expected


def test_the_same_image_again_is_an_encoder_cache_hit_with_the_same_tokens(dense: Case) -> None:
    """The same image in a second request (other text before it, so no prefix-cache hit
    reaches it): encoded once, the second's embeddings from the encoder cache, HF's tokens
    both times. The first prompt sent again resumes past the image from the prefix cache (its
    attention blocks and its linear-attention state saved at a block boundary) and gives HF's
    tokens once more."""
    image = random_image(5)
    first = dense.prompt(["Look:", image, "what now?"])
    again = dense.prompt(["Now look again at", image, "what now?"])
    assert first[1][0].offset + first[1][0].length < 16 < len(first[0])  # a hit past the image
    runner = dense.llm.engine.runner.multimodal
    plans = dense.llm.engine.runner.warm_up_plans()  # the warm-up's blank image is valid
    (blank,) = [s for plan in plans for s in plan.scheduled if s.request.images]
    runner.check(blank.request)
    encoded, hits = runner.encoded_images, runner.cache.hits
    expected = dense.hf_greedy(first[0], first[2])
    assert dense.generate([first]) == [expected]
    assert dense.generate([again]) == [dense.hf_greedy(again[0], again[2])]
    assert (runner.encoded_images - encoded, runner.cache.hits - hits) == (1, 1)
    prefix_hits = dense.llm.engine.scheduler.counts().prefix_cache_hits
    assert dense.generate([first]) == [expected]
    assert dense.llm.engine.scheduler.counts().prefix_cache_hits - prefix_hits == 16


def test_our_vision_tower_is_hf_s(moe: Case) -> None:
    """The engine's tower against HF's on random pixels of two images at once (one smaller,
    one larger than the 4x4 learned position grid): the merged embeddings."""
    grids = [(1, 2, 4), (1, 10, 14)]
    patches = sum(t * h * w for t, h, w in grids)
    width = 3 * 2 * QWEN3_PATCH * QWEN3_PATCH
    pixels = torch.randn(patches, width, generator=torch.Generator().manual_seed(0))
    ours = moe.llm.engine.runner.model.encode_images(pixels, grids)
    with torch.no_grad():
        theirs = moe.hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def vl_server(dense: Case, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-batched-tokens", "32"]
    args += ["--max-num-seqs", "4", "--served-model-name", "default"]
    srv = start_server(tmp_path_factory.mktemp("serve-qwen3.5-vl"), model=str(dense.folder),
                       args=args)  # fmt: skip
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_server_takes_a_data_url_image(vl_server: Server, dense: Case) -> None:
    from transformers import AutoTokenizer

    image = random_image(7)
    ids, _, pil = dense.prompt(["Describe", image])
    tokens = dense.hf_greedy(ids, pil)
    text = AutoTokenizer.from_pretrained(str(dense.folder)).decode(tokens, skip_special_tokens=True)
    reply = ask_about_image(vl_server, "Describe", image, NEW_TOKENS)
    assert reply.choices[0].message.content == text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)


def test_the_quantization_flag_is_refused(dense: Case) -> None:
    """Quantizing as it loads is not tested for Qwen3.5 (its published block-FP8 checkpoints
    are: tests/test_vision_quantized.py)."""
    from tests.paged_harness import load_float32

    with pytest.raises(ValueError, match=r"as it loads \(--quantization fp8\) is not impl"):
        load_float32(dense.folder, quantization="fp8")
