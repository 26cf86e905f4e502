"""Give a freshly built model's linear layers the weight format its ModelConfig says (FP8, W8A8
INT8 or W4A16), before any weight loads.

Which layers: every ``Linear`` of the decoder layers (attention's qkv and output projections,
the MLP's gate/up and down; Qwen3-Next's linear-attention projections, shared expert and its
gate) and, in FP8 and W4A16, a mixture of experts' experts, except the modules a checkpoint
lists as ignored. The embeddings, the LM head, norms and a mixture of experts' router stay in
the model's dtype, as every quantized checkpoint we read keeps them.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from engine_core.config import (
    Fp8Config,
    Int8Config,
    ModelConfig,
    QuantConfig,
    W4A16Config,
    is_ignored,
)
from engine_core.models.gguf_layers import GgufEmbedding
from engine_core.models.layers import Linear
from engine_core.models.llama import FUSED_PROJECTIONS
from engine_core.models.moe import SparseMoE

logger = logging.getLogger(__name__)

# Architectures whose own layers (gpt-oss's experts, which are not SparseMoE) no quantized
# checkpoint has been checked against: refused, never run on a guess.
UNTESTED_ARCHITECTURES = {
    "gpt_oss": "gpt-oss",
}
# Architectures of our own layers -> (their name, the formats (``format_kind``) a test holds
# them to against HF: tests/test_hybrid_quant.py, test_qwen3_next_w4a16.py); any other format
# is refused by name.
TESTED_FORMATS = {
    "qwen3_next": ("Qwen3-Next and Qwen3.5", ("block FP8", "W4A16 (compressed-tensors)")),
    "qwen3_5_vl": ("Qwen3.5 with images", ("block FP8",)),
    "llama4": ("Llama 4", ("per-channel FP8",)),
    # Dense Qwen3-VL shares its architecture but not this limit (``tested_key``).
    "qwen3_vl_moe": ("Qwen3-VL-MoE", ("block FP8",)),
}
# Qwen3.5's linear-attention projections, merged in our model (models/qwen3_next.py), by the
# checkpoint's names of the parts.
SEPARATE_PARTS = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
# Where a Qwen3.5 ConditionalGeneration checkpoint keeps the language model's layers.
LANGUAGE_MODEL_PREFIX = "model.language_model."


def make_quantized_linears(model: nn.Module, config: ModelConfig) -> None:
    """Make every quantizable Linear of ``model`` hold the config's format (before loading)."""
    quant = config.quantization
    if quant is None:
        return
    check_architecture(config, quant)
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            make_quantized_experts(module, quant, name, config)
            continue
        if not isinstance(module, Linear):
            continue
        parts = checkpoint_names(name, config)
        ignored = [ignored_in_checkpoint(part, quant, config) for part in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"the checkpoint's ignore list leaves some of {parts} unquantized but not all; "
                "Tandem runs them as one merged projection"
            )
        check_experts_only(config, quant, name)
        check_float_shared_expert_gate(config, quant, name)
        make_quantized(module, quant, name)


def hold_gguf_blocks(model: nn.Module, config: ModelConfig) -> None:
    """Make every Linear whose parts the checkpoint all gives as GGUF blocks
    (``config.gguf_blocks``), and a token embedding it gives so, hold them (before loading); a
    layer with some parts in other types reads them all as floats. Logged by type."""
    types = dict(config.gguf_blocks)
    if not types:
        return
    kept: Counter[str] = Counter()
    floats = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parts = [types.get(f"{part}.weight") for part in checkpoint_names(name, config)]
        if all(parts):
            module.make_gguf(tuple(parts))  # type: ignore[arg-type]
            kept.update(parts)
        elif any(parts):
            floats.append(name)
    body = getattr(model, "model", None)
    embed = getattr(body, "embed_tokens", None)
    embed_type = types.get("model.embed_tokens.weight")
    if isinstance(embed, nn.Embedding) and embed_type is not None:
        body.embed_tokens = GgufEmbedding(embed.num_embeddings, embed.embedding_dim, embed_type)
        kept[embed_type] += 1
    logger.info("GGUF tensors held in their blocks: %s; layers whose parts are of several types, "
                "some without a kernel, read as floats: %d %s", dict(kept), len(floats),
                floats[:3])  # fmt: skip


