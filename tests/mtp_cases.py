"""A tiny random DeepSeek-V3 with an MTP layer, saved as DeepSeek publishes V3 (decoder layer
``num_hidden_layers`` of the checkpoint is the MTP layer's block, its own tensors beside it):
the writers tests/test_speculative_mtp.py (CPU) and tests/test_speculative_mtp_gpu.py share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from tests.factories import tiny_hf_sizes
from tests.paged_harness import randomize
from tests.test_models_deepseek import MLA, MOE, YARN

VOCAB = 49152
LAYERS = 2  # the target's; the MTP layer is stored as layer 2
# The only tokens the target's LM head gives a non-zero logit, so that a draft can be right.
EMITTED = list(range(100, VOCAB, 1536))  # 32 tokens


# MLP widths the GPU's block-FP8 GEMM takes in 64 x 64 blocks (the defaults, 96 and 32, not).
GPU_FP8_WIDTHS = {"intermediate_size": 128, "moe_intermediate_size": 64}


def v3_config(
    layers: int, vocab: int = VOCAB, widths: dict[str, int] | None = None
) -> DeepseekV3Config:
    """``widths``: MLP widths in place of the defaults (intermediate 96, experts 32)."""
    sizes = tiny_hf_sizes(vocab) | MLA | {"intermediate_size": 96, "num_hidden_layers": layers}
    fields = sizes | {"max_position_embeddings": 256} | MOE | (widths or {})
    return DeepseekV3Config(
        **fields, q_lora_rank=48, n_group=4, topk_group=2, rope_parameters=YARN,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
    )  # fmt: skip


def deeper_model(
    seed: int = 0,
    vocab: int = VOCAB,
    emitted: list[int] | None = EMITTED,
    widths: dict[str, int] | None = None,
) -> DeepseekV3ForCausalLM:
    """A random V3 of LAYERS + 1 layers: its first LAYERS are the target, its last the MTP
    layer's block. Router biases random (HF zeroes them); the LM head's rows zero but for
    ``emitted``'s (all kept: None), scaled so that greedy choices are well separated."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(v3_config(LAYERS + 1, vocab, widths)).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
        head = model.lm_head.weight.mul_(8.0)
        if emitted is not None:
            kept = torch.zeros(vocab, dtype=torch.bool)
            kept[emitted] = True
            head.masked_fill_(~kept[:, None], 0.0)
    return model


def two_token_head(vocab: int, hidden: int, tokens: list[int]) -> torch.Tensor:
    """An LM head [vocab, hidden] whose rows are zero but for ``tokens``' two, one the other's
    negative: its argmax is always one of them."""
    head = torch.zeros(vocab, hidden)
    row = torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    head[tokens[0]], head[tokens[1]] = row, -row
    return head


def mtp_own_tensors(embedding: torch.Tensor, head: torch.Tensor, seed: int = 1) -> dict:
    """The layer's own tensors under DeepSeek-V3's names (less ``model.layers.<L>.``)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = embedding.shape[1]

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.1

    return {
        "enorm.weight": 1 + noise(hidden),
        "hnorm.weight": 1 + noise(hidden),
        "eh_proj.weight": noise(hidden, 2 * hidden) * 3,
        "shared_head.norm.weight": 1 + noise(hidden),
        "shared_head.head.weight": head,
        "embed_tokens.weight": embedding.clone(),
    }


def write_target(folder: Path, deeper: DeepseekV3ForCausalLM) -> Path:
    """The target as DeepSeek publishes V3: the MTP layer's block stored as layer LAYERS
    (config.json says LAYERS), no MTP tensors of its own yet."""
    deeper.save_pretrained(folder)
    edit_config(folder, num_hidden_layers=LAYERS)
    return folder


def add_mtp_tensors(folder: Path, deeper: DeepseekV3ForCausalLM, head: torch.Tensor) -> Path:
    """The layer's own tensors added to the target's safetensors, as DeepSeek-V3's hold them."""
    own = mtp_own_tensors(deeper.model.embed_tokens.weight.detach(), head)
    add_tensors(folder, {f"model.layers.{LAYERS}.{k}": v for k, v in own.items()})
    return folder


def add_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    path = folder / "model.safetensors"
    weights = load_file(str(path)) | tensors
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), {"format": "pt"})


def edit_config(folder: Path, **fields: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))
