"""LoRA adapters for tests, written by the peft library in its real layout, with random A and B
(peft starts B at zero, which would make every adapter the base model), and HF transformers +
PEFT's greedy tokens as the reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(
    base_dir: Path, out: Path, seed: int, *, std: float = 0.2, **lora_fields: Any
) -> Path:
    """A LoRA adapter of the model at ``base_dir`` (``LoraConfig(**lora_fields)``: every
    projection by default), its A and B drawn from N(0, std) with ``seed``, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    fields = {"r": 4, "lora_alpha": 8, "target_modules": ALL_TARGETS, **lora_fields}
    model = get_peft_model(base, LoraConfig(**fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter: Path | None, prompt: list[int], new: int) -> list[int]:
    """HF transformers + PEFT's greedy tokens for ``prompt`` (the base model's without an
    adapter), EOS disabled so both sides generate ``new`` tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


class CountedKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted under its name."""

    def __init__(self, kernel: Any, name: str, counts: Counter[str]) -> None:
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.counts[self.name] += 1
        return self.kernel[grid]


def count_lora_launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """A counter of the LoRA kernels' launches (engine_core/lora/triton_lora.py), by kernel,
    from now until the test ends. Imports triton."""
    from engine_core.lora import triton_lora

    counts: Counter[str] = Counter()
    for name in ("_fused_kernel", "_shrink_kernel", "_expand_kernel"):
        kernel = getattr(triton_lora, name)
        monkeypatch.setattr(triton_lora, name, CountedKernel(kernel, name, counts))
    return counts


def write_moe_case(root: Path) -> dict[str, Path]:
    """A tiny Qwen3-MoE (8 experts, 2 a token) under ``root`` and two adapters that peft writes
    with target_parameters on the stacked experts (per-expert A and B): "experts" (gate_up and
    down, rank 4) and "both" (q/o and the experts' gate_up, rank 6)."""
    from tests.factories import write_tiny_qwen3_moe

    base = write_tiny_qwen3_moe(root / "base")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return {
        "base": base,
        "experts": write_adapter(
            base, root / "experts", seed=21, target_modules=[], target_parameters=experts
        ),
        "both": write_adapter(
            base, root / "both", seed=22, r=6, lora_alpha=12,
            target_modules=["q_proj", "o_proj"], target_parameters=experts[:1],
        ),
    }  # fmt: skip


def count_graph_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that each CUDA graph replay of the engines built afterwards appends its rows to."""
    from engine_core.cuda_graph import CudaGraphRunner

    replays: list[int] = []
    run = CudaGraphRunner.run

    def counting(self: CudaGraphRunner, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        replays.append(input_ids.shape[0])
        return run(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(CudaGraphRunner, "run", counting)
    return replays
