"""Programmatic dependent launch (PDL) for the small Triton kernels of a decode step.

A decode layer of a small model is a chain of short kernels (norm, rotary, KV write, attention,
its merge, SiLU-and-mul) whose own work takes a few microseconds each; between two of them the
GPU drains one grid and launches the next. Launched as a programmatic dependent (sm_90+), a
kernel's programs may become resident while the kernel before it finishes: each first waits for
that kernel's completion and memory flush (``griddepcontrol.wait``), then lets the kernel after
it start early (``griddepcontrol.launch_dependents``). So each kernel of the chain completes
only after the one before it did, and a kernel becomes resident only once the one before it has
passed its wait: everything the kernels before that one wrote is in memory by then. (Kernels
that release at entry, before any wait, are plain launches, never programmatic dependents, so
this holds by induction along the chain.) Before its own wait a kernel may therefore read, and
ask L2 for (``prefetch_l2``), anything except what the kernel just before it writes: the step's
inputs, the weights. It stores nothing before its wait, since the kernel before it may still
be reading the memory it would write.

The attention chain kernels read their step inputs before the wait (the KV writes their slots,
the rotary kernels their cos/sin, decode attention and its merge the sequence lengths and block
tables): whoever calls them must not have those written by the kernel launched just before. The
engine writes them at the step's start (the input copy, the rotary embedding's lookup), several
kernels earlier.

Importing this module imports triton (see engine_core/attention/triton_kernels.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def hopper_or_later(device: torch.device) -> bool:
    """NVIDIA sm_90+: TMA and programmatic dependent launch (griddepcontrol) exist from Hopper
    on (a ROCm GPU reports its own major version, 9 on MI300, and has neither)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launches_dependents(x: torch.Tensor) -> bool:
    """Whether a kernel over x may let a programmatic dependent launch start early (the FP8
    skinny GEMM after a quantizing norm or quantizer): CUDA tensors on Hopper or later."""
    return x.is_cuda and hopper_or_later(x.device)


def chain_pdl(x: torch.Tensor) -> bool:
    """Whether a kernel of the decode chain over x launches as a programmatic dependent (pass
    it as both the kernel's ``PDL`` and the launch's ``launch_pdl``): wherever it may let the
    kernel after it start early too."""
    return launches_dependents(x)


@triton.jit
def pdl_wait_then_release(PDL: tl.constexpr):
    """First statement of a chain kernel: wait for the kernel before it, then let the kernel
    after it become resident (it waits in turn for this one to complete)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ptrs in L2 (kept there first when space runs out), which
    every later load sees coherently: a kernel's first step while the kernel before it
    finishes."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
