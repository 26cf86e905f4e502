"""Random-weight benchmark models with the real shapes (``--model random:NAME``).

No weights can be downloaded, and a decode step costs the same with random weights as with real
ones, so the benchmarks build these directly on the device: no Hugging Face, no disk. Every preset
has a 49,152-token vocabulary, so the default model's tokenizer covers every id; a vision-language
preset has four more, Qwen's vision tokens, which its tokenizer folder adds to the default
tokenizer (engine_core/preset_folders.py).

    model, config = build_random_model("llama-1b", "cuda", torch.bfloat16)

Each preset is kept as the Hugging Face config.json it corresponds to (``hf_config(name)``), so a
benchmark can build the transformers peer of exactly the same shape.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine_core.config import ModelConfig
from engine_core.models import build_model, finish_loading, model_config_from_hf
from engine_core.models.fp8 import quantize_rows
from engine_core.models.int8 import quantize_rows as int8_rows
from engine_core.models.layers import Linear, reset_buffers
from engine_core.models.meta_build import materialize, meta_build
from engine_core.models.moe import SparseMoE
from engine_core.models.quant_config import random_weights_config
from engine_core.models.target import BuildTarget
from protocol.messages import EmbeddingModel

INIT_STD = 0.02  # small, so activations stay finite through every layer of a random model
_VOCAB = 49152
_MAX_POSITIONS = 4096
# SmolLM2-Instruct's ids, so the default tokenizer's special tokens mean the same here.
_SPECIAL = {"bos_token_id": 1, "eos_token_id": 2}


def _llama(
    hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, tied: bool, theta: float
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _VOCAB,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": mlp,
        "max_position_embeddings": _MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": theta,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        **_SPECIAL,
    }


def _qwen3_moe() -> dict[str, Any]:
    """Qwen3-30B-A3B: 48 layers of 128 experts (top 8, width 768), q/k norms, head dim 128."""
    return _llama(2048, 48, 32, 4, 6144, tied=False, theta=1000000.0) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _mixtral() -> dict[str, Any]:
    """Mixtral-8x7B: 32 layers of 8 experts (top 2, width 14336), no sliding window."""
    return _llama(4096, 32, 32, 8, 14336, tied=False, theta=1000000.0) | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    }


def _gpt_oss_20b() -> dict[str, Any]:
    """gpt-oss-20b (openai/gpt-oss-20b's config.json): 24 layers alternating a 128-token window
    and full attention, 64 heads of 64 with 8 KV heads and sinks, 32 experts (top 4, width
    2880) in MXFP4, YaRN x32 over 4,096; the vocabulary is the presets' (201,088 there)."""
    return _llama(2880, 24, 64, 8, 2880, tied=False, theta=150000.0) | {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "head_dim": 64,
        "attention_bias": True,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    }


def _llama4_scout(layers: int) -> dict[str, Any]:
    """Llama-4-Scout-17B-16E's text model at full width with ``layers`` layers: 40 heads of 128
    with 8 KV heads, every layer an MoE of 16 experts (top 1, width 8192) beside a shared one,
    every fourth layer NoPE and global, the others chunked over 8,192 tokens, QK L2 norm,
    llama3 rope x16 over 8,192. Its context is 32,768 here, so prompts run past the chunk."""
    return _llama(5120, layers, 40, 8, 8192, tied=False, theta=500000.0) | {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "head_dim": 128,
        "intermediate_size_mlp": 16384,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "max_position_embeddings": 32768,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    }


# Qwen's vision tokens, as a vision-language preset's ids: the default tokenizer's vocabulary
# followed by these four, in this order (engine_core/preset_folders.py adds them so).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_VISION_IDS = {token: _VOCAB + i for i, token in enumerate(VISION_TOKENS)}


def _qwen2_5_vl_7b() -> dict[str, Any]:
    """Qwen2.5-VL-7B-Instruct (its config.json, transformers 4's flat layout): Qwen2's 28 layers
    of 3,584 (28 heads of 128, 4 KV heads, width 18,944, q/k/v biases) with M-RoPE sections
    16/24/24, and a vision tower of 32 blocks of 1,280 (16 heads, width 3,420; windows of 112
    pixels, blocks 7/15/23/31 over whole images) whose 2x2 merged 14-pixel patches become
    3,584-wide tokens. The vocabulary is the presets' and the four vision tokens (152,064
    there): the LM head's share of a step is smaller, the image and layer work the same."""
    return _llama(3584, 28, 28, 4, 18944, tied=False, theta=1000000.0) | {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": _VOCAB + len(VISION_TOKENS),
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128000,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "image_token_id": _VISION_IDS["<|image_pad|>"],
        "video_token_id": _VISION_IDS["<|video_pad|>"],
        "vision_start_token_id": _VISION_IDS["<|vision_start|>"],
        "vision_end_token_id": _VISION_IDS["<|vision_end|>"],
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "out_hidden_size": 3584,
            "tokens_per_second": 2,
        },
    }


