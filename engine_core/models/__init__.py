"""Our model implementations, and the mapping from a Hugging Face config.json to ModelConfig.

Every model has the interface the model runner uses::

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden]
    compute_logits(hidden [N, hidden], widen=True) -> logits [N, vocab] float32 (widen=False:
        in the weights' dtype, for the sampler, which widens the rows that need it)
    plain_logits_weight() -> W [vocab rows, hidden] or None: where the logits are exactly
        hidden @ W.T (one rank, no soft cap), the decode CUDA graphs project them themselves
    load_weights(Iterable[(hf_name, tensor)]) -> None
    attention_layers() -> list[Attention]

A served model is built for its target (models/target.py): ``build_model(config, target)``
gives its layers their final form before any weight exists, and ``finish_loading`` puts the
loaded weights into the layouts they chose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

from engine_core.config import ModelConfig, VisionConfig
from engine_core.models.deepseek import DeepseekForCausalLM, deepseek_fields
from engine_core.models.gemma3 import Gemma3ForCausalLM
from engine_core.models.gemma3_mm import Gemma3ForConditionalGeneration
from engine_core.models.gpt2 import ACTIVATIONS, GPT2LMHeadModel
from engine_core.models.gpt_oss import GptOssForCausalLM, gpt_oss_fields
from engine_core.models.layers import ROPE_TYPES, pack_cpu_weights
from engine_core.models.llama import (
    LlamaForCausalLM,
    choose_layer_forms,
    interleave_loaded_gate_ups,
)
from engine_core.models.llama4 import (
    LLAMA4_ARCHITECTURES,
    Llama4ForCausalLM,
    llama4_fields,
    llama4_text_config,
)
from engine_core.models.llama4_mm import Llama4ForConditionalGeneration
from engine_core.models.llama4_vision import check_vision_config, tokens_per_tile
from engine_core.models.mistral3 import Mistral3ForConditionalGeneration
from engine_core.models.moe import MOE_ARCHITECTURES, moe_fields
from engine_core.models.quant_config import quant_config_from_hf
from engine_core.models.quantize import hold_gguf_blocks, make_quantized_linears
from engine_core.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine_core.models.qwen3_5_vl import Qwen3_5VLForConditionalGeneration, qwen3_5_vision_config
from engine_core.models.qwen3_next import (
    QWEN3_5_ARCHITECTURES,
    Qwen3NextForCausalLM,
    qwen3_5_text_config,
    qwen3_next_fields,
)
from engine_core.models.qwen3_vl import Qwen3VLForConditionalGeneration
from engine_core.models.target import BuildTarget
from engine_core.parallel import get_tp_group

LLAMA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
# Bare decoder bodies (a checkpoint saved from HF's *Model: no LM head), as embedding models
# are: built as the causal LM of their family, without the head (engine_core/embedding.py).
BARE_BODIES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = (
    *LLAMA_ARCHITECTURES,
    *MOE_ARCHITECTURES,
    "Gemma3ForCausalLM",
    "GPT2LMHeadModel",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    *LLAMA4_ARCHITECTURES,
    "Qwen3NextForCausalLM",
    *QWEN3_5_ARCHITECTURES,
)
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt2": "GPT2LMHeadModel",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
}
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "gpt_oss": GptOssForCausalLM,
    "deepseek": DeepseekForCausalLM,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "gemma3_vl": Gemma3ForConditionalGeneration,
    "llama4": Llama4ForCausalLM,
    "llama4_vl": Llama4ForConditionalGeneration,
    "mistral3": Mistral3ForConditionalGeneration,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_vl": Qwen3_5VLForConditionalGeneration,
}


def build_model(config: ModelConfig, target: BuildTarget | None = None) -> nn.Module:
    """An uninitialised model for ``config`` (load_weights fills it), on the current device, in
    the form its layers take on ``target`` (None: the plain form, every kernel choice's
    reference)."""
    try:
        model_class = _MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(
            f"unknown architecture {config.architecture!r}; expected one of {list(_MODEL_CLASSES)}"
        ) from None
    tp_size = get_tp_group().size
    if tp_size > 1 and config.vision is not None:
        raise ValueError(
            f"--tensor-parallel-size {tp_size}: vision-language models run on one rank only for "
            "now (a step's images do not reach the other ranks)"
        )
    model = model_class(config)
    make_quantized_linears(model, config)
    hold_gguf_blocks(model, config)
    if target is not None:
        choose_layer_forms(model, target)
    return model


def finish_loading(model: nn.Module, target: BuildTarget | None) -> None:
    """After the weights are in: the weight layouts the layers chose for ``target`` (gate/up
    rows interleaved on CUDA; plain CPU weights packed for oneDNN, models/cpu_gemm.py)."""
    if target is None:
        return
    if target.on_cuda:
        interleave_loaded_gate_ups(model)
    elif target.device.type == "cpu":
        pack_cpu_weights(model)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face config.json (as a dict) to ModelConfig.

    Accepts both the transformers 4 layout (rope_theta, rope_scaling) and the transformers 5 one
    (rope_parameters). Raises ValueError for an architecture or a feature we do not implement.
    """
    architecture = hf_architecture(hf)
    config = architecture_config(hf, architecture)
    if architecture == "GptOssForCausalLM":  # its quantization_config is MXFP4 experts, read there
        return config
    return dataclasses.replace(config, quantization=quant_config_from_hf(hf))


