"""Speculative decoding on a linear-attention model (Qwen3-Next, Qwen3.5) on CUDA, float32, with
CUDA graphs on (decodes replay them; a verify step's positions run one recurrent step each,
eagerly): scripted drafts kept in every count from none to all, and the checkpoint's own MTP
layer (its K chained forwards a graph replay), each giving HF transformers' greedy tokens (HF on
the same GPU) and the non-speculative engine's, with every KV block and state slot given back.
The CPU versions: tests/test_speculative_hybrid.py, tests/test_speculative_qwen3_next_mtp.py."""

# The tiny models' fixtures come from the CPU tests' modules, as parameters named like the
# imported fixtures: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from tests.paged_harness import random_prompts  # noqa: E402
from tests.test_models_qwen3_next import VOCAB, qwen3_next  # noqa: E402, F401
from tests.test_speculative_hybrid import (  # noqa: E402
    NGRAM,
    check_all_given_back,
    check_every_count_kept,
    greedy,
    hf_tokens,
    script,
)
from tests.test_speculative_qwen3_next_mtp import (  # noqa: E402, F401
    K,
    family,
    mtp_config,
    mtp_tensors,
    source,
    two_token,
)

CUDA = torch.device("cuda")


def cuda_llm(folder: Path, **kwargs: Any) -> LLM:
    settings = {
        "device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 128,
        "max_model_len": 400, "max_num_batched_tokens": 64, "max_num_seqs": 4,
    }  # fmt: skip
    return LLM(str(folder), **(settings | kwargs))


def on_cuda(hf_model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the CPU fixture's HF model on the GPU (the fixture stays on the CPU)."""
    return copy.deepcopy(hf_model).to(CUDA)


def plain_tokens(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    llm = cuda_llm(folder)
    try:
        return [o.token_ids for o in llm.generate(prompts, greedy(new), detokenize=False)]
    finally:
        llm.engine.shutdown()


def test_scripted_drafts_on_cuda_give_hfs_tokens(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """Four prompts batched, one chunked: drafts kept 0, 1, 2 and 3 at a time (the state after
    each kept draft copied into its slot on the device, before the next step's graph replay)."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (20, 45, 150, 31))
    want = hf_tokens(on_cuda(hf_model), prompts, 40)
    llm = cuda_llm(folder, speculative_config=NGRAM)
    assert llm.engine.runner.graph_runner is not None
    script(llm, prompts, want)
    check_every_count_kept(llm, prompts, want)
    assert plain_tokens(folder, prompts, 40) == want


def test_the_mtp_layer_on_cuda_gives_hfs_tokens_from_graph_replays(
    two_token: tuple[Path, torch.nn.Module],
) -> None:
    """The checkpoint's MTP layer drafting under graphs: every proposal a replay of its K chained
    forwards (its full-attention layer reading the layer's own K/V cache), the forward beside
    the target's eager; the tokens HF's and the plain engine's."""
    folder, hf_model = two_token
    prompts = random_prompts(VOCAB, (20, 45, 150, 31))
    want = hf_tokens(on_cuda(hf_model), prompts, 40)
    llm = cuda_llm(folder, speculative_config=mtp_config())
    drafter = llm.engine.runner.drafter
    assert llm.engine.runner.graph_runner is not None and drafter.proposal_graphs is not None
    try:
        got = llm.generate(prompts, greedy(40), detokenize=False)
        assert [o.token_ids for o in got] == want
        counts = llm.engine.scheduler.counts()
        assert 0 < counts.spec_accepted_tokens < counts.spec_draft_tokens
        assert drafter.forwards.proposal_replays > 0 and drafter.forwards.proposal_eager == 0
        assert drafter.forwards.alongside_eager > 0
        check_all_given_back(llm, 4)
    finally:
        llm.engine.shutdown()
    assert plain_tokens(folder, prompts, 40) == want
