"""Qwen3-Next on a GPU: flash-linear-attention's Triton kernels (the CUDA path of the prompt
chunks' gated delta rule, where ``fla`` is installed) against our torch path on one step that
mixes decodes, continued prompt chunks and fresh ones over the state slots (the decodes take our
own in-place kernel on both sides: tests/test_graph_groups_gpu.py holds it to the torch step);
and the engine on CUDA giving HF transformers' greedy tokens for a tiny random model, batched,
chunked and preempted (decode steps replaying CUDA graphs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.forward_context import StateRows, forward_context  # noqa: E402
from engine_core.llm import LLM  # noqa: E402
from engine_core.models import model_config_from_hf  # noqa: E402
from engine_core.models import qwen3_next as qwen3_next_module  # noqa: E402
from engine_core.models.delta_rule import fla_kernels  # noqa: E402
from engine_core.models.qwen3_next import GatedDeltaNet  # noqa: E402
from tests.paged_harness import hf_greedy, random_prompts, randomize  # noqa: E402
from tests.test_models_qwen3_next import VOCAB, greedy, hf_dict, tiny_config  # noqa: E402

CUDA = torch.device("cuda")


def step_metadata(lengths: list[int]) -> AttentionMetadata:
    """What a linear-attention layer reads of a step's metadata: where each sequence's rows
    start (the rest is placeholder: no attention layer runs here)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    empty = torch.zeros(0, dtype=torch.int32, device=CUDA)
    return AttentionMetadata(
        slot_mapping=empty, query_start_loc=empty, seq_lens=empty, block_tables=empty,
        max_query_len=max(lengths), max_seq_len=max(lengths), query_start_loc_cpu=starts,
        seq_lens_cpu=lengths,
    )  # fmt: skip


