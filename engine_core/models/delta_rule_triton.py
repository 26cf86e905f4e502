"""The gated delta rule's one-token step (Qwen3-Next's decode) in Triton, in place on the state
slots: every decode row reads its slot's recurrent state, updates it and writes it back where it
was, in one launch, reading the rows' q, k, v, g and beta where the layer computed them.

That is what a CUDA graph needs of a decode step: no host value (the rows and slots are device
tensors, static in a graph) and no gather into a temporary and scatter back (a padding row's slot
is the padding slot, engine_core/cuda_graph.py). The math is models/delta_rule.py's
``recurrent_gated_delta_step`` after GatedDeltaNet.heads (q and k L2-normalised with the epsilon
inside the root, q scaled by Dk^-0.5, each key head serving ``value_heads / key_heads`` value
heads), in float32, the state stored back in its own dtype; vLLM's fused recurrent kernel
(``fused_recurrent_gated_delta_rule`` with its state indices, from flash-linear-attention) does
the same. One program per (row, value head, block of value columns): each owns its columns of
the head's [Dk, Dv] state, so no two programs of a real row write the same element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_step_kernel(
    Mixed, Rows, G, Beta, State, Slots, Out,
    stride_m, stride_g, stride_b, stride_s, stride_sh, stride_o, stride_oh,
    v_offset, scale, eps,
    PER_KEY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, KEY_DIM: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(Rows + n).to(tl.int64)
    slot = tl.load(Slots + n).to(tl.int64)
    key_head = head // PER_KEY
    dk = tl.arange(0, BK)
    k_mask = dk < DK
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    v_mask = dv < DV
    base = Mixed + row * stride_m
    q = tl.load(base + key_head * DK + dk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(base + KEY_DIM + key_head * DK + dk, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(base + v_offset + head * DV + dv, mask=v_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + eps)
    decay = tl.exp(tl.load(G + row * stride_g + head).to(tl.float32))
    beta = tl.load(Beta + row * stride_b + head).to(tl.float32)
    # [Dk, BV] of the head's state (its last two dims contiguous)
    cells = State + slot * stride_s + head * stride_sh + dk[:, None] * DV + dv[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(cells, mask=mask, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(cells, state.to(State.dtype.element_ty), mask=mask)
    out_row = Out + row * stride_o + head * stride_oh
    tl.store(out_row + dv, out.to(Out.dtype.element_ty), mask=v_mask)


def decode_step_in_place(
    mixed: torch.Tensor,  # [T, 2 * key_dim + value_dim]: q, k, v side by side (the convolution's)
    rows: torch.Tensor,  # [N] int64: the decode rows of the step
    slots: torch.Tensor,  # [N] int64: each row's state slot
    g: torch.Tensor,  # [T, Hv] float32: the log decay
    beta: torch.Tensor,  # [T, Hv]: the write strength
    state: torch.Tensor,  # [slots, Hv, Dk, Dv]: updated in place
    out: torch.Tensor,  # [T, Hv, Dv]: the rows' outputs written here
    num_key_heads: int,
) -> None:
    """One gated-delta-rule step for each of ``rows`` (see the module's docstring)."""
    num, (_, heads, dk, dv) = rows.shape[0], state.shape
    key_dim = num_key_heads * dk
    inner = (state.stride(3), state.stride(2), mixed.stride(1), out.stride(2), g.stride(1))
    if inner != (1, dv, 1, 1, 1) or beta.stride(1) != 1:
        raise ValueError("the delta rule's decode kernel needs contiguous states and inputs")
    block_v = min(triton.next_power_of_2(dv), 32)
    grid = (num, heads, triton.cdiv(dv, block_v))
    _decode_step_kernel[grid](
        mixed, rows, g, beta, state, slots, out,
        mixed.stride(0), g.stride(0), beta.stride(0), state.stride(0), state.stride(1),
        out.stride(0), out.stride(1), 2 * key_dim, dk**-0.5, 1e-6,
        PER_KEY=heads // num_key_heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v,
        KEY_DIM=key_dim,
    )  # fmt: skip
