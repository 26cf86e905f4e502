"""The load generator's arithmetic and bookkeeping, against hand-computed expectations.

Timestamps are written by hand (seconds from the start of the run), and every expected figure
below was worked out on paper from them, not with the code under test.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from loadgen.arrival import Arrival
from loadgen.backends import Clock, OpenAIBackend, RequestOptions, sse_events
from loadgen.metrics import RequestRecord, Slo, format_summary, summarize
from loadgen.runner import RunPlan, run_once
from loadgen.sweep import Sweep
from loadgen.workload import (
    LenRange,
    RequestSpec,
    WorkloadConfig,
    build_workload,
    load_dataset,
)

approx = pytest.approx


def hand_records() -> list[RequestRecord]:
    """Four requests of one run.

    a: sent 0.01 s late; chunks at 0.11, 0.16, 0.21, 0.31 (4 tokens); done at 0.31
    b: one token at 0.70, sent on time at 0.50; done at 0.72
    c: failed at 1.40 after one chunk at 1.30 (an HTTP 500 midway)
    d: 6 tokens in 3 chunks at 0.90, 1.00, 1.30; sent 0.60 (due 0.55); done 1.30
    """
    a = RequestRecord("a", 10, 4, 0.00, 0.01, [0.11, 0.16, 0.21, 0.31], 0.31, 4, "length")
    b = RequestRecord("b", 20, 1, 0.50, 0.50, [0.70], 0.72, 1, "length")
    c = RequestRecord("c", 30, 8, 1.00, 1.00, [1.30], None, 1)
    c.fail("BackendError: HTTP 500: boom", 1.40)
    d = RequestRecord("d", 40, 6, 0.55, 0.60, [0.90, 1.00, 1.30], 1.30, 6, "length")
    return [a, b, c, d]


def test_per_request_definitions() -> None:
    a, b, c, d = hand_records()
    assert a.ttft == approx(0.10)  # 0.11 - 0.01
    assert a.tpot == approx(0.20 / 3)  # (0.31 - 0.11) / (4 - 1)
    assert a.itls == approx([0.05, 0.05, 0.10])
    assert a.e2e == approx(0.30)
    assert a.submit_lag == approx(0.01)
    # One token: a TTFT and a latency, but no TPOT and no gaps.
    assert b.ttft == approx(0.20) and b.e2e == approx(0.22)
    assert b.tpot is None and b.itls == []
    # Several tokens per chunk: TPOT divides by tokens, ITL counts chunk gaps.
    assert d.tpot == approx(0.40 / 5)  # (1.30 - 0.90) / (6 - 1)
    assert d.itls == approx([0.10, 0.30])
    assert d.submit_lag == approx(0.05)
    assert not c.ok and c.error == "BackendError: HTTP 500: boom" and c.ended_at == 1.40


def test_summary_of_a_run() -> None:
    s = summarize(hand_records())
    assert (s.num_requests, s.completed, s.failed) == (4, 3, 1)
    assert s.errors == {"BackendError: HTTP 500: boom": 1}
    assert s.duration_s == approx(1.40)  # the failed request ended last
    # Completed requests only: prompts 10 + 20 + 40, outputs 4 + 1 + 6.
    assert (s.total_input_tokens, s.total_output_tokens) == (70, 11)
    assert s.request_throughput == approx(3 / 1.4)
    assert s.output_throughput == approx(11 / 1.4)
    assert s.total_token_throughput == approx(81 / 1.4)
    # TTFT (ms) of a, b, d: 100, 200, 300 -> mean 200; p90 = 200 + 0.8 * 100 (linear between
    # order statistics, rank 0.9 * 2 = 1.8).
    assert (s.ttft.count, s.ttft.mean, s.ttft.p50) == (3, approx(200), approx(200))
    assert s.ttft.p90 == approx(280) and s.ttft.p99 == approx(298)
    # TPOT (ms): a 66.67 and d 80; b has none.
    assert s.tpot.count == 2 and s.tpot.mean == approx((200 / 3 + 80) / 2)
    # ITL (ms): a's 50, 50, 100 and d's 100, 300 -> sorted 50 50 100 100 300, median 100.
    assert s.itl.count == 5 and s.itl.mean == approx(120) and s.itl.p50 == approx(100)
    assert s.itl.p95 == approx(260)  # rank 3.8: 100 + 0.8 * 200
    # E2E (ms): 300, 220, 700.
    assert s.e2e.mean == approx(1220 / 3) and s.e2e.p50 == approx(300)
    # Submit lag counts every request that went out, the failed one too: 10, 0, 0, 50 ms.
    assert s.submit_lag.count == 4 and s.submit_lag.mean == approx(15)
    assert s.goodput is None


def test_a_multi_turn_run_splits_ttft_by_turn() -> None:
    assert summarize(hand_records()).ttft_first_turn is None  # no conversations: no split

    def turn(conversation: int, k: int, ttft: float, ok: bool = True) -> RequestRecord:
        ended = 1.0 + ttft if ok else None
        return RequestRecord(f"c{conversation}t{k}", 10, 2, 0.0, 0.0, [ttft, ttft + 0.01],
                             ended, 2, "length", conversation=conversation, turn=k)  # fmt: skip

    records = [turn(0, 0, 0.40), turn(0, 1, 0.05), turn(0, 2, 0.07),
               turn(1, 0, 0.20), turn(1, 1, 0.03), turn(1, 2, 0.09, ok=False)]  # fmt: skip
    s = summarize(records)
    assert s.ttft_first_turn is not None and s.ttft_later_turns is not None
    # First turns: 400 and 200 ms. Later turns completed: 50, 70, 30 ms (the failed one out).
    assert (s.ttft_first_turn.count, s.ttft_first_turn.p50) == (2, approx(300))
    assert (s.ttft_later_turns.count, s.ttft_later_turns.p50) == (3, approx(50))
    printed = format_summary(s)
    assert "TTFT, each conversation's first turn" in printed and "TTFT, later turns" in printed
    assert json.loads(json.dumps(s.as_json()))["ttft_later_turns"]["mean"] == approx(50)


def test_percentiles_of_five_values() -> None:
    recs = [
        RequestRecord(str(i), 1, 1, 0.0, 0.0, [t], t, 1, "stop")
        for i, t in enumerate([0.5, 0.1, 0.4, 0.2, 0.3])
    ]
    d = summarize(recs).ttft
    # Sorted 100..500 ms; rank p/100 * 4: p90 -> 3.6 -> 400 + 0.6 * 100.
    assert (d.mean, d.p50, d.p90, d.p95, d.p99) == approx((300, 300, 460, 480, 496))


def test_goodput_against_slos() -> None:
    recs = hand_records()
    # TTFT <= 150 ms: only a (100 ms).
    s = summarize(recs, Slo.parse("ttft=150"))
    assert s.good_requests == 1 and s.goodput == approx(1 / 1.4)
    # TPOT <= 70 ms: a (66.7) passes, d (80) fails; b has one token, so no TPOT to fail.
    s = summarize(recs, Slo.parse("tpot=70"))
    assert s.good_requests == 2 and s.slo == {"tpot": approx(70)}
    # Both: a (100, 66.7) and b (200, none) pass, d (300, 80) fails on both. The failed request
    # never counts, however fast.
    s = summarize(recs, Slo.parse(" ttft=250 , tpot=70 "))
    assert s.good_requests == 2
    for bad in ("", "ttft", "itl=5", "ttft=fast"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_empty_and_all_failed_runs_have_no_latencies() -> None:
    assert summarize([]).duration_s == 0.0
    rec = RequestRecord("x", 5, 5, 0.0)
    rec.fail("timed out after 1 s", 1.0)
    s = summarize([rec])
    assert (s.completed, s.failed, s.request_throughput) == (0, 1, 0.0)
    assert math.isnan(s.ttft.mean) and s.as_json()["ttft"]["mean"] is None
    json.dumps(s.as_json(), allow_nan=False)  # NaN never reaches the JSON
    assert "Failed requests:" in format_summary(s) and "timed out" in format_summary(s)


def test_printed_summary_has_every_section() -> None:
    text = format_summary(summarize(hand_records(), Slo.parse("ttft=150")), "t")
    for label in ("Successful requests:", "Output token throughput", "Request goodput",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P90 E2E (ms):",
                  "Mean lag (ms):"):  # fmt: skip
        assert label in text
    assert re.search(r"^Successful requests:\s+3$", text, re.M)
    assert re.search(r"^Failed requests:\s+1$", text, re.M)


# ---- parsing the HTTP streams ----------------------------------------------------------------


async def _lines(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def _collect(lines: list[str]) -> list[str]:
    return [e async for e in sse_events(_lines(lines))]


def test_sse_events_join_data_lines_and_skip_comments() -> None:
    lines = [": keep-alive", "", 'data: {"a":', "data: 1}", "", "event: x", "data:[DONE]", ""]
    assert asyncio.run(_collect(lines)) == ['{"a":\n1}', "[DONE]"]
    assert asyncio.run(_collect(["data: tail"])) == ["tail"]  # no blank line at the end


def _stream(kind: str, events: list[dict | str]) -> tuple[RequestRecord, bool]:
    backend = OpenAIBackend(kind, "http://unused", Clock(), RequestOptions(), 1)
    rec = RequestRecord("r", 3, 8, 0.0, 0.0)
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n" for e in events]
    lines = [part for line in lines for part in line.split("\n")]  # each event, a blank line

    async def go() -> bool:
        try:
            return await backend.read_stream(sse_events(_lines(lines)), rec)
        finally:
            await backend.close()

    return rec, asyncio.run(go())


def test_chat_stream_role_chunk_is_not_a_token() -> None:
    usage = {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20}
    events: list[dict | str] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
        "[DONE]",
    ]
    rec, done = _stream("openai-chat", events)
    assert done and rec.finish_reason == "length"
    assert len(rec.chunk_times) == 2  # the two text chunks, not the role chunk
    assert (rec.prompt_len, rec.output_tokens) == (17, 3)  # the server's counts


def test_completion_stream_counts_and_errors() -> None:
    events: list[dict | str] = [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}], "usage": None},
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "usage": None},
        "[DONE]",
    ]
    rec, done = _stream("openai-completions", events)
    # No usage chunk: one token per text chunk; the finish-only chunk is still a chunk time.
    assert done and rec.output_tokens == 1 and len(rec.chunk_times) == 2
    rec, done = _stream("openai-completions", events[:1])  # cut off before [DONE]
    assert not done
    with pytest.raises(RuntimeError, match="engine_down"):
        _stream("openai-completions", [{"error": {"message": "engine_down"}}])


# ---- the runner accounts for every request ---------------------------------------------------


class ScriptedBackend:
    """A stand-in for the network only: request i succeeds, raises, or never answers."""

    kind = "scripted"
    wants_ids = True

    def __init__(self, script: dict[int, str]) -> None:
        self.clock = Clock()
        self.script = script

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        rec.submitted_at = self.clock.now()
        action = self.script.get(int(rec.request_id.rsplit("-", 1)[1]), "ok")
        if action == "raise":
            raise ConnectionError("refused")
        if action == "hang":
            await asyncio.sleep(3600)
        rec.chunk_times.append(self.clock.now())
        rec.output_tokens = spec.output_len
        rec.finish_reason = "length"


def test_runner_accounts_for_every_request() -> None:
    specs = [RequestSpec([1, 2, 3], None, 4) for _ in range(10)]
    backend = ScriptedBackend({3: "raise", 7: "hang"})
    plan = RunPlan(Arrival(), max_concurrency=3, request_timeout=0.2, progress=False)
    records = asyncio.run(run_once(backend, specs, plan, run_index=5))
    assert len(records) == 10 and len({r.request_id for r in records}) == 10
    failed = {int(r.request_id.rsplit("-", 1)[1]): r.error for r in records if not r.ok}
    assert failed == {3: "ConnectionError: refused", 7: "timed out after 0.2 s"}
    assert all(r.output_tokens == 4 and r.ended_at is not None for r in records if r.ok)
    s = summarize(records)
    assert (s.completed, s.failed) == (8, 2)


def test_interval_schedules() -> None:
    specs = [RequestSpec([1], None, 1) for _ in range(4)]
    absolute = Arrival("interval", interval=0.01, interval_mode="absolute")
    recs = asyncio.run(run_once(ScriptedBackend({}), specs, RunPlan(absolute, progress=False), 0))
    assert [r.scheduled_at for r in recs] == approx([0.0, 0.01, 0.02, 0.03])
    relative = Arrival("interval", interval=0.01, interval_mode="relative")
    recs = asyncio.run(run_once(ScriptedBackend({}), specs, RunPlan(relative, progress=False), 0))
    # Each is due one interval after the previous one actually went out, never before.
    for prev, cur in zip(recs, recs[1:], strict=False):
        assert cur.scheduled_at >= prev.scheduled_at + 0.01
        assert prev.submitted_at is not None and cur.submitted_at >= cur.scheduled_at


def test_poisson_gaps_have_the_asked_rate_and_burstiness() -> None:
    n = 20001
    for burstiness in (1.0, 0.25, 4.0):
        gaps = np.asarray(Arrival.from_rate(50.0, burstiness, seed=1).gaps(n)[1:])
        # Gamma(shape k, scale 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k).
        assert gaps.mean() == approx(1 / 50.0, rel=0.03)
        assert gaps.std() / gaps.mean() == approx(1 / math.sqrt(burstiness), rel=0.05)
    assert Arrival.from_rate(math.inf).gaps(3) == [0.0, 0.0, 0.0]


# ---- workloads --------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character (ids are code points below 128); id 0 is the only special one."""

    all_special_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return 128