def gguf_block_names(model: nn.Module, config: ModelConfig) -> set[str]:
    """The checkpoint names of the tensors ``hold_gguf_blocks`` made ``model`` hold as blocks."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.gguf is not None:
            names.update(f"{part}.weight" for part in checkpoint_names(name, config))
        elif isinstance(module, GgufEmbedding):
            names.add(f"{name}.weight")
    return names


def make_quantized_experts(
    module: SparseMoE, quant: QuantConfig, name: str, config: ModelConfig
) -> None:
    """A mixture of experts' experts in FP8, INT8 or W4A16."""
    if ignored_in_checkpoint(f"{name}.experts", quant, config):
        return
    if isinstance(quant, Fp8Config):
        module.make_fp8(quant)
    elif isinstance(quant, Int8Config):
        module.make_int8(quant)
    elif isinstance(quant, W4A16Config):
        check_act_order_experts(config, quant)
        module.make_w4a16(quant, name)


def check_act_order_experts(config: ModelConfig, quant: W4A16Config) -> None:
    """Act-order experts are tested in our Llama-family MoE (Qwen3-MoE, Mixtral) only."""
    if quant.act_order and config.architecture != "llama":
        field = "desc_act" if quant.source == "gptq" else "actorder"
        raise ValueError(
            f"quantization_config.{field}: act-order W4A16 experts are tested for Qwen3-MoE and "
            f"Mixtral only, not this model ({config.architecture}); quantize "
            "without act-order"
        )


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
    return f"W4A16 ({quant.origin or quant.source})"


def format_kind(quant: QuantConfig) -> str:
    """The format as TESTED_FORMATS names it: FP8 by its scales and origin, else its name."""
    if not isinstance(quant, Fp8Config):
        return format_name(quant)
    if not quant.prequantized:
        return "FP8 quantized as it loads"
    if quant.block is not None:
        return "block FP8"
    return "per-channel FP8" if quant.dynamic_activations else "FP8 with static input scales"


def check_tested_format(config: ModelConfig, quant: QuantConfig) -> None:
    """For an architecture of TESTED_FORMATS, refuse a format no test has held it to."""
    key = tested_key(config)
    if key not in TESTED_FORMATS:
        return
    model, tested = TESTED_FORMATS[key]
    kind = format_kind(quant)
    if kind not in tested:
        raise ValueError(
            f"{kind} ({quant.source}) is not implemented for {model} (tested: "
            f"{', '.join(tested)}); serve this model unquantized or in a tested format"
        )


def tested_key(config: ModelConfig) -> str:
    """The model's key in TESTED_FORMATS: its architecture, but Qwen3-VL-MoE apart from dense
    Qwen3-VL (one architecture, ``qwen3_vl``, for both), as their experts are tested apart."""
    if config.architecture == "qwen3_vl" and config.num_experts:
        return "qwen3_vl_moe"
    return config.architecture


def check_experts_only(config: ModelConfig, quant: QuantConfig, name: str) -> None:
    """DeepSeek in W4A16 is tested in Kimi-K2's INT4 layout only: routed experts quantized, the
    latent attention, shared experts and dense MLPs listed as ignored. A linear of those the
    checkpoint quantizes is refused, named."""
    if config.architecture == "deepseek" and isinstance(quant, W4A16Config):
        raise ValueError(
            f"{format_name(quant)} for DeepSeek's {name} is not implemented: only the routed "
            "experts run in W4A16 (Kimi-K2's INT4 layout, the other layers in the ignore list); "
            "serve this model unquantized or in FP8"
        )


