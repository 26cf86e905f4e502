"""A preset's random weights written once as a Hugging Face checkpoint that both servers load.

    python -m benchmarks serving --model deepseek-v2-lite --checkpoint --vllm-python ...

Why: vLLM's ``--load-format dummy`` fills every weight with U(-0.001, 0.001) from one seed, so
every layer's router is the same matrix and rows of near-identical hidden states route alike: a
mixture of experts then reads a fraction of its experts a step, while Tandem's ``random:`` presets
(normal at the models' init range) reach all of them. Beside each other, the two do different
work (docs/design/gpt-oss-and-deepseek.md). A checkpoint written here, HF's own initialisation of
the preset's config in bf16 saved with ``save_pretrained`` (the published tensor layout, sharded),
gives both the same weights and so the same routing. gpt-oss presets get their experts in the
published MXFP4 layout (``*_blocks``, ``*_scales``, the preset's ``quantization_config``), quantized
by the reference quantizer shard by shard.

The folder also holds the tokenizer the random presets share, so it serves as the load
generator's tokenizer too. Disk: the bf16 weights (about 31 GB for deepseek-v2-lite; gpt-oss-20b
is written in bf16 first, 42 GB, then shrinks to 13 GB); deepseek-v2-lite takes about 30 s.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch

MXFP4_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
SHARD_SIZE = "2GB"  # shards rewritten one at a time stay small in host memory


def write_preset_checkpoint(preset: str, out: Path, device: str, seed: int = 0) -> Path:
    """Preset ``preset``'s random weights and the shared tokenizer in folder ``out``."""
    from benchmarks.servers import peer_model_dir
    from engine_core.model_dir import tokenizer_dir_for_random
    from engine_core.presets import hf_config

    peer_model_dir(preset, tokenizer_dir_for_random(), out)  # the tokenizer's files
    return write_random_checkpoint(hf_config(preset), out, device, seed)


def write_random_checkpoint(config: dict[str, Any], out: Path, device: str, seed: int = 0) -> Path:
    """HF's initialisation of ``config`` (a config.json as a dict) in bf16, saved in ``out``;
    experts in MXFP4 where ``config`` says so (``quant_method: mxfp4``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.servers import write_config_entry

    hf = dict(config)
    quantization = hf.pop("quantization_config", None)
    if quantization is not None and quantization.get("quant_method") != "mxfp4":
        raise ValueError(f"random checkpoints quantize experts to MXFP4 only, not {quantization}")
    torch.manual_seed(seed)
    peer_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(peer_config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    del model
    if quantization is not None:
        quantize_expert_shards(out, device)
        write_config_entry(out, "quantization_config", quantization)
    release_device_memory()
    return out


def release_device_memory() -> None:
    """Hand the model's GPU memory back to the driver: the servers start from this process,
    and vLLM refuses to start while another process holds more than its share of the GPU."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def quantize_expert_shards(folder: Path, device: str) -> None:
    """Rewrite each shard's bf16 expert tensors (HF's [E, in, out]) as published MXFP4 (rows of
    [E, out, in] in blocks of 32 along ``in``) and point the index at the new names."""
    from safetensors.torch import load_file, save_file

    from engine_core.models import mxfp4

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    shards = sorted(folder.glob("model*.safetensors"))
    for shard in shards:
        tensors = load_file(shard)
        names = [name for name in tensors if name.endswith(MXFP4_EXPERTS)]
        if not names:
            continue
        for name in names:
            weight = tensors.pop(name).to(device).transpose(1, 2)
            blocks, scales = mxfp4.quantize(weight)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.cpu(), scales.cpu()
            if index is not None:
                saved = weight.nbytes - blocks.nbytes - scales.nbytes
                index["metadata"]["total_size"] -= saved
                del index["weight_map"][name]
                for suffix in ("_blocks", "_scales"):
                    index["weight_map"][name + suffix] = shard.name
        save_file(tensors, shard, metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n")