def test_random_workload_lengths_and_fresh_prompts_per_run() -> None:
    cfg = WorkloadConfig(200, LenRange.parse("5:9"), LenRange.parse("3"), seed=7)
    tok = CharTokenizer()
    run0 = build_workload(cfg, 0, want_ids=True, tokenizer=tok)
    assert {len(s.prompt_ids or []) for s in run0} == {5, 6, 7, 8, 9}
    assert {s.output_len for s in run0} == {3}
    assert all(0 not in (s.prompt_ids or []) for s in run0)  # no special ids in prompts
    assert build_workload(cfg, 0, True, tok) == run0  # seeded
    assert [s.prompt_ids for s in build_workload(cfg, 1, True, tok)] != [s.prompt_ids for s in run0]
    text = build_workload(cfg, 0, want_ids=False, tokenizer=tok)
    assert [s.prompt_text for s in text] == [tok.decode(s.prompt_ids or []) for s in run0]


def test_fixed_prompt_unique_heads() -> None:
    tok = CharTokenizer()
    same = build_workload(WorkloadConfig(3, LenRange(1, 1), None, prompt="hi"), 0, False, tok)
    assert [s.prompt_text for s in same] == ["hi"] * 3 and same[0].output_len == 128
    cfg = WorkloadConfig(3, LenRange(1, 1), None, prompt="hi", unique_prompts=True)
    texts = [s.prompt_text or "" for s in build_workload(cfg, 2, False, tok)]
    assert len(set(texts)) == 3 and all(t.endswith("hi") for t in texts)
    # As ids (zmq, --pretok): the same headed text, encoded.
    ids = [s.prompt_ids for s in build_workload(cfg, 2, True, tok)]
    assert ids == [tok.encode(t) for t in texts]


