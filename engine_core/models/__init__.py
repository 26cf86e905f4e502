"""Our model implementations, and the mapping from a Hugging Face config.json to ModelConfig.

Every model has the interface the model runner uses::

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden]
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] float32
    load_weights(Iterable[(hf_name, tensor)]) -> None
    attention_layers() -> list[Attention]
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine_core.config import ModelConfig
from engine_core.models.gpt2 import ACTIVATIONS, GPT2LMHeadModel
from engine_core.models.llama import LlamaForCausalLM

LLAMA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, "GPT2LMHeadModel")
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
_MODEL_CLASSES: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}
_ROPE_TYPES = ("default", "linear", "llama3")


def build_model(config: ModelConfig) -> nn.Module:
    """An uninitialised model for ``config`` (load_weights fills it), on the current device."""
    try:
        model_class = _MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(
            f"unknown architecture {config.architecture!r}; expected one of {list(_MODEL_CLASSES)}"
        ) from None
    return model_class(config)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face config.json (as a dict) to ModelConfig.

    Accepts both the transformers 4 layout (rope_theta, rope_scaling) and the transformers 5 one
    (rope_parameters). Raises ValueError for an architecture or a feature we do not implement.
    """
    architecture = hf_architecture(hf)
    if architecture == "GPT2LMHeadModel":
        return gpt2_config(hf)
    return llama_config(hf, architecture)


def hf_architecture(hf: dict[str, Any]) -> str:
    names = list(hf.get("architectures") or [])
    if not names and hf.get("model_type") in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = names or hf.get("model_type")
    raise ValueError(
        f"unsupported model architecture {found!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
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
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_window=sliding_window(hf, architecture),
        hidden_act="silu",
        eos_token_ids=token_ids(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        hf_config=hf,
    )


def rope_config(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None for plain rope) from either config layout."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}"
        )
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def sliding_window(hf: dict[str, Any], architecture: str) -> int | None:
    """Mistral windows every layer; Qwen only when use_sliding_window, and only for some layers."""
    if architecture == "MistralForCausalLM":
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
