"""Expert parallelism's all-to-all dispatch and combine, at the layer: N real processes over gloo
each hold 1/N of a random MoE layer's experts and route their own slice of the tokens; every
rank's output equals the whole layer's computed densely in one process (every expert on every
token, masked to the top-k), and each rank's experts receive exactly the (token, expert) pairs
routed to them, not every token.

Uneven slices: 7 tokens over 2 ranks (4 + 3), 5 over 3 (2, 2, 1), 5 over 4 (2, 2, 1 and a rank
with no token), 1 over 2 (a decode: rank 1 routes nothing but still serves its experts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_core.models.expert_dispatch import token_slice
from engine_core.models.moe import SparseMoE, route
from engine_core.parallel import TPGroup
from tests.expert_dispatch_ranks import WholeWeights, rank_layer, run_ranks
from tests.test_models_moe import SIZES, dense_moe, moe_config

EXPERTS, TOP_K = 12, 3  # 12 experts split over 2, 3 and 4 ranks


def whole_layer() -> SparseMoE:
    """The random layer (fixed seed) that the ranks split and the dense reference runs whole."""
    torch.manual_seed(0)
    layer = SparseMoE(moe_config(EXPERTS, TOP_K, True))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return layer


def tokens(num_tokens: int) -> torch.Tensor:
    return torch.randn(num_tokens, SIZES["hidden_size"], generator=torch.Generator().manual_seed(1))


def layer_weights(layer: SparseMoE) -> WholeWeights:
    """What the ranks copy their share from (handed to them: they build no layer of their own)."""
    return layer.gate.weight.detach(), layer.w13.detach(), layer.w2.detach()


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
CASES = [(2, 7, "cpu"), (3, 5, "cpu"), (4, 5, "cpu"), (2, 1, "cpu")]
# The same over NCCL, the experts through the fused kernels: written, not yet run (no machine
# with two GPUs has been lent).
CASES += [pytest.param(2, 7, "cuda", marks=[pytest.mark.gpu, TWO_GPUS])]


@pytest.mark.parametrize(("size", "num_tokens", "device_type"), CASES)
def test_all_to_all_layer_equals_the_whole_layer(
    size: int, num_tokens: int, device_type: str, tmp_path: Path
) -> None:
    whole, x = whole_layer(), tokens(num_tokens)
    with torch.no_grad():
        want = dense_moe(x, whole.gate.weight, whole.w13, whole.w2, TOP_K, True)
        _, ids = route(whole.gate(x), TOP_K, True)
    config = moe_config(EXPERTS, TOP_K, True)
    results = run_ranks(size, config, layer_weights(whole), x, tmp_path, device_type=device_type)
    for result in results:  # every rank ends with every token's output
        torch.testing.assert_close(result["out"], want, atol=1e-5, rtol=1e-5)
    # Each expert's owner ran it over exactly the pairs routed to it: T*K rows in all, where
    # the all-reduce form ran every rank's experts over all T tokens.
    received = torch.cat([r["received"] for r in results])
    assert received.tolist() == torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    assert received.sum() == num_tokens * TOP_K


def test_a_rank_that_receives_no_rows(tmp_path: Path) -> None:
    """Every pair routed to rank 0's experts: rank 1 runs none, and both still agree on the
    output, which a per-token loop over the same routing gives."""
    whole, x = whole_layer(), tokens(6)
    local = EXPERTS // 2
    with torch.no_grad():
        weights, ids = route(whole.gate(x), TOP_K, True)
        want = per_token_moe(x, whole.w13, whole.w2, weights, ids % local)
    config = moe_config(EXPERTS, TOP_K, True)
    results = run_ranks(2, config, layer_weights(whole), x, tmp_path, to_zero=True)
    assert results[1]["received"].sum() == 0
    assert results[0]["received"].sum() == 6 * TOP_K
    for result in results:
        torch.testing.assert_close(result["out"], want, atol=1e-5, rtol=1e-5)


def per_token_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum over k of weights[t, k] * SwiGLU expert ids[t, k] (x[t]), one token at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (w2[ids[t, k]] @ (F.silu(gate) * up))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows", [1, 9, 40])
def test_received_rows_through_the_fused_kernels(num_rows: int) -> None:
    """What a rank runs over the rows it received (each row one local expert, weight one): on
    CUDA the fused kernels in bf16, close to a per-row loop in float32."""
    tp = TPGroup(rank=1, size=2, expert_parallel=True)
    layer = rank_layer(moe_config(EXPERTS, TOP_K, True), layer_weights(whole_layer()), tp)
    layer = layer.to("cuda", torch.bfloat16)
    rows = tokens(num_rows).to("cuda", torch.bfloat16)
    experts = torch.randint(0, EXPERTS // 2, (num_rows,), device="cuda")
    with torch.no_grad():
        got = layer.run_local_experts(rows, experts).float()
        ones = torch.ones((num_rows, 1), device="cuda")
        w13, w2 = layer.w13.float(), layer.w2.float()
        want = per_token_moe(rows.float(), w13, w2, ones, experts[:, None])
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_token_slices_cover_the_tokens_in_order() -> None:
    for size, num_tokens in [(2, 7), (3, 5), (4, 5), (4, 1), (2, 0)]:
        slices = [token_slice(num_tokens, r, size) for r in range(size)]
        covered = [t for s in slices for t in range(num_tokens)[s]]
        assert covered == list(range(num_tokens))
    assert [token_slice(5, r, 4) for r in range(4)] == [
        slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)
    ]  # fmt: skip
