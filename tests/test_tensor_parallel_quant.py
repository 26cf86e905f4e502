"""Quantized checkpoints under tensor parallelism, over gloo on the CPU in real worker processes:
each rank loads its share of the packed weights and their scales (and zero points), and TP=2
gives the greedy tokens and logprobs of the reference that TP=1 is tested against
(tests/test_w4a16_moe.py, tests/test_fp8_moe.py), so TP=1's.

- AWQ (4-bit, 32-column groups, zero points) Qwen3-MoE with a dense layer: q/k/v and gate/up
  split by output rows (their per-group scales and zero points by column), o and down by whole
  groups of input columns, every expert's width 64 into 32 per rank (gate/up rows, down's
  columns: one group); the reference is HF on the dequantized weights.
- Block-FP8 (32 x 32 blocks, dynamic activations per token and 32-column group) Qwen3-MoE:
  every expert's width split into one block per rank, head_dim 32 so that each rank's k and v
  rows are one whole row block; the reference is HF on the dequantized weights with the
  activations' round trip. Each rank's input shares are whole activation groups, so each rank
  quantizes as TP=1 does; the all-reduce's other order of sums may move a value across a
  rounding boundary now and then (tests/tp_cases.py ``assert_same_greedy_quantized``).
- A row-parallel W4A16 layer's shares (compressed-tensors; GPTQ act-order within each rank's
  columns; one group over the whole input) sum to x @ W.T of the weights the checkpoint stands
  for, a column-parallel one's (act-order over all columns) are its rows; act-order groups
  that span ranks, shapes that do not split, and quantized experts under expert parallelism
  are refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from engine_core.config import Fp8Config, W4A16Config
from engine_core.loader import load_model_config
from engine_core.models import model_config_from_hf
from engine_core.models.layers import (
    Linear,
    MergedLinear,
    RowParallelLinear,
    load_mapped_weights,
)
from engine_core.models.moe import SparseMoE
from engine_core.models.quantize import make_quantized
from engine_core.parallel import TPGroup, check_tensor_parallel
from tests.factories import tiny_hf_sizes
from tests.paged_harness import random_prompts
from tests.quant_fixtures import (
    LINEARS,
    SIZES,
    e4m3_per_token,
    gptq_tensors,
    quantize_expert_inputs,
    quantize_inputs,
)
from tests.test_fp8 import BLOCK, FORMATS, write_quantized
from tests.test_fp8_moe import MLA_LINEARS, e4m3_groups
from tests.test_w4a16_moe import ct_tensors, scaled_head, write_w4a16_moe
from tests.tp_cases import (
    assert_same_greedy,
    assert_same_greedy_quantized,
    engine_greedy,
    hf_reference,
)

NEW_TOKENS = 8
VOCAB = 256
PROMPTS = random_prompts(VOCAB, (11, 23))  # the 23-token one in two chunks beside a decode


def test_tp2_awq_qwen3_moe_matches_hf_on_the_dequantized_weights(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    make_qwen3_moe(head_dim=16, mlp_only_layers=[1]).save_pretrained(plain)
    folder, reference = write_w4a16_moe(plain, tmp_path, "awq-g32")
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    got = engine_greedy(folder, PROMPTS, NEW_TOKENS, tp=2)
    assert_same_greedy(got, hf_reference(hf, PROMPTS, NEW_TOKENS))


def make_qwen3_moe(**overrides: object) -> nn.Module:
    """4 experts of width 64, random weights, the LM head scaled so greedy choices are apart."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        **tiny_hf_sizes(VOCAB), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, norm_topk_prob=True, **overrides,
    )  # fmt: skip
    return scaled_head(AutoModelForCausalLM.from_config(config).eval(), 0)


def test_tp2_block_fp8_qwen3_moe_matches_hf(tmp_path: Path) -> None:
    fmt = FORMATS["fp8-block"]
    write_quantized(make_qwen3_moe(head_dim=32), fmt, tmp_path / "fp8", tmp_path / "ref")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    round_trip = lambda x: e4m3_per_token(x, BLOCK[1])  # noqa: E731
    quantize_inputs(hf, round_trip)
    quantize_expert_inputs(hf, round_trip)
    got = engine_greedy(tmp_path / "fp8", PROMPTS, NEW_TOKENS, tp=2)
    assert_same_greedy_quantized(got, hf_reference(hf, PROMPTS, NEW_TOKENS))


