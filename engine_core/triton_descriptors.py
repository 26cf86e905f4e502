"""The device memory Triton's kernels take for the tensor (TMA) descriptors they build.

A kernel that calls ``tl.make_tensor_descriptor`` writes each program's descriptors (128 bytes
each) into global scratch that Triton asks its allocator for at launch. The allocator lives in
a context variable, so it is set in the launching thread before each such launch (a cheap set).

Importing this module imports triton (see engine_core/attention/triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """From torch's caching allocator on the current device, so a CUDA graph's capture takes it
    from the graph's pool."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_descriptor_scratch(device: torch.device) -> None:
    """Set ``_descriptor_scratch`` as Triton's allocator before a launch, on CUDA (the
    interpreter needs none)."""
    if device.type == "cuda":
        triton.set_allocator(_descriptor_scratch)
