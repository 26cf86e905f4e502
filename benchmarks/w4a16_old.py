"""The W4A16 kernel before the tiled layout (engine commit 40fc945, symmetric weights only),
kept for `python -m benchmarks w4a16` to time beside its successor; delete it once the sweep
has been recorded in docs/design/quantization.md."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def old_kernel(
    A, QWeight, Scales, C, Part, M, N, K, stride_am, stride_cm, K_PER_SPLIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Program (row tile, weight tile, K split) over the loaded layout [N, K / 8]: one load per
    word, the eight nibbles shifted out into a [BLOCK_N, BLOCK_K / 8, 8] tile laid flat."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k0 = split * K_PER_SPLIT
    shifts = tl.arange(0, 8) * 4
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w_ptrs = QWeight + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :]
        packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        q = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        scale = tl.load(Scales + (k0 // GROUP) * N + rn, mask=n_ok, other=0.0)
        w = ((q.to(tl.float32) - 8.0) * scale[:, None]).to(A.dtype.element_ty)
        acc += tl.dot(w, tl.trans(a))
        k0 += BLOCK_K
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        c_ptrs = C + rm[None, :].to(tl.int64) * stride_cm + rn[:, None]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)
    else:
        tl.store(Part + (split * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc, mask=mask)
