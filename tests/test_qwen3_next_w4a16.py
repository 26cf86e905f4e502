"""Qwen3-Next and Qwen3.5 in 4-bit weights (W4A16) on the CPU against HF transformers: tiny
random models (tests/test_models_qwen3_next.py's ``Qwen3NextForCausalLM``, and a
``Qwen3_5MoeForCausalLM`` of tests/test_models_qwen3_5.py's sizes) saved with
``save_pretrained``, then written by the test in the layouts llm-compressor's recipes publish:
compressed-tensors ``pack-quantized``, symmetric 4-bit groups (128 columns there, 16 here,
which divide the tiny models' 48-wide shared expert), targets every Linear, and

- Qwen3-Next (examples/awq/qwen3_next_example.py, the recipe of the cpatonn / cyankiwi
  Qwen3-Next-80B-A3B-*-AWQ-4bit checkpoints): ignore ``lm_head``, the router
  (``re:.*mlp.gate$``) and ``re:.*mlp.shared_expert_gate$``; so the linear attention's
  in_proj_qkvz, in_proj_ba and out_proj, the full attention, the routed experts and the shared
  expert are 4-bit;
- Qwen3.5-MoE (examples/big_models_with_sequential_onloading/qwen3_5_moe_w4a16_distributed.py):
  the same, and the whole linear attention (``re:.*linear_attn.*``) in float.

Those checkpoints' own config.json was not found to confirm the lists
(docs/design/quantization.md). The reference is HF on the dequantized weights (the same 4-bit
values as floats, packed and unpacked by tests/quant_fixtures.py, independently of our code);
W4A16 leaves activations in float, so the tokens agree. A quantized router or shared-expert
gate and a group size that does not divide a layer are refused by name (the other 4-bit
formats: tests/test_hybrid_quant.py); TP=2 over gloo gives the same tokens where every rank's
share is whole groups, and is refused naming the layer where it is not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from engine_core.models import build_model
from engine_core.models.moe import SparseMoE
from engine_core.models.quant_config import random_weights_config
from engine_core.presets import PRESETS
from tests.paged_harness import hf_greedy, load_float32, random_prompts, randomize
from tests.quant_fixtures import write_folder
from tests.test_models_qwen3_5 import text_fields
from tests.test_models_qwen3_next import NEW_TOKENS, VOCAB, greedy, make_llm, tiny_config
from tests.test_w4a16_moe import ct_qc, ct_tensors, write_w4a16_moe
from tests.tp_cases import assert_same_greedy, engine_greedy, hf_reference

GROUP = 16
# llm-compressor's Qwen3-Next W4A16 recipe's ignore list, as published.
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
# The weights that recipe quantizes (every Linear but those): the checkpoint's names.
QUANTIZED = re.compile(
    r".*\.(linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)|self_attn\.[qkvo]_proj"
    r"|mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj)\.weight$"
)
# Its Qwen3.5-MoE recipe's (the vision tower's and MTP's entries match nothing in a CausalLM).
QWEN3_5_IGNORE = [*IGNORE, "re:.*linear_attn.*"]
QWEN3_5_QUANTIZED = re.compile(
    r".*\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj)"
    r"\.weight$"
)


def save_tiny(folder: Path, seed: int = 3, **overrides: object) -> Path:
    """A tiny random Qwen3-Next saved as HF saves it (``folder/plain``)."""
    torch.manual_seed(seed)
    return save_scaled(AutoModelForCausalLM.from_config(tiny_config(**overrides)), folder, seed)


def save_tiny_qwen3_5(folder: Path, seed: int = 3) -> Path:
    """A tiny random Qwen3.5-MoE text model saved as HF saves it (``folder/plain``)."""
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**text_fields(moe=True))
    return save_scaled(Qwen3_5MoeForCausalLM(config), folder, seed)


def save_scaled(model: torch.nn.Module, folder: Path, seed: int) -> Path:
    """``model`` with random weights, its LM head scaled so greedy choices are well apart."""
    randomize(model.eval(), seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(folder / "plain")
    return folder / "plain"


# A published layout: (the tiny model it is written on, its ignore list, what it quantizes).
LAYOUTS: dict[str, tuple[Callable[[Path], Path], list[str], re.Pattern[str]]] = {
    "qwen3-next": (save_tiny, IGNORE, QUANTIZED),
    "qwen3.5-moe": (save_tiny_qwen3_5, QWEN3_5_IGNORE, QWEN3_5_QUANTIZED),
}


def write_ct(
    plain: Path,
    folder: Path,
    ignore: list[str] = IGNORE,
    quantized: re.Pattern[str] = QUANTIZED,
    group: int = GROUP,
) -> tuple[Path, Path]:
    """``plain`` with the weights ``quantized`` matches in pack-quantized W4A16 under
    ``ignore``; returns (that checkpoint, a plain one of the weights it stands for)."""
    packer = (lambda w, _: ct_tensors(w, group), ct_qc(group) | {"ignore": ignore})
    return write_w4a16_moe(plain, folder, "w4a16", packer, selected=quantized.match)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def w4a16_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    """(a W4A16 checkpoint in a published layout, HF on the weights it stands for)."""
    save, ignore, quantized = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder, reference = write_ct(save(root), root, ignore, quantized)
    return folder, AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def w4a16_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-Next checkpoint in llm-compressor's layout."""
    root = tmp_path_factory.mktemp("qwen3-next-w4a16")
    return write_ct(save_tiny(root), root)[0]


