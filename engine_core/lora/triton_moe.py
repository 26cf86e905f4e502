"""LoRA on the MoE experts on CUDA: each routed (token, k) slot's delta through its expert's
adapter pair, computed over the fused MoE's own row blocks (models/fused_moe.py).

The fused MoE sorts the slots by expert and pads each expert's run to whole blocks of BLOCK_M
rows, so a block's rows share an expert; its rows may belong to different adapters. A program
takes one block and loops over the adapter slots: for each slot that some of its rows use, one
tl.dot of those rows against that (adapter, expert)'s A (shrink) or B (expand), the other rows
masked. So each (expert, adapter) pair's weights are read once a block, rows of the base model
(token slot -1) are never computed, and the grid is the fused MoE's, fixed by the step's size:
nothing is read on the host, and the launches run inside CUDA graphs.

The deltas go where PEFT's ParamWrapper puts them (it adds B_e @ A_e * scale to expert e's
weight): the gate_up delta into the gate_up product before the activation, the down delta into
the down product before the routing weight. Both are written per slot [T*K, N] in the model's
dtype, zeros for rows of the base model, and the fused MoE's kernels add them in
(``HAS_DELTA``). The torch form (layers.lora_experts) is the reference, which the CPU runs.

Importing this module imports triton: only CUDA code paths and interpreter tests may do so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_core.models.fused_moe import block_rows


@triton.jit
def _expert_lora_kernel(
    X,  # [rows, IN]: the tokens (x) or the slots (act)
    W,  # shrink: A [L, E, R, IN]; expand: B [L, E, N, R]
    Out,  # shrink: [S, R_PAD] float32; expand: [S, N] in the model's dtype
    TokenSlots,  # [T] int32 adapter slot of each token, -1: the base model
    SortedSlots,
    BlockExperts,
    stride_x,
    stride_wl,
    stride_we,
    stride_wn,
    stride_o,
    num_slots,
    n_out,  # shrink: the rank R; expand: N
    N_IN: tl.constexpr,  # shrink: IN; expand: R (a layer's shape: one variant a model)
    NUM_ADAPTERS: tl.constexpr,  # the engine's slots: fixed, so one variant
    SLOTS_PER_ROW: tl.constexpr,  # K where X holds tokens, 1 where it holds slots
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_SLOT_PER_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_INPUT: tl.constexpr,  # expand: the shrink's float32 rounded to the weights' dtype
):
    """Out[slot, n] = sum_k X[row, k] * W[adapter, expert, n, k] for the rows of one block of
    sorted slots, adapter by adapter: the shrink (W = A) and the expand (W = B) alike."""
    block_m = tl.program_id(0)
    expert, slots = block_rows(
        SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, ONE_SLOT_PER_BLOCK
    )
    if expert < 0:
        return
    row_ok = slots < num_slots
    adapters = tl.load(TokenSlots + slots // TOP_K, mask=row_ok, other=-1)
    rows = (slots // SLOTS_PER_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    for adapter in range(NUM_ADAPTERS):
        mine = row_ok & (adapters == adapter)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            w_base = W + adapter * stride_wl + expert * stride_we
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, N_IN, BLOCK_K):
                k_ok = (ks + k0) < N_IN
                x_ptrs = X + rows[:, None] * stride_x + (ks + k0)[None, :]
                x = tl.load(x_ptrs, mask=mine[:, None] & k_ok[None, :], other=0.0)
                if ROUND_INPUT:
                    x = x.to(W.dtype.element_ty)
                w_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn + (ks + k0)[:, None]
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
            out_ptrs = Out + slots[:, None].to(tl.int64) * stride_o + cols[None, :]
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mine[:, None] & col_ok[None, :])


@dataclass
class ExpertLora:
    """One MoE layer's expert adapter slots and a step's token slots, as the fused MoE takes
    them (its ``deltas``): a13 [L, E, R, H], b13 [L, E, 2I, R], a2 [L, E, R, I], b2 [L, E, H, R],
    token_slots [T] int32 (-1: the base model)."""

    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    token_slots: torch.Tensor
    top_k: int

    def gate_up(
        self, x: torch.Tensor, rows: tuple[torch.Tensor | None, torch.Tensor], block_m: int
    ) -> torch.Tensor:
        return self._delta(x, self.a13, self.b13, rows, block_m, per_token=True)

    def down(
        self, act: torch.Tensor, rows: tuple[torch.Tensor | None, torch.Tensor], block_m: int
    ) -> torch.Tensor:
        return self._delta(act, self.a2, self.b2, rows, block_m, per_token=False)

    def _delta(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        rows: tuple[torch.Tensor | None, torch.Tensor],
        block_m: int,
        per_token: bool,
    ) -> torch.Tensor:
        """[T*K, N]: each slot's x @ A.T @ B.T through its token's adapter and its expert;
        zeros for the base model's slots."""
        num_slots = self.token_slots.shape[0] * self.top_k
        rank = a.shape[2]
        shrunk = torch.zeros(num_slots, _rank_block(rank), dtype=torch.float32, device=x.device)
        delta = torch.zeros(num_slots, b.shape[2], dtype=x.dtype, device=x.device)
        self._launch(x, a, shrunk, rows, block_m, rank, x.shape[1], per_token, False)
        self._launch(shrunk, b, delta, rows, block_m, b.shape[2], rank, False, True)
        return delta

    def _launch(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        rows: tuple[torch.Tensor | None, torch.Tensor],
        block_m: int,
        n_out: int,
        n_in: int,
        per_token: bool,
        expand: bool,
    ) -> None:
        sorted_slots, block_experts = rows
        one_slot = sorted_slots is None
        block_n = 64 if expand else _rank_block(n_out)
        block_k = _rank_block(n_in) if expand else 64
        grid = (block_experts.numel(), triton.cdiv(n_out, block_n))
        _expert_lora_kernel[grid](
            x, w, out, self.token_slots,
            block_experts if one_slot else sorted_slots, block_experts,
            x.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
            self.token_slots.shape[0] * self.top_k, n_out,
            N_IN=n_in, NUM_ADAPTERS=w.shape[0], TOP_K=self.top_k,
            SLOTS_PER_ROW=self.top_k if per_token else 1,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            ONE_SLOT_PER_BLOCK=one_slot, ROUND_INPUT=expand,
            # float32 models (the tests' HF comparisons) need exact products, not TF32's
            PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
        )  # fmt: skip


def _rank_block(rank: int) -> int:
    """A rank's tile: a power of two, at least tl.dot's smallest side."""
    return max(16, triton.next_power_of_2(rank))
