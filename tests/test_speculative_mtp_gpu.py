"""DeepSeek-V3's MTP layer under CUDA graphs (engine_core/mtp.py over draft_graphs.py's feature
chain): with graphs on, a tiny random V3 with its MTP layer (tests/mtp_cases.py) gives the plain
engine's greedy tokens in float32, every proposal is a replay of the layer's K chained forwards
(its latent attention's decode kernel and its MoE inside) whose drafts equal the eager chain's on
the same rows, and its forward beside the target's runs eagerly (prompt-shaped rows); in bf16
the replays' drafts stay within a stated agreement of the eager chain's; block-FP8 experts run
inside the graphs and give the eager speculative engine's tokens. Skipped without CUDA."""

from __future__ import annotations

import json
import random
import shutil
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
SEED = 2  # tests/test_speculative_mtp.py's target
# bf16: the share of draft tokens a replay must give as the eager chain does on the same rows
# (the two round differently: the graphs' argmax tail is the skinny GEMM, the eager one torch's).
BF16_AGREEMENT = 0.9


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Six rows (the graphs' bucket of 8 pads two), a one-token prompt, contexts across block
    borders, one row that stops inside a drafted run (fewer drafts: dead rows in the chain)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in (1, 9, 16, 33, 70, 5)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 5
    params.append(SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    return prompts, params


def engine(folder: Path, spec: bool, dtype: str = "float32", **options: Any) -> Any:
    from engine_core.llm import LLM

    config = json.dumps({"method": "mtp", "num_speculative_tokens": K}) if spec else None
    return LLM(
        str(folder), device="cuda", dtype=dtype, block_size=BS, num_kv_blocks=256,
        max_num_seqs=8, max_model_len=256, speculative_config=config, **options,
    )  # fmt: skip


def generate(llm: Any) -> list[list[int]]:
    prompts, params = workload()
    return [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]


def comparing_proposals(drafter: Any) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Each proposal's drafts from its graph replay, beside the eager chain's on the same rows
    (run right after it: the same kept hidden states and the same latent rows before the rows'
    positions, which both write alike)."""
    seen: list[tuple[list[list[int]], list[list[int]]]] = []
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


@pytest.fixture(scope="module")
def deeper() -> Any:
    from tests.mtp_cases import deeper_model

    return deeper_model(SEED)


@pytest.fixture(scope="module")
def target_dir(
    tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path, deeper: Any
) -> Path:
    from tests.factories import copy_tokenizer
    from tests.mtp_cases import write_target

    path = write_target(tmp_path_factory.mktemp("target"), deeper)
    return copy_tokenizer(default_tokenizer_dir, path)


@pytest.fixture(scope="module")
def plain_tokens(target_dir: Path) -> list[list[int]]:
    plain = engine(target_dir, spec=False)
    assert plain.engine.runner.graph_runner is not None
    return generate(plain)


def common_two(tokens: list[list[int]]) -> list[int]:
    """The two tokens the target emits most: the MTP head drafts only these (some are kept)."""
    return [t for t, _ in Counter(t for row in tokens for t in row).most_common(2)]


@pytest.fixture(scope="module")
def mtp_dir(
    tmp_path_factory: pytest.TempPathFactory,
    target_dir: Path,
    deeper: Any,
    plain_tokens: list[list[int]],
) -> Path:
    from tests.mtp_cases import VOCAB, add_mtp_tensors, two_token_head

    path = tmp_path_factory.mktemp("with-mtp") / "model"
    shutil.copytree(target_dir, path)
    head = two_token_head(VOCAB, deeper.config.hidden_size, common_two(plain_tokens))
    return add_mtp_tensors(path, deeper, head)


def test_graphs_give_the_plain_tokens_and_the_eager_chains_drafts(
    mtp_dir: Path, plain_tokens: list[list[int]]
) -> None:
    spec = engine(mtp_dir, spec=True)
    drafter = spec.engine.runner.drafter
    assert spec.engine.runner.graph_runner is not None and drafter.proposal_graphs is not None
    seen = comparing_proposals(drafter)
    assert generate(spec) == plain_tokens
    assert seen and all(graphed == eager for graphed, eager in seen)
    # Every proposal replayed (the wrapper asserts it; none ran eagerly on its own), and the
    # layer's forward beside the target's ran eagerly, once a step.
    assert drafter.forwards.proposal_replays == drafter.forwards.proposal_eager == len(seen)
    assert drafter.forwards.alongside_replays == 0 and drafter.forwards.alongside_eager > 0
    counts = spec.engine.scheduler.counts()
    print(
        f"\nmtp under graphs, K = {K}: {counts.spec_accepted_tokens} of "
        f"{counts.spec_draft_tokens} drafts kept over {len(seen)} proposals"
    )
    assert counts.spec_accepted_tokens > 0
    spec.engine.scheduler.block_manager.check_integrity()
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def test_enforce_eager_gives_the_same_tokens(mtp_dir: Path, plain_tokens: list[list[int]]) -> None:
    """The eager chain on CUDA (the latent attention's Triton kernels, no graphs) is exact too."""
    spec = engine(mtp_dir, spec=True, enforce_eager=True)
    drafter = spec.engine.runner.drafter
    assert drafter.proposal_graphs is None
    assert generate(spec) == plain_tokens
    assert drafter.forwards.proposal_replays == 0 and drafter.forwards.proposal_eager > 0


def test_bf16_replays_draft_as_the_eager_chain_within_tolerance(mtp_dir: Path) -> None:
    """In bf16 a replay and the eager chain round differently (near-ties may go either way):
    every proposal still replays, and at least BF16_AGREEMENT of the draft tokens agree."""
    spec = engine(mtp_dir, spec=True, dtype="bfloat16")
    drafter = spec.engine.runner.drafter
    seen = comparing_proposals(drafter)
    outputs = generate(spec)
    assert [len(o) for o in outputs] == [p.max_tokens for p in workload()[1]]
    pairs = [
        (g, e)
        for graphed, eager in seen
        for row_g, row_e in zip(graphed, eager, strict=True)
        for g, e in zip(row_g, row_e, strict=True)
    ]
    agreement = sum(g == e for g, e in pairs) / len(pairs)
    print(f"\nmtp bf16: {agreement:.3f} of {len(pairs)} draft tokens as the eager chain's")
    assert agreement >= BF16_AGREEMENT
    assert drafter.forwards.proposal_replays == len(seen) > 0
    spec.engine.scheduler.block_manager.check_integrity()


def test_block_fp8_experts_run_in_the_graphs_and_keep_the_tokens(
    tmp_path: Path, default_tokenizer_dir: Path
) -> None:
    """DeepSeek publishes V3 in block FP8: here the MLPs and experts of every layer, the MTP
    layer's included, in e4m3 with 64 x 64 blocks (what the GPU's block GEMM takes; the
    attention stays in float); with graphs on, every proposal replays (the FP8 fused experts
    inside) and the tokens are the eager speculative engine's.

    Not the plain FP8 engine's: quantizing activations to e4m3 turns the float32 rounding of
    differently shaped steps into whole e4m3 steps, so an FP8 engine is not batch-invariant (the
    plain one's logprobs for a prompt alone and in a batch differ by up to 0.19 here, against
    1e-5 for the float32 target), and a verify step's K + 1 rows a sequence are such a shape."""
    from tests.factories import copy_tokenizer
    from tests.mtp_cases import (
        GPU_FP8_WIDTHS,
        LAYERS,
        VOCAB,
        add_mtp_tensors,
        deeper_model,
        edit_config,
        two_token_head,
    )
    from tests.test_fp8 import E4M3, fp8_block_format, write_quantized

    deeper = deeper_model(SEED, widths=GPU_FP8_WIDTHS)
    folder = tmp_path / "fp8"
    fmt = fp8_block_format((64, 64), not_converted=("self_attn",))
    write_quantized(deeper, fmt, folder, tmp_path / "ref", ("gate_proj", "up_proj", "down_proj"))
    edit_config(folder, num_hidden_layers=LAYERS)
    copy_tokenizer(default_tokenizer_dir, folder)
    plain = generate(engine(folder, spec=False))
    head = two_token_head(VOCAB, deeper.config.hidden_size, common_two(plain))
    add_mtp_tensors(folder, deeper, head)
    eager = generate(engine(folder, spec=True, enforce_eager=True))
    spec = engine(folder, spec=True)
    drafter = spec.engine.runner.drafter
    assert drafter.layer.block.mlp.w13.dtype == E4M3
    assert drafter.proposal_graphs is not None
    assert generate(spec) == eager
    assert drafter.forwards.proposal_eager == 0 and drafter.forwards.proposal_replays > 0
    assert spec.engine.scheduler.counts().spec_draft_tokens > 0
