"""What a pipeline stage's model holds in place of another stage's pieces.

Under pipeline parallelism (engine_core/parallel.py ``PipelineStage``) a stage builds only its
own decoder layers, the first stage the embedding, the last the final norm and LM head. The
others are ``MissingLayer``s in the same places, so every module keeps the name it has in the
checkpoint and in a one-stage model: a layer's weights load under the same names wherever its
stage is, and the loader skips the tensors of pieces this stage does not hold
(``held_elsewhere``).
"""

from __future__ import annotations

from typing import NoReturn

from torch import nn


class MissingLayer(nn.Module):
    """A piece of the model that another pipeline stage holds: no weights, never run."""

    def forward(self, *args: object) -> NoReturn:
        raise RuntimeError("a layer of another pipeline stage was called on this one")


def held_elsewhere(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` (dotted, from ``model``) lies inside a MissingLayer."""
    module: nn.Module | None = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return False
        if isinstance(module, MissingLayer):
            return True
    return False
