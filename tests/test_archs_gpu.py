"""gpt-oss's attention sinks in the Triton kernels, and gpt-oss and DeepSeek-V3 through the
engine on a GPU. Written without a GPU to run them on: the lead runs them on the GPU machine.

The decode kernel (one split, and several, whose merge adds the sink) and the prefill kernel
with sinks against the float32 torch reference on random inputs; then the tiny models of
tests/test_models_gpt_oss.py and tests/test_models_deepseek.py through ``LLM`` on CUDA in
float32 (the Triton attention for gpt-oss, the Triton MLA kernels and the fused experts for
DeepSeek; both eager) against HF's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.attention.torch_ref import attend  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
)
from engine_core.llm import LLM  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests import test_models_deepseek, test_models_gpt_oss  # noqa: E402
from tests.paged_harness import hf_greedy  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16
LENGTHS = [1, 17, 130, 300]


def paged_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """Random K/V caches and block tables for sequences of LENGTHS, and sinks [H]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = sum(-(-n // PAGE) for n in LENGTHS)
    shape = (blocks, PAGE, KV_HEADS, DIM)
    k = torch.randn(shape, generator=gen, device="cuda")
    v = torch.randn(shape, generator=gen, device="cuda")
    width = max(-(-n // PAGE) for n in LENGTHS)
    order = torch.randperm(blocks, generator=gen, device="cuda").int()
    tables, used = torch.zeros(len(LENGTHS), width, dtype=torch.int32, device="cuda"), 0
    for i, n in enumerate(LENGTHS):
        count = -(-n // PAGE)
        tables[i, :count] = order[used : used + count]
        used += count
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    sinks = torch.randn(HEADS, generator=gen, device="cuda") * 2
    return k, v, tables, seq_lens, sinks


def reference(q: torch.Tensor, k, v, tables, seq, query_len, window, sinks) -> torch.Tensor:
    n = LENGTHS[seq]
    blocks = tables[seq, : -(-n // PAGE)].long()
    ks, vs = k[blocks].flatten(0, 1)[:n], v[blocks].flatten(0, 1)[:n]
    return attend(q, ks, vs, DIM**-0.5, window, sinks)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [None, 64])
def test_decode_kernel_adds_the_sinks(num_splits: int, window: int | None) -> None:
    k, v, tables, seq_lens, sinks = paged_inputs(0)
    q = torch.randn(len(LENGTHS), HEADS, DIM, device="cuda")
    got = paged_decode_attention(
        q, k, v, tables, seq_lens, DIM**-0.5, sliding_window=window, num_splits=num_splits,
        min_split_tokens=16, sinks=sinks,
    )  # fmt: skip
    for seq in range(len(LENGTHS)):
        want = reference(q[seq : seq + 1], k, v, tables, seq, 1, window, sinks)
        torch.testing.assert_close(got[seq : seq + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 64])
def test_prefill_kernel_adds_the_sinks(window: int | None) -> None:
    k, v, tables, seq_lens, sinks = paged_inputs(1)
    query_lens = [1, 17, 70, 300]  # the last rows of each sequence: chunks after a prefix
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), HEADS, DIM, device="cuda")
    got = paged_prefill_attention(
        q, k, v, tables, seq_lens, starts.cuda(), max(query_lens), DIM**-0.5,
        sliding_window=window, sinks=sinks,
    )  # fmt: skip
    for seq, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)):
        want = reference(q[lo:hi], k, v, tables, seq, hi - lo, window, sinks)
        torch.testing.assert_close(got[lo:hi], want, atol=2e-5, rtol=1e-4)


MAKERS = {
    "gpt_oss": test_models_gpt_oss.make_hf_model,
    "deepseek_v3": lambda: test_models_deepseek.make_hf_model("v3"),
}


def hf_honours_the_config(hf_model: torch.nn.Module) -> bool:
    """Whether this transformers reads the config the engine reads: releases before 5.18 fix
    gpt-oss's SwiGLU clamp at 7.0 whatever ``swiglu_limit`` says (the tiny model's is 0.5)."""
    experts = getattr(hf_model.model.layers[0].mlp, "experts", None)
    limit = getattr(hf_model.config, "swiglu_limit", None)
    return experts is None or limit is None or getattr(experts, "limit", limit) == limit


def cpu_engine_tokens(folder: Path, prompts: list[list[int]], params: SamplingParams) -> list:
    """The CPU engine's greedy tokens (equal to current transformers' in the CPU suite)."""
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64)
    try:
        return [out.token_ids for out in llm.generate(prompts, params, detokenize=False)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", list(MAKERS))
def test_engine_on_the_gpu_gives_hf_greedy_tokens(name: str, tmp_path: Path) -> None:
    """Against HF's greedy tokens; where the installed transformers ignores a config field
    the engine honours, against the CPU engine's (which the CPU suite holds to a current HF)."""
    hf_model = MAKERS[name]()
    hf_model.save_pretrained(tmp_path)
    prompts = test_models_gpt_oss.PROMPTS
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    if hf_honours_the_config(hf_model):
        want = [hf_greedy(hf_model, prompt, 16).tokens[0] for prompt in prompts]
    else:
        want = cpu_engine_tokens(tmp_path, prompts, params)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=128,
              num_kv_blocks=64)  # fmt: skip
    try:
        got = llm.generate(prompts, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [out.token_ids for out in got] == want
