"""GPU tests of the FP8 matmul kernels (engine_core/models/fp8_kernels.py) against torch
references written here: the quantizers' scales are absmax / 448 and their values round-trip
within e4m3's rounding; both GEMMs equal float32 matmuls of the dequantized operands (up to
bf16 output rounding); a CUDA graph replays them exactly; an FP8 linear on the GPU equals the
CPU's dequantizing reference within the activations' rounding, and an FP8 engine on the GPU
picks the CPU reference's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)

from engine_core.config import Fp8Config  # noqa: E402
from engine_core.llm import LLM  # noqa: E402
from engine_core.models.fp8 import fp8_linear, quantize_rows  # noqa: E402
from engine_core.models.fp8_kernels import (  # noqa: E402
    fp8_block_gemm,
    fp8_rowwise_gemm,
    fp8_skinny_gemm,
    quantize_per_token,
    quantize_per_token_group,
    quantize_static,
    silu_and_mul_quant,
    skinny_block_k,
)
from engine_core.models.skinny_gemm import tma_loads_fit  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests.factories import write_tiny_llama  # noqa: E402

E4M3 = torch.float8_e4m3fn
ROWS = (1, 7, 16, 64, 200, 2048)
SHAPES = ((512, 256), (4096, 4096), (6144, 4096), (4096, 14336))  # (N, K)


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x * torch.rand(m, 1, device="cuda", generator=gen, dtype=torch.bfloat16) * 4


def weight(n: int, k: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(n, k, device="cuda", generator=gen) * 0.02


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < rel, f"relative error {err:.2e}"


@pytest.mark.parametrize("m", ROWS)
def test_quantize_per_token(m: int) -> None:
    x = activations(m, 4096)
    q, scale = quantize_per_token(x)
    assert q.dtype == E4M3 and scale.shape == (m, 1)
    want = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)  # zero rows
    torch.testing.assert_close(scale, want, rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself (relative), or tiny
    # (the conversion may round twice, through fp16: 2^-10 more)
    back = q.float() * scale
    bound = x.float().abs() * (2**-4 + 2**-10) + scale * 2**-9
    assert ((back - x.float()).abs() <= bound).all()


def test_quantize_static_and_groups() -> None:
    x = activations(33, 1024)
    s = torch.tensor([0.01], device="cuda")
    q = quantize_static(x, s)
    want = (x.float() / 0.01).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    qg, sg = quantize_per_token_group(x, 128)
    assert sg.shape == (33, 8)
    groups = x.float().view(33, 8, 128)
    torch.testing.assert_close(sg, groups.abs().amax(-1) / 448.0, rtol=1e-6, atol=0)
    want_g = (groups / sg[..., None]).clamp(-448, 448).to(E4M3).view(33, 1024)
    assert torch.equal(qg.view(torch.uint8), want_g.view(torch.uint8))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_rowwise_gemm_matches_dequantized_matmul(m: int, n: int, k: int) -> None:
    x, w = activations(m, k), weight(n, k)
    w_scale = w.abs().amax(dim=1) / 448.0
    wq = (w / w_scale[:, None]).to(E4M3)
    xq, x_scale = quantize_per_token(x)
    got = fp8_rowwise_gemm(xq, x_scale, wq, w_scale, torch.bfloat16)
    want = (xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).T
    assert_close_relative(got, want, 1e-2)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 512), (13, 512, 576), (64, 6144, 4096)])
def test_skinny_gemm_matches_dequantized_matmul(
    m: int, n: int, k: int, split_k: int, tma: bool
) -> None:
    """The decode-sized Triton GEMM with per-thread and with TMA loads, every K split, an N that
    is no multiple of its 64-row tile (TMA reads the rows past N and M as zeros), K = 576
    (SmolLM2's hidden size: 64-wide K tiles), a bias, float32 and bf16 outputs."""
    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90+")
    x, w = activations(m, k), weight(n, k)
    w_scale = w.abs().amax(dim=1) / 448.0
    wq = (w / w_scale[:, None]).to(E4M3)
    xq, x_scale = quantize_per_token(x)
    bias = torch.randn(n, device="cuda")
    block_k = skinny_block_k(xq, wq)
    if k % (block_k * split_k):
        pytest.skip(f"K={k} does not split {split_k} ways in {block_k}-wide tiles")
    want = (xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).T + bias
    got = fp8_skinny_gemm(
        xq, x_scale, wq, w_scale, torch.float32, bias, block_k=block_k, split_k=split_k, tma=tma
    )
    # Each K tile's FP8 product is exact to about 2^-13; the sum over tiles is float32.
    assert_close_relative(got, want, 1e-3)
    got16 = fp8_skinny_gemm(
        xq, x_scale, wq, w_scale, torch.bfloat16, bias, block_k=block_k, tma=tma
    )
    assert_close_relative(got16, want, 2**-8)


def test_skinny_gemm_loads_by_tma_where_the_operands_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Hopper the default is TMA; an operand whose base address is not 16-byte aligned (a
    view one element in) falls back to per-thread loads and still gives the product."""
    xq, x_scale = quantize_per_token(activations(8, 1024 + 16))
    w = weight(256, 1024)
    w_scale = w.abs().amax(dim=1) / 448.0
    wq = (w / w_scale[:, None]).to(E4M3)
    aligned = xq[:, :1024]
    shifted = xq[:, 1:1025]  # 1-byte offset: TMA refuses such a base address
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert tma_loads_fit(aligned, wq) == hopper
    assert not tma_loads_fit(shifted, wq)
    from engine_core.models import skinny_gemm

    class CountLaunches:  # stands in for the TMA kernel's launcher and counts its launches
        def __init__(self, kernel: object) -> None:
            self.kernel, self.launches = kernel, 0

        def __getitem__(self, grid: tuple[int, ...]) -> object:
            self.launches += 1
            return self.kernel[grid]

    spy = CountLaunches(skinny_gemm._skinny_gemm_tma_kernel)
    monkeypatch.setattr(skinny_gemm, "_skinny_gemm_tma_kernel", spy)
    for a, by_tma in ((aligned, hopper), (shifted, False)):
        before = spy.launches
        want = (a.float() * x_scale) @ (wq.float() * w_scale[:, None]).T
        assert_close_relative(fp8_rowwise_gemm(a, x_scale, wq, w_scale, torch.float32), want, 1e-3)
        assert spy.launches - before == int(by_tma)


def test_skinny_gemm_takes_decode_sizes_and_a_static_scale() -> None:
    """fp8_rowwise_gemm runs the Triton kernel up to SKINNY_MAX_ROWS (64) rows, cuBLASLt above;
    a static activation scale arrives expanded (stride 0) and is read right."""
    w = weight(256, 1024)
    w_scale = w.abs().amax(dim=1) / 448.0
    wq = (w / w_scale[:, None]).to(E4M3)
    assert skinny_block_k(activations(64, 1024), wq) == 256
    assert skinny_block_k(activations(65, 1024), wq) == 0
    assert skinny_block_k(activations(8, 1024)[:, ::2], wq[:, :512]) == 0  # strided rows
    x = activations(9, 1024)
    s = torch.tensor([0.02], device="cuda")
    xq = quantize_static(x, s)
    got = fp8_rowwise_gemm(xq, s.view(1, 1).expand(9, 1), wq, w_scale, torch.bfloat16)
    want = (xq.float() * 0.02) @ (wq.float() * w_scale[:, None]).T
    assert_close_relative(got, want, 2**-8)


def block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    tiles = w.view(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    q = (tiles / scale[:, None, :, None]).view(n, k).to(E4M3)
    return q, scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_block_gemm_matches_dequantized_matmul(m: int, n: int, k: int) -> None:
    x = activations(m, k)
    wq, w_scale = block_quantize(weight(n, k))
    xq, x_scale = quantize_per_token_group(x, 128)
    got = fp8_block_gemm(xq, x_scale, wq, w_scale, (128, 128), torch.bfloat16)
    x_deq = (xq.float().view(m, k // 128, 128) * x_scale[..., None]).view(m, k)
    want = x_deq @ block_dequantize(wq, w_scale).T
    assert_close_relative(got, want, 1e-2)


def test_kernels_replay_in_a_cuda_graph() -> None:
    x = activations(64, 4096)
    wq, w_scale = block_quantize(weight(4096, 4096))
    row_scale = torch.rand(4096, device="cuda") / 100 + 1e-3

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs = quantize_per_token_group(x, 128)
        block = fp8_block_gemm(xq, xs, wq, w_scale, (128, 128), torch.bfloat16)
        tq, ts = quantize_per_token(x)
        return block, fp8_rowwise_gemm(tq, ts, wq, row_scale, torch.bfloat16)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up off the default stream, as capture needs
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.mul_(-1.0)  # new inputs in place: the replay must see them
    graph.replay()
    x.mul_(-1.0)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)


def test_fp8_linear_matches_its_cpu_reference() -> None:
    """fp8_linear on CUDA (activations quantized per token, the row-wise FP8 GEMM) against the
    same layer through the CPU's dequantizing reference: within activation rounding."""
    wq, ws = quantize_rows(weight(2048, 2048))
    x = activations(64, 2048)
    config = Fp8Config(weight_scales="channel")
    got = fp8_linear(x, wq, ws, None, config)
    want = fp8_linear(x.float().cpu(), wq.cpu(), ws.cpu(), None, config)
    assert_close_relative(got.cpu(), want, 5e-2)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("rows", "n"), [(1, 64), (7, 576), (64, 4096)])
