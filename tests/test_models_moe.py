"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against HF transformers on the same weights.

Tiny random HF models are saved with ``save_pretrained`` and loaded through our loader; greedy
generation over the paged KV cache must give HF ``generate(do_sample=False)``'s tokens, with the
logits behind them within atol 1e-4 (float32), for whole-batch prefills, chunked prefills mixed
with decodes, and a prefill that starts from another sequence's cached blocks. The MoE layer is
also checked alone against a dense computation written out here: every expert on every token,
weighted by the top-k softmax mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from engine_core.config import ModelConfig
from engine_core.loader import iter_checkpoint, load_model_config
from engine_core.models import build_model, model_config_from_hf
from engine_core.models.layers import load_mapped_weights
from engine_core.models.moe import SparseMoE, experts_reference, map_moe_name, route
from engine_core.parallel import TPGroup
from tests.factories import tiny_hf_sizes
from tests.paged_harness import (
    GreedyResult,
    HFCase,
    PagedRunner,
    Sequence,
    assert_matches,
    generate_greedy,
    hf_greedy,
    load_float32,
    random_prompts,
    randomize,
    save_hf_case,
)

ATOL = 1e-4
NEW_TOKENS = 32
VOCAB = 320
SIZES = tiny_hf_sizes(VOCAB)
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "mixtral": lambda: MixtralConfig(**SIZES, num_local_experts=6, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SIZES, **QWEN3_MOE, head_dim=32, norm_topk_prob=True),
    "qwen3_moe_unnormalised": lambda: Qwen3MoeConfig(**SIZES, **QWEN3_MOE, norm_topk_prob=False),
    # Layers 1 and 3 are sparse by decoder_sparse_step 2, and layer 3 dense by mlp_only_layers:
    # one MoE layer among three dense ones.
    "qwen3_moe_dense_layers": lambda: Qwen3MoeConfig(
        **(SIZES | {"num_hidden_layers": 4}),
        **QWEN3_MOE,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
}
# Lengths 5, 11 and 23: partial, multiple and many blocks of 4.
PROMPTS = random_prompts(VOCAB, (5, 11, 23))


def make_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Every parameter random, norm scales near 1; the router's weights as random as the rest,
    so tokens spread over the experts (test_router_spreads_tokens checks)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    randomize(model, seed)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFCase:
    folder = tmp_path_factory.mktemp(request.param)
    return save_hf_case(request.param, make_hf_model(request.param), PROMPTS, folder, NEW_TOKENS)


def test_greedy_matches_hf(case: HFCase) -> None:
    """All prompts prefilled in one flattened batch, then decoded together."""
    got = generate_greedy(load_float32(case.folder), PROMPTS, NEW_TOKENS, block_size=4)
    assert_matches(got, case.reference, ATOL)


def test_chunked_prefill_mixed_with_decodes_matches_hf(case: HFCase) -> None:
    """Staggered starts and 5-token prefill chunks: one forward mixes a prompt chunk with other
    sequences' decodes (so the experts see tokens of several sequences at once)."""
    got = generate_greedy(
        load_float32(case.folder),
        PROMPTS,
        NEW_TOKENS,
        block_size=4,
        prefill_chunk=5,
        stagger=3,
        shuffle_blocks=True,
    )
    assert_matches(got, case.reference, ATOL)


def test_prefix_cached_prefill_matches_hf(case: HFCase) -> None:
    """A prompt sharing its first 5 blocks with an earlier one prefills only its tail, reading
    the shared prefix's K/V from the earlier sequence's blocks."""
    prompt = PROMPTS[2][:20] + [7, 8, 9]
    got = generate_after_cached_prefix(load_float32(case.folder), PROMPTS[2], prompt, NEW_TOKENS)
    ref = hf_greedy(case.hf_model, prompt, NEW_TOKENS)
    assert got.tokens[0] == ref.tokens[0]
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=ATOL, rtol=0)


def generate_after_cached_prefix(
    model: torch.nn.Module, first: list[int], prompt: list[int], max_new_tokens: int
) -> GreedyResult:
    """Prefill ``first``, then greedy-decode ``prompt`` starting from ``first``'s full blocks
    that hold the tokens the two share (as the prefix cache hands them out)."""
    runner = PagedRunner(model, block_size=4)
    cached = Sequence(list(first))
    runner.step([(cached, len(first))])
    shared = next(i for i, (a, b) in enumerate(zip(first, prompt, strict=False)) if a != b) // 4
    seq = Sequence(list(prompt), block_ids=cached.block_ids[:shared], num_computed=4 * shared)
    tokens, rows = [], []
    while len(tokens) < max_new_tokens:
        row = runner.step([(seq, seq.num_pending)])[0]
        tokens.append(int(row.argmax()))
        seq.token_ids.append(tokens[-1])
        rows.append(row)
    return GreedyResult(tokens=[tokens], logits=[torch.stack(rows)])


