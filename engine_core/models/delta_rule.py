"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in torch, float32.

Per value head, with a state S [Dk, Dv], each token t (q, k L2-normalised, q scaled by Dk^-0.5):

    S = exp(g_t) * S                        decay
    S = S + k_t (beta_t (v_t - S^T k_t))^T   write the part of v_t the state does not predict
    o_t = S^T q_t

``recurrent_gated_delta_step`` is one token of many sequences (decode). ``chunk_gated_delta_rule``
is a chunk of one sequence computed in blocks of ``block`` tokens: within a block the sequential
writes are condensed into triangular solves (the WY/UT form of the DeltaNet paper), and only the
blocks are sequential. It is the same math as HF transformers' torch fallback
(``torch_chunk_gated_delta_rule``), written for one sequence whose state comes in and goes out,
so a prompt split into chunks continues exactly where the last chunk ended.

On CUDA a prompt chunk's math runs in flash-linear-attention's Triton kernels (PyPI
``fla-core``, import ``fla``; what HF transformers itself uses on GPUs) where that package is
installed: an optional dependency, never needed on the CPU (``fla_kernels``;
tests/test_qwen3_next_gpu.py holds the two paths to each other). The decodes' step on CUDA is
our own kernel, in place on the state slots (models/delta_rule_triton.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 64  # tokens per block of the chunked form (HF's and FLA's chunk size)


class FlaKernels(NamedTuple):
    """flash-linear-attention's gated delta rule, variable-length chunked (the prompt chunks';
    decodes take our own in-place step, models/delta_rule_triton.py)."""

    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def fla_kernels() -> FlaKernels | None:
    """The kernels where ``fla`` imports (it needs Triton, so CUDA builds of torch), else None."""
    try:
        from fla.ops import gated_delta_rule as fla
    except ImportError:
        return None
    return FlaKernels(fla.chunk_gated_delta_rule)


def missing_prompt_kernels(device: torch.device) -> str | None:
    """What to tell an operator whose CUDA engine has no flash-linear-attention: its prompt
    chunks then run the chunked rule in torch, an order of magnitude below the tensor cores
    (docs/design/qwen3-next.md, "Kernels"); None where nothing is missing."""
    if device.type != "cuda" or fla_kernels() is not None:
        return None
    return (
        "flash-linear-attention is not installed: prompt chunks of the linear-attention layers "
        "run the gated delta rule in torch, far slower than its Triton kernels; "
        "`pip install fla-core` (in the gpu extra) to use them"
    )


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of N sequences: q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H], state
    [N, H, Dk, Dv] (float32) -> (output [N, H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("nhkv,nhk->nhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one sequence: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], state
    [H, Dk, Dv] (float32) -> (output [H, L, Dv], the state after the last token)."""
    heads, length, _ = k.shape
    pad = -length % block
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # padded tokens write nothing
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.view(heads, -1, block, x.shape[-1]) for x in (q, k, v))  # [H, B, C, D]
    g, beta = g.view(heads, -1, block), beta.view(heads, -1, block)
    decay = g.cumsum(-1)  # [H, B, C]: log of the decay from the block's start to each token
    above = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
    # pairwise[i, j] = decay from token j to token i (j <= i); zero above the diagonal.
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(above, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Token i's write depends on the writes before it in its block: (I + strictly lower part)
    # x = rhs, solved once for the values written and for the keys that read the entry state.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    entry_keys = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * pairwise  # [H, B, C, C]: reads inside the block
    q_decayed = q * decay.exp()[..., None]  # reads of the entry state
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]  # writes, decayed to block end
    block_decay = decay[..., -1].exp()[..., None, None]  # [H, B, 1, 1]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        written = values[:, i] - entry_keys[:, i] @ state  # [H, C, Dv]
        out[:, i] = q_decayed[:, i] @ state + within[:, i] @ written
        state = state * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ written
    return out.view(heads, -1, v.shape[-1])[:, :length], state
