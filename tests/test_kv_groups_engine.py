"""Gemma 3 and a Mistral-style model on KV layer groups through the real engine on the CPU
(``engine_core.llm.LLM``), against HF transformers' greedy tokens on the same random weights
(saved with ``save_pretrained``).

The issue's case is a 16k-token request with Gemma 3's window of 1,024: a sliding layer needs the
last 1,024 tokens, a sixteenth of the context. Here it is scaled down in the same ratio for the
CPU: window 64, a 1,024-token request, blocks of 16. Five of the six layers slide, so the single
table (every layer keeps every block: 64 blocks x 6 layers) holds about four times what the layer
groups do (64 blocks of the full layer and 4-5 of each sliding one, each block one layer's):
the test reads the manager's own counts at the request's last step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

from engine_core.llm import LLM
from engine_core.memory_plan import kv_block_bytes
from engine_core.request import Request
from protocol.messages import SamplingParams
from tests.factories import tiny_hf_sizes
from tests.paged_harness import hf_greedy, random_prompts, randomize

VOCAB = 320
WINDOW = 64
BLOCK = 16
NEW_TOKENS = 24
LONG = 1024 - NEW_TOKENS  # the prompt of the long request: 1,024 tokens at its end


def gemma_config() -> Gemma3TextConfig:
    """Six layers, every sixth global (Gemma 3's pattern): five slide over 64 tokens."""
    sizes = tiny_hf_sizes(VOCAB) | {"num_hidden_layers": 6, "max_position_embeddings": 2048}
    return Gemma3TextConfig(
        **sizes,
        head_dim=16,
        sliding_window=WINDOW,
        sliding_window_pattern=6,
        rope_local_base_freq=100.0,
        rope_theta=10000.0,
        query_pre_attn_scalar=24,
    )


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma_config()).eval()
    randomize(model, 0)
    folder = tmp_path_factory.mktemp("gemma3-groups")
    model.save_pretrained(folder)
    return folder, model


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_long_request_holds_a_quarter_of_the_single_table(
    gemma: tuple[Path, torch.nn.Module],
) -> None:
    """1,000 prompt tokens in chunks of 200 (each chunk's first queries need the window behind
    it, from the chunk before, split mid-block), then 24 decodes: HF's tokens, and at the last
    step the groups hold at most a quarter of the single table's bytes."""
    folder, hf_model = gemma
    prompt = random_prompts(VOCAB, (LONG,))[0]
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS).tokens[0]
    llm = LLM(
        str(folder), block_size=BLOCK, num_kv_blocks=200, max_model_len=1100,
        max_num_batched_tokens=200, max_num_seqs=4,
    )  # fmt: skip
    try:
        engine = llm.engine
        layout = engine.runner.kv_layout
        assert layout.windows == (None, *[WINDOW] * 5) and layout.group_size == 1
        bm = engine.scheduler.block_manager
        engine.add_request(Request("long", prompt, greedy()))
        tokens: list[int] = []
        held_at_end = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            if engine.has_unfinished():
                held_at_end = bm.num_used_blocks  # all the long request's: it runs alone
        assert tokens == expected
        mc = engine.model_config
        group_bytes = held_at_end * kv_block_bytes(mc, mc.num_kv_heads, BLOCK, torch.float32)
        # The single table: every block of the 1,024 tokens, in all six layers.
        per_layer_block = BLOCK * 2 * mc.num_kv_heads * mc.head_dim * 4
        single_bytes = math.ceil((LONG + NEW_TOKENS) / BLOCK) * mc.num_layers * per_layer_block
        # 64 blocks of the full layer, and each sliding layer's window of 64 tokens behind the
        # last query: blocks 60..63, plus the one its last token opened.
        assert held_at_end <= 64 + 5 * 5
        assert group_bytes <= single_bytes / 4, (group_bytes, single_bytes)
        assert bm.num_used_blocks == 0  # all given back (or cached) at its end
        bm.check_integrity()
    finally:
        engine.shutdown()