def test_tp2_deepseek_v3_block_fp8_matches_hf(tmp_path: Path) -> None:
    """DeepSeek-V3's published FP8 form (tests/test_fp8_moe.py's, TP=1) at TP=2: each rank
    takes its heads' row blocks of q_b and kv_b (kv_b dequantized after the split), its column
    blocks of o, and its width of every expert; q_a and kv_a whole. Head dims of 16 + 16 and
    v of 16 make each rank's share whole 32 x 32 blocks."""
    from tests import test_models_deepseek as deepseek

    torch.manual_seed(0)
    mla = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}
    config = deepseek.CONFIGS["v3"]()
    widths = {"moe_intermediate_size": 64, "intermediate_size": 128, "qk_head_dim": 32}
    for name, value in (mla | widths | {"head_dim": 16}).items():  # HF's derived ones too
        setattr(config, name, value)
    hf_model = scaled_head(AutoModelForCausalLM.from_config(config).eval(), 0)
    linears = LINEARS + MLA_LINEARS
    write_quantized(hf_model, FORMATS["fp8-block"], tmp_path / "fp8", tmp_path / "ref", linears)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    quantize_inputs(hf, e4m3_groups, leaves=LINEARS + MLA_LINEARS[:3])  # kv_b's input stays
    quantize_expert_inputs(hf, e4m3_groups)
    prompts = random_prompts(deepseek.VOCAB, (11, 23))
    got = engine_greedy(tmp_path / "fp8", prompts, NEW_TOKENS, tp=2)
    assert_same_greedy_quantized(got, hf_reference(hf, prompts, NEW_TOKENS))


def test_latent_attention_shares_that_are_not_whole_blocks_are_refused() -> None:
    """tests/test_models_deepseek.py's V3 (4 heads of 16 + 8 query dims, 16 + 24 latent
    up-projection dims) in 32 x 32 blocks over 2 ranks: q_b's 96 rows give each rank a block
    and a half, kv_b's 160 two and a half; named before any worker starts."""
    from tests import test_models_deepseek as deepseek

    hf = deepseek.CONFIGS["v3"]().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    config = model_config_from_hf(hf)
    fp8 = Fp8Config(weight_scales="block", prequantized=True, block=(32, 32))
    with pytest.raises(ValueError, match=r"32 x 32 blocks: .*query width .* 96 / 2, latent up"):
        check_tensor_parallel(dataclasses.replace(config, quantization=fp8), 2)


# ---- a row-parallel W4A16 layer's shares -------------------------------------------------------

ROWS, COLS, GROUP = 16, 128, 32
GPTQ_ASYM = {"source": "gptq", "zero_points": True, "zero_offset": 1}