def _qwen3_vl_8b() -> dict[str, Any]:
    """Qwen3-VL-8B-Instruct (its config.json on the Hugging Face hub, transformers 4.57's
    layout: ``text_config`` with ``rope_scaling``): Qwen3's 36 layers of 4,096 (32 heads of
    128, 8 KV heads, width 12,288, q/k norms, no biases), interleaved M-RoPE sections 24/20/20
    at theta 5,000,000; a vision tower of 27 blocks of 1,152 (16 heads, width 4,304, GELU),
    16-pixel patches merged 2x2 into 4,096-wide tokens, a 48x48 learned position grid, and
    DeepStack features from blocks 8, 16 and 24 for the first three layers. The vocabulary is
    the presets' and the four vision tokens (151,936 there), as for qwen2.5-vl-7b."""
    text = _llama(4096, 36, 32, 8, 12288, tied=False, theta=5000000.0)
    del text["architectures"]  # the top level names it
    text |= {
        "model_type": "qwen3_vl_text",
        "vocab_size": _VOCAB + len(VISION_TOKENS),
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "attention_bias": False,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "tie_word_embeddings": False,
        "text_config": text,
        "image_token_id": _VISION_IDS["<|image_pad|>"],
        "video_token_id": _VISION_IDS["<|video_pad|>"],
        "vision_start_token_id": _VISION_IDS["<|vision_start|>"],
        "vision_end_token_id": _VISION_IDS["<|vision_end|>"],
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
            "out_hidden_size": 4096,
        },
    }


def _qwen3_vl_30b_a3b() -> dict[str, Any]:
    """Qwen3-VL-30B-A3B-Instruct (its config.json, transformers 4.57's layout): Qwen3-VL-8B's
    tower (its merger out to 2,048) over Qwen3-30B-A3B's language model: 48 layers of 2,048
    (32 heads of 128, 4 KV heads), every MLP 128 experts of width 768, top 8 renormalised;
    M-RoPE sections 24/20/20 interleaved at theta 5,000,000. The presets' vocabulary and the
    four vision tokens (151,936 there)."""
    config = _qwen3_vl_8b()
    moe = {k: v for k, v in _qwen3_moe().items() if k not in ("architectures", "model_type")}
    moe["rope_theta"] = config["text_config"]["rope_theta"]
    config["text_config"] |= moe | {
        "model_type": "qwen3_vl_moe_text",
        "vocab_size": _VOCAB + len(VISION_TOKENS),
        "max_position_embeddings": 262144,
    }
    config["vision_config"] = config["vision_config"] | {"out_hidden_size": 2048}
    return (
        config
        | {"architectures": ["Qwen3VLMoeForConditionalGeneration"]}
        | {"model_type": "qwen3_vl_moe"}
    )


# Gemma 3's image tokens, as a vision-language preset's ids: the default tokenizer's vocabulary
# followed by these three, in this order (engine_core/preset_folders.py adds them so).
GEMMA3_VISION_IDS = {"boi_token_index": _VOCAB, "image_token_index": _VOCAB + 1}
GEMMA3_VISION_IDS["eoi_token_index"] = _VOCAB + 2


