"""Pooling: an embedding request's vector from its prompt's final hidden states.

The model runner of an embedding engine hands each step's hidden states (after the model's
final norm, as HF's ``last_hidden_state``) to its ``Pooler``, which looks at the step's pooling
rows only:

- last-token pooling takes the hidden state of the prompt's last token, in the step that runs
  its last chunk (a prefix-cache hit never covers the last token, so it is always computed);
- mean pooling sums every prompt token's hidden state in float32, chunk by chunk (a request
  keeps its partial sum here between chunks; its first chunk, also after a preemption, starts
  it afresh), and divides by the prompt's length at its last chunk. Such a request takes no
  prefix-cache hit: a cached token has no hidden state to add (Request.pools_every_token).

The vectors of the requests that end in a step reach the host in one copy; there each is cut to
its ``dimensions`` (Matryoshka) and then L2-normalised where asked (as sentence-transformers'
Normalize and torch's ``F.normalize`` do: eps 1e-12), in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_core.request import Request, SchedulerOutput
from protocol.messages import PoolingKind, PoolingParams

NORM_EPS = 1e-12  # F.normalize's: a zero vector stays zero


@dataclass
class PooledStep:
    """The vectors of the requests whose last prompt chunk ran in one step."""

    requests: list[Request]
    vectors: torch.Tensor  # [R, hidden] float32, on the device


class Pooler:
    """Pools the rows of a step's pooling requests; keeps the partial sums of mean pooling."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[Request, torch.Tensor]] = {}  # id -> (request, [hidden])

    def pool(
        self, plan: SchedulerOutput, hidden: torch.Tensor, query_start: list[int]
    ) -> PooledStep | None:
        """The step's finished vectors from its hidden states [T, hidden], whose rows for the
        plan's i-th request start at ``query_start[i]``; None where no request finishes."""
        if self._sums:
            self._forget_finished()
        finished: list[Request] = []
        vectors: list[torch.Tensor] = []
        for i, s in enumerate(plan.scheduled):
            request = s.request
            if request.pooling is None:
                continue
            rows = hidden[query_start[i] : query_start[i] + s.num_new_tokens]  # [n, hidden]
            last = s.start + s.num_new_tokens == request.num_prompt_tokens
            vector = self._pool_chunk(request, s.start, rows, last)
            if vector is not None:
                finished.append(request)
                vectors.append(vector)
        return PooledStep(finished, torch.stack(vectors)) if finished else None

    def _pool_chunk(
        self, request: Request, start: int, rows: torch.Tensor, last: bool
    ) -> torch.Tensor | None:
        """One chunk's part of a request's vector: the vector [hidden] float32 at its last
        chunk, else None (a mean's partial sum is kept)."""
        assert request.pooling is not None
        if request.pooling.kind == PoolingKind.LAST:
            return rows[-1].float() if last else None
        total = rows.float().sum(dim=0)  # [hidden]
        if start > 0:  # the sum of the chunks before this one
            total += self._sums.pop(request.request_id)[1]
        if last:
            return total / request.num_prompt_tokens
        self._sums[request.request_id] = (request, total)
        return None

    def _forget_finished(self) -> None:
        """Drop the partial sums of requests that ended before their last chunk (aborted)."""
        self._sums = {rid: kept for rid, kept in self._sums.items() if not kept[0].is_finished}

    @staticmethod
    def to_host(pooled: PooledStep | None) -> dict[str, list[float] | None]:
        """Each finished request's vector as its pooling asks (cut, normalised), by request id;
        None for a vector that is not finite (the engine fails that request)."""
        if pooled is None:
            return {}
        host = pooled.vectors.cpu().numpy()  # [R, hidden]: one copy for the step
        return {
            r.request_id: finish_vector(host[i], r.pooling)
            for i, r in enumerate(pooled.requests)
            if r.pooling is not None
        }


def finish_vector(values: np.ndarray, pooling: PoolingParams) -> list[float] | None:
    """A pooled vector [hidden] float32 cut to ``pooling.dimensions`` and then normalised, where
    asked; None where it is not finite."""
    if pooling.dimensions is not None:
        values = values[: pooling.dimensions]
    if not np.isfinite(values).all():
        return None
    if pooling.normalize:
        norm = float(np.linalg.norm(values.astype(np.float64)))
        values = values / np.float32(max(norm, NORM_EPS))
    return values.astype(np.float32).tolist()
