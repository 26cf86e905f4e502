"""gpt-oss (``GptOssForCausalLM``) over the paged KV cache: the Llama implementation with
attention sinks, q/k/v/o biases, sliding-window layers alternating with full ones
(``layer_types``), YaRN rotary, and gpt-oss's mixture of experts (models/gpt_oss_moe.py) in bf16
or MXFP4 as published (models/mxfp4.py).

What differs from the Llama checkpoint layout is mapped here, once, as the weights stream in:

- ``self_attn.sinks`` [H] lives on the attention layer (``self_attn.attn.sinks``);
- ``mlp.experts.gate_up_proj`` [E, H, 2I] (HF's in-memory layout: input first, gate and up
  columns interleaved) becomes ``w13 [E, 2I, H]``, gate rows then up rows; its bias likewise;
  ``down_proj`` [E, I, H] becomes ``w2 [E, H, I]``;
- MXFP4's ``*_blocks`` [E, rows, cols / 32, 16] and ``*_scales`` [E, rows, cols / 32] are
  already output-major: their rows are sorted the same way, the blocks' last dims merged.

Under tensor parallelism the attention splits by heads as Llama's does, each rank keeping its
heads' sinks; the experts split as gpt_oss_moe.py says.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine_core.models.layers import load_mapped_weights, rank_rows
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.mxfp4 import check_mxfp4_config
from engine_core.parallel import SINGLE, TPGroup

_EXPERTS = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_OURS = {"gate_up_proj": "w13", "down_proj": "w2"}
_SUFFIX = {None: "", "_bias": "", "_blocks": "_blocks", "_scales": "_scales"}


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss; checkpoint names follow HF's GptOssForCausalLM. Its MoE layers say whether a
    CUDA graph may capture them (gpt_oss_moe.py: MXFP4 experts yes, bf16 ones no)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, gpt_oss_tensors(weights, self.tp), self.map_name)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.endswith(".self_attn.sinks"):
            return hf_name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        if ".mlp." in hf_name:  # the router, and the experts gpt_oss_tensors renamed
            return hf_name, None
        return super().map_name(hf_name)


def gpt_oss_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], tp: TPGroup = SINGLE
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's tensors with the experts' put into our layout and names (see the module docstring);
    the sinks [H] cut to this rank's heads (the attention layer that keeps them splits nothing
    itself); every other tensor as it is."""
    for name, tensor in weights:
        if name.endswith(".self_attn.sinks"):
            yield name, rank_rows(tensor, tp)
            continue
        match = _EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, proj, suffix = match[1], match[2], match[3]
        ours = f"{prefix}.{_OURS[proj]}{_SUFFIX[suffix]}"
        if suffix == "_bias":
            ours = f"{prefix}.b{_OURS[proj][1:]}"
        yield ours, expert_layout(tensor, proj, suffix)


def expert_layout(tensor: torch.Tensor, proj: str, suffix: str | None) -> torch.Tensor:
    """One stacked expert tensor from HF's layout into ours (output rows first, gate then up)."""
    if suffix is None:  # a plain weight: HF keeps [E, in, out]
        tensor = tensor.transpose(1, 2)
    if suffix == "_blocks":  # [E, rows, cols / 32, 16] -> [E, rows, cols / 2]
        tensor = tensor.flatten(-2)
    if proj == "gate_up_proj":  # rows (dim 1) alternate gate, up
        tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    return tensor.contiguous()


def gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a gpt-oss config.json beyond the Llama family's."""
    num_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if len(kinds) != num_layers or unknown:
        raise ValueError(f"GptOssForCausalLM: unsupported layer_types {kinds!r}")
    experts, top_k = hf.get("num_local_experts", 128), hf.get("num_experts_per_tok", 4)
    if not 0 < top_k <= experts:
        raise ValueError(
            f"GptOssForCausalLM: num_experts_per_tok ({top_k}) must be between 1 and the number "
            f"of experts ({experts})"
        )
    return {
        "architecture": "gpt_oss",
        "attention_bias": bool(hf.get("attention_bias", True)),
        "attention_sinks": True,
        "sliding_window": hf.get("sliding_window", 128),
        "layer_types": tuple(kinds),
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": hf["intermediate_size"],
        "moe_router": "gpt_oss",
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "expert_format": expert_format(hf),
    }


def expert_format(hf: dict[str, Any]) -> str:
    """ "mxfp4" where config.json's quantization_config says so (checked), else "dense"."""
    qc = hf.get("quantization_config")
    if not qc:
        return "dense"
    if qc.get("quant_method") != "mxfp4":
        raise ValueError(
            f"GptOssForCausalLM: quantization_config.quant_method {qc.get('quant_method')!r} is "
            "not supported; gpt-oss is read in bf16 or as published (mxfp4)"
        )
    check_mxfp4_config(qc)
    return "mxfp4"
