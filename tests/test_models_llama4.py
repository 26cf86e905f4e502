"""Llama 4's text model through the real engine on the CPU (``engine_core.llm.LLM``), against HF
transformers' greedy tokens on the same random weights (saved with ``save_pretrained``).

The tiny model has Llama 4's layer pattern at four layers: three chunked rotary layers (chunk
16, QK L2 norm) and a NoPE global layer whose queries take the temperature scaling (floor_scale
8, so it changes within these prompts), dense MLPs and MoE layers (sigmoid top-1 routing, a
shared expert) alternating. Prompts run past two chunks, so every chunked layer reads only its
query's chunk, and the chunked KV groups give blocks back as requests advance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
)

from engine_core.llm import LLM
from engine_core.models import model_config_from_hf
from engine_core.request import Request
from protocol.messages import SamplingParams
from tests.paged_harness import (
    assert_matches,
    generate_greedy,
    hf_greedy,
    load_float32,
    random_prompts,
    randomize,
)

VOCAB = 320
CHUNK = 16
NEW_TOKENS = 12


def text_config(**overrides: object) -> Llama4TextConfig:
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 32,  # each expert's width, and the shared expert's
        "intermediate_size_mlp": 96,  # the dense layers' MLP
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "interleave_moe_layer_step": 2,  # MoE on layers 1 and 3
        "attention_chunk_size": CHUNK,
        "floor_scale": 8,
        "attn_scale": 0.5,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    return Llama4TextConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = Llama4ForCausalLM(text_config()).eval()
    randomize(model, 0)
    folder = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(folder)
    return folder, model


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def make_llm(folder: Path, **overrides: int | bool) -> LLM:
    limits = {"block_size": 4, "num_kv_blocks": 300, "max_model_len": 256}
    limits |= {"max_num_batched_tokens": 64, "max_num_seqs": 4}
    return LLM(str(folder), **(limits | overrides))


def test_the_config_maps_to_layer_kinds_and_groups(llama4: tuple[Path, torch.nn.Module]) -> None:
    folder, _ = llama4
    llm = make_llm(folder)
    try:
        config = llm.engine.model_config
        assert config.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
        assert config.nope_layers == (3,) and config.dense_layers == (0, 2)
        assert config.query_temperature == (8.0, 0.5) and config.qk_l2_norm
        assert (config.intermediate_size, config.moe_intermediate_size) == (96, 32)
        layout = llm.engine.runner.kv_layout
        # The NoPE layer's full group first (the plan's main table), then a group per chunked
        # layer (one layer each: the fewest kind has one layer).
        assert layout.attention_chunks == (None, CHUNK, CHUNK, CHUNK)
        assert [g.layers for g in layout.groups] == [(3,), (0,), (1,), (2,)]
    finally:
        llm.engine.shutdown()


def test_logits_match_hf(llama4: tuple[Path, torch.nn.Module]) -> None:
    """The model alone over a paged cache (tests/paged_harness.py: no scheduler, every block
    kept), prompts in chunks of 11 beside the other's decodes: HF's tokens and, within float32
    rounding, its logits (which a token-level test could miss, e.g. the router's score on the
    expert's output rather than its input)."""
    folder, hf_model = llama4
    prompts = random_prompts(VOCAB, (45, 70))
    reference = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    model = load_float32(folder)
    got = generate_greedy(model, prompts, NEW_TOKENS, prefill_chunk=11, stagger=3)
    assert_matches(got, reference, atol=1e-4)


@pytest.mark.parametrize(
    "variant",
    [
        # Maverick's switches: no QK norm, MoE on given layers only; and q/k/v/o biases (whose
        # q and k rows are permuted with the weights') with the temperature off.
        {"use_qk_norm": False, "moe_layers": [2]},
        {"attention_bias": True, "attn_temperature_tuning": False, "no_rope_layers": [1, 0, 1, 1]},
    ],
    ids=["no-qk-norm", "bias-no-temperature"],
)
def test_config_variants_match_hf_logits(tmp_path: Path, variant: dict[str, object]) -> None:
    torch.manual_seed(2)
    hf_model = Llama4ForCausalLM(text_config(**variant)).eval()
    randomize(hf_model, 2)
    hf_model.save_pretrained(tmp_path)
    prompts = random_prompts(VOCAB, (45, 38))
    reference = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    got = generate_greedy(load_float32(tmp_path), prompts, NEW_TOKENS, prefill_chunk=13, stagger=2)
    assert_matches(got, reference, atol=1e-4)


def test_single_requests_and_a_batch_match_hf(llama4: tuple[Path, torch.nn.Module]) -> None:
    """Prompts of two to four chunks, alone and batched together (prefills beside decodes)."""
    folder, hf_model = llama4
    prompts = random_prompts(VOCAB, (45, 70, 33))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    llm = make_llm(folder)
    try:
        for prompt, want in zip(prompts, expected, strict=True):
            assert llm.generate([prompt], greedy(), detokenize=False)[0].token_ids == want
        outs = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in outs] == expected
        bm = llm.engine.scheduler.block_manager
        assert bm.num_used_blocks == 0
        bm.check_integrity()
    finally:
        llm.engine.shutdown()