def architecture_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    if architecture == "GPT2LMHeadModel":
        return gpt2_config(hf)
    if architecture == "Gemma3ForCausalLM":
        return gemma3_config(hf)
    if architecture == "GptOssForCausalLM":
        return dataclasses.replace(llama_config(hf, architecture), **gpt_oss_fields(hf))
    if architecture in DEEPSEEK_ARCHITECTURES:  # MLA and DeepSeekMoE (models/deepseek.py)
        return dataclasses.replace(
            llama_config(hf, architecture), **deepseek_fields(hf, architecture)
        )
    if architecture == "Qwen3NextForCausalLM":  # linear + gated attention (models/qwen3_next.py)
        return dataclasses.replace(llama_config(hf, architecture), **qwen3_next_fields(hf))
    if architecture in QWEN3_5_ARCHITECTURES:  # Qwen3-Next's layers (+ images: qwen3_5_vl.py)
        return qwen3_5_config(hf, architecture)
    if architecture in MOE_ARCHITECTURES:  # Llama-family attention, MoE MLPs (models/moe.py)
        return dataclasses.replace(llama_config(hf, architecture), **moe_fields(hf, architecture))
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        return qwen2_5_vl_config(hf)
    if architecture in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"):
        return qwen3_vl_config(hf, architecture)
    if architecture == "Gemma3ForConditionalGeneration":
        return gemma3_vl_config(hf)
    if architecture == "Mistral3ForConditionalGeneration":
        return mistral3_config(hf)
    if architecture in LLAMA4_ARCHITECTURES:  # models/llama4.py (+ llama4_mm.py: images)
        text = llama4_text_config(hf) | {"quantization_config": hf.get("quantization_config")}
        fields = llama4_fields(text, architecture) | llama4_vision_fields(hf)
        return dataclasses.replace(llama_config(text, architecture), **fields)
    return llama_config(hf, architecture)


def llama4_vision_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A Llama4ForConditionalGeneration's image side (models/llama4_mm.py): each tile's patch
    grid pixel-shuffled to ``tokens_per_tile`` rows, which the existing ``t*h*w / merge^2`` rule
    gives with merge 1 / pixel_shuffle_ratio; nothing for a text-only config."""
    tower = hf.get("vision_config")
    if not tower:
        return {}
    check_vision_config(tower)
    tokens = tokens_per_tile(tower)
    vision = VisionConfig(
        tower=tower,
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 200_092)),
        spatial_merge_size=round(1 / tower["pixel_shuffle_ratio"]),
        tokens_per_image=tokens,
        max_image_tokens=tokens,
    )
    return {"architecture": "llama4_vl", "vision": vision}


def mistral3_config(hf: dict[str, Any]) -> ModelConfig:
    """Mistral 3: the Mistral language model (``text_config``) and Pixtral's tower, each image
    a run of rows of [IMG] each closed by one more token (models/mistral3.py). What HF's model
    would do and ours does not is refused by name."""
    name = "Mistral3ForConditionalGeneration"
    for key, honoured in (("vision_feature_layer", -1), ("projector_hidden_act", "gelu")):
        if hf.get(key, honoured) != honoured:
            raise ValueError(f"{name}: {key} {hf[key]!r} is not supported (only {honoured!r})")
    text = dict(hf.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id"):  # top level in some checkpoints
        if key in hf and key not in text:
            text[key] = hf[key]
    # HF ties the LM head by the top level's flag, whose default is true in Mistral3Config.
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)
    tower = dict(hf["vision_config"])
    merge = hf.get("spatial_merge_size", 2)
    side = tower.get("image_size", 1024) // (tower["patch_size"] * merge)
    vision = VisionConfig(
        tower=tower,
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 10)),
        spatial_merge_size=merge,
        max_image_tokens=side * (side + 1),  # the largest image's cells and row breaks
        row_breaks=True,
    )
    config = llama_config(text, "MistralForCausalLM")
    return dataclasses.replace(config, architecture="mistral3", vision=vision, hf_config=hf)


def qwen2_5_vl_config(hf: dict[str, Any]) -> ModelConfig:
    """Qwen2.5-VL: Qwen2's language model (``text_config``, or the top level in transformers
    4's layout) with M-RoPE, and its vision tower (models/qwen2_5_vl.py)."""
    text, rope = mrope_text_config(hf, "Qwen2_5_VLForConditionalGeneration", "qwen2")
    tower = hf["vision_config"]
    vision = VisionConfig(
        tower=tower,
        image_token_id=hf.get("image_token_id", text.get("image_token_id", 151655)),
        spatial_merge_size=tower.get("spatial_merge_size", 2),
        mrope_section=tuple(rope["mrope_section"]),
    )
    config = llama_config(text, "Qwen2ForCausalLM")
    return dataclasses.replace(config, architecture="qwen2_5_vl", vision=vision)


