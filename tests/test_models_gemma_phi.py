"""Gemma 3 (text) and Phi-3 against HF transformers on the same random weights, through our loader.

As in test_models_hf.py: tiny random HF models saved with ``save_pretrained``, greedy tokens over
the paged KV cache (block size 4) equal to HF ``generate(do_sample=False)``'s, logits within
atol 1e-4 (float32). Gemma 3 interleaves sliding layers (window 8) with global ones and its
prompts run past the window; every run is repeated with chunked prefill and with a prefill whose
first blocks come from another sequence (a prefix-cache hit). Phi-3 covers LongRoPE (prompts
beyond the original length with the long factors, a model within it with the short ones),
partial rotary with a sliding window, and TP=2 of the fused checkpoint.
Each feature has a test showing that getting it wrong would fail.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Phi3Config, PretrainedConfig

from engine_core.attention.base import AttentionBackend
from engine_core.config import ModelConfig
from engine_core.loader import iter_checkpoint, load_model, load_model_config
from engine_core.models import build_model, model_config_from_hf
from tests.factories import tiny_hf_sizes
from tests.paged_harness import (
    GreedyResult,
    HFCase,
    PagedRunner,
    Sequence,
    assert_matches,
    generate_greedy,
    hf_greedy,
    random_prompts,
    randomize,
    save_hf_case,
)
from tests.test_models_hf import ATOL

NEW_TOKENS = 32
VOCAB = 320
WINDOW = 8
SIZES = tiny_hf_sizes(VOCAB)
GEMMA_SIZES = {**SIZES, "head_dim": 16, "max_position_embeddings": 256}
# Distinct factors per frequency, short ones near 1 and long ones well above, so a swap shows.
SHORT = [1.0 + 0.1 * i for i in range(8)]
LONG = [2.0 + 0.5 * i for i in range(8)]
LONGROPE = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # sliding, full, sliding, full; each kind its own rope (the global one scaled); a scale
    # that is not head_dim ** -0.5.
    "gemma3": lambda: Gemma3TextConfig(
        **{**GEMMA_SIZES, "num_hidden_layers": 4},
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        rope_local_base_freq=100.0,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        query_pre_attn_scalar=24,
    ),
    # Explicit layer_types, untied head, final logit soft-capping.
    "gemma3_softcap": lambda: Gemma3TextConfig(
        **{**GEMMA_SIZES, "num_hidden_layers": 3},
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        tie_word_embeddings=False,
        final_logit_softcapping=2.0,
    ),
    # Original length 32 of 128: the long factors, cos/sin scaled by sqrt(1 + ln 4 / ln 32).
    "phi3_longrope": lambda: Phi3Config(
        **SIZES, original_max_position_embeddings=32, rope_scaling=LONGROPE
    ),
    # Context 48 of original 48: the short factors, with an explicit attention factor.
    "phi3_shortrope": lambda: Phi3Config(
        **{**SIZES, "max_position_embeddings": 48},
        original_max_position_embeddings=48,
        rope_scaling={**LONGROPE, "attention_factor": 1.25},
    ),
    "phi3_partial_window": lambda: Phi3Config(
        **SIZES, partial_rotary_factor=0.5, sliding_window=WINDOW, tie_word_embeddings=True
    ),
}
GEMMA = ["gemma3", "gemma3_softcap"]
# Lengths 5, 11, 23 and 40: within the window, and up to five windows past it.
PROMPTS = random_prompts(VOCAB, (5, 11, 23, 40))
LONG_PROMPTS = random_prompts(VOCAB, (33, 45))


def prompts_for(name: str) -> list[list[int]]:
    """HF rotates a sequence with the long factors only once it is longer than the original
    length (it then recomputes the cache), so: prompts longer than 32 for the long-factor model,
    and the short-factor model's sequences within its 48 positions."""
    if name == "phi3_longrope":
        return [*LONG_PROMPTS, PROMPTS[-1]]
    return PROMPTS[:2] if name == "phi3_shortrope" else PROMPTS


def make_hf_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    randomize(model, seed)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFCase:
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    return save_hf_case(name, make_hf_model(name), prompts_for(name), folder, NEW_TOKENS)


def load(case: HFCase) -> nn.Module:
    return load_model(str(case.folder), torch.device("cpu"), torch.float32).module


def test_greedy_matches_hf(case: HFCase) -> None:
    """All prompts prefilled in one flattened batch, then decoded together."""
    assert_matches(generate_greedy(load(case), case.prompts, NEW_TOKENS), case.reference, ATOL)


