"""Fused mixture-of-experts on CUDA: tokens grouped by expert, two grouped GEMMs.

The torch path of an MoE layer (engine_core/models/moe.py) loops over experts on the host, which
costs a launch or more per expert and a host sync; at decode, where a batch of 64 tokens with top 8
of 128 experts touches most experts with a handful of rows each, that loop dominates the step.
Here the whole layer is five launches whatever the routing at decode sizes (the router's top-k,
the grouping, the two GEMMs, the combine), and every shape is static, so it runs inside CUDA
graphs:

1. ``align``: the (token, k) slots sorted by expert, each expert's run padded to a multiple of
   BLOCK_M, so that a block of BLOCK_M sorted rows belongs to one expert (fixed sizes: the buffer
   is sized for the worst case, ``T*K + E*(BLOCK_M-1)`` rows; unused blocks say -1). One Triton
   program up to ALIGN_KERNEL_MAX_SLOTS slots (decode), torch ops above.
2. ``_gate_up_kernel``: for each block of sorted rows and block of intermediate columns, the
   tokens' rows times that expert's gate and up weights, SiLU(gate) * up written per slot.
3. ``_down_kernel``: each slot's activation times its expert's down weights, scaled by the
   slot's routing weight, written per slot.
4. ``combine_kernel``: the K slots of each token summed in float32, in slot order.

The routing itself (softmax, top-k, renormalisation) is ``route_topk``, one launch, which
moe.route takes on CUDA; a single token's router product and routing together are
``route_one_token``, one launch, which SparseMoE.route_tokens takes on CUDA.

A single token (batch-1 decode) skips step 1: its K experts are distinct, so row block k can be
slot k alone (``fused_moe_one_token``, the kernels' ONE_SLOT_PER_BLOCK), and the GEMM grids
hold K blocks instead of align's worst case of one per expert, most of them empty.

Weights are stored as the MoE layer keeps them: ``w13 [E, 2*I, H]`` (gate rows, then up rows)
and ``w2 [E, H, I]``. Accumulation is float32; the activation is rounded to the input dtype
between the GEMMs, as the torch path does.

Importing this module imports triton: only CUDA code paths and GPU tests may do so (or set
``TRITON_INTERPRET=1`` first to run on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl


@triton.jit
def block_rows(
    SortedSlots,
    BlockExperts,
    block_m,
    num_slots,
    BLOCK_M: tl.constexpr,
    ONE_SLOT_PER_BLOCK: tl.constexpr,
):
    """Row block ``block_m``'s expert (-1: nothing to do) and the slot of each of its BLOCK_M
    rows (num_slots for padding). Grouped: read from align's output. ONE_SLOT_PER_BLOCK (a
    single token, whose K experts are distinct): block b is slot b alone, BlockExperts holds the
    token's expert ids, and there is no grouping step at all."""
    expert = tl.load(BlockExperts + block_m).to(tl.int64)
    if ONE_SLOT_PER_BLOCK:
        slots = tl.where(tl.arange(0, BLOCK_M) == 0, block_m, num_slots)
    else:
        slots = tl.load(SortedSlots + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, slots


# The slot count (tokens x top-k) changes from step to step: specialized, a count that is a
# multiple of 16 and one that is not would each compile a variant, the second in the middle of
# serving. qwen3-30b-a3b: after the warm-up, an eager prefill whose slot count was not a multiple
# of 16 (every prefill graph's is) built a second variant of both kernels and stalled every
# running request 1.2 s (docs/design/cuda-graphs-and-warm-up.md, "Nothing compiles mid-serving").
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    X,  # [T, H]
    W13,  # [E, 2*I, H]
    Act,  # [S, I] (S = T*K slots)
    SortedSlots,  # [R] slot of each sorted row; S for padding
    BlockExperts,  # [R // BLOCK_M] expert of each block of rows; -1 past the last one
    Delta,  # [S, 2*I] a LoRA delta added to gate and up before the activation (HAS_DELTA)
    stride_xt,
    stride_we,
    stride_wn,
    stride_as,
    num_slots,
    hidden,
    inter,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_SLOT_PER_BLOCK: tl.constexpr = False,
    HAS_DELTA: tl.constexpr = False,
):
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    expert, slots = block_rows(
        SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, ONE_SLOT_PER_BLOCK
    )
    if expert < 0:
        return
    row_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_xt + ks[None, :]
    w_base = W13 + expert * stride_we + ks[:, None]
    gate_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn
    up_ptrs = w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (ks + k0) < hidden
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate_w = tl.load(gate_ptrs + k0, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs + k0, mask=w_mask, other=0.0)
        gate = tl.dot(x, gate_w, gate, input_precision=PRECISION)
        up = tl.dot(x, up_w, up, input_precision=PRECISION)
    # Each GEMM's output is rounded to the activations' dtype, as the unfused path does.
    gate = gate.to(Act.dtype.element_ty).to(tl.float32)
    up = up.to(Act.dtype.element_ty).to(tl.float32)
    if HAS_DELTA:  # rounded again after the sum, as the torch form's in-place add is
        mask = row_ok[:, None] & col_ok[None, :]
        d_ptrs = Delta + slots[:, None].to(tl.int64) * (2 * inter) + cols[None, :]
        gate += tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(d_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        gate = gate.to(Act.dtype.element_ty).to(tl.float32)
        up = up.to(Act.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Act.dtype.element_ty).to(tl.float32) * up
    out_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + cols[None, :]
    tl.store(out_ptrs, act.to(Act.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])  # as _gate_up_kernel
def _down_kernel(
    Act,  # [S, I]
    W2,  # [E, H, I]
    Out,  # [S, H]
    SlotWeights,  # [S] float32
    SortedSlots,
    BlockExperts,
    Delta,  # [S, H] a LoRA delta added before the routing weight (HAS_DELTA)
    stride_as,
    stride_we,
    stride_wn,
    stride_os,
    num_slots,
    hidden,
    inter,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_SLOT_PER_BLOCK: tl.constexpr = False,
    HAS_DELTA: tl.constexpr = False,
):
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    expert, slots = block_rows(
        SortedSlots, BlockExperts, block_m, num_slots, BLOCK_M, ONE_SLOT_PER_BLOCK
    )
    if expert < 0:
        return
    row_ok = slots < num_slots
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = Act + slots[:, None].to(tl.int64) * stride_as + ks[None, :]
    w_ptrs = W2 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (ks + k0) < inter
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    acc = acc.to(Out.dtype.element_ty).to(tl.float32)
    if HAS_DELTA:
        d_ptrs = Delta + slots[:, None].to(tl.int64) * hidden + cols[None, :]
        delta = tl.load(d_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc = (acc + delta.to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
    weight = tl.load(SlotWeights + slots, mask=row_ok, other=0.0)
    out_ptrs = Out + slots[:, None].to(tl.int64) * stride_os + cols[None, :]
    out = (acc * weight[:, None]).to(Out.dtype.element_ty)
    tl.store(out_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _route_kernel(
    Logits,  # [T, E]
    Weights,  # [T, K] float32 out
    Ids,  # [T, K] int32 out
    stride_l,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Program t: token t's routing from its router logits (_top_k_route), stored once."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(Logits + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    weights, ids = _top_k_route(x, E, BLOCK_E, K, BLOCK_K, RENORMALIZE)
    kk = tl.arange(0, BLOCK_K)
    tl.store(Ids + t * K + kk, ids, mask=kk < K)
    tl.store(Weights + t * K + kk, weights, mask=kk < K)


@triton.jit
def _top_k_route(
    x,  # [BLOCK_E] float32 logits, -inf past E
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """The softmax of one token's router logits in float32, its K largest entries (largest
    first; a tie goes to the lower expert) and, with RENORMALIZE, those K weights divided by
    their sum: moe.route's torch ops. The K choices stay in registers. A row with NaN (or +inf)
    logits gets NaN weights, as torch gives, and ids that stay in range."""
    e = tl.arange(0, BLOCK_E)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.div_rn(p, tl.sum(p, 0))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.max(p, 0)
        idx = tl.min(tl.where(p == w, e, BLOCK_E), 0)  # the lowest expert holding the max
        idx = tl.minimum(idx, E - 1)  # NaN matches nothing: stay in range
        ids = tl.where(kk == k, idx, ids)
        weights = tl.where(kk == k, w, weights)
        p = tl.where(e == idx, -1.0, p)  # below any probability: not chosen again
    if RENORMALIZE:
        weights = tl.div_rn(weights, tl.sum(tl.where(kk < K, weights, 0.0), 0))
    return weights, ids


@triton.jit
def _one_token_router_kernel(
    X,  # [1, H]
    W,  # [E, H] the router's weight
    Logits,  # [E] scratch, X's dtype
    Arrived,  # [1] int32, zero between calls
    Weights,  # [1, K] float32 out
    Ids,  # [1, K] int32 out
    hidden,
    E: tl.constexpr,
    EXPERTS_PER_PROGRAM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One token's router logits and routing in one launch: each program computes the logits
    of EXPERTS_PER_PROGRAM experts (rounded to X's dtype, as the router linear's output is) and
    stores them; the program that arrives last routes the token from all of them
    (_top_k_route) and takes its launch's count back off Arrived.

    Arrived counts arrivals modulo the number of programs: the one whose arrival completes a
    multiple is last, and subtracting the launch's count (rather than writing 0) leaves Arrived
    where it was, so even launches that overlapped (which the callers never do: one layer's
    launches are stream-ordered) would leave no residue for the next.

    The logits are summed in another order than cuBLAS sums the router linear, so a logit may
    differ from that path's in its last bit, and between near-equal experts a token alone may
    pick otherwise than in a batch."""
    pid = tl.program_id(0)
    experts = pid * EXPERTS_PER_PROGRAM + tl.arange(0, EXPERTS_PER_PROGRAM)
    e_ok = experts < E
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros([EXPERTS_PER_PROGRAM], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h_ok = (hs + h0) < hidden
        x = tl.load(X + h0 + hs, mask=h_ok, other=0.0).to(tl.float32)
        w_ptrs = W + experts[:, None].to(tl.int64) * hidden + h0 + hs[None, :]
        w = tl.load(w_ptrs, mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(Logits + experts, acc.to(Logits.dtype.element_ty), mask=e_ok)
    # Every thread's logits are written (the barrier) before one thread's release says so; the
    # last program's acquire, and the barrier Triton puts before the count reaches its other
    # threads, order its loads of all the logits after every program's stores.
    tl.debug_barrier()
    num_programs = tl.num_programs(0)
    arrived = tl.atomic_add(Arrived, 1, sem="acq_rel", scope="gpu")
    if (arrived + 1) % num_programs == 0:
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(Logits + e, mask=e < E, other=float("-inf"))
        weights, ids = _top_k_route(logits.to(tl.float32), E, BLOCK_E, K, BLOCK_K, RENORMALIZE)
        kk = tl.arange(0, BLOCK_K)
        tl.store(Ids + kk, ids, mask=kk < K)
        tl.store(Weights + kk, weights, mask=kk < K)
        tl.atomic_add(Arrived, -num_programs, sem="relaxed", scope="gpu")


def route_one_token(
    x: torch.Tensor, weight: torch.Tensor, arrived: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route(router(x)) for a single token x [1, H] and router weight [E, H] in one launch
    (batch-1 decode, where the router's GEMM and the routing were two launches of a few
    microseconds each): (weights [1, K] float32, expert ids [1, K] int32). ``arrived`` [1]
    int32 starts at zero and belongs to the caller, one per layer; the launches that share one
    must not overlap (one stream), as a layer's calls never do."""
    num_experts, hidden = weight.shape
    if weight.stride(1) != 1 or weight.stride(0) != hidden:
        raise ValueError("route_one_token needs a contiguous router weight")
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(num_experts, dtype=x.dtype, device=x.device)
    # One expert a program, one warp (as route_topk): the last program's top-k is K rounds of
    # reductions, which across four warps took 7 us where the product takes ~2
    # (docs/design/kernels-and-limits.md, "Tried and dropped").
    per_program = 1
    _one_token_router_kernel[(triton.cdiv(num_experts, per_program),)](
        x.contiguous(), weight, logits, arrived, weights, ids, hidden,
        E=num_experts, EXPERTS_PER_PROGRAM=per_program,
        BLOCK_H=min(2048, triton.next_power_of_2(hidden)),
        BLOCK_E=triton.next_power_of_2(num_experts), K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        num_warps=1 if num_experts <= 256 else 4,
    )  # fmt: skip
    return weights, ids


def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route on CUDA in one launch: (weights [T, K] float32, expert ids [T, K] int32)."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_kernel[(num_tokens,)](
        logits, weights, ids, logits.stride(0), E=num_experts,
        BLOCK_E=triton.next_power_of_2(num_experts), K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        num_warps=1 if num_experts <= 256 else 4,
    )  # fmt: skip
    return weights, ids


@triton.jit
def combine_kernel(
    Slots,  # [T * K, H]: each (token, k) slot's weighted expert output
    Out,  # [T, H]
    hidden,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Out[t] = sum over k of Slots[t * K + k] in float32, k in order, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(Slots + (t * K + k) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * hidden + cols, acc.to(Out.dtype.element_ty), mask=mask)


def combine_slots(slots: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in ``dtype``: each token's K slot outputs ``slots`` [T * K, H] summed in float32
    in slot order (a fixed order, so a token's sum never varies), rounded once, one launch."""
    hidden = slots.shape[1]
    num_tokens = slots.shape[0] // top_k
    combined = torch.empty(num_tokens, hidden, dtype=dtype, device=slots.device)
    block = min(1024, triton.next_power_of_2(hidden))
    combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        slots, combined, hidden, K=top_k, BLOCK=block, num_warps=4
    )
    return combined


@triton.jit(do_not_specialize=["num_slots", "num_rows"])  # as _gate_up_kernel
def _align_kernel(
    TopkIds,  # [S] expert of each slot
    SortedSlots,  # [R] out
    BlockExperts,  # [R // BLOCK_M] out
    Starts,  # [2 * BLOCK_E] int32 scratch: padded starts, then unpadded starts, per expert
    num_slots,
    num_rows,
    E: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_slots
    BLOCK_E: tl.constexpr,  # >= E
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # rows and blocks written per loop iteration
):
    """align() in one program: the experts' counts, their padded runs, and each slot's place,
    from one sort of (expert, slot) keys, which keeps the slots of an expert in slot order."""
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_slots
    ids = tl.load(TopkIds + s, mask=s_ok, other=0).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E, mask=s_ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    tl.store(Starts + e, padded_ends - padded)
    tl.store(Starts + BLOCK_E + e, tl.cumsum(counts, 0) - counts)
    # Padding rows (no slot), and each block's expert: the one whose padded run holds its start.
    c = tl.arange(0, CHUNK)
    for r0 in range(0, num_rows, CHUNK):
        tl.store(SortedSlots + r0 + c, num_slots, mask=r0 + c < num_rows)
    num_blocks = num_rows // BLOCK_M
    for b0 in range(0, num_blocks, CHUNK):
        first_row = (b0 + c) * BLOCK_M
        ended = (padded_ends[None, :] <= first_row[:, None]) & (e[None, :] < E)
        expert = tl.sum(ended.to(tl.int32), 1)
        expert = tl.where(expert < E, expert, -1)
        tl.store(BlockExperts + b0 + c, expert, mask=b0 + c < num_blocks)
    tl.debug_barrier()  # padding and starts written before any thread reads or overwrites them
    keys = tl.where(s_ok, ids * BLOCK_S + s, E * BLOCK_S + s)  # padding keys sort last
    keys = tl.sort(keys)
    expert = keys // BLOCK_S
    slot = keys % BLOCK_S
    valid = expert < E
    start = tl.load(Starts + expert, mask=valid, other=0)
    rank = s - tl.load(Starts + BLOCK_E + expert, mask=valid, other=0)  # s: place in the sort
    tl.store(SortedSlots + start + rank, slot, mask=valid)


# align() runs _align_kernel up to this many (token, k) slots (every decode batch of the presets:
# 256 tokens x top 8); above it, torch's sort, whose extra launches matter less next to a
# prefill's GEMMs.
ALIGN_KERNEL_MAX_SLOTS = 4096


def align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots [R], block_experts [R // block_m]) for ``topk_ids`` [T, K].

    Slot s = t*K + k. Rows of expert e occupy [start_e, start_e + count_e) of the sorted order,
    with start_e a multiple of ``block_m``; padding rows hold S (no slot). Sizes depend only on
    T, K, E and block_m, and nothing syncs with the host, so this is captured in CUDA graphs.
    One launch up to ALIGN_KERNEL_MAX_SLOTS slots, torch ops above.
    """
    num_slots = topk_ids.numel()
    if 0 < num_slots <= ALIGN_KERNEL_MAX_SLOTS:
        return align_in_one_launch(topk_ids, num_experts, block_m)
    return align_torch(topk_ids, num_experts, block_m)


def _num_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Sorted rows: every slot, plus each expert's run padded by at most block_m - 1."""
    num_rows = num_slots + num_experts * (block_m - 1)
    return (num_rows + block_m - 1) // block_m * block_m


def align_in_one_launch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """align() as one Triton launch (the torch version takes about ten)."""
    flat = topk_ids.reshape(-1).contiguous()
    num_slots = flat.numel()
    num_rows = _num_rows(num_slots, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    sorted_slots = torch.empty(num_rows, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(num_rows // block_m, dtype=torch.int32, device=flat.device)
    starts = torch.empty(2 * block_e, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](
        flat, sorted_slots, block_experts, starts, num_slots, num_rows,
        E=num_experts, BLOCK_S=triton.next_power_of_2(num_slots), BLOCK_E=block_e,
        BLOCK_M=block_m, CHUNK=32, num_warps=8,
    )  # fmt: skip
    return sorted_slots, block_experts


def align_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """align() in torch ops (any number of slots)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    starts = padded_ends - padded  # where each expert's rows begin
    count_starts = torch.cumsum(counts, 0) - counts  # ... in the unpadded sorted order
    order = torch.sort(flat, stable=True).indices  # slots by expert, in slot order within one
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=device) - count_starts[sorted_experts]
    num_rows = _num_rows(num_slots, num_experts, block_m)
    sorted_slots = torch.full((num_rows,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, num_rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_slots, block_experts.to(torch.int32)


class SlotDeltas(Protocol):
    """Per-slot LoRA deltas of the experts (engine_core/lora/triton_moe.py), computed over the
    same row blocks as the GEMMs: ``rows`` is (sorted slots or None, block experts), ``block_m``
    the rows a block."""

    def gate_up(
        self, x: torch.Tensor, rows: tuple[torch.Tensor | None, torch.Tensor], block_m: int
    ) -> torch.Tensor:  # [T*K, 2*I]: each slot's delta, added before the activation
        ...

    def down(
        self, act: torch.Tensor, rows: tuple[torch.Tensor | None, torch.Tensor], block_m: int
    ) -> torch.Tensor:  # [T*K, H]: each slot's delta, added before the routing weight
        ...


@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch settings of both kernels."""

    m: int  # sorted rows per program (each expert's run is padded to a multiple)
    n: int  # output columns per program
    k: int  # reduction step
    warps: int = 4
    stages: int = 3


def block_sizes(num_slots: int, num_experts: int, inter: int) -> Blocks:
    """Small row blocks when each expert gets few rows (decode), large ones when many (prefill),
    so padding wastes little either way. Chosen by a tile sweep at qwen3-30b-a3b's shape
    (docs/design/kernels-and-limits.md, "MoE"): the best or within 5% of it at 1, 64, 256 and
    4,096 tokens, with uniform and with skewed routing."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 8:
        return Blocks(16, 64, 64)
    if per_expert <= 64:
        return Blocks(32, 64, 128)
    return Blocks(128, 128, 64, warps=8)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2*I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    blocks: Blocks | None = None,  # None: block_sizes' choice (a benchmark may sweep others)
    deltas: SlotDeltas | None = None,  # LoRA on the experts (engine_core/lora/triton_moe.py)
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token: [T, H].
    A single token (batch-1 decode) takes fused_moe_one_token unless ``blocks`` is given."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe needs each weight row contiguous")
    if num_tokens == 1 and blocks is None:
        return fused_moe_one_token(x, w13, w2, topk_weights, topk_ids, deltas=deltas)
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    b = blocks or block_sizes(topk_ids.numel(), num_experts, inter)
    sorted_slots, block_experts = align(topk_ids, num_experts, b.m)
    return _grouped_gemms(x, w13, w2, topk_weights, topk_ids.shape[1],
                          (sorted_slots, block_experts), b, b, deltas)  # fmt: skip


# The one-token path's tiles (row block 16: one slot a block, the rest masked), gate/up and down,
# swept at qwen3-30b-a3b's layer (docs/design/kernels-and-limits.md, "MoE"): gate/up tiles from
# 16 to 64 columns and 64 to 256 deep all gave the layer 34-36 us.
ONE_TOKEN_GATE_UP = Blocks(16, 32, 128, warps=4, stages=4)
ONE_TOKEN_DOWN = Blocks(16, 64, 64)


def fused_moe_one_token(
    x: torch.Tensor,  # [1, H]
    w13: torch.Tensor,  # [E, 2*I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [1, K] float32
    topk_ids: torch.Tensor,  # [1, K]
    gate_up: Blocks | None = None,  # None: ONE_TOKEN_GATE_UP (a benchmark may sweep others)
    down: Blocks | None = None,  # None: ONE_TOKEN_DOWN
    deltas: SlotDeltas | None = None,
) -> torch.Tensor:
    """fused_moe for one token without the grouping step: its K experts are distinct, so row
    block k is slot k alone (the kernels' ONE_SLOT_PER_BLOCK), and the grids hold the K slots'
    blocks only, where align's worst-case layout holds one per expert. Three launches."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    return _grouped_gemms(x, w13, w2, topk_weights, ids.numel(), (None, ids),
                          gate_up or ONE_TOKEN_GATE_UP, down or ONE_TOKEN_DOWN, deltas)  # fmt: skip


def _grouped_gemms(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    top_k: int,
    rows: tuple[torch.Tensor | None, torch.Tensor],  # (sorted slots, block experts); see below
    gate_up: Blocks,
    down: Blocks,
    deltas: SlotDeltas | None = None,
) -> torch.Tensor:
    """The two GEMM launches and the combine over row blocks that ``rows`` describes: align's
    (sorted slots, each block's expert), or (None, the single token's expert ids) for one slot
    a block. ``deltas``: LoRA's per-slot deltas, added into both GEMMs' outputs."""
    num_slots = x.shape[0] * top_k
    act = torch.empty(num_slots, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    out = torch.empty(num_slots, x.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    buffers = (act, out)
    grouped_gemms_into(
        x.contiguous(), w13, w2, weights, top_k, rows, (gate_up, down), buffers, deltas
    )
    return combine_slots(out, top_k, x.dtype)


def grouped_gemms_into(
    x: torch.Tensor,  # [T, H], contiguous
    w13: torch.Tensor,  # [E, 2*I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [S] float32: each slot's routing weight
    top_k: int,
    rows: tuple[torch.Tensor | None, torch.Tensor],  # as _grouped_gemms'
    tiles: tuple[Blocks, Blocks],  # gate/up's, down's
    buffers: tuple[torch.Tensor, torch.Tensor],  # act [S, I], out [S, H]
    deltas: SlotDeltas | None = None,
) -> None:
    """The two GEMM launches: the rows of the blocks that ``rows`` names (blocks of expert -1
    are skipped) written into ``out``, each slot weighted, not yet combined. A caller that runs
    the experts a chunk at a time (w4a16_prefill.py) keeps one ``out`` over the chunks.
    ``deltas``: LoRA's per-slot deltas, added into both GEMMs' outputs."""
    sorted_slots, block_experts = rows
    one_slot = sorted_slots is None
    slots_arg = block_experts if one_slot else sorted_slots  # unread with ONE_SLOT_PER_BLOCK
    act, out = buffers
    num_slots, hidden = out.shape
    inter = act.shape[1]
    num_blocks = block_experts.numel()
    # float32 models (the tests' HF comparisons) need exact float32 products, not TF32's.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    b = tiles[0]
    delta = act if deltas is None else deltas.gate_up(x, rows, b.m)  # unread without deltas
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, b.n))](
        x, w13, act, slots_arg, block_experts, delta,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        num_slots, hidden, inter,
        TOP_K=top_k, PRECISION=precision, BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, HAS_DELTA=deltas is not None,
        num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
    b = tiles[1]
    delta = out if deltas is None else deltas.down(act, rows, b.m)
    _down_kernel[(num_blocks, triton.cdiv(hidden, b.n))](
        act, w2, out, weights, slots_arg, block_experts, delta,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        num_slots, hidden, inter,
        PRECISION=precision, BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k,
        ONE_SLOT_PER_BLOCK=one_slot, HAS_DELTA=deltas is not None,
        num_warps=b.warps, num_stages=b.stages,
    )  # fmt: skip
