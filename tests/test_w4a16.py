"""W4A16 checkpoints on the CPU: AWQ, GPTQ (symmetric and not, with and without act-order, both
zero-point conventions, group sizes 32/64/-1) and compressed-tensors pack-quantized (symmetric
and with zero points), each written in its tool's layout (tests/quant_fixtures.py), load into the
one packed layout (engine_core/models/w4a16.py) and give HF transformers' greedy tokens.

The references: HF on the compressed-tensors W4A16 checkpoint itself (transformers runs it);
HF on the dequantized weights for the others (transformers needs gptqmodel or autoawq to run
AWQ and GPTQ, and its compressed-tensors loader refuses the packed zero points of
W4A16_ASYM). Activations are not quantized in W4A16, so the logits agree to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine_core.config import W4A16Config
from engine_core.loader import load_model
from engine_core.memory_plan import module_bytes
from engine_core.models import build_model
from engine_core.models.w4a16 import (
    dequantize,
    pack_int4,
    tile_qweight,
    to_layout,
    unpack_int4,
    untile_qweight,
)
from tests.paged_harness import assert_matches, generate_greedy, load_float32, random_prompts
from tests.quant_fixtures import (
    AWQ_ORDER,
    VOCAB,
    awq_tensors,
    ct_dequantized,
    gptq_tensors,
    make_hf_model,
    pack_along_rows,
    reference_run,
    write_compressed_tensors,
    write_dequantized,
    write_w4a16,
)

NEW_TOKENS = 12
ATOL = 1e-4
PROMPTS = random_prompts(VOCAB, (5, 11, 23))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The float32 model every format here quantizes."""
    folder = tmp_path_factory.mktemp("plain")
    make_hf_model().save_pretrained(folder)
    return folder


def awq_qc(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}  # fmt: skip


def gptq_qc(group_size: int, desc_act: bool, sym: bool, v2: bool) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
            "checkpoint_format": "gptq_v2" if v2 else "gptq", "pack_dtype": "int32"}  # fmt: skip


@dataclasses.dataclass
class Case:
    make: Callable[[torch.Tensor, int], tuple[dict, torch.Tensor]]
    qc: dict


def gptq_case(group_size: int, act_order: bool, sym: bool, v2: bool) -> Case:
    def make(weight: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
        return gptq_tensors(weight, group_size, act_order, sym, v2, seed)

    return Case(make, gptq_qc(group_size, act_order, sym, v2))


CASES = {
    "awq-g64": Case(lambda w, _: awq_tensors(w, 64), awq_qc(64)),
    "awq-g-1": Case(lambda w, _: awq_tensors(w, -1), awq_qc(-1)),
    "gptq-g32-sym": gptq_case(32, act_order=False, sym=True, v2=False),
    "gptq-g64-asym-act-order": gptq_case(64, act_order=True, sym=False, v2=False),
    "gptq-g32-sym-act-order-v2": gptq_case(32, act_order=True, sym=True, v2=True),
    "gptq-g-1-asym-v2": gptq_case(-1, act_order=False, sym=False, v2=True),
}


def write_case(name: str, plain: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the quantized checkpoint, a plain one of the weights it stands for)."""
    case = CASES[name]
    folder, dequantized = write_w4a16(plain, tmp_path / name, case.make, case.qc)
    return folder, write_dequantized(plain, tmp_path / "reference", dequantized)


# ---- each format gives HF's tokens --------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_awq_and_gptq_match_hf_on_the_dequantized_weights(
    name: str, plain: Path, tmp_path: Path
) -> None:
    folder, reference = write_case(name, plain, tmp_path)
    ours = load_float32(folder)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.dtype == torch.int32  # held packed, not widened
    act_order = CASES[name].qc.get("desc_act", False)
    assert (qkv.perm is not None) == act_order and qkv.g_idx is None
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


def test_compressed_tensors_w4a16_matches_hf_running_it(plain: Path, tmp_path: Path) -> None:
    """llm-compressor's W4A16 scheme (symmetric, 128-column groups): HF runs the checkpoint."""
    folder = write_compressed_tensors(plain, tmp_path / "w4a16", "W4A16")
    ours = load_float32(folder)
    assert ours.model.layers[1].mlp.down_proj.scales.shape == (2, 128)  # [groups, rows]
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, reference_run(folder, PROMPTS, NEW_TOKENS), ATOL)