def test_router_spreads_tokens(case: HFCase) -> None:
    """The comparisons above prove the experts only if tokens reach many of them: over the
    prompts, every MoE layer routes tokens to most experts, and tokens disagree on their top-k."""
    model = load_float32(case.folder)
    chosen: list[torch.Tensor] = []  # [T, K] expert ids of each MoE layer
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.gate.register_forward_hook(
                lambda _m, _a, logits, k=layer.mlp.top_k: chosen.append(logits.topk(k).indices)
            )
    generate_greedy(model, PROMPTS, 1)  # one forward: the three prompts' prefills
    num_experts = model.config.num_experts
    assert chosen, "no MoE layer ran"
    for ids in chosen:
        assert ids.unique().numel() >= num_experts - 1
        assert ids.sort(dim=-1).values.unique(dim=0).shape[0] > 3


def test_both_checkpoint_layouts_load_alike(tmp_path: Path) -> None:
    """transformers 5 can also write the experts stacked (its in-memory layout): it loads into
    the same weights as the per-expert layout the Hub has."""
    for name in ("mixtral", "qwen3_moe_dense_layers"):
        hf_model = make_hf_model(name)
        hf_model.save_pretrained(tmp_path / name / "per_expert")
        hf_model.save_pretrained(tmp_path / name / "stacked", save_original_format=False)
        stacked_names = [n for n, _ in iter_checkpoint(tmp_path / name / "stacked")]
        assert any(n.endswith("experts.gate_up_proj") for n in stacked_names)
        per_expert = load_float32(tmp_path / name / "per_expert").state_dict()
        stacked = load_float32(tmp_path / name / "stacked").state_dict()
        assert per_expert.keys() == stacked.keys()
        for key, value in per_expert.items():
            assert torch.equal(value, stacked[key]), key


def test_topk_renormalisation_is_exercised(tmp_path: Path) -> None:
    """norm_topk_prob must change the output, or the unnormalised case proves nothing."""
    hf_model = make_hf_model("qwen3_moe_unnormalised")
    hf_model.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert not config.norm_topk_prob
    wrong = build_model(dataclasses.replace(config, norm_topk_prob=True)).eval()
    wrong.load_weights(iter_checkpoint(tmp_path))
    got = generate_greedy(wrong, PROMPTS[-1:], 4)
    ref = hf_greedy(hf_model, PROMPTS[-1], 4)
    assert (got.logits[0] - ref.logits[0]).abs().max() > 100 * ATOL


# ---- the layer alone ---------------------------------------------------------------------------


def dense_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """Every expert on every token, weighted by the softmax masked to each token's top-k."""
    probs = torch.softmax(x @ router.T, dim=-1)  # [T, E]
    kth = probs.topk(top_k, dim=-1).values[:, -1:]  # [T, 1]
    mask = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if renormalize:
        mask = mask / mask.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].T).chunk(2, dim=-1)
        out += mask[:, e : e + 1] * ((F.silu(gate) * up) @ w2[e].T)
    return out


def moe_config(experts: int, top_k: int, renormalize: bool) -> ModelConfig:
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        **SIZES,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": 24,
        "norm_topk_prob": renormalize,
    }
    return model_config_from_hf(hf)


@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(8, 2, True), (5, 3, False)])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_layer_matches_dense_computation(
    experts: int, top_k: int, renormalize: bool, num_tokens: int
) -> None:
    torch.manual_seed(num_tokens)
    layer = SparseMoE(moe_config(experts, top_k, renormalize))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    x = torch.randn(num_tokens, SIZES["hidden_size"])
    with torch.no_grad():
        got = layer(x)
    want = dense_moe(x, layer.gate.weight, layer.w13, layer.w2, top_k, renormalize)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_route_picks_and_renormalises_the_top_k() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[1, 2]] / probs[[1, 2]].sum())


