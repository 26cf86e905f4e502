"""A CPU engine keeps freed memory (engine_core/cpu_malloc.py): a temporary freed and allocated
again costs no page faults, where glibc's defaults fault every page of it in anew.

Each case runs in its own interpreter: mallopt's settings are process-wide and the test process
may already hold an engine that set them.
"""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

# Minor page faults per round of the torch RMSNorm at a 2,048-row prefill chunk of the default
# model (its temporaries are 4.7 MB each), after a warm-up.
FAULTS_SCRIPT = """
import resource, sys
import torch
from engine_core.cpu_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x, weight = torch.randn(2048, 576), torch.randn(576)
def norm():
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
for _ in range(20):
    norm()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    norm()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""
PAGES_PER_TEMPORARY = 2048 * 576 * 4 // 4096


def faults(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "libc.so" not in str(ctypes.util.find_library("c")),
    reason="mallopt is glibc's",
)
def test_freed_temporaries_are_not_faulted_in_again() -> None:
    default, kept = faults("default"), faults("keep")
    assert default >= PAGES_PER_TEMPORARY  # glibc's defaults: a temporary faulted in each round
    assert kept < PAGES_PER_TEMPORARY / 100  # kept: reused, not faulted in again
