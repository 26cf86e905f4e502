"""What the CPU tests of a feature-chained proposer share (tests/test_speculative_mtp.py for
DeepSeek-V3's MTP layer, tests/test_speculative_qwen3_next_mtp.py for Qwen3-Next's and
Qwen3.5's, tests/test_speculative_eagle3.py): the engine's proposals recorded, an HF decoder
layer run causally, a reference layer's chained drafts, and each recorded proposal checked
against them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from engine_core.llm import LLM
from engine_core.speculative import DraftRow

# request id -> (the row's position, its drafts) per proposal
Proposals = dict[str, list[tuple[int, list[int]]]]
# (tokens after the entries' positions, their hidden states [n, H]) -> normed outputs [n, H]
LayerRun = Callable[[list[int], torch.Tensor], torch.Tensor]
# (the final sequence, HF's hidden states of it, the row's position, the draft count) -> drafts
Propose = Callable[[list[int], torch.Tensor, int, int], list[int]]


def recording_proposals(llm: LLM) -> Proposals:
    """The engine's drafter made to record every proposal it makes."""
    drafter = llm.engine.runner.drafter
    made: Proposals = {}
    propose = drafter.propose_batch

    def recording(rows: list[DraftRow]) -> list[list[int]]:
        drafts = propose(rows)
        for row, row_drafts in zip(rows, drafts, strict=True):
            made.setdefault(row.request_id, []).append((row.position, row_drafts))
        return drafts

    drafter.propose_batch = recording
    return made


@torch.no_grad()
def causal_forward(block: nn.Module, rotary: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's decoder layer ``block`` over x [n, H] at positions 0..n-1, each attending to itself
    and those before (dense causal attention, no cache) -> its output [n, H]."""
    n = x.shape[0]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = block(
        x[None],
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=rotary(x[None], positions),
    )
    out = out[0] if isinstance(out, tuple) else out
    return out[0]


def chained_drafts(
    run: LayerRun, head: torch.Tensor, sequence: list[int], hidden: torch.Tensor, p: int, count: int
) -> list[int]:
    """The drafts after the known tokens sequence[: p + 1]: entries 0..p-1 from the true
    tokens and the target's hidden states, then one entry per draft (its token, the previous
    entry's normed output); each draft the argmax of ``head`` [V, H] over the last output."""
    tokens, feature = sequence[1 : p + 1], hidden[:p]
    drafts: list[int] = []
    for _ in range(count):
        normed = run(tokens, feature)
        drafts.append(int((normed[-1] @ head.T).argmax()))
        tokens, feature = [*tokens, drafts[-1]], torch.cat([feature, normed[-1:]])
    return drafts


def check_proposals(
    made: Proposals,
    prompts: Sequence[list[int]],
    outputs: Sequence[Any],
    hidden_of: Callable[[list[int]], torch.Tensor],
    propose: Propose,
) -> tuple[int, int, int]:
    """Assert every recorded proposal is ``propose``'s over the final sequence (prompt and
    output) and its hidden states; returns (proposals, drafted tokens, kept tokens) as the
    final sequences say, for the engine's counts to be compared with."""
    steps = drafted = kept = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        sequence = [*prompt, *output.token_ids]
        hidden = hidden_of(sequence)
        for position, drafts in made[output.request_id]:
            assert drafts == propose(sequence, hidden, position, len(drafts)), position
            following = sequence[position + 1 : position + 1 + len(drafts)]
            pairs = enumerate(zip(drafts, following, strict=True))
            steps, drafted = steps + 1, drafted + len(drafts)
            kept += next((i for i, (d, t) in pairs if d != t), len(drafts))
    return steps, drafted, kept
