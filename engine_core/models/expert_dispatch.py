"""Expert parallelism's all-to-all dispatch and combine (``--enable-expert-parallel``).

Rank r of N holds experts [r*L, (r+1)*L), L = E/N, whole. The step's T tokens arrive replicated
(attention is tensor-parallel and ends with an all-reduce), so each rank takes its own contiguous
slice of them (``token_slice``: ceil(T/N) each, the last ranks fewer or none) and:

1. routes its slice and sorts its (token, k) pairs by expert, which also sorts them by the rank
   that owns the expert and, within one rank's block, by that rank's local expert;
2. tells every rank how many pairs it sends to each of that rank's experts (one all-to-all of an
   [N, L] count table: equal splits), so each rank knows what it receives and from whom;
3. sends each pair's hidden state to the expert's owner (``all_to_all_single``, variable splits);
4. the owner runs its experts over the rows it received (``run_local``: each row one expert,
   weight one; the fused kernels on CUDA, the torch reference elsewhere) and sends each result
   back where it came from (a second ``all_to_all_single``, the splits reversed);
5. the sender sums its pairs' results with their routing weights, in float32, one rounding;
6. ``all_gather_rows`` rebuilds the T tokens on every rank (each slice padded to ceil(T/N)).

The split sizes are host integers (torch.distributed takes lists), so a step reads the counts
back: no CUDA graph captures it, and the MoE layer says so (``cuda_graph_safe``).
docs/design/multi-node.md, "Expert parallelism", has the cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.parallel import TPGroup

# run_local(rows [R, H], local expert of each row [R]) -> [R, H]: this rank's experts.
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_slice(num_tokens: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``num_tokens`` replicated tokens: ceil(T/size) each,
    in rank order, so the last ranks may hold fewer or none (T=5 over 4: 2, 2, 1, 0)."""
    chunk = -(-num_tokens // size)
    start = min(rank * chunk, num_tokens)
    return slice(start, min(start + chunk, num_tokens))


@dataclass(frozen=True)
class Dispatch:
    """This rank's (token, k) pairs in the order they were sent, and the split sizes both ways."""

    tokens: torch.Tensor  # [P] the token (within the slice) of each sent pair
    weights: torch.Tensor  # [P] float32, its routing weight
    send_counts: list[int]  # pairs sent to each rank
    recv_counts: list[int]  # pairs received from each rank
    recv_experts: torch.Tensor  # [R] the local expert of each received row


def plan_dispatch(
    weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int, tp: TPGroup
) -> Dispatch:
    """Sort this rank's pairs by expert and agree the split sizes with every rank (one
    all-to-all of the per-expert counts; its read-back is the step's host sync)."""
    top_k = ids.shape[1]
    flat = ids.flatten()  # [t*K] global expert ids
    order = flat.argsort(stable=True)  # by owner rank, then local expert, then token
    table = torch.bincount(flat, minlength=tp.size * experts_per_rank)  # [E]
    table = table.view(tp.size, experts_per_rank)  # pairs for each rank's each expert
    ones = [1] * tp.size  # row r of the table to rank r; row s of what arrives from rank s
    received = tp.all_to_all(table, ones, ones)  # [N, L]: pairs for each of my experts
    recv_total = received.sum(dim=1)
    # Rows arrive by source rank, and within one source's block by local expert (its sort).
    local = torch.arange(experts_per_rank, device=ids.device).repeat(tp.size)
    recv_experts = local.repeat_interleave(received.flatten())
    return Dispatch(
        tokens=order // top_k,
        weights=weights.flatten()[order].float(),
        send_counts=table.sum(dim=1).tolist(),
        recv_counts=recv_total.tolist(),
        recv_experts=recv_experts,
    )


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts_per_rank: int,
    tp: TPGroup,
    run_local: LocalExperts,
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert ids[t, k] (x[t]) for this rank's slice x [t, H]
    (t may be 0), every expert wherever it lives: [t, H] in x's dtype. A collective: every
    rank of ``tp`` calls it in the same layer."""
    plan = plan_dispatch(weights, ids, experts_per_rank, tp)
    rows = tp.all_to_all(x.index_select(0, plan.tokens), plan.send_counts, plan.recv_counts)
    results = run_local(rows, plan.recv_experts) if rows.shape[0] else rows  # [R, H]
    back = tp.all_to_all(results, plan.recv_counts, plan.send_counts)  # [P, H], as sent
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, plan.tokens, back.float() * plan.weights[:, None])
    return out.to(x.dtype)


def gather_tokens(part: torch.Tensor, num_tokens: int, tp: TPGroup) -> torch.Tensor:
    """Every rank's slice of the output (``token_slice``) -> all ``num_tokens`` rows on every
    rank: each slice padded to the same length for one all-gather, the padding cut."""
    chunk = -(-num_tokens // tp.size)
    padded = part.new_zeros((chunk, *part.shape[1:]))
    padded[: part.shape[0]] = part
    return tp.all_gather_rows(padded)[:num_tokens]
