"""Random LoRA adapters for a model, in PEFT's layout, for serving benchmarks with many adapters.

Each adapter targets q/k/v/o and gate/up/down of every layer with a dense MLP (attention only
in an MoE layer) at the given rank: ``adapter_config.json`` written by peft's own
``LoraConfig.save_pretrained`` and ``adapter_model.safetensors`` with the tensor names peft
saves, A and B random (scaled so the delta is of the order of the base product), so both
Tandem and vLLM load them as they would a trained adapter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_core.config import ModelConfig
from engine_core.lora.adapter import TARGETS, WEIGHTS_FILE, target_shapes

# Our fused module -> the HF projections it stacks, in shard order.
_HF_NAMES = {ours: [hf for hf, (o, s) in TARGETS.items() if o == ours and s is not None]
             for ours, _ in TARGETS.values()}  # fmt: skip


def model_config(model: str) -> ModelConfig:
    """A random preset's config (``llama-8b``) or a folder's."""
    from engine_core.loader import load_model_config
    from engine_core.models import model_config_from_hf
    from engine_core.presets import PRESETS, hf_config

    if model in PRESETS:
        return model_config_from_hf(hf_config(model))
    return load_model_config(Path(model))


def write_random_adapters(
    config: ModelConfig, out_dir: Path, count: int, rank: int, seed: int = 0
) -> dict[str, Path]:
    """``count`` adapters ``lora0``, ``lora1``, ... under ``out_dir``; their folders by name."""
    from peft import LoraConfig

    generator = torch.Generator().manual_seed(seed)
    folders = {}
    for index in range(count):
        folder = out_dir / f"lora{index}"
        folder.mkdir(parents=True, exist_ok=True)
        targets = sorted({hf for names in _HF_NAMES.values() for hf in names})
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets).save_pretrained(folder)
        tensors = random_tensors(config, rank, generator)
        from safetensors.torch import save_file

        save_file(tensors, str(folder / WEIGHTS_FILE))
        folders[f"lora{index}"] = folder
    return folders


def random_tensors(
    config: ModelConfig, rank: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One adapter's lora_A [r, in] and lora_B [out, r] per targeted projection, in bf16."""
    tensors = {}
    for (layer, ours), shape in target_shapes(config).items():
        if shape.num_experts:
            continue  # the experts are left to adapters that target them
        parent = ours.split(".")[0]
        for hf, out in zip(_HF_NAMES[ours], shape.output_sizes, strict=True):
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{hf}"
            a = torch.randn(rank, shape.in_features, generator=generator)
            b = torch.randn(out, rank, generator=generator)
            tensors[f"{prefix}.lora_A.weight"] = (a / shape.in_features**0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (b / rank**0.5 * 0.1).bfloat16()
    return tensors


def serve_flags(folders: dict[str, Path], rank: int) -> list[str]:
    """The flags that serve ``folders`` by name, the same for `tandem serve` and `vllm serve`."""
    modules = [f"{name}={folder}" for name, folder in folders.items()]
    return [
        "--enable-lora",
        "--max-loras",
        str(len(folders)),
        "--max-lora-rank",
        str(rank),
        "--lora-modules",
        *modules,
    ]
