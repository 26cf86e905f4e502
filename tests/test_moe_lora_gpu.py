"""GPU tests of LoRA on the MoE experts (engine_core/lora/triton_moe.py inside the fused MoE):
the kernels against the torch reference (lora/layers.py lora_experts) at qwen3-30b-a3b's
layer shape over eight adapters and the base model, bf16; and a tiny Qwen3-MoE engine with CUDA
graphs: adapters of the experts (and of attention) mixed with the base model in one batch give
HF + PEFT's greedy tokens through the decode graphs, and the eager engine's.

    .venv/bin/python -m pytest -q tests/test_moe_lora_gpu.py
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.llm import LLM  # noqa: E402
from engine_core.lora.layers import lora_experts  # noqa: E402
from engine_core.lora.triton_moe import ExpertLora  # noqa: E402
from engine_core.models.fused_moe import fused_moe  # noqa: E402
from engine_core.models.moe import route  # noqa: E402
from protocol.messages import LoraRef, SamplingParams  # noqa: E402
from tests.lora_fixtures import count_graph_replays, peft_greedy, write_moe_case  # noqa: E402

CUDA = torch.device("cuda")
PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9, 10], [200, 31, 77]]
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_kernels_match_the_reference_at_qwen3_30b_a3b_shape(tokens: int) -> None:
    experts, hidden, inter, top_k, slots, rank = 128, 2048, 768, 8, 8, 16
    gen = torch.Generator(device=CUDA).manual_seed(tokens)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=CUDA) * std).to(torch.bfloat16)

    x = randn(tokens, hidden, std=1.0)
    moe = SimpleNamespace(
        w13=randn(experts, 2 * inter, hidden, std=0.02), w2=randn(experts, hidden, inter, std=0.02)
    )
    lora = SimpleNamespace(
        a13=randn(slots, experts, rank, hidden, std=0.02),
        b13=randn(slots, experts, 2 * inter, rank, std=0.02),
        a2=randn(slots, experts, rank, inter, std=0.02),
        b2=randn(slots, experts, hidden, rank, std=0.02),
    )
    weights, ids = route(torch.randn(tokens, experts, generator=gen, device=CUDA), top_k, True)
    token_slots = ((torch.arange(tokens, device=CUDA) % (slots + 1)) - 1).to(torch.int32)
    if tokens == 1:
        token_slots[0] = 3
    deltas = ExpertLora(lora.a13, lora.b13, lora.a2, lora.b2, token_slots, top_k)
    got = fused_moe(x, moe.w13, moe.w2, weights, ids, deltas=deltas)
    want = lora_experts(x, moe, weights, ids, token_slots, lora)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    plain = fused_moe(x, moe.w13, moe.w2, weights, ids)
    assert (got - plain).abs().amax() > 1e-2  # the adapters are in


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_moe_case(tmp_path_factory.mktemp("moe_lora_gpu"))


def generate(llm: LLM, case: dict[str, Path], jobs: list[tuple[str | None, int]]) -> list:
    loras = [None if name is None else LoraRef(name, str(case[name])) for name, _ in jobs]
    out = llm.generate([PROMPTS[i] for _, i in jobs], GREEDY, detokenize=False, lora=loras)
    return [o.token_ids for o in out]


def test_graphs_with_expert_adapters_give_peft_and_eager_tokens(
    case: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    replays = count_graph_replays(monkeypatch)
    names: list[str | None] = ["experts", None, "both"]
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
    want = [
        peft_greedy(case["base"], None if n is None else case[n], PROMPTS[i], NEW_TOKENS)
        for n, i in jobs
    ]
    results = {}
    for eager in (False, True):
        llm = LLM(
            str(case["base"]), device="cuda", dtype="float32", block_size=16, num_kv_blocks=128,
            max_model_len=128, max_num_seqs=16, enable_lora=True, max_loras=2,
            max_lora_rank=8, enforce_eager=eager,
        )  # fmt: skip
        try:
            assert (llm.engine.runner.graph_runner is None) == eager
            results[eager] = generate(llm, case, jobs)
        finally:
            llm.engine.shutdown()
    assert results[False] == want
    assert results[True] == want
    assert replays, "no step replayed a graph"