def test_rms_norm_quantizes_its_output_like_the_quantizer(
    rows: int, n: int, residual: bool
) -> None:
    """The fused quantizer of an RMSNorm writes exactly what quantize_per_token makes of the
    norm's output, and the norm's own outputs do not change."""
    from engine_core.models import triton_ops

    x, w = activations(rows, n), torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    res = activations(rows, n, seed=3) if residual else None
    plain = triton_ops.rms_norm(x, w, 1e-6, res)
    fp8 = triton_ops.quantized_rows(rows, n, torch.float8_e4m3fn, x.device)
    fused = triton_ops.rms_norm(x, w, 1e-6, res, fp8)
    if not residual:
        fused, plain = (fused,), (plain,)
    for got, want in zip(fused, plain, strict=True):
        assert torch.equal(got, want)
    q, scale = quantize_per_token(plain[0])
    assert torch.equal(fp8[1], scale)
    assert torch.equal(fp8[0].view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (37, 700), (512, 14336)])
def test_silu_and_mul_quant_equals_the_two_launches(rows: int, inter: int) -> None:
    """The prefill path's fused SiLU-and-mul quantizer writes exactly what silu_and_mul and
    then quantize_per_token write: the activation, its e4m3 rows and their scales."""
    from engine_core.models import triton_ops

    gate_up = activations(rows, 2 * inter)
    act, q, scale = silu_and_mul_quant(gate_up)
    want_act = triton_ops.silu_and_mul(gate_up)
    want_q, want_scale = quantize_per_token(want_act)
    assert torch.equal(act, want_act)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_fused_quantizers_leave_an_fp8_model_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU runner moves two quantizers a layer into the RMSNorms before them, and in
    prefill-sized batches a third into SiLU-and-mul (fuse_quantizers); an FP8 engine's
    prompt logprobs stay bit for bit those of the separate quantizer launches, with short
    prompts and a long one in the batch (570 tokens in one step: the fused SiLU path)."""
    write_tiny_llama(tmp_path, vocab_size=384)
    prompts = [[5, 9, 33, 2 + i, 100] * (3 + i) for i in range(4)]
    prompts.append([(7 * i) % 380 + 3 for i in range(480)])
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    llm = LLM(str(tmp_path), quantization="fp8", max_model_len=512, num_kv_blocks=128,
              device="cuda", dtype="bfloat16", enforce_eager=True)  # fmt: skip
    try:
        model = llm.engine.runner.model
        norms = [m for m in model.modules() if getattr(m, "quantize_output", False)]
        assert len(norms) == 4  # 2 layers, both norms each
        mlps = [m for m in model.modules() if getattr(m, "quantize_act", False)]
        assert len(mlps) == 2
        from engine_core.models import fp8_kernels

        calls = []
        real = fp8_kernels.silu_and_mul_quant
        monkeypatch.setattr(
            fp8_kernels,
            "silu_and_mul_quant",
            lambda x, dtype: calls.append(x.shape[0]) or real(x, dtype),
        )
        fused = llm.generate(prompts, score, detokenize=False)
        assert calls  # the 570-token step took the fused SiLU quantizer
        for module in norms:
            module.quantize_output = None
        for module in mlps:
            module.quantize_act = None
        plain = llm.generate(prompts, score, detokenize=False)
    finally:
        llm.engine.shutdown()
    for a, b in zip(fused, plain, strict=True):
        assert [lp.logprob for lp in a.prompt_logprobs] == [lp.logprob for lp in b.prompt_logprobs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_engine_on_the_gpu_scores_like_the_cpu_reference(
    tmp_path: Path, kv_cache_dtype: str
) -> None:
    """A tiny Llama under --quantization fp8 (and an FP8 KV cache) on the GPU in bf16: its
    prompt logprobs (teacher-forced, so no greedy divergence compounds) stay within 0.15 nats of
    the CPU's float32 dequantizing reference (activation rounding to e4m3 and bf16 on a
    64-wide model); and decoding through CUDA graphs gives exactly the eager tokens."""
    write_tiny_llama(tmp_path, vocab_size=384)
    prompts = [[5, 9, 33, 2 + i, 100] * (3 + i) for i in range(4)]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    decode = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(params: SamplingParams, **engine: object) -> list:
        llm = LLM(str(tmp_path), quantization="fp8", max_model_len=256, num_kv_blocks=64, **engine)
        try:
            return llm.generate(prompts, params, detokenize=False)
        finally:
            llm.engine.shutdown()

    gpu = {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype}
    cpu_scores = run(score, device="cpu", dtype="float32")
    gpu_scores = run(score, **gpu)
    for ours, ref in zip(gpu_scores, cpu_scores, strict=True):
        got = torch.tensor([lp.logprob for lp in ours.prompt_logprobs])
        want = torch.tensor([lp.logprob for lp in ref.prompt_logprobs])
        assert (got - want).abs().max() < 0.15
    graphs = [o.token_ids for o in run(decode, **gpu)]
    eager = [o.token_ids for o in run(decode, enforce_eager=True, **gpu)]
    assert graphs == eager


@pytest.mark.parametrize("m", [7, 200])
def test_block_gemm_with_192_row_blocks(m: int) -> None:
    """A weight block that 128-wide N tiles do not divide: each tile still reads its own
    block's scale."""
    n, k, rows = 384, 256, 192
    w = weight(n, k)
    tiles = w.view(n // rows, rows, k // 128, 128)
    w_scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    wq = (tiles / w_scale[:, None, :, None]).view(n, k).to(E4M3)
    x = activations(m, k)
    xq, x_scale = quantize_per_token_group(x, 128)
    got = fp8_block_gemm(xq, x_scale, wq, w_scale, (rows, 128), torch.bfloat16)
    w_deq = wq.float() * w_scale.repeat_interleave(rows, 0).repeat_interleave(128, 1)
    x_deq = (xq.float().view(m, k // 128, 128) * x_scale[..., None]).view(m, k)
    assert_close_relative(got, x_deq @ w_deq.T, 1e-2)