def test_compressed_tensors_w4a16_with_zero_points(plain: Path, tmp_path: Path) -> None:
    """W4A16_ASYM: zero points packed along the rows. transformers cannot load these (its
    compressed-tensors loader sizes the packed zero points as unpacked), so the reference is HF
    on compressed-tensors' own fake-quantized weights."""
    folder = write_compressed_tensors(plain, tmp_path / "asym", "W4A16_ASYM", group_size=64)
    reference = write_dequantized(plain, tmp_path / "ref", ct_dequantized(plain, "W4A16_ASYM", 64))
    ours = load_float32(folder)
    assert ours.model.layers[0].mlp.gate_up_proj.zeros.dtype == torch.uint8
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


def test_biases_load_beside_the_packed_weights(tmp_path: Path) -> None:
    """A model with q/k/v/o biases (Qwen2's q/k/v, Llama's attention_bias): the biases stay in
    the model's dtype next to the 4-bit weights."""
    make_hf_model(seed=3, attention_bias=True).save_pretrained(tmp_path / "plain")
    case = CASES["gptq-g64-asym-act-order"]
    folder, dequantized = write_w4a16(tmp_path / "plain", tmp_path / "q", case.make, case.qc)
    reference = write_dequantized(tmp_path / "plain", tmp_path / "ref", dequantized)
    ours = load_float32(folder)
    assert ours.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS)
    assert_matches(got, reference_run(reference, PROMPTS, NEW_TOKENS), ATOL)


def test_the_quantization_changes_the_tokens(plain: Path, tmp_path: Path) -> None:
    """The comparisons above only show a format is read if reading it as plain weights would
    fail: the 4-bit weights' logits are far from the float ones'."""
    folder, _ = write_case("gptq-g64-asym-act-order", plain, tmp_path)
    a = generate_greedy(load_float32(plain), PROMPTS[:1], 4).logits[0]
    b = generate_greedy(load_float32(folder), PROMPTS[:1], 4).logits[0]
    assert (a - b).abs().max() > 1000 * ATOL


