"""The fused-MoE Triton kernels (engine_core/models/fused_moe.py) against a dense computation:
every token through each of its top-k experts, one at a time, weighted and summed.

On a GPU: bf16 over token counts 1 to 4,096, 8 to 128 experts, top 1 to 8, widths that are and
are not multiples of the blocks, and routing skewed onto a few experts. Without a GPU the module
is skipped unless ``TRITON_INTERPRET=1``: then a few small float32 shapes run through Triton's
CPU interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.gpu
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.models.fused_moe import (  # noqa: E402
    align,
    align_in_one_launch,
    align_torch,
    block_sizes,
    fused_moe,
    fused_moe_one_token,
    route_one_token,
    route_topk,
)

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPE = torch.float32 if INTERPRET else torch.bfloat16

# (tokens, experts, top_k, hidden, intermediate)
if INTERPRET:
    SHAPES = [(1, 4, 2, 32, 48), (1, 8, 3, 40, 36), (7, 8, 2, 64, 32), (33, 6, 3, 48, 80)]
else:
    SHAPES = [
        (1, 128, 8, 2048, 768),
        (1, 8, 2, 4096, 14336),
        (1, 60, 4, 1000, 1400),
        (7, 8, 2, 4096, 1792),
        (64, 128, 8, 2048, 768),
        (256, 128, 8, 2048, 768),
        (300, 60, 4, 1024, 1408),
        (1000, 8, 2, 512, 1000),
        (4096, 128, 8, 2048, 768),
        (4096, 8, 1, 1024, 512),
    ]


def dense_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """One token and one expert at a time, in float32, rounding where the kernels round."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = (w13[e].float() @ x[t].float()).to(x.dtype).float()
            gate, up = h[:inter], h[inter:]
            act = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype).float()
            y = (w2[e].float() @ act).to(x.dtype).float()
            out[t] += (y * weights[t, k]).to(x.dtype).float()
    return out.to(x.dtype)


def routing(
    num_tokens: int, num_experts: int, top_k: int, skewed: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skewed:  # most tokens on the first few experts: long runs, many empty experts
        logits[:, : max(top_k, 2)] += 4.0
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(DEVICE), ids.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_moe_matches_the_dense_computation(shape: tuple[int, ...], skewed: bool) -> None:
    check_against_dense(shape, skewed, DTYPE)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs float32 above already")
def test_fused_moe_is_exact_in_float32() -> None:
    """float32 models (the HF comparisons) must not get TF32 products on the GPU."""
    check_against_dense((64, 8, 2, 256, 192), False, torch.float32)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs float32 above already")
def test_one_token_path_is_exact_in_float32() -> None:
    """A single token takes fused_moe_one_token (batch-1 decode): float32 products too."""
    check_against_dense((1, 16, 4, 320, 200), False, torch.float32)


def test_one_token_path_equals_the_grouped_path() -> None:
    """One token through the one-token kernels and through the grouped ones (align, two
    grouped GEMMs, combine): the same rounding steps, so the same result up to the order of
    float32 sums."""
    gen = torch.Generator().manual_seed(5)
    num_experts, top_k, hidden, inter = 12, 4, 96, 80
    x = torch.randn(1, hidden, generator=gen).to(DEVICE, DTYPE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(
        DEVICE, DTYPE
    )
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, DTYPE)
    weights, ids = routing(1, num_experts, top_k, False, gen)
    one_token = fused_moe_one_token(x, w13, w2, weights, ids)
    grouped = fused_moe(x, w13, w2, weights, ids, blocks=block_sizes(top_k, num_experts, inter))
    atol = 2e-2 if DTYPE is torch.bfloat16 else 1e-5
    torch.testing.assert_close(one_token, grouped, atol=atol, rtol=atol)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), one_token, atol=0, rtol=0)