def _gemma3_4b() -> dict[str, Any]:
    """gemma-3-4b-it (google/gemma-3-4b-it's config.json on the Hugging Face Hub, transformers
    4's layout: text_config hidden 2,560, 34 layers, MLP 10,240, a 1,024-token window, linear
    RoPE x8 on the global layers; vision_config SigLIP of 27 blocks of 1,152, 16 heads, MLP
    4,304, 14-pixel patches of 896-pixel images, no pooling head; mm_tokens_per_image 256).
    The fields that config.json leaves out take transformers' Gemma3TextConfig defaults, which
    are the 4B's and are written out here: 8 heads and 4 KV heads of 256, query_pre_attn_scalar
    256, five sliding layers to one global, RoPE bases 1,000,000 (global) and 10,000 (sliding).
    The vocabulary is the presets' and the three image tokens (262,208 there), so the LM head
    is smaller; the image and layer work is the same."""
    text = {
        "model_type": "gemma3_text",
        "vocab_size": _VOCAB + len(GEMMA3_VISION_IDS),
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        **_SPECIAL,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        **GEMMA3_VISION_IDS,
        **_SPECIAL,
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }


# Mistral 3's image tokens ([IMG], [IMG_BREAK], [IMG_END]) as a preset's ids: the default
# tokenizer's vocabulary followed by these three (engine_core/preset_folders.py adds them so).
MISTRAL3_IMAGE_ID = _VOCAB
MISTRAL3_IMAGE_TOKENS = 3


def _mistral_small_3_1_24b() -> dict[str, Any]:
    """Mistral-Small-3.1-24B-Instruct-2503 (transformers' Mistral3Config defaults, which are
    that checkpoint's shapes): text_config Mistral of 40 layers of 5,120, 32 heads and 8 KV
    heads of 128, MLP 32,768, RoPE base 10^9, no sliding window; vision_config Pixtral of 24
    blocks of 1,024, 16 heads of 64, MLP 4,096 (SiLU gate), 14-pixel patches of images up to
    1,540 pixels a side; 2 x 2 patch merger; written from those defaults and the shapes as
    remembered, not read from the Hub (no network here). ``tie_word_embeddings`` false is
    written at the top level, where HF reads it (the checkpoint has its own LM head). The
    vocabulary is the presets' and the three image tokens (131,072 there)."""
    text = {
        "model_type": "mistral",
        "vocab_size": _VOCAB + MISTRAL3_IMAGE_TOKENS,
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        **_SPECIAL,
    }
    return {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "image_token_index": MISTRAL3_IMAGE_ID,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
        **_SPECIAL,
        "text_config": text,
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "head_dim": 64,
            "hidden_act": "silu",
            "image_size": 1540,
            "patch_size": 14,
            "rope_theta": 10000.0,
        },
    }


def _deepseek(hidden: int, layers: int, heads: int, mlp: int, **fields: Any) -> dict[str, Any]:
    """The MLA and DeepSeekMoE fields both DeepSeek shapes share (kv_lora_rank 512, rotary key
    64, no-rope key 128, value 128; YaRN x40 over 4,096)."""
    return _llama(hidden, layers, heads, heads, mlp, tied=False, theta=10000.0) | {
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        **fields,
    }


def _deepseek_v2_lite() -> dict[str, Any]:
    """DeepSeek-V2-Lite: 27 layers, 16 heads, q in one projection, 64 experts (top 6, width
    1408) and 2 shared, softmax greedy routing, the first layer dense (10944)."""
    yarn = {"mscale": 0.707, "mscale_all_dim": 0.707}
    return _deepseek(2048, 27, 16, 10944) | {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1,
        "n_group": 1,  # as the published config: one group, so greedy top-k over all experts
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rope_scaling": _deepseek_yarn() | yarn,
    }


def _deepseek_v3(layers: int) -> dict[str, Any]:
    """DeepSeek-V3 (and R1, V3.1; Kimi-K2 differs in experts and heads) at full width with
    ``layers`` layers, the first dense: 128 heads, q_lora_rank 1536, 256 experts (top 8, width
    2048) and one shared, grouped sigmoid routing (8 groups, top 4), scaling 2.5."""
    return _deepseek(7168, layers, 128, 18432) | {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": 1536,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 1,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "rope_scaling": _deepseek_yarn() | {"mscale": 1.0, "mscale_all_dim": 1.0},
    }


