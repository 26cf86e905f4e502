"""Overlap (async scheduling) changes no output.

Every test runs the same workload with the overlapped loop (step N+1 planned before step N's
tokens reach the host, placeholders fed on the device) and with the simple loop
(``async_scheduling=False``), through the offline LLM API or EngineCore on tiny random Llamas,
and compares tokens and finish reasons; the stop-condition tests also check the tokens against
what the conditions demand, computed from an unconstrained run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from engine_core.args import add_engine_args, engine_config_from_args
from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.input_batch import InputBatch
from engine_core.llm import LLM
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from engine_core.scheduler import PLACEHOLDER
from protocol.messages import FinishReason, SamplingParams
from tests.factories import write_tiny_llama

VOCAB = 384
Result = list[tuple[list[int], FinishReason | None]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_prompts(n: int, seed: int, low: int = 3, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def make_config(model: Path, overlap: bool) -> EngineConfig:
    return EngineConfig(
        model=str(model), device="cpu", block_size=4, num_kv_blocks=256, async_scheduling=overlap
    )


def make_llm(model: Path, overlap: bool, **kwargs: object) -> LLM:
    options: dict[str, object] = {"device": "cpu", "block_size": 4, "num_kv_blocks": 256}
    options.update(kwargs)
    return LLM(str(model), async_scheduling=overlap, **options)


def generate(
    model: Path,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    overlap: bool,
    **kwargs: object,
) -> Result:
    llm = make_llm(model, overlap, **kwargs)
    outs = llm.generate(prompts, params, detokenize=False)
    assert_all_freed(llm.engine)
    return [(o.token_ids, o.finish_reason) for o in outs]


def assert_all_freed(core: EngineCore) -> None:
    bm = core.scheduler.block_manager
    bm.check_integrity()
    assert not core.has_unfinished()
    assert bm.num_free_blocks + bm.num_cached_blocks == core.runner.num_kv_blocks


def both(model: Path, prompts: list[list[int]], params: object, **kwargs: object) -> Result:
    """Run with and without overlap; assert the same outputs and return them."""
    simple = generate(model, prompts, params, overlap=False, **kwargs)  # type: ignore[arg-type]
    overlapped = generate(model, prompts, params, overlap=True, **kwargs)  # type: ignore[arg-type]
    assert overlapped == simple
    return simple


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """Greedy and seeded sampled rows (top-k, top-p, min-p), varied lengths, in one batch."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        sampled = i % 3 != 0
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(1, 16),
                temperature=rng.choice([0.7, 1.0, 1.3]) if sampled else 0.0,
                seed=rng.randrange(2**31) if sampled else None,
                top_k=rng.choice([0, 5, 50]),
                top_p=rng.choice([1.0, 0.9]),
                min_p=rng.choice([0.0, 0.05]),
                ignore_eos=True,
            )
        )
    return params


def test_greedy_and_seeded_sampling_give_the_same_tokens(tiny_llama: Path) -> None:
    prompts = make_prompts(12, seed=1)
    params = mixed_params(12, seed=2)
    outs = both(tiny_llama, prompts, params)
    # Nothing stops these early: every request ran to its max_tokens (max_tokens=1 included).
    assert [len(tokens) for tokens, _ in outs] == [p.max_tokens for p in params]
    assert all(reason == FinishReason.LENGTH for _, reason in outs)


def test_chunked_prefill_and_a_small_budget(tiny_llama: Path) -> None:
    prompts = make_prompts(6, seed=3, low=20, high=60)
    both(tiny_llama, prompts, mixed_params(6, seed=4), max_num_batched_tokens=16, max_num_seqs=4)


