"""The host KV tier end to end on the CPU (--kv-offload-gb): a prefix evicted from a tiny KV pool
comes back from the host tier without being computed again, and gives HF transformers' tokens.

On the CPU the "device" KV cache is host memory too; the tier is a second, separately bounded
pool, and its copies are synchronous (engine_core/kv_offload_pool.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_core.kv_offload import KVMoves
from engine_core.kv_offload_pool import HostKVPool, slot_runs
from engine_core.llm import LLM
from engine_core.request import Request
from protocol.messages import SamplingParams
from tests.factories import write_tiny_llama

BLOCK_SIZE = 4
# The tiny Llama's block: 4 tokens x 2 layers x (K, V) x 2 KV heads x head dim 16 x 4 bytes.
BLOCK_BYTES = BLOCK_SIZE * 2 * 2 * 2 * 16 * 4
HOST_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(length)] for _ in range(n)]


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def tiny_llm(
    model_dir: Path,
    num_kv_blocks: int,
    host_blocks: int,
    device: str = "cpu",
    num_layers: int = 2,
    **kwargs: object,
) -> LLM:
    """An engine on the tiny Llama (of ``num_layers`` layers) whose host tier holds
    ``host_blocks`` of its blocks."""
    block_bytes = BLOCK_BYTES // 2 * num_layers
    return LLM(
        str(model_dir),
        device=device,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        kv_offload_gb=host_blocks * block_bytes / 2**30,
        **kwargs,
    )


def scheduled_tokens(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int, int]:
    """Run one prompt alone: its tokens, the tokens the engine computed for it (its step
    tokens), and its tokens served without computing by the device pool and by the host tier,
    all by the engine's own counts."""
    before = llm.engine.scheduler.counts()
    out = llm.generate([prompt], GREEDY, detokenize=False)[0]
    after = llm.engine.scheduler.counts()
    computed = after.step_tokens_sum - before.step_tokens_sum
    device_hits = after.prefix_cache_hits - before.prefix_cache_hits
    return out.token_ids, computed, device_hits, after.kv_offload_hits - before.kv_offload_hits


def test_an_evicted_prefix_is_restored_from_the_host_tier_not_computed(tiny_llama: Path) -> None:
    shared, *fillers = prompts(4, 20, seed=11)  # 5 blocks each, 4 of them full and cachable
    expected = hf_greedy(tiny_llama, shared, GREEDY.max_tokens)
    runs = {}
    for host_blocks in (0, HOST_BLOCKS):
        # 12 blocks: one request (7 blocks) at a time, and the fillers evict the shared prefix.
        llm = tiny_llm(tiny_llama, num_kv_blocks=12, host_blocks=host_blocks)
        first = scheduled_tokens(llm, shared)
        for filler in fillers:
            scheduled_tokens(llm, filler)
        again = scheduled_tokens(llm, shared)
        bm = llm.engine.scheduler.block_manager
        bm.check_integrity()
        assert bm.num_used_blocks == 0
        runs[host_blocks] = (first, again, llm.engine.scheduler.counts())
    (first, again, _), (first_t, again_t, _) = runs[0], runs[HOST_BLOCKS]
    decode_tokens = GREEDY.max_tokens - 1
    # Without the tier the prefix was evicted and computed again, all 20 prompt tokens.
    assert first == (expected, 20 + decode_tokens, 0, 0)
    assert again == (expected, 20 + decode_tokens, 0, 0)
    # With it: the 4 full blocks (16 tokens) came back from the host, and only the rest ran.
    assert first_t == (expected, 20 + decode_tokens, 0, 0)
    assert again_t == (expected, 4 + decode_tokens, 0, 16)
    counts = runs[HOST_BLOCKS][2]
    assert counts.kv_offload_restored_blocks == 4
    assert counts.kv_offload_stored_blocks >= 4  # the prefix's blocks and the fillers' evicted
    assert 0 < bm.num_host_used_blocks <= bm.num_host_blocks == HOST_BLOCKS


def test_tensor_parallel_ranks_each_restore_their_shard(tiny_llama: Path) -> None:
    """TP=2 over gloo: rank 0's block manager decides, each rank copies its half of the KV
    heads of the same blocks (the moves cross with the step's inputs), and the restored prefix
    gives HF's tokens."""
    shared, *fillers = prompts(4, 20, seed=11)
    expected = hf_greedy(tiny_llama, shared, GREEDY.max_tokens)
    llm = tiny_llm(tiny_llama, num_kv_blocks=12, host_blocks=HOST_BLOCKS, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.num_host_kv_blocks == HOST_BLOCKS  # the engine's GiB, split
        first = scheduled_tokens(llm, shared)
        for filler in fillers:
            scheduled_tokens(llm, filler)
        again = scheduled_tokens(llm, shared)
    finally:
        llm.engine.shutdown()
    assert first == (expected, 20 + GREEDY.max_tokens - 1, 0, 0)
    assert again == (expected, 4 + GREEDY.max_tokens - 1, 0, 16)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_stages_each_restore_their_layers(stages: int, tmp_path: Path) -> None:
    """PP=2 (1 + 1 layers) and PP=3 (1 + 1 + 1) over gloo: rank 0's block manager decides,
    each stage copies its own layers of the same blocks (the moves cross with the step's
    inputs, each stage making them when it runs that step), and the restored prefix gives
    HF's tokens, counted as served by the host tier, not computed."""
    model_dir = write_tiny_llama(tmp_path, num_layers=stages)
    shared, *fillers = prompts(4, 20, seed=11)
    expected = hf_greedy(model_dir, shared, GREEDY.max_tokens)
    # The slots are counted from the whole model's block, every layer's K and V.
    llm = tiny_llm(model_dir, num_kv_blocks=12, host_blocks=HOST_BLOCKS, num_layers=stages,
                   pipeline_parallel_size=stages)  # fmt: skip
    try:
        runner = llm.engine.runner
        assert runner.num_host_kv_blocks == HOST_BLOCKS  # the engine's GiB, over the stages
        assert runner.host_kv is not None and runner.host_kv.host.shape[1] == 1  # its layer
        first = scheduled_tokens(llm, shared)
        for filler in fillers:
            scheduled_tokens(llm, filler)
        again = scheduled_tokens(llm, shared)
    finally:
        llm.engine.shutdown()
    assert first == (expected, 20 + GREEDY.max_tokens - 1, 0, 0)
    assert again == (expected, 4 + GREEDY.max_tokens - 1, 0, 16)


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("three-layer-llama"), num_layers=3)