def _qwen3_next(layers: int) -> dict[str, Any]:
    """Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json) on ``layers`` layers:
    every fourth a gated full attention (16 heads of 256, 2 KV heads, a quarter of each head
    rotating), the others gated DeltaNet (16 key heads and 32 value heads of 128, convolution of
    4); 512 experts (top 10, width 512) and a shared expert of 512 in every layer."""
    return _llama(2048, layers, 16, 2, 5120, tied=False, theta=10_000_000.0) | {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _qwen3_5(moe: bool) -> dict[str, Any]:
    """Qwen3.5's text model, dense (Qwen3.5-9B) or MoE (Qwen3.5-35B-A3B), whole: the defaults
    of transformers 5.24's Qwen3_5TextConfig and Qwen3_5MoeTextConfig, which their docstrings
    call the Qwen3.5-9B and Qwen3.5-35B-A3B style configurations (docs/design/qwen3-next.md):
    every fourth layer a gated full attention (16 heads of 256; 4 KV heads dense, 2 MoE; a
    quarter of each head rotating), the others gated DeltaNet (16 key and 32 value heads of
    128, convolution of 4); dense MLPs of 12,288, or 256 experts of 512 (top 8) and a shared
    one of 512. The rope base is the published 10,000,000 (transformers' default is 10,000),
    the context 262,144."""
    if moe:
        base = _llama(2048, 40, 16, 2, 0, tied=False, theta=10_000_000.0) | {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
        }
        del base["intermediate_size"]  # none in the MoE's config: no layer has a dense MLP
    else:
        base = _llama(4096, 32, 16, 4, 12288, tied=False, theta=10_000_000.0) | {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
        }
    return base | {
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
    }  # fmt: skip


def _deepseek_yarn() -> dict[str, Any]:
    return {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    }


_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": _llama(576, 30, 9, 3, 1536, tied=True, theta=100000.0),
    "llama-1b": _llama(2048, 16, 32, 8, 8192, tied=True, theta=500000.0),
    "llama-8b": _llama(4096, 32, 32, 8, 14336, tied=False, theta=500000.0),
    "qwen3-30b-a3b": _qwen3_moe(),
    "mixtral-8x7b": _mixtral(),
    "gpt-oss-20b": _gpt_oss_20b(),
    "deepseek-v2-lite": _deepseek_v2_lite(),
    # The real model has 61 layers (3 dense): 4 here (1 dense, 3 MoE, ~75 GB in bf16) measure
    # the kernels at full width on one GPU.
    "deepseek-v3-4l": _deepseek_v3(4),
    # The real model has 48 layers (about 216 GB of weights in bf16, past one 141 GB H200): 24
    # here (about 108 GB; 6 NoPE, 18 chunked) leave room for the KV cache on one GPU.
    "llama4-scout": _llama4_scout(24),
    # The real model has 48 layers, ~160 GB in bf16 (its experts alone 3.2 GB a layer): 24 here
    # (six of its four-layer patterns, ~80 GB) leave one H200 room for the KV cache and states.
    "qwen3-next-80b": _qwen3_next(24),
    # Whole: about 15 GB (dense) and 68 GB (MoE) of bf16 weights at this vocabulary.
    "qwen3.5-9b": _qwen3_5(moe=False),
    "qwen3.5-35b-a3b": _qwen3_5(moe=True),
    "qwen2.5-vl-7b": _qwen2_5_vl_7b(),
    "qwen3-vl-8b": _qwen3_vl_8b(),
    "qwen3-vl-30b-a3b": _qwen3_vl_30b_a3b(),
    "gemma-3-4b": _gemma3_4b(),
    "mistral-small-3.1-24b": _mistral_small_3_1_24b(),
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": _VOCAB,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": 3072,
        "n_positions": _MAX_POSITIONS,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        **_SPECIAL,
    },
}

PRESETS: dict[str, ModelConfig] = {
    name: model_config_from_hf(hf) for name, hf in _HF_CONFIGS.items()
}


def hf_config(name: str) -> dict[str, Any]:
    """The Hugging Face config.json (as a dict) of preset ``name``, for the transformers peer."""
    return copy.deepcopy(_HF_CONFIGS[_check_name(name)])


def is_vision_preset(name: str) -> bool:
    """Whether preset ``name`` takes images (its API process needs a vision tokenizer folder)."""
    return PRESETS[_check_name(name)].vision is not None