def test_datasets(tmp_path: Path) -> None:
    tok = CharTokenizer()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"prompt": "abc", "output_len": 5}\n\n{"prompt_token_ids": [70, 71]}\n')
    sharegpt = tmp_path / "d.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "why"}, {"from": "gpt", "value": "because"}]},
        {"conversations": [{"from": "gpt", "value": "orphan answer"}]},
    ]))  # fmt: skip
    assert len(load_dataset(jsonl)) == 2 and len(load_dataset(sharegpt)) == 1
    specs = build_workload(WorkloadConfig(4, LenRange(1, 1), None, dataset=jsonl), 0, True, tok)
    # Two entries cycled over four requests, each with its own output length or the default.
    assert sorted((tuple(s.prompt_ids or []), s.output_len) for s in specs) == [
        ((70, 71), 128), ((70, 71), 128), ((97, 98, 99), 5), ((97, 98, 99), 5)
    ]  # fmt: skip
    specs = build_workload(WorkloadConfig(1, LenRange(1, 1), None, dataset=sharegpt), 0, False, tok)
    assert specs[0].prompt_text == "why" and specs[0].output_len == len("because")
    forced = WorkloadConfig(1, LenRange(1, 1), LenRange(2, 2), dataset=sharegpt)
    assert build_workload(forced, 0, False, tok)[0].output_len == 2


