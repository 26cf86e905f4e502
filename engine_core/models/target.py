"""What a model is built for, known before it is built.

The layers of a served model take their final form from it when the model is built
(``build_model``: FP8 input quantizers fused into the kernels before them, tensor-parallel sums
deferred into the next norm, gate/up rows interleaved for the SiLU epilogue), and the loader
finishes the weight layouts they chose once the weights are in (``finish_loading``). Nothing
rewires the model afterwards. A model built without a target keeps the plain form that every
kernel choice is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BuildTarget:
    device: torch.device
    dtype: torch.dtype
    cuda_graphs: bool = False  # decode steps replay CUDA graphs (CUDA, not --enforce-eager)
    # LoRA slots wrap the projections after loading (engine_core/lora/), adding each adapter's
    # delta to a projection's output in the checkpoint's row order: the layouts that fuse a
    # projection with what follows it (interleaved gate/up rows, the SiLU in the GEMM's
    # epilogue) are not chosen, so a LoRA model runs the plain MLP, in graphs and out.
    lora: bool = False

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def hopper(self) -> bool:
        """NVIDIA sm_90 or later (the skinny GEMM's TMA kernels)."""
        from engine_core.triton_pdl import hopper_or_later

        return hopper_or_later(self.device)