def test_preemption_under_a_tiny_kv_pool(tiny_llama: Path) -> None:
    prompts = make_prompts(8, seed=5, low=10, high=20)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 4
    params += [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(4)]
    both(tiny_llama, prompts, params, num_kv_blocks=24, enable_prefix_caching=False)
    # The pool (24 blocks of 4) holds a fraction of the 8 x ~40 tokens: preemption did happen.
    llm = make_llm(tiny_llama, True, num_kv_blocks=24, enable_prefix_caching=False)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        llm.engine.add_request(Request(f"r{i}", prompt, p))
    requests = list(llm.engine.scheduler.requests.values())
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.engine.scheduler.block_manager.check_integrity()
    assert sum(r.num_preemptions for r in requests) > 0
    assert_all_freed(llm.engine)


def test_prefix_caching(tiny_llama: Path) -> None:
    shared = make_prompts(1, seed=6, low=17, high=18)[0]  # 4 full blocks and one token
    prompts = [shared + tail for tail in make_prompts(6, seed=7, low=1, high=9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    without_cache = generate(tiny_llama, prompts, params, False, enable_prefix_caching=False)
    # Requests admitted one per step, so the later ones hit the blocks the first one cached.
    assert both(tiny_llama, prompts, params, prefill_max_batch_size=1) == without_cache
    llm = make_llm(tiny_llama, True, prefill_max_batch_size=1)
    llm.generate(prompts + prompts, params, detokenize=False)
    assert llm.engine.scheduler.block_manager.num_cached_blocks > 0
    assert_all_freed(llm.engine)


def test_stop_token_ids_and_min_tokens(tiny_llama: Path) -> None:
    prompts = make_prompts(6, seed=8)
    free = generate(
        tiny_llama, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), False
    )
    params, expected = [], []
    for i, (tokens, _) in enumerate(free):
        # Stop on the token at output 3; with min_tokens, only on a later occurrence (if any).
        min_tokens = 5 if i % 2 else 0
        stop = tokens[3]
        params.append(
            SamplingParams(
                max_tokens=12,
                temperature=0.0,
                min_tokens=min_tokens,
                stop_token_ids=[stop],
                ignore_eos=True,
            )
        )
        expected.append(expected_stop(tokens, {stop}, min_tokens, 12))
    outs = both(tiny_llama, prompts, params)
    # min_tokens masks the stop id while short, so the unmasked run is a reference only up to
    # the first masked position; the requests without min_tokens must match it exactly.
    for i, ((tokens, reason), want) in enumerate(zip(outs, expected, strict=True)):
        if i % 2 == 0:
            assert (tokens, reason) == want
        else:
            assert len(tokens) >= 5 and tokens[:5].count(params[i].stop_token_ids[0]) == 0


def expected_stop(
    tokens: list[int], stops: set[int], min_tokens: int, max_tokens: int
) -> tuple[list[int], FinishReason]:
    for i, token in enumerate(tokens[:max_tokens]):
        if i + 1 >= min_tokens and token in stops:
            return tokens[: i + 1], FinishReason.STOP
    return tokens[:max_tokens], FinishReason.LENGTH


def test_eos_stops_one_step_late_without_a_trace(tiny_llama: Path, tmp_path: Path) -> None:
    """A model whose EOS is a token it emits early: the request stops right there."""
    prompts = make_prompts(6, seed=9)
    free = generate(
        tiny_llama, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), False
    )
    eos = free[0][0][2]
    model = write_tiny_llama(tmp_path / "eos")  # the same weights (same seed) ...
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = eos  # ... with a new EOS
    (model / "config.json").write_text(json.dumps(config))
    outs = both(model, prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for (tokens, reason), (free_tokens, _) in zip(outs, free, strict=True):
        assert (tokens, reason) == expected_stop(free_tokens, {eos}, 0, 10)
    assert outs[0] == (free[0][0][:3], FinishReason.STOP)


def test_max_model_len(tiny_llama: Path) -> None:
    prompts = make_prompts(4, seed=10, low=20, high=30)
    outs = both(
        tiny_llama,
        prompts,
        SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
        max_model_len=40,
    )
    for prompt, (tokens, reason) in zip(prompts, outs, strict=True):
        assert (len(prompt) + len(tokens), reason) == (40, FinishReason.LENGTH)


def test_penalties_and_logprobs(tiny_llama: Path) -> None:
    """Penalties read the real previous tokens, so their steps run synchronously; logprobs
    come back with the overlapped copy. Mixed with plain rows, outputs are unchanged."""
    prompts = make_prompts(6, seed=11)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3, logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, frequency_penalty=2.0),
        SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=1.0, seed=5),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    runs = []
    for overlap in (False, True):
        llm = make_llm(tiny_llama, overlap)
        runs.append(llm.generate(prompts, params, detokenize=False))
    simple, overlapped = runs
    for a, b in zip(simple, overlapped, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert len(overlapped[0].logprobs) == 10 and len(overlapped[0].logprobs[0].top_token_ids) == 2
    assert len(overlapped[2].logprobs) == 10 and overlapped[5].logprobs == []


def run_core(
    core: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams,
    abort_at: dict[int, list[str]],
) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Drive EngineCore by hand; abort the listed ids after the given step calls."""
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", prompt, params))
    got: dict[str, tuple[list[int], FinishReason | None]] = {
        f"r{i}": ([], None) for i in range(len(prompts))
    }
    calls = 0
    while core.has_unfinished():
        for out in core.step():
            tokens, reason = got[out.request.request_id]
            assert reason is None, "an output after the request finished"
            got[out.request.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        calls += 1
        for request in core.abort(abort_at.get(calls, [])):
            got[request.request_id] = (got[request.request_id][0], FinishReason.ABORT)
        core.scheduler.block_manager.check_integrity()
    assert_all_freed(core)
    return got


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_mid_generation(tiny_llama: Path, overlap: bool) -> None:
    """Aborted requests stop with ABORT, having received a prefix of their tokens (never a
    placeholder, nothing after the abort); the others are unaffected."""
    prompts = make_prompts(6, seed=12)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    reference = run_core(EngineCore(make_config(tiny_llama, False)), prompts, params, abort_at={})
    config = make_config(tiny_llama, overlap)
    # Step 1 launches the prefill only (with overlap): r0 is aborted before any token arrives.
    aborts = {1: ["r0"], 4: ["r1", "r2"], 9: ["r3"]}
    got = run_core(EngineCore(config), prompts, params, abort_at=aborts)
    for rid, (tokens, reason) in got.items():
        full = reference[rid][0]
        if rid in {"r0", "r1", "r2", "r3"}:
            assert reason == FinishReason.ABORT
            assert len(tokens) < len(full) and tokens == full[: len(tokens)]
        else:
            assert (tokens, reason) == reference[rid]
    assert PLACEHOLDER not in [t for tokens, _ in got.values() for t in tokens]


def test_overlap_delivers_each_step_one_call_late(tiny_llama: Path) -> None:
    """The overlapped loop really overlaps: a step's tokens come back from the next call."""
    core = make_llm(tiny_llama, True).engine
    core.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert core.step() == []  # the prefill is launched, not yet processed
    assert core.scheduler.requests["a"].token_ids[-1] == PLACEHOLDER
    sizes = []
    while core.has_unfinished():
        sizes.append([len(o.new_token_ids) for o in core.step()])
    assert sizes == [[1], [1], [1]]
    assert_all_freed(core)


def test_input_batch_matches_a_per_request_build() -> None:
    """The packed inputs equal a naive per-request construction on a mixed plan (prefill,
    chunk, decodes with different block-table widths), and a placeholder is gathered from the
    previous step's sampled tensor."""
    import torch

    bs = 4
    batch = InputBatch(torch.device("cpu"), bs, 64, 8, 16)
    params = SamplingParams(max_tokens=8)
    decode = Request("d", list(range(10, 19)), params)  # 9 known tokens + a placeholder
    decode.token_ids.append(PLACEHOLDER)
    decode.num_computed_tokens = 9
    chunk = Request("c", list(range(30, 50)), params)  # tokens 8..15 of 20: no sample
    chunk.num_computed_tokens = 8
    fresh = Request("f", list(range(60, 65)), params)  # whole prompt: samples
    plan = SchedulerOutput(
        [
            ScheduledRequest.plan(decode, 1, [7, 3, 9]),
            ScheduledRequest.plan(chunk, 8, [1, 2, 4, 5]),
            ScheduledRequest.plan(fresh, 5, [6, 8]),
        ]
    )
    other = Request("x", [1, 2], params)
    prev_sampled = torch.tensor([111, 222])  # [S_prev]: "d" sampled row 1 last step
    packed = batch.pack(plan, [other, decode], prev_sampled)
    ids, positions, slots, tables = [], [], [], np.zeros((3, 4), dtype=np.int32)
    for i, s in enumerate(plan.scheduled):
        for pos in range(s.start, s.start + s.num_new_tokens):
            ids.append(s.request.token_ids[pos])
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
        tables[i, : len(s.block_ids)] = s.block_ids
    ids[0] = 222
    assert packed.input_ids.tolist() == ids
    assert packed.positions.tolist() == positions
    assert packed.meta.slot_mapping.tolist() == slots
    assert packed.meta.block_tables.tolist() == tables.tolist()
    assert packed.meta.query_start_loc.tolist() == [0, 1, 9, 14]
    assert packed.meta.seq_lens.tolist() == [10, 16, 5]
    assert packed.logits_indices.tolist() == [0, 13]
    assert [r.request_id for r in packed.sampling_requests] == ["d", "f"]
    assert packed.output_positions() == [1, 0]
    assert (packed.meta.max_query_len, packed.meta.max_seq_len) == (8, 16)
    # The prefill kernel's work list: 14 tokens make 16-row tiles, one per sequence here.
    assert packed.meta.prefill_tiles is not None
    assert packed.meta.prefill_tiles.tolist() == [[0, 0], [1, 0], [2, 0]]
    # 70 tokens of one prompt make 64-row tiles: two; a decode-only step has no list.
    long = Request("l", list(range(100, 170)), params)
    blocks = list(range(20, 38))
    packed = batch.pack(SchedulerOutput([ScheduledRequest.plan(long, 70, blocks)]), [], None)
    assert packed.meta.prefill_tiles is not None
    assert packed.meta.prefill_tiles.tolist() == [[0, 0], [0, 1]]
    fresh.token_ids.append(70)  # its prompt computed, its first token known: it decodes
    fresh.num_computed_tokens = 5
    decode_only = SchedulerOutput([ScheduledRequest.plan(fresh, 1, [6, 8])])
    assert batch.pack(decode_only, [], None).meta.prefill_tiles is None


def _decoding(request_id: str, known: int, blocks: list[int]) -> ScheduledRequest:
    """A decode row whose last token is a placeholder (overlap): ``known`` tokens computed."""
    request = Request(request_id, list(range(10, 10 + known)), SamplingParams(max_tokens=8))
    request.token_ids.append(PLACEHOLDER)
    request.num_computed_tokens = known
    return ScheduledRequest.plan(request, 1, blocks)


def test_placeholders_take_the_id_their_request_sampled_last_step() -> None:
    """Each placeholder gets the id sampled by its own request's row of the previous step,
    whether the batch kept its order (no gather: the forward takes the sampled ids as they
    are), changed it, or grew; another tensor-parallel rank's unpack of the same bytes gathers
    the same ids; a request that sampled nothing last step is an error that names it."""
    import torch

    from engine_core.input_batch import PackedInputs

    def forward_ids(packed: PackedInputs) -> list[int]:
        """The ids the forward runs on (model_runner.py ModelRunner._forward)."""
        return (packed.input_ids if packed.ids_from is None else packed.ids_from).tolist()

    def pack_ids(batch: InputBatch, rows: list[ScheduledRequest], prev: list[Request]) -> list:
        sampled = torch.tensor([100 + i for i in range(len(prev))])  # row i sampled 100 + i
        packed = batch.pack(SchedulerOutput(rows), prev, sampled)
        counts, data = batch.last_step()
        other = InputBatch(torch.device("cpu"), 4, 64, 8, 16).unpack(counts, data, sampled)
        assert forward_ids(other) == forward_ids(packed)
        assert torch.equal(other.meta.block_tables, packed.meta.block_tables)  # width too
        # Only a batch in its old order leaves its ids where the sampler wrote them.
        in_order = prev == [r.request for r in rows]
        assert (packed.ids_from is sampled) == (other.ids_from is sampled) == in_order
        return forward_ids(packed)

    batch = InputBatch(torch.device("cpu"), 4, 64, 8, 16)
    rows = [_decoding(name, 5 + i, [i, 9]) for i, name in enumerate("abc")]
    a, b, c = (row.request for row in rows)
    assert pack_ids(batch, rows, [a, b, c]) == [100, 101, 102]  # in order
    assert pack_ids(batch, rows, [c, a, b]) == [101, 102, 100]  # reordered
    assert pack_ids(batch, rows[:2], [c, b, a]) == [102, 101]  # one left the batch
    fresh = Request("f", [7, 8, 9], SamplingParams(max_tokens=8))  # a prompt: no placeholder
    grown = [*rows, ScheduledRequest.plan(fresh, 3, [4])]
    assert pack_ids(batch, grown, [a, b, c]) == [100, 101, 102, 7, 8, 9]
    with pytest.raises(RuntimeError, match="'c' waits on a token"):
        batch.pack(SchedulerOutput(rows), [a, b], torch.tensor([1, 2]))


def test_step_stats_and_flags(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    import argparse
    import logging
    import re

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).async_scheduling is None  # by device
    assert engine_config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    for flag in ("--no-overlap", "--no-async-scheduling"):
        assert engine_config_from_args(parser.parse_args([flag])).async_scheduling is False
    assert engine_config_from_args(parser.parse_args(["--step-stats"])).step_stats is True

    llm = make_llm(tiny_llama, True, step_stats=True)
    with caplog.at_level(logging.INFO, logger="tandem.step_stats"):
        llm.generate(make_prompts(3, seed=13), SamplingParams(max_tokens=5), detokenize=False)
    # The engine logged the run's window when it went idle (well before the 10 s interval).
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.step_stats"]
    assert len(lines) == 1, lines
    steps = int(re.search(r"(\d+) steps", lines[0]).group(1))
    assert steps >= llm.engine.num_steps > 0
    for phase in ("schedule", "prepare", "forward", "sample", "update"):
        assert float(re.search(rf"\b{phase} ([\d.]+)", lines[0]).group(1)) > 0
    assert "gpu " not in lines[0]  # no GPU timing on the CPU
    assert llm.engine.step_stats.summary()["steps"] == 0  # a new window for the next burst


def test_overlap_is_off_by_default_on_the_cpu_so_each_step_returns_its_own_tokens(
    tiny_llama: Path,
) -> None:
    """Unset, overlap follows the device: on the CPU the forward runs on the loop's thread, so
    an overlapped step would return its tokens only with the next one; the simple loop
    returns each step's token from that step. Asked for, it still overlaps."""
    plain = EngineConfig(model=str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=256)
    core = EngineCore(plain)
    assert core.config.async_scheduling is False
    core.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    first = core.step()
    assert [len(o.new_token_ids) for o in first if o.request.request_id == "a"] == [1]
    asked = EngineCore(make_config(tiny_llama, True))
    assert asked.config.async_scheduling is True
    asked.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert not [o for o in asked.step() if o.new_token_ids]  # its token comes a call later