def test_chunked_prefill_mid_chunk_gives_blocks_back(llama4: tuple[Path, torch.nn.Module]) -> None:
    """A 90-token prompt in steps of 22 tokens (each step's first query mid-chunk and
    mid-block: it reads the chunk's keys from the step before), then its decodes: HF's tokens,
    and at its last step each chunked group holds only the blocks from its chunk's start."""
    folder, hf_model = llama4
    prompt = random_prompts(VOCAB, (90,))[0]
    want = hf_greedy(hf_model, prompt, NEW_TOKENS).tokens[0]
    # The overlapped loop, whose last step() call returns while the block tables still hold
    # that step's blocks (the counts below are that step's).
    llm = make_llm(folder, max_num_batched_tokens=22, async_scheduling=True)
    try:
        engine = llm.engine
        bm = engine.scheduler.block_manager
        engine.add_request(Request("long", prompt, greedy()))
        tokens: list[int] = []
        held: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            if engine.has_unfinished():
                held = [len(set(bm.block_ids("long", g)) - {0}) for g in range(bm.num_groups)]
        assert tokens == want
        # At the last step the request computes position 100 (102 tokens after it): the full
        # group holds all 26 blocks; a chunked one the blocks of positions 96.. (24 and 25).
        assert held == [26, 2, 2, 2]
        bm.check_integrity()
    finally:
        llm.engine.shutdown()


def test_prefix_hit_takes_the_chunk_blocks_it_needs(llama4: tuple[Path, torch.nn.Module]) -> None:
    """A prompt sharing its first 54 tokens with a finished one: a hit of 13 blocks (52
    tokens) needs the full group's blocks 0..12 and each chunked group's from the chunk start
    48 on (block 12), which the finished request gave back as it advanced and the cache kept.
    The tokens stay HF's."""
    folder, hf_model = llama4
    first = random_prompts(VOCAB, (70,))[0]
    shared = first[:54] + [3, 1, 4, 1, 5]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in (first, shared)]
    llm = make_llm(folder)
    try:
        assert llm.generate([first], greedy(), detokenize=False)[0].token_ids == expected[0]
        hits_before = llm.engine.scheduler.counts().prefix_cache_hits
        assert llm.generate([shared], greedy(), detokenize=False)[0].token_ids == expected[1]
        assert llm.engine.scheduler.counts().prefix_cache_hits - hits_before == 52
        llm.engine.scheduler.block_manager.check_integrity()
    finally:
        llm.engine.shutdown()


def test_preemption_in_a_small_pool_matches_hf(llama4: tuple[Path, torch.nn.Module]) -> None:
    """Three prompts past two chunks under a budget of 20 tokens in a pool too small for all
    three: preempted requests recompute, and every token is HF's."""
    folder, hf_model = llama4
    prompts = random_prompts(VOCAB, (61, 83, 50))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    llm = make_llm(folder, num_kv_blocks=60, max_model_len=112, max_num_batched_tokens=20)
    try:
        outs = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.counts().preemptions > 0
        bm = llm.engine.scheduler.block_manager
        assert bm.num_used_blocks == 0
        bm.check_integrity()
    finally:
        llm.engine.shutdown()


def test_conditional_generation_serves_its_text_model(tmp_path: Path) -> None:
    """Llama4ForConditionalGeneration (a tiny vision tower beside the text model): its text
    generation is HF's (its images: tests/test_llama4_vision.py)."""
    vision = {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,  # hidden_size over pixel_shuffle_ratio^2, as HF's adapter needs
        "vision_output_dim": 16,
        "image_size": 28,
        "patch_size": 14,
        "projector_input_dim": 16,
        "projector_output_dim": 16,
    }
    config = Llama4Config(text_config=text_config().to_dict(), vision_config=vision)
    torch.manual_seed(1)
    hf_model = Llama4ForConditionalGeneration(config).eval()
    randomize(hf_model, 1)
    hf_model.save_pretrained(tmp_path)
    prompts = random_prompts(VOCAB, (40, 37))
    # Its language model, which a prompt without images runs through alone: transformers
    # 5.24's Llama4ForConditionalGeneration.forward fails on a text-only call (its output
    # type lacks the image_outputs field it sets).
    text_model = hf_model.language_model
    expected = [hf_greedy(text_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    llm = make_llm(tmp_path)
    try:
        outs = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in outs] == expected
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_experts_per_tok", 2, "num_experts_per_tok"),
        ("layer_types", ["sliding_attention"] * 4, "layer_types"),
        ("hidden_act", "gelu", "hidden_act"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
        ("attention_chunk_size", 0, "attention_chunk_size"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(field: str, value: object, named: str) -> None:
    hf = text_config().to_dict() | {"architectures": ["Llama4ForCausalLM"], field: value}
    with pytest.raises(ValueError, match=named):
        model_config_from_hf(hf)


def test_defaults_follow_hf() -> None:
    """Without no_rope_layers, layer_types or moe_layers, HF's defaults: every fourth layer
    NoPE and global, the others chunked; MoE on every layer (interleave step 1)."""
    hf = text_config(num_hidden_layers=8, interleave_moe_layer_step=1).to_dict()
    hf |= {"architectures": ["Llama4ForCausalLM"]}
    for absent in ("no_rope_layers", "layer_types", "moe_layers"):
        hf.pop(absent)
    config = model_config_from_hf(hf)
    assert config.nope_layers == (3, 7)
    assert [config.layer_attention_chunk(i) for i in range(8)] == [CHUNK] * 3 + [None] + [
        CHUNK
    ] * 3 + [None]
    assert config.dense_layers == ()


def test_quantization_flag_is_refused(llama4: tuple[Path, torch.nn.Module]) -> None:
    folder, _ = llama4
    with pytest.raises(ValueError, match=r"as it loads \(--quantization fp8\) is not .*Llama 4"):
        load_float32(folder, quantization="fp8")