def run_layer(
    layer: GatedDeltaNet,
    hidden: torch.Tensor,
    lengths: list[int],
    fresh: list[bool],
    states: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step through ``layer`` from copies of ``states``: (output, conv, recurrent after)."""
    conv, recurrent = states[0].clone(), states[1].clone()
    layer.bind_state(conv, recurrent)
    meta = step_metadata(lengths)
    slots = list(range(len(lengths)))
    rows = StateRows.plan(slots, fresh, meta.query_start_loc_cpu, CUDA)
    with forward_context(meta, None, state=rows):  # type: ignore[arg-type]
        out = layer(hidden)
    return out, conv, recurrent


# Triton's dots take float32 inputs as TF32 (10-bit mantissas): hence 1e-2 in float32.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_fla_kernels_match_the_torch_path(
    dtype: torch.dtype, tol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three decodes from a state, a fresh one-token prompt, a 70-token chunk continuing a
    state and a fresh 130-token prompt (three of the kernels' 64-token blocks), in one step."""
    if fla_kernels() is None:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    overrides: dict[str, Any] = {
        "hidden_size": 128, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    }  # fmt: skip
    config = model_config_from_hf(hf_dict(**overrides))
    torch.manual_seed(0)
    layer = GatedDeltaNet(config)
    randomize(layer, 0)
    layer = layer.to(CUDA, dtype)
    lengths = [1, 1, 1, 1, 70, 130]
    fresh = [False, False, False, True, False, True]
    gen = torch.Generator(device=CUDA).manual_seed(1)
    shapes = layer.state_shapes(len(lengths))
    states = tuple(
        (torch.randn(shape, generator=gen, device=CUDA) * 0.3).to(dtype) for shape in shapes
    )
    hidden = torch.randn(sum(lengths), 128, generator=gen, device=CUDA).to(dtype)
    with torch.inference_mode():
        fla = run_layer(layer, hidden, lengths, fresh, states)
        monkeypatch.setattr(qwen3_next_module, "fla_kernels", lambda: None)
        ours = run_layer(layer, hidden, lengths, fresh, states)
    for got, want in zip(fla, ours, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_engine_on_cuda_gives_hf_greedy_tokens(tmp_path: Path) -> None:
    """Float32 on CUDA (FLA's kernels where installed): four prompts batched, the longest in
    chunks of 23 tokens, in a pool small enough to preempt."""
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    config = tiny_config(linear_key_head_dim=16, linear_value_head_dim=16)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    randomize(hf_model, 0)
    hf_model.save_pretrained(tmp_path)
    hf_model.to(CUDA)  # where fla is installed HF may take its kernels: CUDA tensors only
    prompts = random_prompts(VOCAB, (150, 210, 97, 5))
    want = [hf_greedy(hf_model, prompt, 16).tokens[0] for prompt in prompts]
    llm = LLM(
        str(tmp_path), device="cuda", dtype="float32", block_size=16, num_kv_blocks=24,
        max_model_len=384, max_num_batched_tokens=23, max_num_seqs=3,
    )  # fmt: skip
    try:
        got = llm.generate(prompts, greedy(), detokenize=False)
        assert llm.engine.scheduler.counts().preemptions > 0
    finally:
        llm.engine.shutdown()
    assert [out.token_ids for out in got] == want


def test_prefix_hits_on_cuda_resume_at_saved_states(tmp_path: Path) -> None:
    """Float32 on CUDA, decode steps replaying graphs: a 150-token prompt in chunks of 64 saves
    states at 64, 128 and 144, and its answer's decode at 160 (device copies between slot and
    saved rows, outside the graphs, before the replay that reads the slot); its next turn
    resumes at 160 and a prompt sharing its first 130 tokens at 128, each with HF's greedy
    tokens. Then three 100-token first turns, batched, answer 40 (their decode saves at 112 and
    128 copied as runs: gathers and scatters with row ids from pinned memory) and their next
    turns, batched, resume at 128 with HF's tokens (tests/test_qwen3_next_prefix.py on the
    CPU)."""
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    config = tiny_config(linear_key_head_dim=16, linear_value_head_dim=16)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    randomize(hf_model, 0)
    hf_model.save_pretrained(tmp_path)
    hf_model.to(CUDA)
    first = random_prompts(VOCAB, (150,))[0]
    answer = hf_greedy(hf_model, first, 16).tokens[0]
    new_a, new_b = random_prompts(VOCAB, (20, 25))
    later = [first + answer + new_a, first[:130] + new_b]
    want = [hf_greedy(hf_model, prompt, 16).tokens[0] for prompt in later]
    long_text, new_text = random_prompts(VOCAB, (300, 30))
    firsts = [long_text[i * 100 : (i + 1) * 100] for i in range(3)]
    answers = [hf_greedy(hf_model, first, 40).tokens[0] for first in firsts]
    turns = [
        f + a + new_text[i * 10 : (i + 1) * 10]
        for i, (f, a) in enumerate(zip(firsts, answers, strict=True))
    ]
    want_turns = [hf_greedy(hf_model, turn, 16).tokens[0] for turn in turns]
    # Room for every state saved here: no eviction shortens a hit.
    llm = LLM(
        str(tmp_path), device="cuda", dtype="float32", block_size=16, num_kv_blocks=128,
        max_model_len=400, max_num_batched_tokens=64, max_num_seqs=3, state_snapshots=16,
    )  # fmt: skip
    try:
        assert llm.generate([first], greedy(), detokenize=False)[0].token_ids == answer
        hits = []
        got = []
        for prompt in later:
            before = llm.engine.scheduler.counts().prefix_cache_hits
            got.append(llm.generate([prompt], greedy(), detokenize=False)[0].token_ids)
            hits.append(llm.engine.scheduler.counts().prefix_cache_hits - before)
        got_answers = [o.token_ids for o in llm.generate(firsts, greedy(40), detokenize=False)]
        before = llm.engine.scheduler.counts().prefix_cache_hits
        got_turns = [o.token_ids for o in llm.generate(turns, greedy(), detokenize=False)]
        turn_hits = llm.engine.scheduler.counts().prefix_cache_hits - before
        llm.engine.scheduler.block_manager.check_integrity()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert hits == [160, 128]
    assert got_answers == answers and got_turns == want_turns
    assert turn_hits == 3 * 128