def test_chunked_prefill_matches_hf(case: HFCase) -> None:
    """5-token chunks (the 40-token prompt's later chunks read a full window of cached context
    through the sliding layers), staggered starts, shuffled blocks."""
    got = generate_greedy(
        load(case), case.prompts, NEW_TOKENS, prefill_chunk=5, stagger=3, shuffle_blocks=True
    )
    assert_matches(got, case.reference, ATOL)


def test_prefix_cached_prefill_matches_hf(case: HFCase) -> None:
    """The longest prompt with its first half (whole blocks: 20 of 40 tokens, 8 of 23 for
    LongRoPE) already in the cache, written by another sequence that shares them: the prefill
    computes only the rest."""
    prompt = case.prompts[-1]
    cached_blocks = len(prompt) // 2 // 4
    donor = prompt[: cached_blocks * 4] + [7] * 9
    got = greedy_with_cached_prefix(load(case), donor, prompt, cached_blocks)
    assert_matches(got, case.reference[-1:], ATOL)


def greedy_with_cached_prefix(
    model: nn.Module,
    donor: list[int],
    prompt: list[int],
    cached_blocks: int,
    new_tokens: int = NEW_TOKENS,
    backend: AttentionBackend | None = None,
) -> GreedyResult:
    """Prefill ``donor``, then greedy-decode ``prompt`` starting from the donor's first
    ``cached_blocks`` blocks, as a prefix-cache hit hands them over."""
    runner = PagedRunner(model, block_size=4, shuffle_blocks=True, backend=backend)
    first = Sequence(list(donor))
    runner.step([(first, len(donor))])
    cached = cached_blocks * runner.block_size
    assert prompt[:cached] == donor[:cached]
    seq = Sequence(list(prompt), block_ids=first.block_ids[:cached_blocks], num_computed=cached)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    while len(tokens) < new_tokens:
        row = runner.step([(seq, seq.num_pending)])[0]
        tokens.append(int(row.argmax()))
        seq.token_ids.append(tokens[-1])
        logits.append(row)
    return GreedyResult(tokens=[tokens], logits=[torch.stack(logits)])


# ---- each feature is exercised: getting it wrong changes the logits --------------------------


def logits_differ(name: str, folder: Path, change: dict[str, Any], hf_model: nn.Module) -> float:
    """Largest logit difference from HF over the longest prompt, with ``change`` applied to our
    config (the checkpoint unchanged)."""
    config = dataclasses.replace(load_model_config(folder), **change)
    model = build_model(config).eval()
    model.load_weights(iter_checkpoint(folder))
    got = generate_greedy(model, PROMPTS[-1:], 8)
    ref = hf_greedy(hf_model, PROMPTS[-1], 8)
    return float((got.logits[0] - ref.logits[0]).abs().max())


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    hf_model = make_hf_model("gemma3")
    folder = tmp_path_factory.mktemp("gemma3-variants")
    hf_model.save_pretrained(folder)
    return folder, hf_model


def test_gemma3_config_is_read_as_intended(gemma_folder: tuple[Path, nn.Module]) -> None:
    config = load_model_config(gemma_folder[0])
    assert config.architecture == "gemma3"
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert [config.layer_sliding_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (config.rope_theta, config.local_rope_theta) == (10000.0, 100.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.local_rope_scaling is None
    assert config.attention_scale == 24**-0.5
    assert config.embedding_scale == 8.0 and config.tie_word_embeddings


@pytest.mark.parametrize(
    "change",
    [
        # W - 1 and W + 1: HF's window of W shows a token itself and the W - 1 before it.
        {"sliding_window": WINDOW - 1},
        {"sliding_window": WINDOW + 1},
        {"layer_types": None},  # every layer sliding
        {"sliding_window": None},  # no layer sliding
        {"local_rope_theta": None},  # one rope for all layers
        {"rope_scaling": None},  # the global rope's linear scaling
        {"attention_scale": 16**-0.5},
        {"embedding_scale": None},
    ],
    ids=lambda change: next(iter(change)) + "=" + str(next(iter(change.values()))),
)
def test_gemma3_features_are_exercised(
    gemma_folder: tuple[Path, nn.Module], change: dict[str, Any]
) -> None:
    folder, hf_model = gemma_folder
    assert logits_differ("gemma3", folder, change, hf_model) > 100 * ATOL


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("gemma3_softcap", {"final_logit_softcapping": None}),
        ("phi3_partial_window", {"partial_rotary_factor": 1.0}),
        ("phi3_partial_window", {"sliding_window": None}),
    ],
)
def test_other_features_are_exercised(name: str, change: dict[str, Any], tmp_path: Path) -> None:
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    assert logits_differ(name, tmp_path, change, hf_model) > 100 * ATOL


