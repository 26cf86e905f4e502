"""The MXFP4 expert kernels (engine_core/models/mxfp4_kernels.py) on a GPU, and gpt-oss's MXFP4
experts through the engine on CUDA. Written without a GPU to run them on: the lead runs them on
the GPU machine.

- The kernels at gpt-oss-20b's expert shapes (hidden 2880, width 2880, 32 experts, top 4) for
  a decode batch and a prefill, in bf16, against the dequantize-then-torch reference in float32;
  the bound is the bf16 reference's own distance from it (twice that, or 1e-3 of the output's
  largest value): the kernel rounds where the bf16 reference rounds, bf16's 2^-8, and no worse.
  In float32 (IEEE products) against the same reference within 1e-4 (sums of 2,880 terms in
  another order).
- The same for the decode kernels (mxfp4_gemv.py: one slot a program, align's blocks, K split)
  at 1-16 tokens and the prefill path (mxfp4_prefill.py: dequantized experts, in one chunk and
  in uneven chunks) at 256 and 2,048 tokens, and ``mxfp4_moe``'s rule picking each by shape.
- The swapped kernels (mxfp4_swapped.py: tl.dot_scaled in bf16, the bits path in bf16 and
  float32) at 1 to 256 tokens, with the same bounds.
- The layer replayed from a CUDA graph equals the layer run eagerly (no host sync anywhere), on
  every path.
- The tiny MXFP4 gpt-oss of tests/test_models_gpt_oss.py: its MoE layers on CUDA against the CPU
  reference on the same checkpoint, and the engine on CUDA in float32 giving the CPU engine's
  greedy tokens (the CPU engine runs the dequantizing reference path).

    .venv/bin/python -m pytest -q tests/test_mxfp4_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.llm import LLM  # noqa: E402
from engine_core.loader import load_model  # noqa: E402
from engine_core.models import mxfp4  # noqa: E402
from engine_core.models.fused_moe import Blocks  # noqa: E402
from engine_core.models.gpt_oss_moe import GptOssMoE, experts_reference  # noqa: E402
from engine_core.models.mxfp4_gemv import GemvTiles  # noqa: E402
from engine_core.models.mxfp4_kernels import fused_moe_mxfp4  # noqa: E402
from engine_core.models.mxfp4_moe import (  # noqa: E402
    Choice,
    Dequantize,
    choose,
    multiprocessors,
    mxfp4_moe,
)
from engine_core.models.mxfp4_prefill import dequantized_moe_mxfp4  # noqa: E402
from engine_core.models.mxfp4_swapped import SWAPPED_CANDIDATES, Swapped  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests import test_models_gpt_oss  # noqa: E402
from tests.test_archs_gpu import cpu_engine_tokens  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4  # gpt-oss-20b


def gpt_oss_20b_experts(dtype: torch.dtype, seed: int = 0) -> mxfp4.Mxfp4Experts:
    """Random codes with scales of 2^-9 to 2^-6 (products of a few units at this width, so the
    SwiGLU's clamp at 7 bites on some), biases of the activations' dtype."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def codes(rows: int, cols: int) -> torch.Tensor:
        shape = (EXPERTS, rows, cols // 2)
        return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)

    def scales(rows: int, cols: int) -> torch.Tensor:
        shape = (EXPERTS, rows, cols // mxfp4.BLOCK)
        return torch.randint(118, 122, shape, dtype=torch.uint8, device="cuda", generator=gen)

    def bias(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.5).to(dtype)

    return mxfp4.Mxfp4Experts(
        codes(2 * INTER, HIDDEN), scales(2 * INTER, HIDDEN), bias(EXPERTS, 2 * INTER),
        codes(HIDDEN, INTER), scales(HIDDEN, INTER), bias(EXPERTS, HIDDEN),
        limit=7.0, alpha=1.702,
    )  # fmt: skip


def with_biases(experts: mxfp4.Mxfp4Experts, dtype: torch.dtype) -> mxfp4.Mxfp4Experts:
    e = experts
    return mxfp4.Mxfp4Experts(
        e.w13_blocks, e.w13_scales, e.b13.to(dtype),
        e.w2_blocks, e.w2_scales, e.b2.to(dtype), e.limit, e.alpha,
    )  # fmt: skip


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing (softmax over the top-4 logits) of random logits, skewed so that some
    experts get many tokens and some few."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen)
    logits[:, :3] += 1.0
    top, ids = logits.topk(TOP_K, dim=-1)
    return torch.softmax(top, dim=-1), ids.to(torch.int32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("tokens", [1, 7, 64, 2048])
def test_bf16_kernels_at_gpt_oss_20b_shapes(tokens: int) -> None:
    experts = gpt_oss_20b_experts(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    weights, ids = routing(tokens, seed=tokens)
    exact = experts_reference(
        x, with_biases(experts, torch.float32), weights, ids.long()
    )  # float32 throughout
    bf16 = experts_reference(x.bfloat16(), experts, weights.bfloat16(), ids.long())
    got = fused_moe_mxfp4(x.bfloat16(), experts, weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, HIDDEN)
    assert relative_error(got, exact) <= max(2 * relative_error(bf16, exact), 1e-3)


@pytest.mark.parametrize("tokens", [1, 64])
def test_float32_kernels_at_gpt_oss_20b_shapes(tokens: int) -> None:
    experts = gpt_oss_20b_experts(torch.float32)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    weights, ids = routing(tokens, seed=tokens + 1)
    want = experts_reference(x, experts, weights, ids.long())
    got = fused_moe_mxfp4(x, experts, weights, ids)
    assert relative_error(got, want) <= 1e-4


@pytest.mark.parametrize("tokens", [1, 7, 16, 64, 256])
@pytest.mark.parametrize(
    "tiles", [Swapped(), Swapped(64, 32, 128), Swapped(128, 16, 64, scaled=False)]
)
def test_bf16_swapped_kernels_at_gpt_oss_20b_shapes(tokens: int, tiles: Swapped) -> None:
    """tl.dot_scaled's widening and the bits path."""
    check_bf16_swapped(tokens, tiles)


@pytest.mark.parametrize("tiles", SWAPPED_CANDIDATES)
def test_the_swapped_candidates_at_64_tokens(tiles: Swapped) -> None:
    """Each tile the sweep times."""
    check_bf16_swapped(64, tiles)


def check_bf16_swapped(tokens: int, tiles: Swapped) -> None:
    """The swapped kernels in bf16 against the float32 reference, the bound as
    test_bf16_kernels_at_gpt_oss_20b."""
    experts = gpt_oss_20b_experts(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    weights, ids = routing(tokens, seed=tokens + 3)
    exact = experts_reference(x, with_biases(experts, torch.float32), weights, ids.long())
    bf16 = experts_reference(x.bfloat16(), experts, weights.bfloat16(), ids.long())
    got = mxfp4_moe(x.bfloat16(), experts, weights.bfloat16(), ids, tiles)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, HIDDEN)
    assert relative_error(got, exact) <= max(2 * relative_error(bf16, exact), 1e-3)


def test_float32_swapped_kernels_at_gpt_oss_20b_shapes() -> None:
    """float32 activations take the bits path with IEEE products: within 1e-4 of the reference."""
    experts = gpt_oss_20b_experts(torch.float32)
    x = torch.randn(64, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    weights, ids = routing(64, seed=65)
    want = experts_reference(x, experts, weights, ids.long())
    assert relative_error(mxfp4_moe(x, experts, weights, ids, Swapped()), want) <= 1e-4


# (tokens, the path forced, or None: the rule's, with the kind of path it must pick)
PATHS = [
    (1, None, GemvTiles),
    (4, None, GemvTiles),
    (16, None, Swapped),
    (16, GemvTiles(4, 64, 16, 4), GemvTiles),  # align's blocks of 4, K in 4 splits
    (40, None, Swapped),  # the rule's tiles (no measured bucket)
    (64, Blocks(16, 64, 64), Blocks),  # the tiled kernels
    (256, None, Swapped),
    (512, None, Dequantize),
    (2048, None, Dequantize),
]


@pytest.mark.parametrize(("tokens", "choice", "kind"), PATHS)
def test_each_path_at_gpt_oss_20b_shapes(tokens: int, choice: Choice | None, kind: type) -> None:
    """In bf16 against the float32 reference, the bound as test_bf16_kernels_at_gpt_oss_20b."""
    experts = gpt_oss_20b_experts(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    weights, ids = routing(tokens, seed=tokens + 2)
    if choice is None:
        choice = choose(tokens, TOP_K, experts, HIDDEN, multiprocessors(x.device))
    assert isinstance(choice, kind)
    exact = experts_reference(x, with_biases(experts, torch.float32), weights, ids.long())
    bf16 = experts_reference(x.bfloat16(), experts, weights.bfloat16(), ids.long())
    got = mxfp4_moe(x.bfloat16(), experts, weights.bfloat16(), ids, choice)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, HIDDEN)
    assert relative_error(got, exact) <= max(2 * relative_error(bf16, exact), 1e-3)


def test_the_prefill_path_in_uneven_chunks_equals_one_chunk() -> None:
    """Experts dequantized 7 at a time (32 = 4 x 7 + 4) give the bits of one chunk of 32: each
    slot's sums are the same, only which launch computes them differs."""
    experts = gpt_oss_20b_experts(torch.bfloat16)
    x = torch.randn(512, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(512, seed=9)
    one = dequantized_moe_mxfp4(x, experts, weights, ids, None, EXPERTS)
    assert torch.equal(dequantized_moe_mxfp4(x, experts, weights, ids, None, 7), one)


@pytest.mark.parametrize(("tokens", "choice"), [(1, None), (64, None), (1, GemvTiles(1, 64, 16, 4)),
                                                (16, None), (256, Dequantize()),
                                                (64, Swapped())])  # fmt: skip
def test_a_cuda_graph_replays_the_layer(tokens: int, choice: Choice | None) -> None:
    """The rule's path (the tiled kernels where ``choice`` is None and at 64 tokens as
    before), the decode kernels with K split, the prefill path and the swapped kernels."""
    experts = gpt_oss_20b_experts(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens, seed=5)

    def layer() -> torch.Tensor:
        if choice is None and tokens == 64:
            return fused_moe_mxfp4(x, experts, weights, ids)
        return mxfp4_moe(x, experts, weights, ids, choice)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    new_weights, new_ids = routing(tokens, seed=6)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    assert torch.equal(out, layer())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    test_models_gpt_oss.write_mxfp4_checkpoint(test_models_gpt_oss.make_hf_model(), root)
    return root


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_layers_on_cuda_match_the_cpu_reference(folder: Path, tokens: int) -> None:
    cpu = load_model(str(folder), torch.device("cpu"), torch.float32).module
    gpu = load_model(str(folder), torch.device("cuda"), torch.float32).module
    hidden = cpu.config.hidden_size
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    for cpu_layer, gpu_layer in zip(cpu.model.layers, gpu.model.layers, strict=True):
        assert isinstance(gpu_layer.mlp, GptOssMoE) and gpu_layer.mlp.mxfp4
        want = cpu_layer.mlp(x)
        got = gpu_layer.mlp(x.cuda()).cpu()
        assert relative_error(got, want) <= 1e-4


def test_the_engine_on_cuda_gives_the_reference_path_tokens(folder: Path) -> None:
    prompts = test_models_gpt_oss.PROMPTS
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = cpu_engine_tokens(folder, prompts, params)
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64)
    try:
        got = [out.token_ids for out in llm.generate(prompts, params, detokenize=False)]
    finally:
        llm.engine.shutdown()
    assert got == want


def test_decode_graphs_give_the_reference_path_tokens(folder: Path) -> None:
    """The engine on CUDA captures gpt-oss's MXFP4 decode steps in graphs, and their replays
    give the CPU reference path's tokens."""
    prompts = test_models_gpt_oss.PROMPTS
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = cpu_engine_tokens(folder, prompts, params)
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64)
    try:
        assert llm.engine.runner.graph_runner is not None
        got = [out.token_ids for out in llm.generate(prompts, params, detokenize=False)]
    finally:
        llm.engine.shutdown()
    assert got == want
