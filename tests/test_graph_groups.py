"""CUDA graphs with several KV layer groups and with linear-attention state slots, the part that
runs on the CPU: a graph's static buffers (engine_core/cuda_graph.py GraphBuffers), once a step
is staged into them, must read as the step's own metadata reads. Driven by the real scheduler
(windows, chunks, state slots, preemptions) and the real input batch; every decode step staged
into a decode graph's buffers and every other step into a prefill graph's, each group's static
slots and tables (as the captured metadata views them) compared with the packed step's, and
the padding rows inert: no KV slot in any group, no context, the padding state slot.

The decode staging is a Triton kernel: on the CPU it runs under Triton's interpreter::

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_graph_groups.py -q

and without it the decode checks are skipped (the prefill ones still run). The same staging on
CUDA, captured and replayed, is tests/test_graph_groups_gpu.py's.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from engine_core.attention.base import AttentionMetadata
from engine_core.config import EngineConfig
from engine_core.cuda_graph import GraphBuffers, graph_batch_sizes, prefill_graph_sizes
from engine_core.forward_context import StateRows
from engine_core.input_batch import InputBatch, PackedInputs
from engine_core.request import Request, SchedulerOutput
from engine_core.scheduler import Scheduler
from protocol.messages import SamplingParams

BLOCK = 4
MAX_SEQS = 5
MAX_TOKENS = 32
MAX_MODEL_LEN = 96
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The decode staging kernel runs only on a GPU or under Triton's interpreter (on the CPU).
STAGES_DECODES = torch.cuda.is_available() or (
    INTERPRET and importlib.util.find_spec("triton") is not None
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")

# (windows, attention chunks, state slots, pool): a full group beside a window group (Gemma 3),
# beside two chunked groups (Llama 4), and one full group beside state slots (Qwen3-Next).
CASES = {
    "window": ((None, 6), (), 0, 60),
    "chunked": ((None, None, None), (None, 8, 8), 0, 50),
    "state": ((None,), (), MAX_SEQS, 24),
}


def buffers(groups: int, states: bool) -> GraphBuffers:
    """A graph's buffers as the runner allocates them, the padding state slot past the pool's."""
    return GraphBuffers.allocate(
        MAX_TOKENS, MAX_SEQS, MAX_MODEL_LEN // BLOCK, 8, torch.float32, DEVICE,
        num_groups=groups, pad_state_slot=MAX_SEQS if states else None,
    )  # fmt: skip


def state_rows(plan: SchedulerOutput, packed: PackedInputs) -> StateRows:
    """The step's linear-attention rows, as the runner plans them (model_runner.py)."""
    slots = [s.state_slot for s in plan.scheduled]
    fresh = [s.start == 0 for s in plan.scheduled]
    return StateRows.plan(slots, fresh, packed.meta.query_start_loc_cpu, DEVICE)


def every_group(buf: GraphBuffers, meta: AttentionMetadata) -> tuple[AttentionMetadata, ...]:
    """What a graph captured with group 0's ``meta`` reads, group by group."""
    return buf.group_metadata(meta) or (meta,)


def check_group(graph: AttentionMetadata, step: AttentionMetadata, n: int, rows: int) -> None:
    """One group's graph metadata (over the buffers) reads as the step's: its slots, tables and
    context for the step's rows and sequences, no slot past them up to the graph's ``rows``."""
    tokens, width = step.slot_mapping.shape[0], step.block_tables.shape[1]
    assert torch.equal(graph.slot_mapping[:tokens], step.slot_mapping)
    assert (graph.slot_mapping[tokens:rows] == -1).all()
    assert torch.equal(graph.block_tables[:n, :width], step.block_tables)
    assert torch.equal(graph.seq_lens[:n], step.seq_lens)


def check_decode(buf: GraphBuffers, packed: PackedInputs, state: StateRows | None) -> None:
    n = packed.meta.num_seqs
    batch = next(size for size in graph_batch_sizes(MAX_SEQS) if size >= n)
    metas = packed.group_metadata or (packed.meta,)
    buf.stage_decode((packed.input_ids, packed.positions), metas, state, batch)
    graph = every_group(buf, buf.decode_metadata(batch, MAX_MODEL_LEN))
    for graph_meta, step_meta in zip(graph, metas, strict=True):
        check_group(graph_meta, step_meta, n, batch)
        assert (graph_meta.seq_lens[n:batch] == 0).all()  # padding rows attend to nothing
    assert torch.equal(buf.input_ids[:n], packed.input_ids)
    assert torch.equal(buf.positions[:n], packed.positions)
    captured = buf.decode_state(batch)
    assert (captured is None) == (state is None)
    if captured is not None and state is not None:
        assert captured.decode_slots is not None and state.decode_slots is not None
        assert captured.decode_rows.tolist() == list(range(batch))
        assert captured.decode_slots[:n].tolist() == state.decode_slots.tolist()
        assert captured.decode_slots[n:].tolist() == [buf.pad_state_slot] * (batch - n)