def longrope(config: ModelConfig, **change: Any) -> dict[str, Any]:
    assert config.rope_scaling is not None
    return {"rope_scaling": {**config.rope_scaling, **change}}


@pytest.mark.parametrize(
    ("name", "use_long", "attention_factor"),
    [
        ("phi3_longrope", True, (1 + math.log(4) / math.log(32)) ** 0.5),
        ("phi3_shortrope", False, 1.25),
    ],
)
def test_phi3_longrope_factor_set_and_attention_factor_are_exercised(
    name: str, use_long: bool, attention_factor: float, tmp_path: Path
) -> None:
    """The model uses the factor set claimed (the other set breaks the match with HF), and
    cos/sin carry the attention factor (1.0 breaks it)."""
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert config.rope_scaling is not None
    assert config.rope_scaling["use_long_factor"] is use_long
    assert config.rope_scaling["attention_factor"] == pytest.approx(attention_factor)
    prompts = prompts_for(name)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    for change in (
        longrope(config, use_long_factor=not use_long),
        longrope(config, attention_factor=1.0),
    ):
        model = build_model(dataclasses.replace(config, **change)).eval()
        model.load_weights(iter_checkpoint(tmp_path))
        got = generate_greedy(model, prompts, NEW_TOKENS)
        worst = max(
            float((g - r.logits[0]).abs().max()) for g, r in zip(got.logits, reference, strict=True)
        )
        assert worst > 100 * ATOL, change


# ---- config refusals and layouts ----------------------------------------------------------


def gemma_hf_dict(**change: Any) -> dict[str, Any]:
    """A transformers 4 layout Gemma 3 text config.json (as on the Hub), as a dict."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        **change,
    }


def test_gemma3_transformers4_layout() -> None:
    config = model_config_from_hf(gemma_hf_dict())
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.local_rope_scaling is None
    assert config.eos_token_ids == (1,) and config.bos_token_id == 2  # HF's defaults


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"layer_types": ["chunked_attention"] * 6}, "layer_types"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ],
)
def test_gemma3_refuses_what_it_does_not_implement(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(gemma_hf_dict(**change))


def test_partial_rotary_is_refused_outside_phi3() -> None:
    hf = {**SIZES, "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        model_config_from_hf(hf)


def test_phi3_longrope_needs_its_original_length() -> None:
    hf = {
        **SIZES,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG},
    }
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        model_config_from_hf(hf)
    config = model_config_from_hf({**hf, "original_max_position_embeddings": 64})
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["attention_factor"] == pytest.approx(
        (1 + math.log(2) / math.log(64)) ** 0.5
    )
    assert config.rope_scaling["use_long_factor"]  # 128 positions of an original 64


# ---- tensor parallelism over the fused checkpoint -------------------------------------------


TP_VOCAB = 387  # test_tensor_parallel.py's: odd, so the last vocabulary shard is padded
TP_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "phi3_fused": lambda: Phi3Config(
        **tiny_hf_sizes(TP_VOCAB), partial_rotary_factor=0.5, sliding_window=WINDOW
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **{**tiny_hf_sizes(TP_VOCAB), "head_dim": 16, "num_hidden_layers": 4},
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        rope_local_base_freq=100.0,
        final_logit_softcapping=2.0,
    ),
}


@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_tp2_matches_tp1_and_hf(name: str, tmp_path: Path) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj split into q, k, v and gate, up before each rank
    takes its slice; Gemma 3's per-head norms, scaled embedding and soft-capped logits around
    the sharded layers. TP=2 (gloo) gives TP=1's tokens and logprobs, and TP=1 gives HF's
    tokens, over mixed batches with chunks and a prefix-cache hit (test_tensor_parallel.py)."""
    # Imported here: it needs the engine's sockets (zmq), which the GPU tests importing this
    # module do without.
    from tests import test_tensor_parallel as tp_tests

    assert tp_tests.VOCAB == TP_VOCAB
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(TP_CONFIGS[name]()).eval()
    randomize(hf_model, 0)
    hf_model.save_pretrained(tmp_path)
    reference = [hf_greedy(hf_model, p, tp_tests.NEW_TOKENS).tokens[0] for p in tp_tests.PROMPTS]
    tokens1, logprobs1 = tp_tests.generate(tmp_path, tp=1)
    tokens2, logprobs2 = tp_tests.generate(tmp_path, tp=2)
    assert tokens1 == reference
    assert tokens2 == tokens1
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-4, rtol=0)
