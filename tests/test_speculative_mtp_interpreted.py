"""The MTP layer's proposal as its CUDA graphs capture it, checked on the CPU through Triton's
interpreter (on a GPU: tests/test_speculative_mtp_gpu.py). For proposals the engine makes while
generating, the rows are staged into the static buffers of ``FeatureProposalGraphs`` (their
bucket's padding rows dead, the tables as wide as the longest context allows) and the captured
work (``_chain``) is run as it is, eagerly, with the latent attention on its Triton decode kernel,
which reads no host value (the graphs pass no host lengths): its drafts are the eager chain's on
the same rows (the torch path, exact host lengths) and it writes the same latent rows. The argmax
tail is left out (torch's argmax here): it is the draft model's and EAGLE-3's, tested on the GPU.

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable; it is not in the main venv):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/vllm-cpu-venv/lib/python3.11/site-packages \\
        .venv/bin/python -m pytest tests/test_speculative_mtp_interpreted.py -q
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.draft_graphs import FeatureProposalGraphs, drafts_of, eager_rows  # noqa: E402
from engine_core.eagle3 import feature_before  # noqa: E402
from engine_core.llm import LLM  # noqa: E402
from engine_core.mtp import MtpProposer  # noqa: E402
from engine_core.speculative import DraftRow  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests.factories import copy_tokenizer  # noqa: E402
from tests.mtp_cases import (  # noqa: E402
    EMITTED,
    VOCAB,
    add_mtp_tensors,
    deeper_model,
    two_token_head,
    write_target,
)
from tests.test_triton_kernels import patch_interpreter_index  # noqa: E402

patch_interpreter_index()

K = 3
BS = 4
MAX_LEN = 64
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300], list(range(10, 30))]
COMPARED = 3  # proposals checked (the interpreter is slow); the engine makes more


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> LLM:
    deeper = deeper_model(2)
    path = write_target(tmp_path_factory.mktemp("mtp"), deeper)
    copy_tokenizer(default_model_dir, path)
    add_mtp_tensors(path, deeper, two_token_head(VOCAB, deeper.config.hidden_size, EMITTED[:2]))
    config = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    return LLM(
        str(path), device="cpu", max_model_len=MAX_LEN, num_kv_blocks=64, block_size=BS,
        speculative_config=config,
    )  # fmt: skip


def graphs_of(drafter: MtpProposer) -> FeatureProposalGraphs:
    """The proposal graphs' buffers as capture_graphs makes them (on the CPU: not captured)."""
    assert drafter.backend is not None
    graphs = FeatureProposalGraphs(
        drafter.chain, drafter.backend, "mtp layer", max_rows=8,
        max_blocks_per_seq=MAX_LEN // BS, num_drafts=K, block_size=BS, max_model_len=MAX_LEN,
        vocab_size=VOCAB, device=drafter.device,
    )  # fmt: skip
    graphs.tail = None
    return graphs


def captured_chain(
    drafter: MtpProposer, graphs: FeatureProposalGraphs, rows: list[DraftRow]
) -> list[list[int]]:
    """The staged rows through the captured work, the latent attention on its Triton kernel."""
    missing = "mtp: no target hidden state"
    features = [feature_before(drafter.features, r, missing) for r in rows]
    chain_rows = [replace(r, position=r.position - 1) for r in rows]
    torch.stack(features, out=graphs.feature[: len(rows)])
    b = graphs.stage(chain_rows)
    staged = graphs.staged_rows(b)
    own = eager_rows(chain_rows, drafter.device)  # what the eager chain reads
    n = len(rows)
    for got, want in ((staged.tokens, own.tokens), (staged.positions, own.positions)):
        assert torch.equal(got[:n], want)
    assert torch.equal(staged.counts[:n], own.counts) and not staged.counts[n:].any()
    for i, row in enumerate(rows):  # past its own table a row's columns are never read
        assert staged.tables[i, : len(row.block_ids)].tolist() == list(row.block_ids)
    attention = drafter.layer.attention()
    attention.use_triton = True
    try:
        graphs._chain(b)
    finally:
        attention.use_triton = None
    return drafts_of(graphs.drafts[:n].tolist(), chain_rows)


def test_the_captured_chain_drafts_and_writes_as_the_eager_chain(spec: LLM) -> None:
    drafter = spec.engine.runner.drafter
    assert isinstance(drafter, MtpProposer)
    graphs = graphs_of(drafter)
    (cache,) = drafter.cache
    propose = drafter.propose_batch
    compared: list[list[list[int]]] = []

    def both(rows: list[DraftRow]) -> list[list[int]]:
        if len(compared) == COMPARED or len(rows) < 2:
            return propose(rows)
        before = cache.clone()
        eager = propose(rows)
        after = cache.clone()
        cache.copy_(before)
        assert captured_chain(drafter, graphs, rows) == eager
        torch.testing.assert_close(cache, after, rtol=1e-4, atol=1e-4)
        cache.copy_(after)
        compared.append(eager)
        return eager

    drafter.propose_batch = both
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        spec.generate(PROMPTS, params, detokenize=False)
    finally:
        del drafter.propose_batch
    assert len(compared) == COMPARED