def test_parsers() -> None:
    assert LenRange.parse("64:256") == LenRange(64, 256) and str(LenRange(8, 8)) == "8"
    for bad in ("0", "9:3", "x"):
        with pytest.raises(ValueError):
            LenRange.parse(bad)
    assert Sweep.parse("rate=1,2.5,inf").values == [1.0, 2.5, math.inf]
    assert Sweep.parse("concurrency=1,4").label(4) == "concurrency 4"
    for bad in ("qps=1", "rate=", "concurrency=1.5", "rate=-1"):
        with pytest.raises(ValueError):
            Sweep.parse(bad)


# ---- seeds: fresh prompts per invocation unless --seed is given --------------------------------


def invocation_prompts(argv: list[str]) -> list[list[int]]:
    """The random prompts the first run of one `tandem bench` invocation with ``argv`` sends."""
    import argparse

    from loadgen.cli import add_args, settle_args, workload_config
    from loadgen.workload import build_workload

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--backend", "zmq", "-n", "4", "--input-len", "16", *argv])
    settle_args(args)
    specs = build_workload(workload_config(args), 0, True, None, vocab=list(range(1000)))
    return [s.prompt_ids for s in specs]


def test_every_invocation_draws_fresh_prompts_by_default() -> None:
    """Back to back against one server, two default invocations must not send the same prompts
    (the second would hit the prefix cache and report a TTFT several times too short)."""
    assert invocation_prompts([]) != invocation_prompts([])