def check_against_dense(shape: tuple[int, ...], skewed: bool, dtype: torch.dtype) -> None:
    num_tokens, num_experts, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(sum(shape) + skewed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w13 = w13.to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, skewed, gen)
    got = fused_moe(x, w13, w2, weights, ids)
    rows = torch.randperm(num_tokens, generator=gen)[:48].to(DEVICE)  # the reference is slow
    want = dense_reference(x[rows], w13, w2, weights[rows], ids[rows])
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (3e-2, 3e-2)
    torch.testing.assert_close(got[rows], want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("one_launch", [False, True])
def test_align_puts_each_slot_once_in_its_experts_block(one_launch: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts, top_k, block_m = 37, 9, 3, 16
    _, ids = routing(num_tokens, num_experts, top_k, True, gen)
    run = align_in_one_launch if one_launch else align_torch
    sorted_slots, block_experts = run(ids, num_experts, block_m)
    flat = ids.reshape(-1).cpu().long()
    slots = sorted_slots.cpu().long()
    experts = block_experts.cpu().long()
    real = slots[slots < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every slot exactly once
    for row, slot in enumerate(slots.tolist()):
        if slot < flat.numel():
            assert experts[row // block_m] == flat[slot]  # in a block of its own expert
    used = experts[experts >= 0]
    assert used.tolist() == sorted(used.tolist())  # blocks in expert order, the rest -1
    assert (experts[len(used) :] == -1).all()


# (tokens, experts, top_k, block_m); 512 x 8 = 4,096 slots, the one launch's largest.
ALIGN_CASES = [
    (1, 128, 8, 16),
    (7, 8, 2, 16),
    (64, 128, 8, 16),
    (256, 128, 8, 32),
    (33, 60, 4, 64),
    (512, 128, 8, 16),
]


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"), ALIGN_CASES)
def test_align_in_one_launch_equals_the_torch_ops(
    num_tokens: int, num_experts: int, top_k: int, block_m: int, skewed: bool
) -> None:
    """The one-launch align (decode sizes) writes exactly what the torch version writes: the
    same padded runs, the slots of an expert in slot order, the same block experts."""
    gen = torch.Generator().manual_seed(num_tokens)
    _, ids = routing(num_tokens, num_experts, top_k, skewed, gen)
    want = align_torch(ids, num_experts, block_m)
    got = align_in_one_launch(ids, num_experts, block_m)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    assert all(
        torch.equal(a, b) for a, b in zip(align(ids, num_experts, block_m), got, strict=True)
    )


# (tokens, experts, top_k): E not a power of two, E > 256 (4 warps), K = 1 and K = E.
ROUTE_CASES = [(1, 128, 8), (37, 60, 4), (5, 8, 2), (3, 8, 1), (4, 320, 8), (2, 8, 8)]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), ROUTE_CASES)
def test_route_topk_equals_the_torch_routing(
    num_tokens: int, num_experts: int, top_k: int, renormalize: bool
) -> None:
    """The one-launch router (softmax, top-k, renormalisation) picks K distinct experts whose
    probabilities are the K largest, largest first, with torch's weights to float32 rounding.
    (Between equal probabilities, which bf16 logits often give, either choice is a top-k: it
    takes the lower expert, torch's topk may not.)"""
    gen = torch.Generator().manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(DTYPE).to(DEVICE)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.topk(top_k, dim=-1).values
    want_w = top / top.sum(dim=-1, keepdim=True) if renormalize else top
    got_w, got_ids = route_topk(logits, top_k, renormalize)
    ids = got_ids.long()
    assert all(len(set(row)) == top_k for row in ids.tolist())
    torch.testing.assert_close(probs.gather(1, ids), top, atol=0, rtol=0)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_route_topk_breaks_ties_to_the_lower_expert_and_keeps_nan_rows_in_range() -> None:
    """Equal logits pick experts 0..K-1 in order, with equal weights; a row with a NaN logit
    gets NaN weights (as torch's softmax gives) and ids that are valid experts."""
    logits = torch.zeros(2, 12, dtype=DTYPE)
    logits[1, 5] = float("nan")
    weights, ids = route_topk(logits.to(DEVICE), 4, True)
    assert ids[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(weights[0].cpu(), torch.full((4,), 0.25))
    assert ((ids[1] >= 0) & (ids[1] < 12)).all()
    assert torch.isnan(weights[1]).all()


# (experts, top_k, hidden): E not a power of two, E > 256 (four warps), K = E, one expert, H a
# multiple of the 2,048-wide step and past it by a part.
ONE_TOKEN_ROUTER_CASES = [
    (128, 8, 2048),
    (60, 4, 96),
    (8, 2, 4096),
    (10, 3, 72),
    (320, 8, 256),
    (4, 4, 3000),
    (1, 1, 64),
]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("num_experts", "top_k", "hidden"), ONE_TOKEN_ROUTER_CASES)
def test_one_token_router_equals_the_linear_then_the_routing(
    num_experts: int, top_k: int, hidden: int, renormalize: bool
) -> None:
    """The one-launch router of a single token (the router's product, the last program to
    arrive routing from all the logits) picks what the router linear's output, rounded to the
    activations' dtype, gives through route_topk; and leaves its arrival count at zero, so
    the next call (here three more) works alike."""
    gen = torch.Generator().manual_seed(num_experts + hidden)
    weight = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(DEVICE, DTYPE)
    arrived = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(4):
        x = (torch.randn(1, hidden, generator=gen) * 3).to(DEVICE, DTYPE)
        logits = (x.float() @ weight.float().T).to(DTYPE)
        got_w, got_ids = route_one_token(x, weight, arrived, top_k, renormalize)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top = probs.topk(top_k, dim=-1).values
        ids = got_ids.long()
        assert len(set(ids[0].tolist())) == top_k
        # Rounding the logits to bf16 may order near-equal experts either way: compare the
        # chosen experts' probabilities with the K largest, within that rounding.
        atol = 2e-2 if DTYPE is torch.bfloat16 else 1e-6
        torch.testing.assert_close(probs.gather(1, ids), top, atol=atol, rtol=atol)
        want_w, _ = route_topk(logits, top_k, renormalize)
        torch.testing.assert_close(got_w, want_w, atol=atol, rtol=atol)
        assert arrived.item() == 0


def test_one_token_router_leaves_a_count_where_it_found_it() -> None:
    """The arrival count is taken modulo the launch's programs and given back: a count left at
    a multiple of them (as overlapping launches would leave it) still routes right and stays."""
    gen = torch.Generator().manual_seed(3)
    num_experts, hidden = 12, 64
    weight = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(DEVICE, DTYPE)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE, DTYPE)
    want_w, want_ids = route_one_token(
        x, weight, torch.zeros(1, dtype=torch.int32, device=DEVICE), 3, True
    )
    arrived = torch.full((1,), 2 * num_experts, dtype=torch.int32, device=DEVICE)
    got_w, got_ids = route_one_token(x, weight, arrived, 3, True)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
    assert arrived.item() == 2 * num_experts