@pytest.mark.parametrize("stages", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_preemption_and_aborts_with_the_tier_change_no_token_and_leak_nothing(
    stages: int, three_layer_llama: Path
) -> None:
    """Many requests sharing prefixes through a pool that holds two at a time, with a host tier
    smaller than what they evict: preempted and restored requests give the same tokens as alone,
    and after an abort and the end every device and host block is accounted for. Also over
    three pipeline stages, with micro-batches in flight while blocks are evicted, restored,
    preempted and aborted."""
    heads = prompts(3, 12, seed=5)
    tails = prompts(9, 6, seed=6)
    batch = [heads[i % 3] + tails[i] for i in range(9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    model_dir = three_layer_llama
    alone = LLM(str(model_dir), device="cpu", block_size=4, enable_prefix_caching=False)
    expected = [alone.generate([p], params, detokenize=False)[0].token_ids for p in batch]

    llm = tiny_llm(model_dir, num_kv_blocks=16, host_blocks=6, num_layers=3, max_model_len=64,
                   pipeline_parallel_size=stages)  # fmt: skip
    try:
        check_preemption_and_aborts(llm, batch, params, expected)
    finally:
        llm.engine.shutdown()
    if stages > 1:
        assert max(llm.engine.pipeline_depths) == stages


def check_preemption_and_aborts(
    llm: LLM, batch: list[list[int]], params: SamplingParams, expected: list[list[int]]
) -> None:
    outs = llm.generate(batch, params, detokenize=False)
    assert [o.token_ids for o in outs] == expected
    core = llm.engine
    bm = core.scheduler.block_manager
    tier = bm.host_tier
    assert tier is not None
    assert core.scheduler.counts().preemptions > 0
    assert tier.num_restored > 0 and tier.num_stored > tier.num_slots

    for i, prompt in enumerate(batch[:4]):  # aborted mid-way, some restored, some running
        core.add_request(Request(f"x{i}", list(prompt), params))
    core.step()
    core.step()
    core.abort([f"x{i}" for i in range(4)])
    while core.has_unfinished():
        core.step()
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks
    stats = core.stats()  # what /metrics shows of the tier
    assert stats.num_host_used_blocks == bm.num_host_used_blocks <= stats.num_host_blocks == 6
    assert stats.counts.kv_offload_restored_blocks == tier.num_restored
    assert stats.counts.kv_offload_stored_blocks == tier.num_stored


def test_the_pool_copies_every_layer_of_a_block_out_then_in() -> None:
    """Copies out come before copies in: a block evicted and restored into in one step keeps
    its old contents in the host slot. FP8 and bf16 bytes move as they are."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.randn(3, 2, 6, 4, 2, 8).to(dtype)  # [L, 2, blocks, bs, heads, dim]
        original = cache.clone()
        pool = HostKVPool(cache, num_slots=4)
        pool.apply(KVMoves(out_blocks=[1, 4], out_slots=[2, 3]))
        pool.apply(KVMoves([0, 5], [0, 1], in_slots=[2, 3], in_blocks=[5, 0]))
        as_bytes = original.view(torch.uint8)
        assert torch.equal(cache.view(torch.uint8)[:, :, 5], as_bytes[:, :, 1])
        assert torch.equal(cache.view(torch.uint8)[:, :, 0], as_bytes[:, :, 4])
        assert torch.equal(pool.host[0], as_bytes[:, :, 0])  # copied out before restored into
        assert torch.equal(pool.host[1], as_bytes[:, :, 5])
        untouched = [1, 2, 3, 4]
        assert torch.equal(cache.view(torch.uint8)[:, :, untouched], as_bytes[:, :, untouched])


def test_slot_runs_split_at_every_gap() -> None:
    assert list(slot_runs([3, 4, 5, 9, 0, 1])) == [(0, 3, 3), (3, 9, 1), (4, 0, 2)]
    assert list(slot_runs([7])) == [(0, 7, 1)]


def test_flags_the_tier_cannot_honour_are_refused_by_name(tiny_llama: Path) -> None:
    with pytest.raises(
        ValueError, match=r"--kv-offload-gb must be a number of GiB, 0 \(off\) or more"
    ):
        tiny_llm(tiny_llama, num_kv_blocks=12, host_blocks=-1)
    with pytest.raises(ValueError, match="prefix caching"):
        tiny_llm(tiny_llama, num_kv_blocks=12, host_blocks=4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=12, kv_offload_gb=1e-9)