def check_prefill(buf: GraphBuffers, packed: PackedInputs) -> None:
    tokens = packed.input_ids.shape[0]
    size = next(t for t in prefill_graph_sizes(MAX_TOKENS) if t >= tokens)
    metas = packed.group_metadata or (packed.meta,)
    buf.stage_common((packed.input_ids, packed.positions), metas, size)
    graph = every_group(buf, buf.prefill_metadata(size, MAX_MODEL_LEN))
    for graph_meta, step_meta in zip(graph, metas, strict=True):
        check_group(graph_meta, step_meta, packed.meta.num_seqs, size)
    assert torch.equal(buf.input_ids[:tokens], packed.input_ids)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_staged_graph_buffers_read_as_the_steps_metadata(case: str, seed: int) -> None:
    windows, chunks, slots, pool = CASES[case]
    rng = random.Random(seed)
    config = EngineConfig(
        block_size=BLOCK, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS
    )
    scheduler = Scheduler(
        config, pool, MAX_MODEL_LEN, [0], kv_windows=windows, kv_attention_chunks=chunks,
        state_slots=slots,
    )  # fmt: skip
    batch = InputBatch(DEVICE, BLOCK, MAX_TOKENS, MAX_SEQS, MAX_MODEL_LEN // BLOCK, windows, chunks)
    buf = buffers(len(windows), bool(slots))
    assert buf.num_groups == len(windows)
    prev: list[Request] = []
    sampled: torch.Tensor | None = None
    decodes = prefills = 0
    for step in range(160):
        if step < 100 and (not scheduler.has_unfinished() or rng.random() < 0.3):
            prompt = [rng.randrange(10, 100) for _ in range(rng.randrange(1, 40))]
            params = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)
            scheduler.add_request(Request(f"r{step}", prompt, params))
        plan = scheduler.schedule()
        if plan.is_empty:
            continue
        packed = batch.pack(plan, prev, sampled)
        if packed.ids_from is not None:
            packed.input_ids.copy_(packed.ids_from)  # as the forward does
        state = state_rows(plan, packed) if slots else None
        if packed.meta.is_decode_only:
            if STAGES_DECODES:
                check_decode(buf, packed, state)
            decodes += 1
        else:
            check_prefill(buf, packed)
            prefills += 1
        ids = [rng.randrange(10, 100) for _ in packed.sampling_requests]
        sampled = torch.tensor(ids, dtype=torch.int64, device=DEVICE) if ids else None
        prev = packed.sampling_requests
        scheduler.update_from_output(plan, ids)
    assert decodes > 20 and prefills > 15
    assert scheduler.counts().preemptions > 0  # pools too small for every request at once


@pytest.mark.skipif(
    not INTERPRET or importlib.util.find_spec("triton") is None,
    reason="a Triton kernel on CPU tensors: TRITON_INTERPRET=1 (on CUDA: test_graph_groups_gpu.py)",
)
@pytest.mark.parametrize(("key_dim", "value_dim"), [(8, 8), (24, 40)])
def test_decode_step_in_place_matches_the_torch_step(key_dim: int, value_dim: int) -> None:
    """The one-token delta rule the decode graphs replay (models/delta_rule_triton.py): three
    rows, out of order, of a five-row step, their slots out of order too, against GatedDeltaNet's
    torch step from copies of the same states: the same outputs on those rows, the same states in
    their slots, every other slot untouched. Head dims that are no power of two and more value
    columns than one block of the kernel (40 > 32) check its masks."""
    from engine_core.models import model_config_from_hf
    from engine_core.models.delta_rule_triton import decode_step_in_place
    from engine_core.models.qwen3_next import GatedDeltaNet
    from tests.test_models_qwen3_next import hf_dict

    overrides = {"linear_key_head_dim": key_dim, "linear_value_head_dim": value_dim}
    layer = GatedDeltaNet(model_config_from_hf(hf_dict(**overrides)))
    la = layer.la
    gen = torch.Generator().manual_seed(key_dim)
    conv_shape, state_shape = layer.state_shapes(6)
    states = torch.randn(state_shape, generator=gen)
    mixed = torch.randn(5, la.conv_dim, generator=gen)
    g = -torch.rand(5, la.num_value_heads, generator=gen)
    beta = torch.rand(5, la.num_value_heads, generator=gen)
    rows, slots = torch.tensor([4, 0, 2]), torch.tensor([5, 1, 3])
    want_core = torch.zeros(5, la.num_value_heads, la.value_head_dim)
    layer.bind_state(torch.zeros(conv_shape), want := states.clone())
    layer.decode_torch(mixed, g, beta, StateRows(rows, slots, [], None), want_core)
    got, got_core = states.clone(), torch.zeros_like(want_core)
    decode_step_in_place(mixed, rows, slots, g, beta, got, got_core, la.num_key_heads)
    torch.testing.assert_close(got_core, want_core, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[[0, 2, 4]], states[[0, 2, 4]])  # no row's slot
    assert not torch.equal(got[[1, 3, 5]], states[[1, 3, 5]])
