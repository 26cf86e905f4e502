"""Turn a freshly built model's linear layers into FP8 ones, as its ModelConfig says.

Which layers: every ``Linear`` of the decoder layers (attention's qkv and output projections,
the MLP's gate/up and down), except the modules a checkpoint lists as ignored. The embeddings,
the LM head, norms and a mixture of experts' router stay in the model's dtype, as every FP8
checkpoint we read keeps them.
"""

from __future__ import annotations

from torch import nn

from engine_core.config import ModelConfig
from engine_core.models.fp8_config import is_ignored
from engine_core.models.layers import Linear
from engine_core.models.llama import FUSED_PROJECTIONS


def make_fp8_linears(model: nn.Module, config: ModelConfig) -> None:
    """Make every quantizable Linear of ``model`` FP8 (before its weights load)."""
    fp8 = config.quantization
    if fp8 is None:
        return
    check_fp8_architecture(config)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parts = checkpoint_names(name)
        ignored = [is_ignored(part, fp8) for part in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"the checkpoint's ignore list leaves some of {parts} unquantized but not all; "
                "Tandem runs them as one merged projection"
            )
        module.make_fp8(fp8)


def check_fp8_architecture(config: ModelConfig) -> None:
    """FP8 covers the dense Llama-family layers (Llama, Mistral, Qwen2/3, Phi-3, Gemma 3)."""
    if config.num_experts:
        raise ValueError(
            "FP8 is not implemented for mixture-of-experts models (their experts have no FP8 "
            "kernel yet); serve this model without --quantization or an FP8 checkpoint"
        )
    if config.architecture == "gpt2":
        raise ValueError("FP8 is not implemented for GPT-2; serve it without --quantization")


def checkpoint_names(module_name: str) -> list[str]:
    """The checkpoint's module names that our module ``module_name`` holds: q/k/v for a merged
    qkv_proj, gate/up for gate_up_proj, else its own name."""
    parent, _, leaf = module_name.rpartition(".")
    parts = FUSED_PROJECTIONS.get(leaf)
    if parts is None:
        return [module_name]
    return [f"{parent}.{part}" if parent else part for part in parts]