def test_batches_chunks_and_preemption_match_hf(gemma: tuple[Path, torch.nn.Module]) -> None:
    """Three prompts past the window, batched under a budget of 48 tokens (chunks split
    mid-window and mid-block, prefills beside decodes), in a pool too small for all three at
    once: preempted requests recompute, and every token is HF's."""
    folder, hf_model = gemma
    prompts = random_prompts(VOCAB, (150, 210, 97))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    llm = LLM(
        str(folder), block_size=BLOCK, num_kv_blocks=100, max_model_len=512,
        max_num_batched_tokens=48, max_num_seqs=3,
    )  # fmt: skip
    try:
        outs = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.counts().preemptions > 0
        bm = llm.engine.scheduler.block_manager
        assert bm.num_used_blocks == 0
        bm.check_integrity()
    finally:
        llm.engine.shutdown()


def test_prefix_hit_takes_the_window_blocks_it_needs(gemma: tuple[Path, torch.nn.Module]) -> None:
    """A prompt sharing its first 180 tokens with a finished one: a hit of 11 blocks (176
    tokens) needs the full layer's blocks 0..10 and each sliding layer's blocks from position
    176 - 63 = 113 on (blocks 7..10), which the finished request gave back as it advanced and
    the cache kept. The tokens stay HF's."""
    folder, hf_model = gemma
    first = random_prompts(VOCAB, (210,))[0]
    shared = first[:180] + [3, 1, 4, 1, 5]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in (first, shared)]
    llm = LLM(
        str(folder), block_size=BLOCK, num_kv_blocks=400, max_model_len=512,
        max_num_batched_tokens=64, max_num_seqs=4,
    )  # fmt: skip
    try:
        assert llm.generate([first], greedy(), detokenize=False)[0].token_ids == expected[0]
        bm = llm.engine.scheduler.block_manager
        hits_before = llm.engine.scheduler.counts().prefix_cache_hits
        out = llm.generate([shared], greedy(), detokenize=False)[0]
        assert out.token_ids == expected[1]
        assert llm.engine.scheduler.counts().prefix_cache_hits - hits_before == 176
        bm.check_integrity()
    finally:
        llm.engine.shutdown()


def test_mistral_windows_every_layer_in_one_group(tmp_path: Path) -> None:
    """Mistral's ``sliding_window`` on every layer: one window group (the null block beside
    it), no full table at all. Prompts past the window in chunks, HF's tokens, and a long
    request holds only its window's blocks at its end."""
    window = 16
    sizes = tiny_hf_sizes(VOCAB) | {"max_position_embeddings": 512}
    torch.manual_seed(1)
    hf_model = AutoModelForCausalLM.from_config(MistralConfig(**sizes, sliding_window=window))
    hf_model = hf_model.eval()
    randomize(hf_model, 1)
    hf_model.save_pretrained(tmp_path)
    prompts = random_prompts(VOCAB, (40, 23, 300))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    llm = LLM(
        str(tmp_path), block_size=4, num_kv_blocks=64, max_model_len=400,
        max_num_batched_tokens=32, max_num_seqs=4,
    )  # fmt: skip
    try:
        assert llm.engine.runner.kv_layout.windows == (window,)
        outs = llm.generate(prompts[:2], greedy(), detokenize=False)
        assert [o.token_ids for o in outs] == expected[:2]
        engine, bm = llm.engine, llm.engine.scheduler.block_manager
        engine.add_request(Request("long", prompts[2], greedy()))
        tokens: list[int] = []
        held_at_end = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            if engine.has_unfinished():
                held_at_end = bm.num_used_blocks
        assert tokens == expected[2]
        # 324 tokens would be 81 blocks in one table, more than the pool's 63; the window
        # group holds the 15 tokens behind the last query and the query's own: 5 blocks.
        assert held_at_end <= 5
        bm.check_integrity()
    finally:
        llm.engine.shutdown()
