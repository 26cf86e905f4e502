"""CUDA graphs with several KV layer groups and with linear-attention state slots, on a GPU: tiny
random Gemma 3 (a full group beside a sliding-window one), Llama 4 (a full group beside chunked
ones) and Qwen3-Next (gated DeltaNet state slots beside a full group) through the engine on CUDA
with graphs on give HF transformers' greedy tokens, batched, chunked and preempted, and every
decode step of the run replayed a graph (counted per forward); the prompt steps of Gemma 3 and
Llama 4 replay prefill graphs too, Qwen3-Next's run eagerly. And the decodes' in-place delta
rule kernel against the torch step on CUDA. The CPU half (the staged buffers, the kernel under
Triton's interpreter) is tests/test_graph_groups.py::

    .venv/bin/python -m pytest tests/test_graph_groups_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.forward_context import StateRows  # noqa: E402
from engine_core.llm import LLM  # noqa: E402
from engine_core.model_runner import ModelInputs  # noqa: E402
from engine_core.models import model_config_from_hf  # noqa: E402
from engine_core.models.delta_rule_triton import decode_step_in_place  # noqa: E402
from engine_core.models.qwen3_next import GatedDeltaNet  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests import test_kv_groups_engine, test_models_llama4  # noqa: E402
from tests.paged_harness import hf_greedy, random_prompts, randomize  # noqa: E402
from tests.test_models_qwen3_next import VOCAB as QWEN_VOCAB  # noqa: E402
from tests.test_models_qwen3_next import hf_dict, tiny_config  # noqa: E402

CUDA = torch.device("cuda")
gemma = test_kv_groups_engine.gemma  # the fixture: the random Gemma 3 saved for HF and us
llama4 = test_models_llama4.llama4  # and the random Llama 4 (chunks of 16, a NoPE layer)
NEW_TOKENS = 12


def record_steps(llm: LLM) -> list[tuple[bool, bool]]:
    """A list each forward of ``llm``'s runner appends to: (the step is decode-only, it
    replayed a CUDA graph)."""
    runner = llm.engine.runner
    assert runner.graph_runner is not None, "the engine captured no CUDA graphs"
    steps: list[tuple[bool, bool]] = []
    replays: list[int] = []
    graph_run, forward = runner.graph_runner.run, runner._forward

    def counting_run(*args: Any, **kwargs: Any) -> torch.Tensor:
        replays.append(1)
        return graph_run(*args, **kwargs)

    def recording_forward(inputs: ModelInputs) -> torch.Tensor:
        before = len(replays)
        out = forward(inputs)
        steps.append((inputs.meta.is_decode_only, len(replays) > before))
        return out

    runner.graph_runner.run = counting_run  # type: ignore[method-assign]
    runner._forward = recording_forward  # type: ignore[method-assign]
    return steps


def generate_with_graphs(
    folder: Path, prompts: list[list[int]], prompt_graphs: bool, **config: Any
) -> list[list[int]]:
    """Greedy tokens of the engine on CUDA with graphs on (float32), checking that every decode
    step replayed a graph and the prompt steps did (``prompt_graphs``) or did not, that the pool
    preempted, and that every block and slot came back."""
    llm = LLM(str(folder), device="cuda", dtype="float32", **config)
    try:
        steps = record_steps(llm)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, detokenize=False)
        decodes = [replayed for decode, replayed in steps if decode]
        prompt_steps = [replayed for decode, replayed in steps if not decode]
        assert len(decodes) >= NEW_TOKENS and all(decodes), steps
        assert prompt_steps and all(r == prompt_graphs for r in prompt_steps), steps
        assert llm.engine.scheduler.counts().preemptions > 0
        llm.engine.scheduler.block_manager.check_integrity()
        return [o.token_ids for o in outs]
    finally:
        llm.engine.shutdown()


def test_gemma3_decodes_replay_graphs_with_hf_tokens(gemma: tuple[Path, torch.nn.Module]) -> None:
    """Seven groups' worth of tables in one graph: a full and a window group of 64 tokens, three
    prompts past the window in chunks of 48 beside decodes, a pool that preempts."""
    folder, hf_model = gemma
    prompts = random_prompts(test_kv_groups_engine.VOCAB, (150, 210, 97))
    want = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    got = generate_with_graphs(
        folder, prompts, True, block_size=test_kv_groups_engine.BLOCK, num_kv_blocks=100,
        max_model_len=512, max_num_batched_tokens=48, max_num_seqs=3,
    )  # fmt: skip
    assert got == want


def test_llama4_decodes_replay_graphs_with_hf_tokens(llama4: tuple[Path, torch.nn.Module]) -> None:
    """A full group and chunked groups (chunks of 16): prompts past two chunks in steps of 20
    tokens, decodes that enter new chunks (whose tables lose every block before it), preempted."""
    folder, hf_model = llama4
    prompts = random_prompts(test_models_llama4.VOCAB, (61, 83, 50))
    want = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    got = generate_with_graphs(
        folder, prompts, True, block_size=4, num_kv_blocks=60, max_model_len=112,
        max_num_batched_tokens=20, max_num_seqs=4,
    )  # fmt: skip
    assert got == want


def test_qwen3_next_decodes_replay_graphs_with_hf_tokens(tmp_path: Path) -> None:
    """State slots in the decode graphs: four prompts (one of 5 tokens) on three slots, the
    longest in chunks of 23, preempted (a slot given back and taken again from zero); three rows
    of a four-row graph leave one padding row, whose update lands in the padding slot."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(linear_key_head_dim=16, linear_value_head_dim=16)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    randomize(hf_model, 0)
    hf_model.save_pretrained(tmp_path)
    hf_model.to(CUDA)
    prompts = random_prompts(QWEN_VOCAB, (150, 210, 97, 5))
    want = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in prompts]
    got = generate_with_graphs(
        tmp_path, prompts, False, block_size=16, num_kv_blocks=24, max_model_len=384,
        max_num_batched_tokens=23, max_num_seqs=3,
    )  # fmt: skip
    assert got == want


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_decode_step_in_place_matches_the_torch_step_on_cuda(
    dtype: torch.dtype, tol: float
) -> None:
    """Qwen3-Next-80B's linear-attention head shapes (16 key heads of 128, 32 value heads of
    128) on 9 rows out of order over 16 slots: the kernel's outputs and states against
    GatedDeltaNet's torch step, slots no row names untouched."""
    overrides = {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                 "linear_key_head_dim": 128, "linear_value_head_dim": 128}  # fmt: skip
    layer = GatedDeltaNet(model_config_from_hf(hf_dict(**overrides)))
    la = layer.la
    gen = torch.Generator(device=CUDA).manual_seed(0)
    conv_shape, state_shape = layer.state_shapes(16)
    states = (torch.randn(state_shape, generator=gen, device=CUDA) * 0.3).to(dtype)
    mixed = torch.randn(12, la.conv_dim, generator=gen, device=CUDA).to(dtype)
    g = -torch.rand(12, la.num_value_heads, generator=gen, device=CUDA)
    beta = torch.rand(12, la.num_value_heads, generator=gen, device=CUDA).to(dtype)
    rows = torch.tensor([11, 0, 3, 5, 7, 2, 9, 1, 4], device=CUDA)
    slots = torch.tensor([15, 2, 9, 0, 4, 7, 12, 6, 3], device=CUDA)
    want_core = torch.zeros(12, la.num_value_heads, la.value_head_dim, dtype=dtype, device=CUDA)
    want = states.clone()
    layer.bind_state(torch.zeros(conv_shape, dtype=dtype, device=CUDA), want)
    with torch.inference_mode():
        layer.decode_torch(mixed, g, beta, StateRows(rows, slots, [], None), want_core)
        got, got_core = states.clone(), torch.zeros_like(want_core)
        decode_step_in_place(mixed, rows, slots, g, beta, got, got_core, la.num_key_heads)
    torch.testing.assert_close(got_core.float(), want_core.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert torch.equal(got[untouched], states[untouched])
