"""The experts' LoRA kernels (engine_core/lora/triton_moe.py) inside the fused MoE, on the CPU
through Triton's interpreter, against the torch reference (lora/layers.py lora_experts): tokens
of three adapters and of the base model interleaved, ranks 4 and 16 in slots of rank 16, 4 and 8
experts, top-2, a single token (the one-slot-a-block path) and batches over several row blocks.

Skipped unless ``TRITON_INTERPRET=1`` (and triton importable; it is not in the main venv):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/triton-site \\
        .venv/bin/python -m pytest tests/test_moe_lora_interpreted.py -q
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.lora.layers import lora_experts  # noqa: E402
from engine_core.lora.triton_moe import ExpertLora  # noqa: E402
from engine_core.models.fused_moe import fused_moe  # noqa: E402
from engine_core.models.moe import route  # noqa: E402

HIDDEN, INTER, MAX_RANK, ADAPTERS, TOP_K = 64, 32, 16, 3, 2


def adapter_slots(gen: torch.Generator, experts: int, ranks: list[int]) -> SimpleNamespace:
    """a13/b13/a2/b2 for ADAPTERS slots, slot i of rank ranks[i] (zeros past it)."""

    def pair(inp: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.zeros(ADAPTERS, experts, MAX_RANK, inp)
        b = torch.zeros(ADAPTERS, experts, out, MAX_RANK)
        for slot, rank in enumerate(ranks):
            a[slot, :, :rank] = torch.randn(experts, rank, inp, generator=gen) * 0.3
            b[slot, :, :, :rank] = torch.randn(experts, out, rank, generator=gen) * 0.3
        return a, b

    a13, b13 = pair(HIDDEN, 2 * INTER)
    a2, b2 = pair(INTER, HIDDEN)
    return SimpleNamespace(a13=a13, b13=b13, a2=a2, b2=b2)


@pytest.mark.parametrize(
    ("experts", "tokens", "ranks"),
    [(4, 1, [4, 16, 16]), (8, 7, [16, 4, 8]), (8, 40, [4, 16, 4])],
)
def test_fused_moe_with_expert_lora_matches_the_torch_reference(
    experts: int, tokens: int, ranks: list[int]
) -> None:
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    moe = SimpleNamespace(
        w13=torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.2,
        w2=torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.2,
    )
    lora = adapter_slots(gen, experts, ranks)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), TOP_K, True)
    # every adapter and the base model, interleaved (a single token: adapter 1)
    token_slots = (torch.arange(tokens, dtype=torch.int32) % (ADAPTERS + 1)) - 1
    if tokens == 1:
        token_slots[0] = 1
    deltas = ExpertLora(lora.a13, lora.b13, lora.a2, lora.b2, token_slots, TOP_K)

    got = fused_moe(x, moe.w13, moe.w2, weights, ids, deltas=deltas)
    want = lora_experts(x, moe, weights, ids, token_slots, lora)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the adapters change what they touch, and only that: base rows are the plain fused MoE's
    plain = fused_moe(x, moe.w13, moe.w2, weights, ids)
    base = token_slots < 0
    torch.testing.assert_close(got[base], plain[base], atol=1e-5, rtol=1e-5)
    assert ((got - plain)[~base].abs().amax(dim=1) > 1e-2).all()


def test_an_engine_whose_experts_run_the_kernels_gives_peft_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen3-MoE on the CPU with the experts' LoRA kernels in place of the torch loop (as
    on CUDA): an adapter of the experts, one of the experts plus attention and the base model in
    one batch each get HF + PEFT's greedy tokens."""
    from engine_core.llm import LLM
    from engine_core.lora import layers
    from protocol.messages import LoraRef, SamplingParams
    from tests.lora_fixtures import peft_greedy, write_moe_case

    folders = write_moe_case(tmp_path)
    base = folders["base"]
    jobs: list[tuple[str | None, list[int]]] = [
        ("experts", [5, 17, 42, 99, 3]), (None, [7, 8, 9, 10]), ("both", [200, 31, 77]),
    ]  # fmt: skip
    new = 4
    want = [peft_greedy(base, None if n is None else folders[n], p, new) for n, p in jobs]
    assert want[0] != peft_greedy(base, None, jobs[0][1], new)
    called: list[int] = []
    fused = ExpertLora.gate_up

    def counted(self: ExpertLora, *args: Any) -> torch.Tensor:
        called.append(1)
        return fused(self, *args)

    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    monkeypatch.setattr(ExpertLora, "gate_up", counted)
    llm = LLM(
        str(base), block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    try:
        refs = [None if n is None else LoraRef(n, str(folders[n])) for n, _ in jobs]
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        out = llm.generate([p for _, p in jobs], params, detokenize=False, lora=refs)
        assert [o.token_ids for o in out] == want
    finally:
        llm.engine.shutdown()
    assert called  # the kernels ran, not the torch loop
