"""DeepSeek under tensor parallelism over gloo on the CPU: TP=2 gives HF transformers' greedy
tokens and logprobs (TP=1's equal HF's in tests/test_models_deepseek.py).

The single-rank tests' tiny V3 (low-rank q, YaRN with DeepSeek's mscale, grouped sigmoid
routing with a random correction bias, a shared expert, a first dense layer) with 4 heads: each
rank keeps 2 heads' q_b/kv_b rows and o columns, the whole latent, half of every expert's
width. One TP=2 engine runs the batch, with a 16-token step budget, so the 23-token prompt is
chunked beside decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.loader import load_model_config
from engine_core.models.deepseek import MlaAttention
from engine_core.parallel import TPGroup
from tests.paged_harness import random_prompts
from tests.test_models_deepseek import VOCAB, make_hf_model
from tests.tp_cases import Greedy, assert_same_greedy, engine_greedy, hf_reference

NEW_TOKENS = 8
PROMPTS = random_prompts(VOCAB, (11, 23))  # the 23-token one in two chunks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Greedy]:
    """The model saved once, and HF's greedy tokens and logprobs for PROMPTS."""
    model = make_hf_model("v3")
    folder = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(folder)
    return folder, hf_reference(model, PROMPTS, NEW_TOKENS)


def test_tp2_matches_hf(saved: tuple[Path, Greedy]) -> None:
    folder, reference = saved
    assert_same_greedy(engine_greedy(folder, PROMPTS, NEW_TOKENS, tp=2), reference)


def test_heads_that_do_not_split_are_refused(
    saved: tuple[Path, Greedy],
) -> None:
    """4 heads over 3 ranks: refused by name, with both sizes, as the layer is built."""
    config = load_model_config(saved[0])
    with pytest.raises(ValueError, match=r"size 3 does not divide .*attention heads \(4\)"):
        MlaAttention(config, TPGroup(rank=0, size=3))