def gptq_halves(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ act-order tensors of weight [N, K] whose groups each lie within one half of the
    columns (each half quantized in its own random order), and the weight they stand for."""
    halves = [gptq_tensors(w, GROUP, True, False, False, seed) for seed, w in
              enumerate(weight.chunk(2, dim=1))]  # fmt: skip
    (first, w0), (second, w1) = halves
    second["g_idx"] = second["g_idx"] + COLS // 2 // GROUP  # the second half's groups follow
    tensors = {name: torch.cat([first[name], second[name]]) for name in first}
    return tensors, torch.cat([w0, w1], dim=1)


def load_layer(
    tensors: dict[str, torch.Tensor], config: W4A16Config, tp: TPGroup, column: bool = False
) -> Linear:
    """Rank ``tp.rank``'s share of one W4A16 linear, through the loader: of its input columns
    (row-parallel), or with ``column`` of its output rows (a merged projection of one part)."""
    holder = nn.Module()
    holder.proj = (
        MergedLinear(COLS, [ROWS], False, tp)
        if column
        else RowParallelLinear(COLS, ROWS, False, tp)
    )
    make_quantized(holder.proj, config, "proj")
    load_mapped_weights(holder, [(f"proj.{k}", t) for k, t in tensors.items()], lambda n: (n, None))
    return holder.proj


CASES = {
    "compressed-tensors": (
        lambda w: ct_tensors(w, GROUP),
        W4A16Config(source="compressed-tensors", group_size=GROUP, zero_points=False),
    ),
    "act-order-within-ranks": (
        gptq_halves,
        W4A16Config(group_size=GROUP, act_order=True, **GPTQ_ASYM),
    ),
    "one-group": (
        lambda w: gptq_tensors(w, -1, False, False, False, 0),
        W4A16Config(group_size=-1, **GPTQ_ASYM),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_row_parallel_w4a16_shares_sum_to_the_weights_product(name: str) -> None:
    make, config = CASES[name]
    tensors, weight = make(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(2))
    shares = [load_layer(tensors, config, TPGroup(rank=rank, size=2)) for rank in (0, 1)]
    summed = sum(share.matmul(part) for share, part in zip(shares, x.chunk(2, dim=1), strict=True))
    torch.testing.assert_close(summed, F.linear(x, weight), atol=1e-4, rtol=0)
    if name == "act-order-within-ranks":  # each rank reads its columns in its own groups' order
        assert all(share.perm is not None for share in shares)


def test_column_parallel_act_order_shares_are_the_weights_rows() -> None:
    """Act-order over all the columns splits by output rows: each rank reads every column in
    the checkpoint's order and computes its half of the rows."""
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1))
    tensors, dequantized = gptq_tensors(weight, GROUP, True, False, False, 0)
    config = W4A16Config(group_size=GROUP, act_order=True, **GPTQ_ASYM)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(2))
    shares = [load_layer(tensors, config, TPGroup(rank=r, size=2), column=True) for r in (0, 1)]
    both = torch.cat([share.matmul(x) for share in shares], dim=1)
    torch.testing.assert_close(both, F.linear(x, dequantized), atol=1e-4, rtol=0)


def test_act_order_groups_across_ranks_are_refused() -> None:
    """GPTQ's act-order over all the columns: a rank's columns fall in every group."""
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1))
    tensors, _ = gptq_tensors(weight, GROUP, True, False, False, 0)
    config = W4A16Config(group_size=GROUP, act_order=True, **GPTQ_ASYM)
    with pytest.raises(ValueError, match="act-order g_idx puts some of tensor-parallel rank 1's"):
        load_layer(tensors, config, TPGroup(rank=1, size=2))


def test_shares_that_are_not_whole_groups_or_blocks_are_refused(tmp_path: Path) -> None:
    """Before any worker starts, naming the layer and its sizes: 128-column groups of o_proj's
    128 inputs over 2 ranks; 32-row blocks of the 64 k/v rows of 16-wide heads over 2 ranks."""
    LlamaConfig(**SIZES).save_pretrained(tmp_path)  # the AWQ test's sizes; no weights needed
    config = load_model_config(tmp_path)
    w4a16 = W4A16Config(source="awq", group_size=128, zero_points=True)
    with pytest.raises(ValueError, match=r"whole groups of 128 .*attention output .* 128 / 2"):
        check_tensor_parallel(dataclasses.replace(config, quantization=w4a16), 2)
    fp8 = Fp8Config(weight_scales="block", prequantized=True, block=(32, 32))
    small_heads = dataclasses.replace(config, quantization=fp8, head_dim=16)
    with pytest.raises(ValueError, match=r"32 x 32 blocks: .*key/value width .* 32 / 2"):
        check_tensor_parallel(small_heads, 2)


def test_quantized_experts_that_do_not_split_are_refused(tmp_path: Path) -> None:
    """As the layer is built: 64-column blocks of down's 32 columns per rank; whole experts per
    rank (expert parallelism), not yet tested quantized."""
    Qwen3MoeConfig(
        **tiny_hf_sizes(VOCAB), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
    ).save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    fp8 = Fp8Config(weight_scales="block", prequantized=True, block=(16, 64), source="test")
    with pytest.raises(ValueError, match=r"width \(64\) into 32 columns .* 64-column blocks"):
        SparseMoE(config, TPGroup(rank=0, size=2)).make_fp8(fp8)
    with pytest.raises(ValueError, match="FP8 experts under --enable-expert-parallel"):
        SparseMoE(config, TPGroup(rank=0, size=2, expert_parallel=True)).make_fp8(fp8)
