"""Verify steps in CUDA graphs of their own (engine_core/cuda_graph.py, verify graphs keyed by
batch size for K + 1 tokens a sequence): a replay equals the eager forward at llama-1b's shapes
(and the verify kernel's output equals the prefill kernel's there), padding sequences write
nothing; through the engine, a model drafting for itself in float32 keeps every draft and gives
the plain engine's greedy tokens, with the target's and the draft's verify steps replaying
verify graphs (counted). The kernel alone against a hand computation at llama-1b and llama-8b
head shapes: tests/test_verify_attention.py. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]
K = 4
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
MAX_SEQS = 16


def verify_step(
    contexts: list[int], queries: int, num_blocks: int, rng: random.Random, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Sequences of ``contexts[i]`` cached tokens and ``queries`` new ones (a verify chunk),
    marked as the input batch marks them."""
    from tests.test_cuda_graph import mixed_step

    device = torch.device("cuda")
    ids, positions, meta = mixed_step([(c, queries) for c in contexts], num_blocks, rng, vocab,
                                      device)  # fmt: skip
    return ids, positions, dataclasses.replace(meta, uniform_query_len=queries)


@pytest.fixture(scope="module")
def llama_1b_graphs() -> Any:
    """llama-1b's random preset on the GPU over a random bf16 cache, with decode, verify (K + 1
    = 5) and prefill graphs."""
    from engine_core.attention.triton_backend import TritonBackend
    from engine_core.cuda_graph import CudaGraphRunner, verify_graph_queries
    from engine_core.presets import build_random_model
    from tests.test_cuda_graph import GraphsOnRandomModel

    device = torch.device("cuda")
    model, config = build_random_model("llama-1b", device, torch.bfloat16, seed=5)
    num_blocks = 1024
    cache = torch.randn(
        config.num_layers, 2, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
        device=device,
    ).to(torch.bfloat16)  # fmt: skip
    for i, layer in enumerate(model.attention_layers()):
        layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
    backend = TritonBackend()
    assert verify_graph_queries(model, backend, K) == K + 1
    graphs = CudaGraphRunner(
        model, backend, max_num_seqs=MAX_SEQS, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, hidden_size=config.hidden_size, dtype=torch.bfloat16,
        device=device, max_prefill_tokens=128, vocab_size=config.vocab_size,
        verify_queries=K + 1,
    )  # fmt: skip
    graphs.capture(progress=False)
    assert sorted(graphs.verify_graphs) == sorted(graphs.graphs)
    return GraphsOnRandomModel(model, config, cache, backend, graphs)


