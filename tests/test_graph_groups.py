"""CUDA graphs with several KV layer groups and with linear-attention state slots, the part that
runs on the CPU: a graph's static buffers (engine_core/cuda_graph.py GraphBuffers), once a step
is staged into them, must read as the step's own metadata reads. Driven by the real scheduler
(windows, chunks, state slots, preemptions) and the real input batch; every decode step staged
into a decode graph's buffers and every other step into a prefill graph's, each group's static
slots and tables (as the captured metadata views them) compared with the packed step's, and
the padding rows inert: no KV slot in any group, no context, the padding state slot. And a
decode graph's forward run without capture (CudaGraphRunner.run with each graph's ``replay``
the forward it would capture, on the Triton backend) through tiny Gemma 3, Llama 4 and
Qwen3-Next engines: every decode step's hidden rows and caches those of the eager step.

The decode staging is a Triton kernel: on the CPU it runs under Triton's interpreter::

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:<a site-packages with triton> \\
        .venv/bin/python -m pytest tests/test_graph_groups.py -q

(Triton 3.6's interpreter turns one-element arrays into loop bounds, which numpy 2.4 refuses:
put a numpy below 2.4 first on that path), and without it the decode checks are skipped (the
prefill ones still run). The same staging on CUDA, captured and replayed, is
tests/test_graph_groups_gpu.py's.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.attention.base import AttentionMetadata
from engine_core.config import EngineConfig
from engine_core.cuda_graph import GraphBuffers, graph_batch_sizes, prefill_graph_sizes
from engine_core.forward_context import StateRows
from engine_core.input_batch import InputBatch, PackedInputs
from engine_core.model_runner import ModelInputs, ModelRunner
from engine_core.request import Request, SchedulerOutput
from engine_core.scheduler import Scheduler
from protocol.messages import SamplingParams
from tests.test_kv_groups_engine import gemma  # noqa: F401  (fixtures)
from tests.test_models_llama4 import llama4  # noqa: F401
from tests.test_models_qwen3_next import qwen3_next  # noqa: F401

BLOCK = 4
MAX_SEQS = 5
MAX_TOKENS = 32
MAX_MODEL_LEN = 96
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The decode staging kernel runs only on a GPU or under Triton's interpreter (on the CPU).
STAGES_DECODES = torch.cuda.is_available() or (
    INTERPRET and importlib.util.find_spec("triton") is not None
)
CPU = torch.device("cpu")
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


# ------------------------------------------------- a decode graph's forward, run without capture


class EagerReplay:
    """Stands in for a captured graph on the CPU: ``replay`` runs the forward it would have
    captured (CudaGraphRunner.decode_forward), over the same static buffers."""

    def __init__(self, forward: Callable[[], None]) -> None:
        self.replay = forward


def with_padding_state_slot(runner: ModelRunner) -> int | None:
    """Give the linear-attention layers one more state slot than the block manager hands out,
    as the runner does where graphs replay (its padding rows'); None for a model without."""
    if not runner.num_state_slots:
        return None
    tensors = []
    for layer in runner.model.linear_attention_layers():
        own = [torch.zeros(shape) for shape in layer.state_shapes(runner.num_state_slots + 1)]
        layer.bind_state(*own)
        tensors += own
    runner.state_cache = tensors
    return runner.num_state_slots


def caches(runner: ModelRunner) -> list[torch.Tensor]:
    kv = runner.kv_cache if isinstance(runner.kv_cache, list) else [runner.kv_cache]
    return [*kv, *runner.state_cache]


def check_decodes_through_graph_forward(
    runner: ModelRunner, pad: int | None, replayed: list[tuple[str, int]] | None = None
) -> list[tuple[int, bool]]:
    """Run every decode step of the engine twice, from the same caches: eagerly (its own
    backend) and as CudaGraphRunner.run would replay it (staging, then the captured forward
    over the static buffers on the Triton backend, interpreted), and require the same hidden
    rows and the same caches after (the padding slot aside); the engine goes on from the eager
    step's. Returns each checked step's rows and whether one of them was fresh (a one-token
    prompt: its slot zeroed before the replay); ``replayed`` gets each replay's graph (kind,
    size: "decode" or "shared", the graphs of steps with a shared prefix)."""
    from engine_core.attention.triton_backend import TritonBackend
    from engine_core.cuda_graph import CudaGraphRunner

    graphs = CudaGraphRunner(
        runner.model, TritonBackend(), max_num_seqs=runner.config.max_num_seqs,
        max_model_len=runner.max_model_len, block_size=runner.block_size,
        hidden_size=runner.model_config.hidden_size, dtype=torch.float32, device=CPU,
        num_kv_groups=len(runner.kv_layout.groups), state_tensors=runner.state_cache,
        pad_state_slot=pad,
    )  # fmt: skip
    log = [] if replayed is None else replayed

    def graph(kind: str, size: int) -> EagerReplay:
        forward = graphs.decode_forward(size, shared=kind == "shared")
        return EagerReplay(lambda: (log.append((kind, size)), forward())[1])

    graphs.graphs = {size: graph("decode", size) for size in graphs.batch_sizes}
    graphs.shared_graphs = {size: graph("shared", size) for size in graphs.shared_sizes}
    eager, checked = runner._forward, []

    def both(inputs: ModelInputs) -> torch.Tensor:
        if not inputs.meta.is_decode_only:
            return eager(inputs)
        before = [t.clone() for t in caches(runner)]
        want = eager(inputs).clone()
        after = [t.clone() for t in caches(runner)]
        for t, saved in zip(caches(runner), before, strict=True):
            t.copy_(saved)
        got = graphs.run(
            inputs.input_ids, inputs.positions, inputs.meta, inputs.ids_from, None,
            inputs.group_metadata, inputs.state,
        )  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for t, saved in zip(caches(runner), after, strict=True):
            real = slice(None, pad) if t.shape[0] == (pad or 0) + 1 else slice(None)
            torch.testing.assert_close(t[real], saved[real], atol=1e-5, rtol=1e-5)
            t.copy_(saved)
        fresh = inputs.state is not None and inputs.state.fresh_slots is not None
        checked.append((inputs.meta.num_seqs, fresh))
        return want

    runner._forward = both  # type: ignore[method-assign]
    return checked


# A model, its engine's sizes, six prompts' lengths and the tokens each generates (chosen so
# that a padded decode step follows a larger one, and the last prompt enters a decode step).
Case = tuple[Path, dict[str, Any], list[int], tuple[int, ...]]


def gemma_case(request: pytest.FixtureRequest) -> Case:
    folder, _ = request.getfixturevalue("gemma")
    config = {"block_size": 16, "num_kv_blocks": 100, "max_model_len": 256}
    return folder, config, [90, 70, 75, 20, 30, 1], (12, 6, 9, 9, 3, 5)  # past the window


def llama4_case(request: pytest.FixtureRequest) -> Case:
    folder, _ = request.getfixturevalue("llama4")
    config = {"block_size": 4, "num_kv_blocks": 200, "max_model_len": 128}
    # Decodes cross chunk edges (chunks of 16).
    return folder, config, [30, 37, 44, 20, 25, 1], (12, 6, 9, 9, 3, 5)


def qwen3_next_case(request: pytest.FixtureRequest) -> Case:
    folder, _ = request.getfixturevalue("qwen3_next")
    config = {"block_size": 16, "num_kv_blocks": 40, "max_model_len": 256}
    return folder, config, [40, 33, 23, 20, 30, 1], (12, 3, 9, 9, 6, 4)


@pytest.mark.skipif(not (INTERPRET and STAGES_DECODES), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", [gemma_case, llama4_case, qwen3_next_case])
def test_a_decode_graphs_forward_computes_the_eager_step(
    case: Callable[[pytest.FixtureRequest], Case],
    request: pytest.FixtureRequest,
) -> None:
    """Six prompts on a five-row cap, finishing at different steps: decode steps of five rows,
    then fewer, three of them replaying the four-row graph (a padding row, whose static slot
    last named a finished request's); the sixth, one token long, waits for a row and enters
    as a fresh decode-shaped row (its state slot zeroed before the replay). Each step's hidden
    rows and every cache after it (each group's K/V, each state slot) equal the eager step's,
    so the padding row wrote nothing but its padding slot; Gemma 3's window group, Llama 4's
    chunked groups and Qwen3-Next's state slots each read through their static buffers."""
    from engine_core.llm import LLM

    folder, config, lengths, new_tokens = case(request)
    llm = LLM(
        str(folder), device="cpu", dtype="float32", max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=64, enable_prefix_caching=False, **config,
    )  # fmt: skip
    try:
        runner = llm.engine.runner
        checked = check_decodes_through_graph_forward(runner, with_padding_state_slot(runner))
        prompts = [[(7 * n + 3 * i) % 300 + 10 for i in range(n)] for n in lengths]
        params = [
            SamplingParams(max_tokens=count, temperature=0, ignore_eos=True) for count in new_tokens
        ]
        llm.generate(prompts, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    rows = [n for n, _ in checked]
    # A padded step (3 rows in the 4-row graph) after a larger one: its padding row's static
    # slots last held a live row's.
    assert any(n == 3 and max(rows[:i], default=0) > 3 for i, n in enumerate(rows)), str(rows)
    assert any(fresh for _, fresh in checked) == (runner.num_state_slots > 0), str(checked)


@pytest.mark.skipif(not (INTERPRET and STAGES_DECODES), reason="needs TRITON_INTERPRET=1")
def test_decode_steps_over_a_shared_prompt_replay_the_shared_graphs(tmp_path: Path) -> None:
    """Twelve conversations over one 272-token system prompt (17 blocks the prefix cache
    shares) on a twelve-row cap, ending at different steps: their decode steps name the
    shared pages and replay the shared decode graphs (of 12 rows, then 8: one padded), whose
    forward (heads of 16: the rotary and KV write first, the pass, then each row's own pages)
    computes the eager step; under 8 rows, the plain decode graphs."""
    from engine_core.llm import LLM
    from tests.factories import write_tiny_llama

    folder = write_tiny_llama(tmp_path)
    llm = LLM(
        str(folder), device="cpu", dtype="float32", max_num_seqs=12, block_size=16,
        num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=512,
        enable_prefix_caching=True,
    )  # fmt: skip
    replayed: list[tuple[str, int]] = []
    try:
        runner = llm.engine.runner
        check_decodes_through_graph_forward(runner, None, replayed)
        rng = random.Random(4)
        system = [rng.randrange(3, 384) for _ in range(272)]
        prompts = [system + [rng.randrange(3, 384) for _ in range(3 + i)] for i in range(12)]
        new_tokens = [5] * 2 + [6] * 2 + [7] * 4 + [9] * 4  # 12 rows, 10, 8, 4
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in new_tokens]
        llm.generate(prompts, params, detokenize=False)
    finally:
        llm.engine.shutdown()
    assert ("shared", 12) in replayed and ("shared", 8) in replayed, replayed
    assert ("decode", 4) in replayed, replayed
    assert all(kind == "shared" for kind, size in replayed if size >= 8), replayed