def test_a_given_seed_repeats_the_prompts() -> None:
    assert invocation_prompts(["--seed", "7"]) == invocation_prompts(["--seed", "7"])
    assert invocation_prompts(["--seed", "7"]) != invocation_prompts(["--seed", "8"])


# ---- flags this run would not use are refused, naming what they need ---------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--connect-timeout", "5"], "--connect-timeout is for --backend zmq"),
        (["--backend", "openai-chat", "--pretok"], "--pretok applies to openai-completions only"),
        (["--output-interval", "4"], "--output-interval applies to --backend zmq only"),
        (["--address", "ipc:///tmp/e"], "--address is the engine's, for --backend zmq"),
        (
            ["--backend", "zmq", "--address", "ipc:///tmp/e", "--api-key", "k"],
            "--api-key: --backend zmq with --address asks no server",
        ),
        (["--backend", "zmq", "--model", "m"], "--model is for the HTTP backends"),
        (["--burstiness", "0.5"], "--burstiness shapes Poisson arrivals"),
        (["--interval", "0.1", "--burstiness", "2"], "--burstiness shapes Poisson arrivals"),
        (["--interval-mode", "relative"], "--interval-mode needs --interval"),
        (["--plot", "x.png"], "--plot draws a sweep"),
        (["--sweep", "rate=1,2", "--request-rate", "5"], "--sweep rate=... sets the rate"),
        (["--sweep", "concurrency=1,2", "--max-concurrency", "4"], "sets the cap of each run"),
        (["--unique-prompts"], "--unique-prompts applies to --prompt or --dataset"),
        (["--dataset-format", "jsonl"], "--dataset-format needs --dataset"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_a_flag_the_run_would_not_use_is_refused(argv: list[str], words: str) -> None:
    import argparse

    from loadgen.cli import add_args, settle_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    with pytest.raises(ValueError, match=re.escape(words)):
        settle_args(parser.parse_args(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "zmq", "--connect-timeout", "5"],
        ["--backend", "zmq", "--prompt", "hi", "--tokenizer", "default"],
        ["--backend", "zmq", "--tokenizer", "default"],  # a harness's, for any backend
        ["--backend", "zmq", "--api-key", "k"],  # for GET /v1/engine on a keyed server
        ["--request-rate", "4", "--burstiness", "0.5"],
        ["--sweep", "rate=1,2", "--burstiness", "0.5", "--plot", "x.png"],
        ["--sweep", "concurrency=1,2", "--request-rate", "5"],
        ["--interval", "0.1", "--interval-mode", "relative"],
        ["--prompt", "hi", "--unique-prompts"],
    ],
    ids=" ".join,
)
def test_the_same_flags_where_the_run_uses_them_are_taken(argv: list[str]) -> None:
    import argparse

    from loadgen.cli import add_args, settle_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    settle_args(parser.parse_args(argv))


