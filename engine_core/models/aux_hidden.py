"""The residual stream entering chosen decoder layers, written by the model's own forward into a
static buffer: the auxiliary hidden states an EAGLE-3 head drafts from (engine_core/eagle3.py).

The decoder loop (models/llama.py ``LlamaModel.forward``) hands each tapped layer's inputs here
before running it, and the stream (the layer's hidden input plus the residual; the embedding
before the first layer) lands in its columns of one [rows, n * H] buffer, row t for the step's
token t. Because the writes are part of the forward, a CUDA graph captures them like any other
kernel and a replay fills the same buffer as an eager run does, which hooks on the layers could
not (a replay runs no Python). The buffer is allocated once, for the largest step, so a graph's
captured writes keep pointing at it; a model without taps (``LlamaModel.aux_hidden_states``
None) runs no extra kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AuxHiddenStates:
    """The taps: ``layer_ids[c]``'s input stream goes to column block c of ``buffer``."""

    layer_ids: tuple[int, ...]
    buffer: torch.Tensor  # [max_tokens, len(layer_ids) * H]
    # layer -> the column blocks it fills (a layer named twice fills two)
    columns: dict[int, list[slice]] = field(init=False)

    def __post_init__(self) -> None:
        width = self.buffer.shape[1] // len(self.layer_ids)
        self.columns = {}
        for c, layer in enumerate(self.layer_ids):
            self.columns.setdefault(layer, []).append(slice(c * width, (c + 1) * width))

    @classmethod
    def allocate(
        cls,
        layer_ids: tuple[int, ...],
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> AuxHiddenStates:
        buffer = torch.zeros(max_tokens, len(layer_ids) * hidden_size, dtype=dtype, device=device)
        return cls(layer_ids, buffer)

    def keep(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Before decoder layer ``layer`` runs on hidden and residual [T, H] (residual None
        before the first layer, whose input is the stream itself): write its input stream."""
        rows = hidden.shape[0]
        for columns in self.columns.get(layer, ()):
            out = self.buffer[:rows, columns]
            if residual is None:
                out.copy_(hidden)
            else:
                torch.add(hidden, residual, out=out)

    def take(self, num_tokens: int) -> torch.Tensor:
        """The latest forward's first ``num_tokens`` rows [T, n * H] (a view: the next forward
        writes over it)."""
        return self.buffer[:num_tokens]