def test_a_quantize_config_json_beside_config_json_is_read(plain: Path, tmp_path: Path) -> None:
    """Older AutoGPTQ checkpoints keep their config in quantize_config.json."""
    folder, reference = write_case("gptq-g32-sym", plain, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (folder / "config.json").write_text(json.dumps(config))
    got = generate_greedy(load_float32(folder), PROMPTS[:1], NEW_TOKENS)
    assert_matches(got, reference_run(reference, PROMPTS[:1], NEW_TOKENS), ATOL)


# ---- the layout ---------------------------------------------------------------------------------


def test_packing_round_trips_every_nibble() -> None:
    values = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    values[0, :8] = 15  # a word with its top bit set: negative as int32
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and int(packed[0, 0]) == -1
    assert torch.equal(unpack_int4(packed), values)


@pytest.mark.parametrize(("rows", "cols"), [(24, 256), (40, 576), (8, 8)])
def test_the_kernel_layout_round_trips(rows: int, cols: int) -> None:
    """tile_qweight then untile_qweight gives the loaded words back, K padded to whole blocks
    of 128 columns and cut again."""
    values = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    words = pack_int4(values)
    tiled = tile_qweight(words)
    assert tiled.shape == (-(-cols // 128) * 16, rows)
    assert torch.equal(untile_qweight(tiled, cols), words)


def test_a_tiled_word_holds_columns_16_apart() -> None:
    """Nibble i of word row 16b + j holds column 128b + 16i + j of its output row; padding
    columns hold 0."""
    values = torch.randint(1, 16, (5, 192), dtype=torch.uint8)
    tiled = tile_qweight(pack_int4(values))  # [32, 5]: two blocks, the second half padding
    nibbles = unpack_int4(tiled.reshape(-1, 1)).reshape(32, 5, 8)
    for b, j, i in [(0, 0, 0), (0, 3, 5), (0, 15, 7), (1, 2, 3)]:
        assert torch.equal(nibbles[16 * b + j, :, i], values[:, 128 * b + 16 * i + j])
    assert int(nibbles[16 + 2, 0, 4]) == 0  # column 128 + 64 + 2 = 194 > 191: padding


def test_awq_words_are_read_in_awq_order() -> None:
    """AutoAWQ's nibble i holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    q = torch.arange(16).repeat(8, 1) + torch.arange(8)[:, None] % 2  # [K=8, N=16], n + k % 2
    awq = pack_along_rows(q % 16, AWQ_ORDER)  # [K, N / 8]
    config = W4A16Config(source="awq", group_size=-1, zero_points=True)
    held = to_layout(config, "qweight", awq, "x.qweight")  # [N, K / 8]
    assert torch.equal(unpack_int4(held), (q % 16).t().to(torch.uint8))


def test_gptq_zero_points_add_one_without_wrapping() -> None:
    """GPTQ's original format stores zero - 1; readers add one back, so a stored 15 is 16."""
    stored = pack_along_rows(torch.tensor([[15, 0, 7, 3, 1, 2, 4, 5]]))
    v1 = W4A16Config(source="gptq", group_size=32, zero_points=True, zero_offset=1)
    v2 = dataclasses.replace(v1, zero_offset=0)
    assert to_layout(v1, "zeros", stored, "z").tolist() == [[16, 1, 8, 4, 2, 3, 5, 6]]
    assert to_layout(v2, "zeros", stored, "z").tolist() == [[15, 0, 7, 3, 1, 2, 4, 5]]


def test_the_memory_plan_counts_the_packed_bytes(plain: Path, tmp_path: Path) -> None:
    """The model built on the meta device holds what the loaded one holds: int32 words of 8
    values, float32 scales and uint8 zeros per group, no float weights; and, while it loads,
    each merged part's g_idx, which become one column order per layer."""
    folder, _ = write_case("gptq-g64-asym-act-order", plain, tmp_path)
    loaded = load_model(str(folder), torch.device("cpu"), torch.float32)
    with torch.device("meta"):
        meta = build_model(loaded.config)
    g_idx = sum(p.numel() * 4 for n, p in meta.named_parameters() if n.endswith("g_idx"))
    perm = sum(b.numel() * 4 for n, b in loaded.module.named_buffers() if n.endswith("perm"))
    assert module_bytes(meta) - g_idx == module_bytes(loaded.module) - perm
    qkv = meta.model.layers[0].self_attn.qkv_proj  # 256 rows (128 + 2 x 64), 128 columns
    assert (qkv.qweight.numel() * 4, qkv.scales.numel() * 4, qkv.zeros.numel()) == (
        256 * 128 // 2, 2 * 256 * 4, 2 * 256,
    )  # fmt: skip


# ---- the engine ---------------------------------------------------------------------------------


def test_the_engine_serves_an_act_order_checkpoint(plain: Path, tmp_path: Path) -> None:
    """Through the engine (scheduler, model runner, memory plan, warm-up): the harness's tokens."""
    from engine_core.llm import LLM
    from protocol.messages import SamplingParams

    folder, _ = write_case("gptq-g64-asym-act-order", plain, tmp_path)
    expected = generate_greedy(load_float32(folder), PROMPTS, NEW_TOKENS).tokens
    llm = LLM(str(folder), block_size=4, num_kv_blocks=64, max_model_len=128)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outputs] == expected


# ---- refusals -----------------------------------------------------------------------------------


def edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("gptq-g32-sym", {"bits": 3}, r"\.bits 3 is not supported"),
        ("gptq-g32-sym", {"bits": 8}, r"\.bits 8 is not supported"),
        ("gptq-g32-sym", {"quant_method": "hqq"}, "quant_method 'hqq' is not a format"),
        ("gptq-g32-sym", {"group_size": 48}, r"group_size 48 does not divide the input size"),
        ("gptq-g32-sym", {"group_size": 0}, r"group_size 0 is not -1 or a size"),
        ("gptq-g32-sym", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("gptq-g32-sym", {"dynamic": {"-:.*down": {}}}, r"\.dynamic is not supported"),
        ("gptq-g32-sym", {"lm_head": True}, r"\.lm_head: a quantized LM head"),
        ("gptq-g32-sym", {"desc_act": "yes"}, r"\.desc_act 'yes' is not true or false"),
        (
            "gptq-g32-sym",
            {"modules_in_block_to_quantize": [["self_attn.q_proj"]]},
            "modules_in_block_to_quantize leaves",
        ),  # fmt: skip
        ("awq-g64", {"version": "gemv"}, r"\.version 'gemv' is not supported"),
        ("awq-g64", {"zero_point": False}, r"\.zero_point False"),
        ("gptq-g32-sym", {"desc_act": True}, r"lacks 14 weights.*qkv_proj\.g_idx\[0\]"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(
    name: str, edit: dict, message: str, plain: Path, tmp_path: Path
) -> None:
    folder, _ = write_case(name, plain, tmp_path)
    if edit.get("desc_act") is True:  # act-order, but the checkpoint has no g_idx
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        tensors = {k: v for k, v in tensors.items() if not k.endswith("g_idx")}
        save_file(tensors, str(folder / "model.safetensors"))
    edit_config(folder, lambda qc: qc.update(edit))
    with pytest.raises(ValueError, match=message):
        load_float32(folder)


def test_a_g_idx_out_of_order_without_act_order_is_refused(plain: Path, tmp_path: Path) -> None:
    folder, _ = write_case("gptq-g64-asym-act-order", plain, tmp_path)
    edit_config(folder, lambda qc: qc.update(desc_act=False))
    with pytest.raises(ValueError, match="out of order, but quantization_config.desc_act"):
        load_float32(folder)


def test_a_g_idx_past_the_groups_without_act_order_is_named_so(plain: Path, tmp_path: Path) -> None:
    """A g_idx naming groups that do not exist is refused as that, not as an order."""
    from safetensors.torch import load_file, save_file

    folder, _ = write_case("gptq-g32-sym", plain, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = next(k for k in tensors if k.endswith("down_proj.g_idx"))
    tensors[name] = torch.full_like(tensors[name], 99)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name}' has groups outside 0\\.\\."):
        load_float32(folder)


def test_merged_parts_with_different_column_orders_are_refused(plain: Path, tmp_path: Path) -> None:
    """q, k and v (gate and up) share an input, so act-order quantizers order them alike; a
    checkpoint that does not cannot run as one merged projection."""
    case = CASES["gptq-g64-asym-act-order"]
    make = lambda w, seed: case.make(w, seed + int(w.shape[0]))  # noqa: E731 (per projection)
    folder, _ = write_w4a16(plain, tmp_path / "mixed", make, case.qc)
    with pytest.raises(ValueError, match="qkv_proj: the merged parts' g_idx differ"):
        load_float32(folder)


def test_the_quantization_flag_must_name_the_checkpoint_format(plain: Path, tmp_path: Path) -> None:
    folder, _ = write_case("awq-g64", plain, tmp_path)
    load_float32(folder, quantization="awq_marlin")  # vLLM's name for the same checkpoints
    with pytest.raises(ValueError, match="--quantization gptq does not match the checkpoint"):
        load_float32(folder, quantization="gptq")
    with pytest.raises(ValueError, match="has no quantization_config"):
        load_float32(plain, quantization="awq")


def test_random_presets_take_a_w4a16_layout() -> None:
    """`random:<preset> --quantization gptq` (the GPU benchmarks' W4A16 runs): packed random
    weights in 128-column groups, or 64 where 128 does not divide smollm2's 576 inputs."""
    from engine_core.presets import build_random_model

    model, config = build_random_model("smollm2-135m", "cpu", torch.float32, quantization="gptq")
    assert config.quantization.group_size == 64
    down = model.model.layers[0].mlp.down_proj
    assert down.qweight.shape == (576, 1536 // 8) and down.zeros.shape == (1536 // 64, 576)
    weight = dequantize(down.qweight, down.scales, down.zeros, 64)
    assert 0.015 < float(weight.std()) < 0.025  # the presets' 0.02