def qwen3_vl_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3-VL: Qwen3's language model (``text_config``) with interleaved M-RoPE, and its
    vision tower with DeepStack features for the first language layers (models/qwen3_vl.py);
    Qwen3-VL-MoE's language model is Qwen3-MoE's (its MLPs mixtures of experts)."""
    text, rope = mrope_text_config(hf, architecture, "qwen3")
    if not rope.get("mrope_interleaved", False):
        raise ValueError(
            f"{architecture}: mrope_interleaved false is not implemented "
            "(every released Qwen3-VL interleaves its M-RoPE sections)"
        )
    tower = hf["vision_config"]
    vision = VisionConfig(
        tower=tower,
        image_token_id=hf.get("image_token_id", 151655),
        spatial_merge_size=tower.get("spatial_merge_size", 2),
        mrope_section=tuple(rope["mrope_section"]),
        mrope_interleaved=True,
        deepstack_layers=len(tower.get("deepstack_visual_indexes") or ()),
    )
    config = llama_config(text, "Qwen3ForCausalLM")
    if architecture == "Qwen3VLMoeForConditionalGeneration":
        config = dataclasses.replace(config, **qwen3_vl_moe_fields(text, architecture))
    return dataclasses.replace(config, architecture="qwen3_vl", vision=vision)


def qwen3_vl_moe_fields(text: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen3-VL-MoE's expert fields: Qwen3-MoE's, but HF's router always renormalises the
    top-k weights (its config has no ``norm_topk_prob``), so a checkpoint saying false is
    refused rather than served one way or the other."""
    if text.get("norm_topk_prob", True) is not True:
        raise ValueError(
            f"{architecture}: config field norm_topk_prob={text['norm_topk_prob']!r} is not "
            "supported (Qwen3-VL-MoE renormalises its top-k routing weights)"
        )
    return moe_fields(text | {"norm_topk_prob": True}, architecture)


def qwen3_5_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3.5: Qwen3-Next's layers; a ConditionalGeneration config with a ``vision_config``
    adds Qwen3-VL's tower without DeepStack and interleaved M-RoPE (models/qwen3_5_vl.py)."""
    text = qwen3_5_text_config(hf)
    fields = qwen3_next_fields(text, architecture)
    config = dataclasses.replace(llama_config(text, architecture), **fields)
    if "ForConditionalGeneration" not in architecture or "vision_config" not in hf:
        return config
    vision = qwen3_5_vision_config(hf, text, architecture)
    return dataclasses.replace(config, architecture="qwen3_5_vl", vision=vision)