def build_random_model(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    quantization: str | None = None,
    check_fit: Callable[[nn.Module, ModelConfig], None] | None = None,
    target: BuildTarget | None = None,
    embedding: EmbeddingModel | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Our implementation of preset ``name`` on ``device`` in ``dtype``, weights ~ N(0, 0.02).

    Norm weights are 1 and biases 0, as a freshly initialised HF model has them. Built on the
    meta device and filled in place on ``device``: nothing is initialised twice, nothing touches
    the host. ``quantization="fp8"``: the linears hold those random weights quantized to FP8, as
    ``--quantization fp8`` would load them. ``check_fit`` (the loader's memory check) sees the
    model on the meta device, before anything is allocated. ``target``: built in its final
    form for serving there (models/target.py). ``embedding``: built as that embedding model (no
    LM head). Returns the model in eval mode without gradients, and its config.
    """
    config = PRESETS[_check_name(name)]
    quant = random_weights_config(quantization, config)
    config = dataclasses.replace(config, quantization=quant, embedding=embedding)
    with meta_build(dtype):
        model = build_model(config, target)
    if check_fit is not None:
        check_fit(model, config)
    materialize(model, device)
    reset_buffers(model)
    init_random_weights(model, seed)
    model.eval().requires_grad_(False)
    finish_loading(model, target)
    return model, config


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Normal(0, INIT_STD) weights, unit norm scales, zero biases, from one seeded generator."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized:
            init_random_quantized(module, gen)
            continue
        if isinstance(module, SparseMoE) and module.w4a16 is not None:
            init_random_w4a16_experts(module, gen)
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dtype == torch.uint8:  # MXFP4 experts: random codes, scales of 2^-7
                _init_mxfp4(name, param, gen)
            elif name == "bias":
                param.zero_()
            elif _is_norm(module):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=gen)


def _init_mxfp4(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    """Random e2m1 codes (values up to 6 x 2^-7 = 0.047, a spread like INIT_STD's)."""
    if name.endswith("_scales"):
        param.fill_(127 - 7)
    else:
        param.random_(0, 256, generator=gen)


def init_random_quantized(module: Linear, gen: torch.Generator) -> None:
    """A quantized linear's weight: Normal(0, INIT_STD) in bf16, quantized row by row, as a plain
    checkpoint loads under --quantization fp8 or w8a8; W4A16: random 4-bit values around the
    zero point 8 with a scale that gives them INIT_STD. The bias, where there is one, zero."""
    if module.w4a16 is not None:
        init_random_w4a16(module, gen)
    else:
        weight = torch.empty(module.weight.shape, dtype=torch.bfloat16, device=module.weight.device)
        quantize = int8_rows if module.int8 is not None else quantize_rows
        quantized, scale = quantize(weight.normal_(0.0, INIT_STD, generator=gen))
        module.weight.copy_(quantized)
        module.weight_scale.copy_(scale)
    if module.bias is not None:
        module.bias.zero_()


def init_random_w4a16(module: Linear, gen: torch.Generator) -> None:
    """Uniform 4-bit values (std 4.6 around 8): each word's bits at random."""
    fill_random_w4a16(module.qweight, module.scales, module.zeros, gen)
    module.tile_w4a16_for_cuda()


def init_random_w4a16_experts(moe: SparseMoE, gen: torch.Generator) -> None:
    """W4A16 experts as ``init_random_w4a16``'s linears (the router is a linear of its own)."""
    for name in ("w13", "w2"):
        words, scales = getattr(moe, f"{name}_qweight"), getattr(moe, f"{name}_scales")
        fill_random_w4a16(words, scales, getattr(moe, f"{name}_zeros"), gen)


def fill_random_w4a16(
    words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, gen: torch.Generator
) -> None:
    """Every word's bits at random, scales that give the values INIT_STD, zero points 8."""
    words.copy_(torch.randint(-(2**31), 2**31 - 1, words.shape, generator=gen,
                              dtype=torch.int32, device=words.device))  # fmt: skip
    scales.fill_(INIT_STD / 4.6)
    if zeros is not None:
        zeros.fill_(8)


def _is_norm(module: nn.Module) -> bool:
    # Our RMSNorm lives in models.layers; matching by name keeps this free of every model's
    # internals (LayerNorm and RMSNorm both scale by a weight initialised to one).
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def _check_name(name: str) -> str:
    if name not in _HF_CONFIGS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(_HF_CONFIGS)}")
    return name
