"""The rooflines the benchmarks measure against.

- Decode: the bytes a step must read over the measured memory bandwidth. A step reads every
  weight once (the embedding table too, as the design card counts it), and each sequence's K
  and V at the workload's mean context (a latent per token with MLA), and its linear-attention
  state, read and written back (Qwen3-Next). In a mixture of experts it reads, per MoE layer,
  one copy of each expert that some token of the batch was routed to: with load-balanced
  routing E (1 - (1 - k/E)^B) of E experts for a batch of B tokens choosing k each; an
  expert's bytes as the model holds them (bf16, FP8, W4A16 or MXFP4 with their scales).
- Prefill: FLOPs over the GPU's dense bf16 tensor-core peak: 2 x the parameters a prompt token
  multiplies through (not the embedding table; not the LM head, which a prefill runs for the
  last token only; k of E experts) plus causal attention, 2 T^2 x head dim per head and layer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

DENSE_BF16_PEAK_TFLOPS = 989.0  # H100 SXM and H200, without sparsity


@dataclass(frozen=True)
class ModelBytes:
    """What a decode step of one model reads, apart from the batch."""

    weights: int  # every parameter, as the model holds it (bf16, or FP8 with its scales)
    expert: int  # one expert of one layer; 0 in a dense model
    moe_layers: int
    num_experts: int
    top_k: int
    kv_per_token: int  # K and V over all layers, in the cache's dtype
    state_per_sequence: int = 0  # linear-attention state read and written a step (both ways)

    @property
    def dense(self) -> int:
        """Every weight outside the experts."""
        return self.weights - self.moe_layers * self.num_experts * self.expert


def meta_model(preset: str, quantization: str | None = None) -> tuple[Any, Any]:
    """(the preset's model on the meta device in bf16, as ``quantization`` holds it; its
    config): shapes and dtypes without memory."""
    import torch

    from engine_core.models import build_model
    from engine_core.models.quant_config import random_weights_config
    from engine_core.presets import PRESETS

    quant = random_weights_config(quantization, PRESETS[preset])
    config = dataclasses.replace(PRESETS[preset], quantization=quant)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return build_model(config), config
    finally:
        torch.set_default_dtype(previous)


def model_bytes(
    preset: str, quantization: str | None = None, kv_cache_dtype: str = "auto"
) -> ModelBytes:
    import torch

    from engine_core.memory_plan import state_slot_bytes

    model, config = meta_model(preset, quantization)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    kv_element = 1 if kv_cache_dtype == "fp8" else 2
    return ModelBytes(
        weights=weights,
        expert=expert_bytes(model, config.num_experts) if moe_layers else 0,
        moe_layers=moe_layers,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        kv_per_token=config.kv_bytes_per_token_at(kv_element),
        state_per_sequence=2 * state_slot_bytes(config, torch.bfloat16),
    )


def expert_bytes(model: Any, num_experts: int) -> int:
    """One expert of one layer as the model holds it: the first MoE layer's stacked tensors
    (every parameter of its own with a leading experts dim: weights, their scales, biases; not
    the router's, nor a shared expert's, which are its submodules') over its experts."""
    for module in model.modules():
        stacked = [
            p
            for p in module.parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] == num_experts
        ]
        if stacked:
            return sum(p.numel() * p.element_size() for p in stacked) // num_experts
    raise ValueError("a mixture-of-experts model with no stacked experts")


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a batch of ``batch`` tokens reaches when each draws ``top_k``
    of ``num_experts`` uniformly: one minus the chance that no token chose a given expert."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def step_bytes(model: ModelBytes, batch: int, mean_context: float) -> int:
    """Bytes one decode step of ``batch`` sequences at ``mean_context`` tokens must read."""
    experts = 0.0
    if model.moe_layers:
        touched = experts_touched(model.num_experts, model.top_k, batch)
        experts = model.moe_layers * touched * model.expert
    states = batch * model.state_per_sequence
    return int(model.dense + experts + batch * mean_context * model.kv_per_token + states)


def prefill_flops(preset: str, prompts: int, prompt_len: int) -> float:
    """FLOPs of prefilling ``prompts`` prompts of ``prompt_len`` tokens (module docstring)."""
    model, config = meta_model(preset)
    params = sum(p.numel() for p in model.parameters())
    vocab = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    idle_experts = moe_layers * (config.num_experts - config.num_experts_per_tok) * expert
    per_token = 2.0 * (params - vocab - idle_experts)
    attention = 2.0 * prompt_len**2 * config.head_dim * config.num_heads * config.num_layers
    return prompts * (prompt_len * per_token + attention)


def measure_bandwidth(device: str, gib: float = 2.0, copies: int = 20) -> float:
    """Bytes per second of a device-to-device copy (bytes read + bytes written): the best of
    ``copies``. The best, not the median: the roofline is what the memory can do, and a lower
    figure would flatter every share against it. On the CPU a 64 MiB copy (a smoke figure)."""
    import torch

    n = int(gib * 2**30) if device == "cuda" else 2**26
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = min(_timed_copy(dst, src, device) for _ in range(copies))
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine's memory plan counts cached blocks as in use
    return 2 * n / best


def _timed_copy(dst: Any, src: Any, device: str) -> float:
    import torch

    if device != "cuda":
        begin = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - begin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
