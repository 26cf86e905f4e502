"""W4A16 experts' prefill path (engine_core/models/w4a16_prefill.py, chosen by w4a16_moe.py) on
the CPU through Triton's interpreter: the dequantizing kernel bit for bit against ``(q - zero) *
scale`` computed here from the 4-bit values each checkpoint format was packed from (AWQ, GPTQ
symmetric and with zero points in its original format, compressed-tensors; groups of 32, 128
and one over the row), and the path's layer output against the reference the CPU serves with
(moe.py ``w4a16_expert_mlp``), in one chunk of experts and in several. In float32 and float16:
Triton's interpreter rounds float32 to bf16 by truncation and multiplies bf16 ``tl.dot``
operands wrongly (tests/test_w4a16_interpreted.py says more), so bf16 is checked on a GPU
(tests/test_w4a16_moe_gpu.py).

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable):

    TRITON_INTERPRET=1 PYTHONPATH=.:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_w4a16_prefill_interpreted.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.config import W4A16Config  # noqa: E402
from engine_core.models import w4a16_kernels, w4a16_moe  # noqa: E402
from engine_core.models.w4a16 import AWQ_ORDER, to_layout  # noqa: E402
from engine_core.models.w4a16_prefill import (  # noqa: E402
    dequantize_experts,
    dequantized_moe_w4a16,
)
from tests.w4a16_moe_cases import random_experts, reference, relative_error, routing  # noqa: E402

EXPERTS, ROWS, COLS = 3, 40, 384  # rows and columns not multiples of the kernel's blocks


@pytest.fixture(autouse=True)
def loops_over_scalar_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter holds a kernel's int arguments as one-element arrays and turns
    them into a ``range`` bound with ``int(array)``, which numpy 2.4 refuses (so every kernel
    with such a loop fails there, fused_moe's and _align_kernel among them): the bound read as
    the array's one element instead, for this module's tests only."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor: type, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


def pack(values: torch.Tensor) -> torch.Tensor:
    """[..., 8C] nibbles -> int32 [..., C], value 8j + i in bits 4i.. of word j (wrapped)."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def checkpoint(
    source: str, q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One layer's tensors as the format stores them, by our names: q [N, K] 0..15, zeros
    [G, N] (what each weight subtracts), scales [G, N]."""
    if source == "awq":  # [K, N / 8] and [G, N / 8], columns interleaved within a word
        order = torch.tensor(AWQ_ORDER)
        tensors = {"qweight": pack(q.t().reshape(q.shape[1], -1, 8)[..., order].flatten(1))}
        if zeros is not None:
            tensors["zeros"] = pack(zeros.reshape(zeros.shape[0], -1, 8)[..., order].flatten(1))
        return tensors | {"scales": scales.half()}
    if source == "gptq":  # [K / 8, N] packed along K; zero points stored minus one
        tensors = {"qweight": pack(q).t().contiguous(), "scales": scales.half()}
        return tensors | ({} if zeros is None else {"zeros": pack(zeros - 1)})
    tensors = {"qweight": pack(q), "scales": scales.t().to(torch.bfloat16)}  # compressed-tensors
    return tensors | ({} if zeros is None else {"zeros": pack(zeros).t()})  # [N / 8, G]


def per_column(per_group: torch.Tensor, cols: int) -> torch.Tensor:
    """[E, G, N] -> [E, N, K]: each group's value over its ``cols`` columns."""
    return per_group.repeat_interleave(cols, 1).transpose(1, 2)


