"""An EAGLE-3 head under CUDA graphs (engine_core/eagle3.py, models/aux_hidden.py): the target's
graph replays write the hidden states the head reads (HF's, at its layers), and with graphs on,
in float32, a random head beside a tiny Llama gives the plain engine's greedy tokens, every
proposal is a replay whose drafts equal the eager chain's on the same rows, and every forward
of the target and of the head beside it is a replay. Skipped without CUDA."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.messages import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]
K = 3
BS = 16
VOCAB = 384
DRAFT_VOCAB = 32
LAYERS = (2, 0, 3)  # the embedding (layer 0's input) among them


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Six rows (the graphs' bucket of 8 pads two), a one-token prompt (a decode-shaped first
    step), contexts across block borders, one row that stops inside a drafted run."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 16, 33, 70, 5)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 5
    params.append(SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    return prompts, params


def engine(target: Path, head: Path | None, **options: Any) -> Any:
    import json

    from engine_core.llm import LLM

    spec = None
    if head is not None:
        spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": K})
    return LLM(
        str(target), device="cuda", dtype="float32", block_size=BS, num_kv_blocks=256,
        max_num_seqs=8, speculative_config=spec, **options,
    )  # fmt: skip


def count_target_replays(runner: Any) -> dict[str, int]:
    """Count the target's forwards and, of them, its graph replays (instance attributes over
    the runner's methods: each engine here is the test's own)."""
    counts = {"forwards": 0, "replays": 0}
    forward, replay = runner._forward, runner.graph_runner.run

    def counted_forward(*args: Any, **kwargs: Any) -> Any:
        counts["forwards"] += 1
        return forward(*args, **kwargs)

    def counted_replay(*args: Any, **kwargs: Any) -> Any:
        counts["replays"] += 1
        return replay(*args, **kwargs)

    runner._forward, runner.graph_runner.run = counted_forward, counted_replay
    return counts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("target"), vocab_size=VOCAB, num_layers=4)


@pytest.fixture(scope="module")
def plain_tokens(target_dir: Path) -> list[list[int]]:
    prompts, params = workload()
    plain = engine(target_dir, None)
    assert plain.engine.runner.graph_runner is not None
    return [o.token_ids for o in plain.generate(prompts, params, detokenize=False)]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory, plain_tokens: list[list[int]]) -> Path:
    """Draft ids mapped onto the tokens the target emits most, so some drafts are kept."""
    from tests.factories import write_eagle3_head

    common = Counter(t for tokens in plain_tokens for t in tokens).most_common(DRAFT_VOCAB)
    targets = [t for t, _ in common] + [t for t in range(VOCAB) if t not in dict(common)]
    d2t = torch.tensor(targets[:DRAFT_VOCAB]) - torch.arange(DRAFT_VOCAB)
    config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}}
    return write_eagle3_head(tmp_path_factory.mktemp("head"), VOCAB, d2t, config=config)


def test_a_graph_replay_writes_hf_hidden_states_entering_the_heads_layers(
    target_dir: Path, head_dir: Path
) -> None:
    from transformers import LlamaForCausalLM

    spec = engine(target_dir, head_dir)
    target = count_target_replays(spec.engine.runner)
    prompt = workload()[0][4]
    spec.generate([prompt], SamplingParams(max_tokens=1), detokenize=False)
    assert target["replays"] == target["forwards"] == 1  # the prompt's prefill graph
    got = spec.engine.runner.drafter.aux.take(len(prompt)).float().cpu()
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in LAYERS], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def comparing_proposals(drafter: Any) -> list[tuple[list[int], list[list[int]]]]:
    """Each proposal's drafts from its graph replay, beside the eager chain's on the same rows
    (run right after it: the same features and the same head KV before the rows' positions)."""
    seen: list[tuple[list[int], list[list[int]]]] = []
    propose = drafter.propose_batch

    def both(rows: list) -> list[list[int]]:
        replays = drafter.forwards.proposal_replays
        graphed = propose(rows)
        assert drafter.forwards.proposal_replays == replays + 1, "the proposal ran eagerly"
        graphs, drafter.proposal_graphs = drafter.proposal_graphs, None
        try:
            eager = propose(rows)
        finally:
            drafter.proposal_graphs = graphs
        seen.append((graphed, eager))
        return graphed

    drafter.propose_batch = both
    return seen


def test_graphs_give_the_plain_tokens_and_the_eager_chains_drafts(
    target_dir: Path, head_dir: Path, plain_tokens: list[list[int]]
) -> None:
    spec = engine(target_dir, head_dir)
    drafter = spec.engine.runner.drafter
    assert drafter.step_graphs is not None and drafter.proposal_graphs is not None
    target = count_target_replays(spec.engine.runner)
    alongside_eager = drafter.forwards.alongside_eager
    alongside_replays = drafter.forwards.alongside_replays
    seen = comparing_proposals(drafter)
    prompts, params = workload()
    got = [o.token_ids for o in spec.generate(prompts, params, detokenize=False)]
    assert got == plain_tokens
    assert seen and all(graphed == eager for graphed, eager in seen)
    # Every forward of the target (prompts, verify chunks, plain decodes) and of the head
    # beside it is a replay.
    assert target["replays"] == target["forwards"] > 0
    assert drafter.forwards.alongside_eager == alongside_eager
    assert drafter.forwards.alongside_replays - alongside_replays == target["forwards"]
    counts = spec.engine.scheduler.counts()
    print(
        f"\neagle3 under graphs, K = {K}: {counts.spec_accepted_tokens} of "
        f"{counts.spec_draft_tokens} drafts kept over {len(seen)} proposals"
    )
    assert counts.spec_accepted_tokens > 0
    spec.engine.scheduler.block_manager.check_integrity()
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def test_enforce_eager_gives_the_same_tokens(
    target_dir: Path, head_dir: Path, plain_tokens: list[list[int]]
) -> None:
    """The eager path on CUDA (the Triton backend's prefill kernel over the head's entries,
    the chain without graphs) is exact too."""
    spec = engine(target_dir, head_dir, enforce_eager=True)
    drafter = spec.engine.runner.drafter
    assert drafter.step_graphs is None and drafter.proposal_graphs is None
    prompts, params = workload()
    got = [o.token_ids for o in spec.generate(prompts, params, detokenize=False)]
    assert got == plain_tokens
    assert drafter.forwards.proposal_replays == drafter.forwards.alongside_replays == 0
