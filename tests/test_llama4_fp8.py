"""Llama 4 in FP8 on the CPU: tests/test_models_llama4.py's tiny model written in the layout of
the published compressed-tensors FP8-dynamic checkpoints (llm-compressor's FP8_DYNAMIC: e4m3
weights with a scale per output row, activations quantized per token as they run; every expert
stored as its own gate/up/down linears, the attention, the routers and the LM head left in float
by the ignore list) gives the greedy tokens of HF transformers running the dequantized weights
with the activations' e4m3 round trip in front of every quantized linear and expert product.
The experts are held in e4m3 in the fused MoE's stacked form; other formats are refused by
name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Llama4ForCausalLM

from engine_core.models import model_config_from_hf
from tests.paged_harness import generate_greedy, hf_greedy, load_float32, random_prompts
from tests.quant_fixtures import assert_matches_quantized, e4m3_per_token, quantize_inputs
from tests.test_fp8 import compressed_tensors_config, dequantize, quantize_per_row, write_folder
from tests.test_models_llama4 import NEW_TOKENS, VOCAB, text_config

E4M3 = torch.float8_e4m3fn
# The published FP8-dynamic checkpoints' ignore list (compressed-tensors regexes).
IGNORE = ["re:.*lm_head", "re:.*self_attn", "re:.*router"]
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and the shared expert
PROMPTS = random_prompts(VOCAB, (7, 40))  # the longer one past two attention chunks


def per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's stacked experts (gate_up_proj [E, H, 2I], down_proj [E, I, H]) as each expert's
    own linear weights [out, in], as llm-compressor writes a Llama 4 it quantized."""
    prefix = name.rpartition(".")[0]
    out = {}
    for e, expert in enumerate(tensor):
        if name.endswith("gate_up_proj"):
            gate, up = expert.chunk(2, dim=-1)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate.T.contiguous()
            out[f"{prefix}.{e}.up_proj.weight"] = up.T.contiguous()
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = expert.T.contiguous()
    return out


def quantized(name: str) -> bool:
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    return name.endswith(".weight") and leaf in MLP_LINEARS


def write_fp8(plain: Path, folder: Path, reference: Path) -> None:
    """``folder``: the FP8 checkpoint; ``reference``: ``plain`` with the weights it stands for."""
    state = load_file(plain / "model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        parts = per_expert(name, tensor) if ".experts." in name else {name: tensor}
        for part, weight in parts.items():
            if not quantized(part):
                tensors[part] = weight
                continue
            q, scale = quantize_per_row(weight)
            tensors[part], tensors[part.removesuffix("weight") + "weight_scale"] = q, scale
            parts[part] = dequantize(q, scale)
        if ".experts." in name:  # back into HF's stacked form, dequantized
            state[name] = stacked(name, parts, tensor.shape[0])
        elif name in parts:
            state[name] = parts[name]
    qc = compressed_tensors_config("FP8_DYNAMIC") | {"ignore": IGNORE}
    write_folder(folder, plain, tensors, qc)
    reference.mkdir()
    save_file(state, str(reference / "model.safetensors"))
    (reference / "config.json").write_text((plain / "config.json").read_text())


def stacked(name: str, parts: dict[str, torch.Tensor], experts: int) -> torch.Tensor:
    prefix = name.rpartition(".")[0]
    if name.endswith("gate_up_proj"):
        return torch.stack([
            torch.cat([parts[f"{prefix}.{e}.{p}.weight"].T for p in ("gate_proj", "up_proj")], -1)
            for e in range(experts)
        ])  # fmt: skip
    return torch.stack([parts[f"{prefix}.{e}.down_proj.weight"].T for e in range(experts)])


def experts_with_quantized_inputs(
    experts: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor
) -> torch.Tensor:
    """HF's Llama4TextExperts.forward with ``fn`` in front of each expert's two products (every
    row a token: the round trip is per token, as our experts' is)."""
    hidden_states = hidden_states.view(experts.gate_up_proj.shape[0], -1, experts.hidden_size)
    gate, up = torch.bmm(fn(hidden_states), experts.gate_up_proj).chunk(2, dim=-1)
    out = torch.bmm(fn(up * experts.act_fn(gate)), experts.down_proj)
    return out.view(-1, experts.hidden_size)


@pytest.fixture(scope="module")
def fp8_llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    """(the FP8 checkpoint, HF on the values it stands for with the activations' round trip)."""
    from tests.paged_harness import randomize

    root = tmp_path_factory.mktemp("llama4-fp8")
    torch.manual_seed(0)
    model = Llama4ForCausalLM(text_config()).eval()
    randomize(model, 0)
    model.save_pretrained(root / "plain")
    write_fp8(root / "plain", root / "fp8", root / "reference")
    hf = Llama4ForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()
    quantize_inputs(hf, e4m3_per_token, leaves=MLP_LINEARS)
    for module in hf.modules():
        if type(module).__name__ == "Llama4TextExperts":
            module.forward = partial(experts_with_quantized_inputs, module, e4m3_per_token)
    return root / "fp8", hf


def test_fp8_llama4_gives_hfs_tokens_on_what_the_checkpoint_means(
    fp8_llama4: tuple[Path, nn.Module],
) -> None:
    folder, hf = fp8_llama4
    ours = load_float32(folder)
    moe, dense = ours.model.layers[1].mlp, ours.model.layers[0].mlp
    assert moe.w13.dtype == moe.w2.dtype == E4M3  # stacked from the per-expert tensors
    assert moe.shared_expert.gate_up_proj.weight.dtype == E4M3
    assert dense.down_proj.weight.dtype == E4M3
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # ignored
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2, block_size=4)
    assert_matches_quantized(got, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])


def test_other_quantization_formats_are_refused_by_name() -> None:
    hf = text_config().to_dict() | {"architectures": ["Llama4ForCausalLM"]}
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="quant_method 'fp8' is not supported for Llama 4"):
        model_config_from_hf(hf | {"quantization_config": fp8})
    block = compressed_tensors_config("FP8_BLOCK")
    config = model_config_from_hf(hf | {"quantization_config": block})
    from engine_core.models import build_model

    with torch.device("meta"), pytest.raises(ValueError, match="block FP8 .* Llama 4"):
        build_model(config)
