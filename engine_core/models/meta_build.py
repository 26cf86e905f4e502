"""Building a model on the meta device: the shapes of every parameter, no memory, no init.

A model is built on the meta device, sized (the memory check), then given real memory on its
device and filled from a checkpoint or a random preset; whatever its modules initialise while
being built is thrown away. On the meta device torch runs random fills (``nn.Embedding``'s
``normal_``, ``nn.Linear``'s ``kaiming_uniform_``) through its Python references, and the first
of them imports ``torch._dynamo``: about 0.7 s of CPU in every process that builds a model, for
numbers that do not exist. ``meta_build`` skips those fills on meta tensors instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# The fills a module's constructor may run on its parameters: nn.init's public functions and
# the tensor methods beneath them. Each returns the tensor it fills, so skipping one returns it.
RANDOM_FILLS: frozenset[Callable[..., Any]] = frozenset(
    {
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.trunc_normal_,
        nn.init.constant_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
        torch.Tensor.fill_,
        torch.Tensor.zero_,
    }
)


class SkipMetaFills(TorchFunctionMode):
    """A torch function mode that skips ``RANDOM_FILLS`` on meta tensors (they hold no values)
    and runs everything else, and every fill of a real tensor, as it is."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in RANDOM_FILLS:
            # nn.init passes the tensor by keyword (``tensor=``), the tensor methods as self.
            filled = args[0] if args else kwargs.get("tensor")
            if isinstance(filled, torch.Tensor) and filled.is_meta:
                return filled
        return func(*args, **kwargs)


@contextmanager
def meta_build(dtype: torch.dtype | None = None) -> Iterator[None]:
    """Build modules on the meta device (in ``dtype`` where given), their init fills skipped."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), SkipMetaFills():
            yield
    finally:
        torch.set_default_dtype(previous)


def computed_buffer(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A buffer a module computes when built (rotary frequencies, index tables), computed on the
    CPU and placed on the device being built on: on the meta device those ops would run through
    torch's Python references and import dynamo, for a value ``reset_buffers`` recomputes."""
    with torch.device("cpu"):
        value = compute()
    return value.to(torch.get_default_device())


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)``: uninitialised memory for every parameter and buffer,
    same shapes, strides and dtypes. Not to_empty itself: its ``empty_like`` of a meta tensor runs
    through torch's Python references, whose first use imports sympy (about a second of CPU at
    every engine start) to compute the strides that ``empty_strided`` is simply given here."""
    module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