def test_the_recipes_layers_are_4bit_and_the_ignored_ones_float(w4a16_next: Path) -> None:
    model = load_float32(w4a16_next)
    linear, full = model.model.layers[0], model.model.layers[1]
    for layer in (linear.linear_attn.in_proj_qkvz, linear.linear_attn.in_proj_ba):
        assert layer.weight is None and layer.qweight.dtype == torch.int32
    assert linear.linear_attn.out_proj.scales.shape == (32 // GROUP, 64)  # [groups, rows]
    assert full.self_attn.qkv_proj.qweight.dtype == full.self_attn.o_proj.qweight.dtype
    moe = linear.mlp
    assert isinstance(moe, SparseMoE) and moe.w13 is None and moe.w13_qweight.dtype == torch.int32
    assert moe.shared_expert.down_proj.qweight.shape == (64, 48 // 8)
    assert moe.gate.weight.dtype == moe.shared_expert_gate.weight.dtype == torch.float32


def test_a_batch_crossing_the_prompt_chunk_gives_hfs_tokens(
    w4a16_model: tuple[Path, torch.nn.Module],
) -> None:
    """Three prompts prefilled (the 97-token one in chunks of 64, its linear-attention state
    carried across) and decoded together."""
    folder, reference = w4a16_model
    llm = make_llm(folder, max_num_batched_tokens=64)
    try:
        prompts = random_prompts(VOCAB, (5, 33, 97))
        got = llm.generate(prompts, greedy(), detokenize=False)
        want = [hf_greedy(reference, prompt, NEW_TOKENS).tokens[0] for prompt in prompts]
        assert [o.token_ids for o in got] == want
    finally:
        llm.engine.shutdown()


def test_the_scales_count(w4a16_next: Path) -> None:
    """The comparison above would see a reader that dropped the linear attention's scales."""
    model = load_float32(w4a16_next)
    projection = model.model.layers[0].linear_attn.in_proj_qkvz
    prompt = torch.tensor(random_prompts(VOCAB, (8,))[0])
    hidden = model.model.embed_tokens(prompt)
    before = projection(hidden)
    projection.scales.data.mul_(2)
    assert torch.allclose(projection(hidden), 2 * before, atol=1e-5)


@pytest.mark.parametrize(
    ("leaf", "named"),
    [
        ("gate", r"model\.layers\.0\.mlp\.gate\.weight_packed"),
        ("shared_expert_gate", r"W4A16 .*model\.layers\.0\.mlp\.shared_expert_gate"),
    ],
    ids=["router", "shared-expert-gate"],
)
def test_a_4bit_router_or_shared_expert_gate_is_refused_by_name(
    leaf: str, named: str, tmp_path: Path
) -> None:
    """The recipe leaves both in float: a checkpoint whose ignore list does not list one (the
    other left listed), holding it packed, is refused naming that layer or tensor."""
    plain = save_tiny(tmp_path)
    both = re.compile(rf"{QUANTIZED.pattern}|.*\.mlp\.{leaf}\.weight$")
    ignore = [entry for entry in IGNORE if entry != f"re:.*mlp.{leaf}$"]
    folder, _ = write_ct(plain, tmp_path, ignore=ignore, quantized=both)
    with pytest.raises(ValueError, match=named):
        load_float32(folder)


def test_a_group_size_not_dividing_a_layer_is_refused(tmp_path: Path) -> None:
    """32-column groups: the shared expert's down projection has 48 inputs."""
    plain = save_tiny(tmp_path)
    tensors = load_file(plain / "model.safetensors")
    folder = write_folder(tmp_path / "g32", plain, tensors, ct_qc(32) | {"ignore": IGNORE})
    with pytest.raises(ValueError, match=r"group_size 32 does not divide the input size \(48\)"):
        load_float32(folder)


def test_tp2_gives_hfs_tokens(tmp_path: Path) -> None:
    """A shared expert of 64 so each rank's share of every row-parallel input (o_proj's 32,
    out_proj's 16, the experts' 16, the shared expert's 32) is whole 16-column groups; each
    rank its key-head groups' rows of in_proj_qkvz and in_proj_ba."""
    plain = save_tiny(tmp_path, shared_expert_intermediate_size=64)
    folder, reference = write_ct(plain, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    prompts = random_prompts(VOCAB, (5, 21))
    got = engine_greedy(folder, prompts, 6, tp=2)
    assert_same_greedy(got, hf_reference(hf, prompts, 6))


def test_tp2_that_cuts_a_group_is_refused(w4a16_next: Path) -> None:
    """The shared expert's 48 inputs over 2 ranks: 24 each, not whole 16-column groups."""
    with pytest.raises(ValueError, match=r"shared_expert\.down_proj.*24 of 48 columns"):
        engine_greedy(w4a16_next, [[1, 2, 3]], 2, tp=2)


def test_the_random_preset_takes_the_recipes_layout() -> None:
    """`random:qwen3-next-80b --quantization compressed-tensors` (the GPU benchmarks): every
    linear 4-bit in 128-column groups but the shared expert's gate, as the recipe leaves it."""
    config = PRESETS["qwen3-next-80b"]
    quant = random_weights_config("compressed-tensors", config)
    with torch.device("meta"):
        model = build_model(dataclasses.replace(config, quantization=quant))
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj_ba.qweight.shape == (64, 2048 // 8)
    assert layer.mlp.w2_scales.shape == (512, 512 // 128, 2048)
    assert layer.mlp.shared_expert_gate.weight.shape == (1, 2048)