# (source, zero points, GPTQ's zero offset)
FORMATS = [
    ("awq", True, 0),
    ("gptq", False, 0),
    ("gptq", True, 1),  # the original format: 16 stored as 15
    ("compressed-tensors", False, 0),
    ("compressed-tensors", True, 0),
]


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("form", FORMATS, ids=str)
def test_dequantize_is_bit_exact_for_each_checkpoint_format(form: tuple, group: int) -> None:
    source, has_zeros, offset = form
    config = W4A16Config(source, group, has_zeros, zero_offset=offset)
    cols = COLS if group == -1 else group
    gen = torch.Generator().manual_seed(group + 7 * offset + len(source) + has_zeros)
    q = torch.randint(0, 16, (EXPERTS, ROWS, COLS), generator=gen)
    shape = (EXPERTS, COLS // cols, ROWS)
    low = 1 if offset else 0  # the original GPTQ format cannot store a zero point of 0
    zeros = torch.randint(low, 16 + offset, shape, generator=gen) if has_zeros else None
    # bf16 values: every format's scale dtype (fp16 or bf16) holds them exactly
    scales = (0.001 + 0.05 * torch.rand(shape, generator=gen)).bfloat16().float()
    held = [
        {
            name: to_layout(config, name, tensor, name)
            for name, tensor in checkpoint(source, q[e], None if zeros is None else zeros[e],
                                           scales[e]).items()
        }
        for e in range(EXPERTS)
    ]  # fmt: skip
    stacked = {name: torch.stack([h[name] for h in held]) for name in held[0]}
    zero = (zeros if has_zeros else torch.full(shape, 8)).float()
    want = (q.float() - per_column(zero, cols)) * per_column(scales, cols)
    for dtype in (torch.float32, torch.float16):
        out = torch.empty(EXPERTS, ROWS, COLS, dtype=dtype)
        got = dequantize_experts(
            stacked["qweight"], stacked["scales"], stacked.get("zeros"), cols, out
        )
        assert torch.equal(got, want.to(dtype)), (source, has_zeros, group, dtype)


# (tokens, experts, top_k, hidden, inter, group, zero points, experts a chunk)
SHAPES = [
    (21, 6, 2, 128, 64, 32, False, 4),  # two chunks, the second short; an idle expert
    (33, 3, 2, 128, 64, -1, True, None),  # one chunk; one group over each input
]


def test_act_order_experts_through_the_prefill_path() -> None:
    """Dequantized in their sorted column order, put back in the inputs' order per expert."""
    experts = random_experts(4, 128, 64, 32, True, seed=5, act_order=True)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(40, 4, 2, 5)
    got = dequantized_moe_w4a16(x, experts, weights, ids, chunk=3)  # a chunk and a remainder
    assert relative_error(got, reference(x, experts, weights, ids)) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_prefill_path_matches_the_reference(shape: tuple) -> None:
    tokens, num_experts, top_k, hidden, inter, group, zeros, chunk = shape
    seed = tokens + hidden
    experts = random_experts(num_experts, hidden, inter, group, zeros, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    weights, ids = routing(tokens, num_experts, top_k, seed)
    want = reference(x, experts, weights, ids)
    # float32: the same dequantized weights as the reference, so float32 sums' order only.
    got = dequantized_moe_w4a16(x, experts, weights, ids, chunk=chunk)
    assert relative_error(got, want) < 1e-5
    half = dequantized_moe_w4a16(x.half(), experts, weights, ids, chunk=chunk)
    assert relative_error(half.float(), want) < 5e-3  # float16's rounding of each product
    wrong = dequantized_moe_w4a16(x, experts, weights, (ids + 1) % num_experts, chunk=chunk)
    assert relative_error(wrong, want) > 0.1  # another expert's output shows


def test_the_chooser_dequantizes_long_steps_unless_measured_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    experts = random_experts(4, 128, 64, 32, True, seed=1)
    at = w4a16_moe.DEQUANTIZE_TOKENS
    assert w4a16_moe.choose(at - 1, 2, experts, 128) == w4a16_moe.Tiled()
    assert w4a16_moe.choose(at, 2, experts, 128) == w4a16_moe.Dequantize()
    tiled = w4a16_moe.Tiled(w4a16_moe.DEQUANTIZE_CANDIDATES[0].blocks)
    bucket = 1 << (at - 1).bit_length()
    monkeypatch.setitem(w4a16_moe.MEASURED, (bucket, 128, 64, 4, 2), tiled)
    assert w4a16_moe.choose(at, 2, experts, 128) == tiled
    assert w4a16_moe.choose(at, 2, experts, 256) == w4a16_moe.Dequantize()  # another shape


def test_both_paths_agree_through_the_entry() -> None:
    experts = random_experts(4, 128, 64, 32, True, seed=2)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(20, 4, 2, 2)
    tiled = w4a16_moe.w4a16_moe(x, experts, weights, ids, w4a16_moe.Tiled())
    dequantized = w4a16_moe.w4a16_moe(x, experts, weights, ids, w4a16_moe.Dequantize())
    assert relative_error(dequantized, tiled) < 1e-5


def test_a_dense_linear_dequantizes_where_measured_and_from_the_row_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """w4a16_kernels.choose_tiles: a MEASURED None (dequantizing won in the sweep) below
    DEQUANTIZE_ROWS takes the dequantize path, unless the weight is too large for its buffer."""
    n, k, sms = 512, 1024, 132
    assert w4a16_kernels.choose_tiles(16, n, k, 128, sms) is not None  # the rule: tiles
    assert w4a16_kernels.choose_tiles(w4a16_kernels.DEQUANTIZE_ROWS, n, k, 128, sms) is None
    monkeypatch.setitem(w4a16_kernels.MEASURED, (16, n, k), None)
    assert w4a16_kernels.choose_tiles(16, n, k, 128, sms) is None
    assert w4a16_kernels.choose_tiles(17, n, k, 128, sms) is not None  # another bucket
    monkeypatch.setattr(w4a16_kernels, "DEQUANTIZE_MAX_VALUES", n * k - 1)
    assert w4a16_kernels.choose_tiles(16, n, k, 128, sms) is not None
