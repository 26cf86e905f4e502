"""Qwen3-Next under tensor parallelism over gloo on the CPU: TP=2 gives HF transformers' greedy
tokens and logprobs (TP=1's equal HF's in tests/test_models_qwen3_next.py).

The single-rank tests' tiny model cut to two layers: a gated DeltaNet one (2 key heads, each
serving 2 value heads: each rank keeps one key-head group, its q/k/v/z/b/a rows, conv channels,
A_log and dt_bias) and a gated full-attention one (4 heads, 2 KV heads), each with routed
experts and a shared one. One TP=2 engine runs the batch; the 23-token prompt is chunked.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from engine_core.llm import LLM
from engine_core.memory_plan import state_slot_bytes
from engine_core.models import model_config_from_hf
from engine_core.models.qwen3_next import GatedDeltaNet
from engine_core.parallel import TPGroup, check_tensor_parallel
from protocol.messages import SamplingParams
from tests.paged_harness import random_prompts, randomize
from tests.test_models_qwen3_5 import text_fields
from tests.test_models_qwen3_next import VOCAB, tiny_config
from tests.test_speculative_hybrid import NGRAM, script
from tests.tp_cases import assert_same_greedy, engine_greedy, hf_reference

NEW_TOKENS = 8
PROMPTS = random_prompts(VOCAB, (11, 23))  # the 23-token one in two chunks


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=2)).eval()
    randomize(model, 0)
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    folder = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(folder)
    return folder, model


def test_tp2_matches_hf(two_layers: tuple[Path, torch.nn.Module]) -> None:
    folder, model = two_layers
    got = engine_greedy(folder, PROMPTS, NEW_TOKENS, tp=2)
    assert_same_greedy(got, hf_reference(model, PROMPTS, NEW_TOKENS))


def test_tp2_speculation_keeps_each_ranks_state_after_the_kept_drafts(
    two_layers: tuple[Path, torch.nn.Module],
) -> None:
    """Drafts kept in every count from none to all (tests/test_speculative_hybrid.py's
    scripted drafts) at TP=2: each rank writes its heads' state after every verify position
    and takes the kept one's (the copies and the rows' draft counts travel in the step's
    message); HF's greedy tokens."""
    folder, model = two_layers
    want = hf_reference(model, PROMPTS, 16)[0]
    llm = LLM(
        str(folder), tensor_parallel_size=2, block_size=4, num_kv_blocks=64, max_model_len=64,
        max_num_batched_tokens=16, max_num_seqs=8, speculative_config=NGRAM,
    )  # fmt: skip
    try:
        script(llm, PROMPTS, want)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        got = llm.generate(PROMPTS, params, detokenize=False)
        counts = llm.engine.scheduler.counts()
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in got] == want
    assert 0 < counts.spec_accepted_tokens < counts.spec_draft_tokens


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tp2_qwen3_5_matches_hf(tmp_path: Path, moe: bool) -> None:
    """Qwen3.5's four separate projections at TP=2: each rank takes its key heads' runs of
    in_proj_qkv's q and k, its value heads' of v, z, b and a; HF's greedy tokens."""
    torch.manual_seed(0)
    if moe:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_fields(moe=True))).eval()
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_fields(moe=False))).eval()
    randomize(model, 0)
    model.save_pretrained(tmp_path)
    got = engine_greedy(tmp_path, PROMPTS, NEW_TOKENS, tp=2)
    assert_same_greedy(got, hf_reference(model, PROMPTS, NEW_TOKENS))


def test_key_heads_that_do_not_split_are_refused() -> None:
    """2 key heads over 4 ranks: refused by name, with both sizes."""
    config = model_config_from_hf(tiny_config(num_hidden_layers=2).to_dict())
    with pytest.raises(ValueError, match=r"size 4 does not divide .*key heads \(2\)"):
        GatedDeltaNet(config, TPGroup(rank=0, size=4))


def test_sizes_that_do_not_split_the_key_heads_are_refused_before_workers_start() -> None:
    """One key head (serving two value heads) over 2 ranks; the attention's 4 heads and 2 KV
    heads would split: refused, naming the key heads."""
    one_key_head = tiny_config(
        num_hidden_layers=2, linear_num_key_heads=1, linear_num_value_heads=2
    )
    config = model_config_from_hf(one_key_head.to_dict())
    with pytest.raises(ValueError, match=r"linear-attention key heads \(1\)"):
        check_tensor_parallel(config, 2)


def test_a_state_slot_is_counted_for_the_ranks_heads() -> None:
    """The memory plan's bytes of a slot on each of 2 ranks: what the rank's layer allocates
    for one slot (its state_shapes), half the single rank's."""
    config = model_config_from_hf(tiny_config(num_hidden_layers=2).to_dict())
    layer = GatedDeltaNet(config, TPGroup(rank=1, size=2))
    elements = sum(math.prod(shape) for shape in layer.state_shapes(1))
    assert state_slot_bytes(config, torch.float32, 2) == elements * 4  # one linear layer
    assert 2 * state_slot_bytes(config, torch.float32, 2) == state_slot_bytes(config, torch.float32)