def test_reference_handles_experts_without_tokens() -> None:
    """Experts nobody picked are skipped; a token's repeated expert slots are not merged."""
    x = torch.randn(3, 8)
    w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    ids = torch.tensor([[2, 0], [2, 0], [0, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [1.0, 0.0]])
    got = experts_reference(x, w13, w2, weights, ids)

    def expert(e: int, t: int) -> torch.Tensor:
        gate, up = (x[t] @ w13[e].T).chunk(2)
        return (F.silu(gate) * up) @ w2[e].T

    want = torch.stack(
        [sum(weights[t, k] * expert(int(ids[t, k]), t) for k in range(2)) for t in range(3)]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def per_expert_weights(layer: SparseMoE) -> list[tuple[str, torch.Tensor]]:
    """``layer``'s experts as a Hub checkpoint (Qwen3-MoE names) holds them."""
    gates, ups = layer.w13.detach().chunk(2, dim=1)
    out = []
    for e in range(layer.w13.shape[0]):
        prefix = f"layers.0.mlp.experts.{e}"
        out += [(f"{prefix}.gate_proj.weight", gates[e]), (f"{prefix}.up_proj.weight", ups[e])]
        out.append((f"{prefix}.down_proj.weight", layer.w2.detach()[e]))
    return out


def stacked_weights(layer: SparseMoE) -> list[tuple[str, torch.Tensor]]:
    return [
        ("layers.0.mlp.experts.gate_up_proj", layer.w13.detach()),
        ("layers.0.mlp.experts.down_proj", layer.w2.detach()),
    ]


def load_rank(
    config: ModelConfig, rank: int, weights: list[tuple[str, torch.Tensor]], router: torch.Tensor
) -> SparseMoE:
    """Rank ``rank`` of 2's layer, loaded through the model loader's path."""
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = SparseMoE(config, TPGroup(rank=rank, size=2))
    weights = [*weights, ("layers.0.mlp.gate.weight", router)]
    load_mapped_weights(holder, weights, lambda name: map_moe_name(name) or (name, None))
    return holder.layers[0].mlp


@pytest.mark.parametrize("layout", [per_expert_weights, stacked_weights])
def test_tensor_parallel_slices_sum_to_the_whole_layer(
    layout: Callable[[SparseMoE], list[tuple[str, torch.Tensor]]],
) -> None:
    """Each of 2 ranks loads half of every expert's width from either checkpoint layout; their
    partial outputs (what the all-reduce sums) add up to the whole layer's."""
    torch.manual_seed(0)
    config = moe_config(6, 2, True)
    whole = SparseMoE(config)
    with torch.no_grad():
        for param in whole.parameters():
            param.normal_(0.0, 0.3)
    x = torch.randn(9, SIZES["hidden_size"])
    weights, ids = route(whole.gate(x), 2, True)
    want = experts_reference(x, whole.w13, whole.w2, weights, ids)
    ranks = [load_rank(config, r, layout(whole), whole.gate.weight.detach()) for r in (0, 1)]
    assert ranks[0].w13.shape == (6, 24, SIZES["hidden_size"])  # half of 2 x 24
    got = sum(experts_reference(x, r.w13, r.w2, weights, ids) for r in ranks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- configs refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shared_expert_intermediate_size", 64),
        ("routed_scaling_factor", 2.5),
        ("scoring_func", "sigmoid"),
    ],
)
def test_unsupported_moe_fields_are_refused(field: str, value: object) -> None:
    hf = CONFIGS["qwen3_moe"]().to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"{field}={value!r} is not supported"):
        model_config_from_hf(hf)


def test_top_k_beyond_the_experts_is_refused() -> None:
    hf = CONFIGS["mixtral"]().to_dict() | {"num_experts_per_tok": 7}
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(7\) must be between 1 and"):
        model_config_from_hf(hf)


def test_qwen2_moe_is_not_taken_for_qwen3_moe() -> None:
    hf = CONFIGS["qwen3_moe"]().to_dict() | {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
    }
    with pytest.raises(ValueError, match="unsupported model architecture"):
        model_config_from_hf(hf)


def test_config_fields() -> None:
    mixtral = model_config_from_hf(CONFIGS["mixtral"]().to_dict())
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (6, 2)
    assert mixtral.moe_intermediate_size == SIZES["intermediate_size"]
    assert mixtral.norm_topk_prob and not mixtral.qk_norm and not mixtral.has_dense_mlp
    qwen = model_config_from_hf(CONFIGS["qwen3_moe_dense_layers"]().to_dict())
    assert qwen.qk_norm and qwen.norm_topk_prob
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    # A Hub config says num_experts where transformers 5 writes num_local_experts.
    hub = CONFIGS["qwen3_moe"]().to_dict()
    hub["num_experts"] = hub.pop("num_local_experts")
    assert model_config_from_hf(hub).num_experts == 8


# ---- benchmark presets -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "experts", "top_k", "width"),
    [("qwen3-30b-a3b", 128, 8, 768), ("mixtral-8x7b", 8, 2, 14336)],
)
def test_moe_presets_have_the_real_shapes(name: str, experts: int, top_k: int, width: int) -> None:
    """Our model of each preset has exactly the parameters transformers builds from the same
    config.json (on the meta device: nothing allocated), with the real expert counts."""
    from transformers import AutoConfig

    from engine_core.presets import PRESETS, hf_config

    config = PRESETS[name]
    assert (config.num_experts, config.num_experts_per_tok) == (experts, top_k)
    assert config.moe_intermediate_size == width and config.vocab_size == 49152
    hf = hf_config(name)
    peer_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        ours = build_model(config)
        peer = AutoModelForCausalLM.from_config(peer_config)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in peer.parameters())
    assert ours.model.layers[0].mlp.w13.shape == (experts, 2 * width, config.hidden_size)