def check_float_shared_expert_gate(config: ModelConfig, quant: QuantConfig, name: str) -> None:
    """Qwen3-Next in W4A16 is tested in llm-compressor's published recipe only, which lists the
    shared expert's gate (one output row) as ignored, as GPTQ and AutoRound checkpoints leave it
    too: a checkpoint that quantizes it is refused, named."""
    gate = name.endswith(".shared_expert_gate")
    if gate and config.architecture == "qwen3_next" and isinstance(quant, W4A16Config):
        raise ValueError(
            f"{format_name(quant)} for Qwen3-Next's {name} is not implemented: the tested "
            "layout (llm-compressor's) keeps the shared expert's gate in float; list it in the "
            "quantization_config's ignore list"
        )


def check_architecture(config: ModelConfig, quant: QuantConfig) -> None:
    """Quantized linears cover the dense Llama-family layers (Llama, Mistral, Qwen2/3, Phi-3,
    Gemma 3) and, in FP8, W4A16 and INT8, mixtures of experts; W4A16 not Phi-3's fused
    projections, whose packed layouts split differently."""
    name = format_name(quant)
    if config.architecture in UNTESTED_ARCHITECTURES:
        raise ValueError(
            f"{name} is not implemented for {UNTESTED_ARCHITECTURES[config.architecture]} yet "
            "(no quantized path of its layers is tested); serve it unquantized"
        )
    check_tested_format(config, quant)
    deepseek_ct = config.architecture == "deepseek" and quant.source == "compressed-tensors"
    if deepseek_ct and not isinstance(quant, W4A16Config):  # V3's own FP8 (quant_method fp8)
        raise ValueError(
            f"{name} (compressed-tensors) is not implemented for DeepSeek models; their "
            "published FP8 checkpoints and Kimi-K2's INT4 experts are"
        )
    if config.architecture == "deepseek" and not getattr(quant, "prequantized", True):
        raise ValueError(
            f"{name} quantizing a plain DeepSeek checkpoint as it loads is not implemented; serve "
            "its published FP8 checkpoint, or this one unquantized"
        )
    if config.num_experts and isinstance(quant, Int8Config) and config.architecture != "llama":
        raise ValueError(
            f"{name} experts are implemented for Qwen3-MoE and Mixtral only (no test holds "
            f"this model's to a reference); serve this model unquantized or in another format"
        )
    if config.architecture == "gpt2":
        raise ValueError(f"{name} is not implemented for GPT-2; serve it unquantized")
    fused = config.hf_config.get("model_type") == "phi3"
    if fused and not isinstance(quant, Fp8Config | Int8Config):
        raise ValueError(f"{name} is not implemented for Phi-3's fused qkv and gate/up weights")


def checkpoint_names(module_name: str, config: ModelConfig) -> list[str]:
    """The checkpoint's module names that our module ``module_name`` holds: q/k/v for a merged
    qkv_proj, gate/up for gate_up_proj (Qwen3.5's qkv/z and b/a for its merged linear-attention
    projections), else its own name."""
    parent, _, leaf = module_name.rpartition(".")
    parts = FUSED_PROJECTIONS.get(leaf)
    if parts is None and separate_projections(config):
        parts = SEPARATE_PARTS.get(leaf)
    if parts is None:
        return [module_name]
    return [f"{parent}.{part}" if parent else part for part in parts]


def separate_projections(config: ModelConfig) -> bool:
    """Whether the model is Qwen3.5 (its linear-attention projections stored in parts)."""
    return config.linear_attention is not None and config.linear_attention.separate_projections


def ignored_in_checkpoint(name: str, quant: QuantConfig, config: ModelConfig) -> bool:
    """Whether the checkpoint's ignore list leaves our module ``name`` (as the checkpoint names
    it) unquantized. A Qwen3.5 ConditionalGeneration checkpoint names the language model's
    layers ``model.language_model.layers...``, and its list may name them either way."""
    if is_ignored(name, quant):
        return True
    if not separate_projections(config) or not name.startswith("model."):
        return False
    return is_ignored(LANGUAGE_MODEL_PREFIX + name.removeprefix("model."), quant)