def mrope_text_config(
    hf: dict[str, Any], architecture: str, model_type: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Qwen VL config's language model as a text config of ``model_type`` (its M-RoPE keys
    taken out of the rope fields, which then name plain RoPE), and those rope fields with
    them: (text config, rope fields)."""
    text = dict(hf.get("text_config") or hf)
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    if not rope.get("mrope_section"):
        raise ValueError(f"{architecture}: the config has no mrope_section")
    plain = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    if plain.get("rope_type", plain.get("type")) == "mrope":  # transformers 4's name for it
        plain["rope_type"] = "default"
        plain.pop("type", None)
    text.update(rope_scaling=None, rope_parameters=plain, model_type=model_type)
    for key in ("eos_token_id", "bos_token_id"):  # top level in some
        if key in hf and key not in text:
            text[key] = hf[key]
    if "tie_word_embeddings" in hf:  # HF ties the LM head by the top level's, whatever text says
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text, rope


def gemma3_vl_config(hf: dict[str, Any]) -> ModelConfig:
    """Gemma 3 with images: its text model (``text_config``) and a SigLIP tower whose patch
    grid is average-pooled to ``mm_tokens_per_image`` tokens (models/gemma3_mm.py)."""
    text = dict(hf.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id"):  # top level in some checkpoints
        if key in hf and key not in text:
            text[key] = hf[key]
    text.setdefault("vocab_size", 262_208)  # HF's Gemma3TextConfig defaults
    text.setdefault("hidden_size", 2304)
    text.setdefault("intermediate_size", 9216)
    text.setdefault("num_hidden_layers", 26)
    text.setdefault("num_attention_heads", 8)
    tower = dict(hf.get("vision_config") or {})
    tokens = hf.get("mm_tokens_per_image", 256)
    side = tower.get("image_size", 224) // tower.get("patch_size", 16)
    per_side = math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(
            f"Gemma3ForConditionalGeneration: mm_tokens_per_image {tokens} does not pool a "
            f"{side}x{side} patch grid evenly"
        )
    vision = VisionConfig(
        tower=tower,
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262_144)),
        spatial_merge_size=side // per_side,
        bidirectional_images=True,
        tokens_per_image=tokens,
        max_image_tokens=tokens,
    )
    return dataclasses.replace(gemma3_config(text), architecture="gemma3_vl", vision=vision)


def hf_architecture(hf: dict[str, Any]) -> str:
    names = list(hf.get("architectures") or [])
    if not names and hf.get("model_type") in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
        if name in BARE_BODIES:
            return BARE_BODIES[name]
    found = names or hf.get("model_type")
    supported = [*SUPPORTED_ARCHITECTURES, *BARE_BODIES]
    raise ValueError(f"unsupported model architecture {found!r}; supported: {', '.join(supported)}")


def is_bare_body(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint is a decoder body without an LM head (it can only embed)."""
    names = list(hf.get("architectures") or [])
    return any(name in BARE_BODIES for name in names) and not any(
        name in SUPPORTED_ARCHITECTURES for name in names
    )


def llama_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{architecture}: unsupported hidden_act {hf['hidden_act']!r}")
    if hf.get("mlp_bias"):
        raise ValueError(f"{architecture}: mlp_bias is not supported")
    heads = hf["num_attention_heads"]
    rope_theta, rope_scaling = rope_config(hf)
    return ModelConfig(
        architecture="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial_rotary_factor(hf, architecture),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_window=sliding_window(hf, architecture),
        hidden_act="silu",
        eos_token_ids=token_ids(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        hf_config=hf,
    )


def rope_config(
    hf: dict[str, Any], params: dict[str, Any] | None = None, default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None for plain rope) from either config layout; ``params``
    overrides where the rope parameters live (Gemma 3 keeps one set per layer type)."""
    if params is None:
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and hf.get("model_type") == "phi3":
        rope_type = "longrope"  # Phi-3's names for it before transformers settled on longrope
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, longrope_scaling(hf, params)
    if rope_type == "yarn":
        return theta, yarn_scaling(hf, params)
    return theta, {**params, "rope_type": rope_type}


def yarn_scaling(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters with HF's defaults resolved (models/layers.py scale_yarn reads them).

    factor defaults to max_position_embeddings / original_max_position_embeddings; the
    attention factor (cos/sin times it) is 0.1 ln(factor) + 1, or with DeepSeek's ``mscale``
    and ``mscale_all_dim`` the ratio of the two such terms; DeepSeek also multiplies its softmax
    scale by the square of the ``mscale_all_dim`` term (``yarn_softmax_factor``).
    """
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_type yarn needs original_max_position_embeddings")
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_mscale(factor)
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
        "attention_factor": float(attention_factor),
        "mscale_all_dim": float(mscale_all_dim or 0.0),
    }


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times (HF's get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_scaling(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters with the factor set and the cos/sin factor resolved.

    The long factors serve a model whose max_position_embeddings exceeds its original length
    (Phi-3 128k), the short ones the others: one set for every token (see RotaryEmbedding). The
    attention factor is HF's: sqrt(1 + ln(factor) / ln(original)), 1 when factor <= 1, where
    factor defaults to max_position_embeddings / original_max_position_embeddings.
    """
    original = params.get("original_max_position_embeddings")
    original = original or hf.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    max_len = hf.get("max_position_embeddings", original)
    factor = params.get("factor") or max_len / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        "short_factor": list(params["short_factor"]),
        "long_factor": list(params["long_factor"]),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
        "use_long_factor": max_len > original,
    }


def partial_rotary_factor(hf: dict[str, Any], architecture: str) -> float:
    """Phi-3's, Qwen3-Next's and Qwen3.5's share of each head that rotary rotates (top level,
    or in rope_parameters); absent, HF's default: 1, but a quarter for the Qwen3-Next family."""
    params = hf.get("rope_parameters") or {}
    qwen3_next = ("Qwen3NextForCausalLM", *QWEN3_5_ARCHITECTURES)
    default = 0.25 if architecture in qwen3_next else 1.0
    factor = float(hf.get("partial_rotary_factor", params.get("partial_rotary_factor", default)))
    if factor != 1.0 and architecture not in ("Phi3ForCausalLM", *qwen3_next):
        raise ValueError(f"{architecture}: partial_rotary_factor {factor} is not supported")
    return factor


