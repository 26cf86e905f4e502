"""Give a freshly built model's linear layers the weight format its ModelConfig says (FP8, W8A8
INT8 or W4A16), before any weight loads.

Which layers: every ``Linear`` of the decoder layers (attention's qkv and output projections,
the MLP's gate/up and down) and, in FP8 and W4A16, a mixture of experts' experts, except the
modules a checkpoint lists as ignored. The embeddings, the LM head, norms and a mixture of
experts' router stay in the model's dtype, as every quantized checkpoint we read keeps them.
"""

from __future__ import annotations

from torch import nn

from engine_core.config import Fp8Config, Int8Config, ModelConfig, QuantConfig, W4A16Config
from engine_core.models.fp8_config import is_ignored
from engine_core.models.layers import Linear
from engine_core.models.llama import FUSED_PROJECTIONS
from engine_core.models.moe import SparseMoE

# Architectures whose own layers (Qwen3-Next's linear attention, Llama 4's chunked MoE layers,
# gpt-oss's experts, which are not SparseMoE) no quantized checkpoint has been checked against:
# refused, never run on a guess.
UNTESTED_ARCHITECTURES = {
    "qwen3_next": "Qwen3-Next",
    "qwen3_5_vl": "Qwen3.5",
    "llama4": "Llama 4",
    "gpt_oss": "gpt-oss",
}


def make_quantized_linears(model: nn.Module, config: ModelConfig) -> None:
    """Make every quantizable Linear of ``model`` hold the config's format (before loading)."""
    quant = config.quantization
    if quant is None:
        return
    check_architecture(config, quant)
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            make_quantized_experts(module, quant, name)
            continue
        if not isinstance(module, Linear):
            continue
        parts = checkpoint_names(name)
        ignored = [is_ignored(part, quant) for part in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"the checkpoint's ignore list leaves some of {parts} unquantized but not all; "
                "Tandem runs them as one merged projection"
            )
        make_quantized(module, quant, name)


def make_quantized_experts(module: SparseMoE, quant: QuantConfig, name: str) -> None:
    """A mixture of experts' experts in FP8 or W4A16 (W8A8 experts are refused by
    ``check_architecture``)."""
    if is_ignored(f"{name}.experts", quant):
        return
    if isinstance(quant, Fp8Config):
        module.make_fp8(quant)
    elif isinstance(quant, W4A16Config):
        module.make_w4a16(quant, name)


def make_quantized(module: Linear, quant: QuantConfig, name: str) -> None:
    if isinstance(quant, Fp8Config):
        module.make_fp8(quant)
    elif isinstance(quant, Int8Config):
        module.make_int8(quant)
    else:
        module.make_w4a16(quant, name)


def format_name(quant: QuantConfig) -> str:
    """The weight format, for messages."""
    if isinstance(quant, Fp8Config):
        return "FP8"
    if isinstance(quant, Int8Config):
        return "W8A8 (int8)"
    return f"W4A16 ({quant.source})"


def check_architecture(config: ModelConfig, quant: QuantConfig) -> None:
    """Quantized linears cover the dense Llama-family layers (Llama, Mistral, Qwen2/3, Phi-3,
    Gemma 3) and, in FP8 and W4A16, mixtures of experts; W4A16 not Phi-3's fused projections,
    whose packed layouts split differently."""
    name = format_name(quant)
    if config.architecture in UNTESTED_ARCHITECTURES:
        raise ValueError(
            f"{name} is not implemented for {UNTESTED_ARCHITECTURES[config.architecture]} yet "
            "(no quantized path of its layers is tested); serve it unquantized"
        )
    if config.architecture == "deepseek" and not getattr(quant, "prequantized", True):
        raise ValueError(
            f"{name} quantizing a plain DeepSeek checkpoint as it loads is not implemented; serve "
            "its published FP8 checkpoint, or this one unquantized"
        )
    if config.architecture == "deepseek" and isinstance(quant, W4A16Config):
        raise ValueError(
            f"{name} is not implemented for DeepSeek models (its latent attention and shared "
            "experts have no tested W4A16 path); serve this model unquantized or in FP8"
        )
    if config.num_experts and isinstance(quant, Int8Config):
        raise ValueError(
            f"{name} is not implemented for mixture-of-experts models (their experts have no "
            f"{name} kernel yet); serve this model unquantized or in another format"
        )
    if config.architecture == "gpt2":
        raise ValueError(f"{name} is not implemented for GPT-2; serve it unquantized")
    fused = config.hf_config.get("model_type") == "phi3"
    if fused and not isinstance(quant, Fp8Config | Int8Config):
        raise ValueError(f"{name} is not implemented for Phi-3's fused qkv and gate/up weights")


def checkpoint_names(module_name: str) -> list[str]:
    """The checkpoint's module names that our module ``module_name`` holds: q/k/v for a merged
    qkv_proj, gate/up for gate_up_proj, else its own name."""
    parent, _, leaf = module_name.rpartition(".")
    parts = FUSED_PROJECTIONS.get(leaf)
    if parts is None:
        return [module_name]
    return [f"{parent}.{part}" if parent else part for part in parts]