@pytest.mark.parametrize("n", [1, 3, 8, 13, 16])
def test_a_verify_replay_equals_the_eager_forward(llama_1b_graphs: Any, n: int) -> None:
    """The replay (n sequences padded to the batch bucket) against the eager forward of the
    same step: the same hidden states and the same K/V in the same slots, nothing written by
    the padding sequences."""
    from tests.test_cuda_graph import check_replay_equals_eager

    on = llama_1b_graphs
    rng = random.Random(n)
    contexts = [rng.randrange(0, MAX_MODEL_LEN // 2) for _ in range(n)]
    ids, positions, meta = verify_step(contexts, K + 1, 1024, rng, on.config.vocab_size)
    assert on.graphs.can_run(meta)
    replays = on.graphs.verify_replays
    # The replay's context splits follow the graph's block table (max_model_len wide), the eager
    # step's its own: bf16 partial sums of K + 1 queries merge in another order, through 16
    # random layers: 2.0-2.1e-2 on the H200 at every n (the float32 self-draft test is exact).
    check_replay_equals_eager(on, ids, positions, meta, f"verify batch {n}", tolerance=3e-2)
    assert on.graphs.verify_replays == replays + 1


def test_the_verify_kernel_agrees_with_the_prefill_kernel_in_the_model(
    llama_1b_graphs: Any,
) -> None:
    """The same verify step eagerly, once through the verify kernel (uniform_query_len) and
    once through the prefill kernel (unmarked): the same hidden states, within bf16 rounding."""
    from engine_core.forward_context import forward_context

    on = llama_1b_graphs
    rng = random.Random(7)
    contexts = [0, 15, 16, 17, 300, 511]
    ids, positions, meta = verify_step(contexts, K + 1, 1024, rng, on.config.vocab_size)
    outs = []
    for marked in (meta, dataclasses.replace(meta, uniform_query_len=0)):
        with torch.inference_mode(), forward_context(marked, on.backend):
            outs.append(on.model(ids, positions).float())
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    # Two kernels summing bf16 partials in different orders through 16 random layers, as the
    # replay test above: 2.0-2.2e-2 on the H200.
    assert err < 3e-2, f"verify vs prefill kernel: relative error {err:.2e}"


def test_other_draft_counts_and_prompts_take_the_prefill_graphs(llama_1b_graphs: Any) -> None:
    graphs = llama_1b_graphs.graphs
    rng, vocab = random.Random(3), llama_1b_graphs.config.vocab_size
    _, _, fewer = verify_step([20, 40], K, 1024, rng, vocab)  # K - 1 drafts a row
    _, _, too_many = verify_step([5] * (MAX_SEQS + 1), K + 1, 1024, rng, vocab)
    assert graphs.can_run(fewer) and not graphs._fits_verify(fewer)
    assert not graphs._fits_verify(too_many)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def engine(model_dir: Path, speculative: bool) -> Any:
    """A float32 engine on the GPU with its CUDA graphs; with ``speculative`` the model drafts
    for itself, K a step."""
    from engine_core.llm import LLM

    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}
    return LLM(
        str(model_dir), device="cuda", dtype="float32", block_size=BLOCK_SIZE,
        num_kv_blocks=256, max_num_seqs=8,
        speculative_config=json.dumps(spec) if speculative else None,
    )  # fmt: skip


def workload() -> tuple[list[list[int]], list[Any]]:
    """Six rows (the graphs' bucket of 8 pads two), contexts across block borders, one row
    that stops inside a drafted run (its last steps verify fewer drafts: prefill-shaped)."""
    from protocol.messages import SamplingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 16, 33, 70, 5)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 5
    params.append(SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    return prompts, params


def count_forwards(runner: Any) -> dict[str, int]:
    """Count the target's forwards and, of them, its graph replays (instance attributes over
    the runner's methods: this engine is the test's own)."""
    counts = {"forwards": 0, "replays": 0}
    forward, replay = runner._forward, runner.graph_runner.run

    def counted_forward(*args: Any) -> Any:
        counts["forwards"] += 1
        return forward(*args)

    def counted_replay(*args: Any) -> Any:
        counts["replays"] += 1
        return replay(*args)

    runner._forward, runner.graph_runner.run = counted_forward, counted_replay
    return counts


def test_a_self_draft_in_float32_keeps_every_draft_through_verify_graphs(model_dir: Path) -> None:
    """The target's and the draft's verify steps replay verify graphs (every target forward a
    replay), every draft is kept, and the tokens are the plain engine's."""
    prompts, params = workload()
    plain = engine(model_dir, speculative=False)
    want = [o.token_ids for o in plain.generate(prompts, params, detokenize=False)]
    del plain
    spec = engine(model_dir, speculative=True)
    runner = spec.engine.runner
    target_graphs, draft_graphs = runner.graph_runner, runner.drafter.step_graphs
    assert target_graphs.verify_queries == draft_graphs.verify_queries == K + 1
    before = (target_graphs.verify_replays, draft_graphs.verify_replays)
    target = count_forwards(runner)
    got = [o.token_ids for o in spec.generate(prompts, params, detokenize=False)]
    assert got == want
    counts = spec.engine.scheduler.counts()
    drafted, kept = counts.spec_draft_tokens, counts.spec_accepted_tokens
    assert kept == drafted > 0, f"{kept} of {drafted} self-drafts kept in float32"
    assert target["replays"] == target["forwards"] > 0
    verified = (target_graphs.verify_replays - before[0], draft_graphs.verify_replays - before[1])
    assert verified[0] > 0 and verified[0] == verified[1], verified
    print(f"\n{verified[0]} verify steps replayed verify graphs of {target['forwards']} forwards")
    spec.engine.scheduler.block_manager.check_integrity()
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0
