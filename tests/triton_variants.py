"""Counting a Triton kernel's compiled variants (GPU tests of shape specialization)."""

from __future__ import annotations

import pytest


def compiled_variants(kernel: object) -> int:
    """How many specializations of a Triton kernel this process has compiled (or loaded)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    return sum(len(entry[0]) for entry in caches.values())