def test_the_benchmarks_commands_pass_the_load_generators_checks(tmp_path: Path) -> None:
    """What `python -m benchmarks serving` runs, over HTTP and with the documented
    `--loadgen-args "--backend zmq"` (docs/benchmarks.md), is a run the load generator takes."""
    import argparse

    from benchmarks.servers import Workload, loadgen_command
    from loadgen.cli import add_args, settle_args

    for extra in ([], ["--backend", "zmq"]):
        command = loadgen_command(
            "http://127.0.0.1:8000", Workload(4, 16, 8), "default", tmp_path / "r.json", 1, 1, extra
        )
        parser = argparse.ArgumentParser()
        add_args(parser)
        settle_args(parser.parse_args(command[command.index("loadgen") + 1 :]))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--interval", "inf"], "--interval must be a finite number of seconds"),
        (["--temperature", "nan"], "--temperature must be a number >= 0"),
        (["--temperature", "-1"], "--temperature must be a number >= 0"),
        (["--seed", "-1"], "--seed must be in [0, 2^63)"),
        (["--result-json", "/proc/version/run.json"], "/proc/version is not a folder"),
        (["--result-json", "/proc"], "--result-json /proc is a folder"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_a_value_the_run_could_not_honour_is_refused_before_it(argv: list[str], words: str) -> None:
    """Each was taken and then hung (an infinite interval), failed every request (a NaN
    temperature), ended in a traceback (a negative seed) or lost the run's results at its end
    (a --result-json that cannot be written; one in folders still to be made is taken)."""
    import argparse

    from loadgen.cli import add_args, settle_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    with pytest.raises(ValueError, match=re.escape(words)):
        settle_args(parser.parse_args(argv))


def test_sweeps_and_slos_refuse_nan_and_limits_at_or_below_zero() -> None:
    from loadgen.metrics import Slo
    from loadgen.sweep import Sweep

    for text in ("rate=nan", "rate=1,nan", "concurrency=0"):
        with pytest.raises(ValueError, match="values must be > 0"):
            Sweep.parse(text)
    assert Sweep.parse("rate=1,inf").values == [1.0, math.inf]
    for text in ("ttft=nan", "tpot=-5", "e2e=0", "ttft=inf"):
        with pytest.raises(ValueError, match="a limit is a number of ms above 0"):
            Slo.parse(text)
    assert Slo.parse("ttft=500,e2e=2000") == Slo(ttft=0.5, e2e=2.0)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("not json", "line 2: Expecting value"),
        ('{"foo": 1}', "line 2: a JSONL line needs 'prompt' or 'prompt_token_ids'"),
        ('{"prompt": "hi", "output_len": 2.7}', "line 2: 'output_len' must be a whole number"),
        ('{"prompt": "hi", "output_len": 0}', "line 2: 'output_len' must be a whole number"),
        ('{"prompt_token_ids": [5, -1]}', "line 2: 'prompt_token_ids' must be a non-empty list"),
        ("[1, 2]", "line 2: not a JSON object"),
    ],
)
def test_a_bad_dataset_line_is_named(tmp_path: Path, line: str, words: str) -> None:
    from loadgen.workload import DatasetError

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine", "output_len": 4}\n' + line + "\n")
    with pytest.raises(DatasetError, match=re.escape(words)):
        load_dataset(path)
    # What JSON writers also write for whole numbers, and an empty id list beside a text.
    path.write_text('{"prompt_token_ids": [5.0, 6], "output_len": 3.0}\n{"prompt": "a", '
                    '"prompt_token_ids": []}\n')  # fmt: skip
    first, second = load_dataset(path)
    assert (first.prompt_ids, first.output_len) == ([5, 6], 3)
    assert (second.prompt_text, second.prompt_ids) == ("a", None)
    sharegpt = tmp_path / "d.json"
    sharegpt.write_text('{"not": "a list"}')
    with pytest.raises(DatasetError, match="not a ShareGPT JSON list"):
        load_dataset(sharegpt)


def test_a_result_json_in_folders_still_to_be_made_is_taken(tmp_path: Path) -> None:
    import argparse

    from loadgen.cli import add_args, settle_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    settle_args(parser.parse_args(["--result-json", str(tmp_path / "a" / "b" / "run.json")]))