def sliding_window(hf: dict[str, Any], architecture: str) -> int | None:
    """Mistral windows every layer; Qwen only when use_sliding_window, and only for some layers."""
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return hf.get("sliding_window")
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    num_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", num_layers) else "full_attention"
        for i in range(num_layers)
    ]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) == {"sliding_attention"}:
        return hf["sliding_window"]
    raise ValueError(f"{architecture}: a sliding window on only some layers is not supported")


def gemma3_config(hf: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text model, with HF's Gemma3TextConfig defaults for absent fields."""
    check_gemma3_supported(hf)
    heads, num_layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    (rope_theta, rope_scaling), (local_theta, local_scaling) = gemma3_ropes(hf)
    return ModelConfig(
        architecture="gemma3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or 256,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        attention_bias=bool(hf.get("attention_bias")),
        qk_norm=True,
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=gemma3_layer_types(hf),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        norm_unit_offset=True,
        embedding_scale=hf["hidden_size"] ** 0.5,
        attention_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        hidden_act="gelu_pytorch_tanh",
        eos_token_ids=token_ids(hf.get("eos_token_id", 1)),
        bos_token_id=hf.get("bos_token_id", 2),
        hf_config=hf,
    )


def check_gemma3_supported(hf: dict[str, Any]) -> None:
    """Refuse the Gemma 3 options that would change the output and that we do not implement."""
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma3ForCausalLM: unsupported hidden_activation {act!r}")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma3ForCausalLM: attn_logit_softcapping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM: use_bidirectional_attention is not supported")


def gemma3_layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or from the older ``sliding_window_pattern``: every pattern-th layer is
    global, the others slide (HF's default pattern is 6)."""
    num_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        pattern = hf.get("sliding_window_pattern", 6)
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if len(kinds) != num_layers or unknown:
        raise ValueError(f"Gemma3ForCausalLM: unsupported layer_types {kinds!r}")
    return tuple(kinds)


def gemma3_ropes(
    hf: dict[str, Any],
) -> tuple[tuple[float, dict[str, Any] | None], tuple[float, dict[str, Any] | None]]:
    """((theta, scaling) of the global layers, (theta, scaling) of the sliding layers).

    transformers 5 keeps ``rope_parameters`` per layer type; transformers 4 has ``rope_theta``
    and ``rope_scaling`` for the global layers and ``rope_local_base_freq`` for the sliding ones.
    """
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = {**(hf.get("rope_scaling") or {}), **params}, {}
    global_rope = rope_config(hf, full, default_theta=1_000_000.0)
    local_theta = hf.get("rope_local_base_freq", 10_000.0)
    local_rope = rope_config(hf, {"rope_theta": local_theta, **local})
    return global_rope, local_rope


def gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"GPT2LMHeadModel: unsupported activation_function {act!r}")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ValueError("GPT2LMHeadModel: only 1/sqrt(head_dim) attention scaling is supported")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        architecture="gpt2",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        hidden_act=act,
        eos_token_ids=token_ids(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        hf_config=hf,
    )


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's token id field, which may be absent, one int or a list, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
