"""A served model is built in its final form for its target (engine_core/models/target.py) and
nothing rewires it afterwards: the layer forms are chosen when the model is built, before any
weight exists, and the loader finishes the weight layouts they chose. Checked on the CPU on
models built on the meta device (the GPU kernels themselves: tests/test_skinny_gemm_gpu.py,
tests/test_fp8_kernels_gpu.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import engine_core.model_runner
from engine_core.config import EngineConfig
from engine_core.loader import default_dtype
from engine_core.model_runner import ModelRunner
from engine_core.models import build_model
from engine_core.models.layers import Linear, RMSNorm
from engine_core.models.llama import LlamaMLP
from engine_core.models.quant_config import with_quantization_flag
from engine_core.models.target import BuildTarget
from engine_core.presets import PRESETS

CUDA = torch.device("cuda")


def built(preset: str, target: BuildTarget | None, quantization: str | None = None) -> object:
    config = PRESETS[preset]
    config = dataclasses.replace(config, quantization=with_quantization_flag(None, quantization))
    with torch.device("meta"), default_dtype(torch.bfloat16):
        return build_model(config, target)


@pytest.fixture
def as_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Targets report a Hopper GPU (this machine has none; only the choice is tested here)."""
    monkeypatch.setattr(BuildTarget, "hopper", property(lambda self: True))


def mlps(model: object) -> list[LlamaMLP]:
    return [m for m in model.modules() if isinstance(m, LlamaMLP)]  # type: ignore[attr-defined]


def test_without_a_target_every_layer_keeps_its_plain_form(as_hopper: None) -> None:
    model = built("smollm2-135m", None)
    assert not any(m.gate_up_interleaved or m.quantize_act for m in mlps(model))
    assert not any(n.quantize_output for n in model.modules() if isinstance(n, RMSNorm))


def test_bf16_mlps_are_interleaved_for_graphs_on_hopper_only(as_hopper: None) -> None:
    graphs = BuildTarget(CUDA, torch.bfloat16, cuda_graphs=True)
    assert all(m.gate_up_interleaved for m in mlps(built("smollm2-135m", graphs)))
    eager = BuildTarget(CUDA, torch.bfloat16, cuda_graphs=False)
    assert not any(m.gate_up_interleaved for m in mlps(built("smollm2-135m", eager)))
    cpu = BuildTarget(torch.device("cpu"), torch.bfloat16, cuda_graphs=False)
    assert not any(m.gate_up_interleaved for m in mlps(built("smollm2-135m", cpu)))


def test_fp8_linears_have_their_input_quantized_by_the_kernel_before_them(
    as_hopper: None,
) -> None:
    """Per-token FP8 activations: each layer's two norms write the e4m3 rows their FP8 linear
    takes, and the SiLU quantizes for down_proj, which then keeps its gate/up rows as they are."""
    target = BuildTarget(CUDA, torch.bfloat16, cuda_graphs=True)
    model = built("llama-1b", target, quantization="fp8")
    layers = model.model.layers  # type: ignore[attr-defined]
    assert all(layer.input_layernorm.quantize_output for layer in layers)
    assert all(layer.post_attention_layernorm.quantize_output for layer in layers)
    assert all(m.quantize_act and not m.gate_up_interleaved for m in mlps(model))
    assert not model.model.norm.quantize_output  # type: ignore[attr-defined]  # feeds the LM head


def test_int8_linears_have_their_input_quantized_by_the_kernel_before_them(
    as_hopper: None,
) -> None:
    """W8A8 (per-token int8 activations): each layer's two norms write the int8 rows their INT8
    linear takes, and the SiLU writes them for down_proj, which keeps its gate/up rows as they
    are; the final norm feeds the bf16 LM head and writes none."""
    target = BuildTarget(CUDA, torch.bfloat16, cuda_graphs=True)
    model = built("llama-1b", target, quantization="w8a8")
    layers = model.model.layers  # type: ignore[attr-defined]
    assert all(layer.input_layernorm.quantize_output == torch.int8 for layer in layers)
    assert all(layer.post_attention_layernorm.quantize_output == torch.int8 for layer in layers)
    assert all(m.quantize_act == torch.int8 and not m.gate_up_interleaved for m in mlps(model))
    assert model.model.norm.quantize_output is None  # type: ignore[attr-defined]


def test_a_cpu_runner_serves_the_loaded_model_as_built(tmp_path: object) -> None:
    """The runner loads the model for its target and changes nothing: on the CPU the linears
    arrive packed for oneDNN, and the runner's module names none of the build's passes."""
    runner = ModelRunner(
        EngineConfig(model="random:smollm2-135m", device="cpu", num_kv_blocks=16, max_model_len=64)
    )
    linears = [m for m in runner.model.modules() if type(m) is Linear]
    assert linears and all(m.packed_weight is not None for m in linears)
    source = inspect.getsource(engine_core.model_runner)
    for name in ("pack_cpu_weights", "fuse_quantizers", "interleave_gate_ups"):
        assert name not in source, name


@pytest.mark.parametrize(
    ("flags", "graphs", "interleaved"),
    [
        ({}, True, True),
        ({"enforce_eager": True}, False, False),
        ({"enable_lora": True}, True, False),
    ],
)
def test_lora_builds_for_graphs_with_the_plain_mlp(
    as_hopper: None, flags: dict, graphs: bool, interleaved: bool
) -> None:
    """LoRA steps replay CUDA graphs, and LoRA wraps gate_up_proj in the checkpoint's row order
    (its delta is added before the activation): its model is built for graphs without the
    interleaved gate/up layout (a wrapped MLP has no weight for the fused epilogue to read)."""
    target = engine_core.model_runner.build_target(EngineConfig(**flags), CUDA, torch.bfloat16)
    assert target.cuda_graphs is graphs
    model = built("smollm2-135m", target)
    assert all(mlp.gate_up_interleaved is interleaved for mlp in mlps(model))
