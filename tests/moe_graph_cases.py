"""The check the quantized-experts GPU tests share (FP8, INT8, W4A16): a tiny MoE checkpoint's
engine on CUDA decodes through CUDA graphs the greedy tokens it decodes eagerly, its MoE layers
held in the format and capturable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine_core.llm import LLM
from engine_core.models.moe import SparseMoE
from protocol.messages import SamplingParams

NEW_TOKENS = 16


def assert_graphs_decode_as_eagerly(
    folder: Path, prompts: list[list[int]], held: Callable[[SparseMoE], bool]
) -> None:
    """The engine's greedy tokens for ``prompts`` from graphs equal its eager ones; its MoE
    layers (there must be some) all hold the format under test (``held``) and are capturable."""

    def run(**engine: object) -> list[list[int]]:
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=128,
                  num_kv_blocks=64, **engine)  # fmt: skip
        try:
            moe = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
            assert moe and all(held(m) for m in moe)
            assert all(getattr(m, "cuda_graph_safe", True) for m in moe)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            return [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]
        finally:
            llm.engine.shutdown()

    graphs = run()
    assert [len(tokens) for tokens in graphs] == [NEW_TOKENS] * len(prompts)
    assert graphs == run(enforce_eager=True)
