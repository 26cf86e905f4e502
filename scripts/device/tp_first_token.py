"""Where a burst's first tokens go over raw ZMQ, by tensor-parallel size: the arrival time of each
StepOutputs and how many first tokens it carries, for bench_decode's warm-up and three bursts of
64 requests (main, fresh prompts, main again: prefix cached). Written to find why llama-8b with
TP=2 took 712 ms to its first tokens over ZMQ against 109 ms in process (2026-11-23).

    python scripts/device/tp_first_token.py --model llama-8b --tensor-parallel-sizes 2,1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_decode
import bench_decode as bd  # noqa: E402

from protocol.client import EngineClient  # noqa: E402
from protocol.messages import StepOutputs  # noqa: E402


def burst(client: Any, work: bd.Workload, vocab: int, tag: str) -> str:
    """Send the workload at once; one line: send time, the first messages, the end."""
    prompts = work.prompts(vocab)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        client.add_request(rid, prompt, work.params)
    sent_ms = (time.perf_counter() - start) * 1e3
    pending, seen, events = set(ids), set(), []
    while pending:
        msg = client.recv(timeout=120.0)
        if msg is None:
            raise TimeoutError("nothing for 120 s")
        if not isinstance(msg, StepOutputs):
            continue
        now_ms = (time.perf_counter() - start) * 1e3
        firsts = sum(o.request_id not in seen for o in msg.outputs)
        seen.update(o.request_id for o in msg.outputs)
        events.append((now_ms, len(msg.outputs), firsts))
        pending.difference_update(o.request_id for o in msg.outputs if o.finish_reason)
        pending.difference_update(msg.finished_without_tokens)
    head = "; ".join(f"{t:.1f} ms: {n} out, {f} first" for t, n, f in events[:5])
    end = f"{len(events)} msgs, end {events[-1][0]:.0f} ms"
    return f"{tag}: sent in {sent_ms:.1f} ms | {head} | {end}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--tensor-parallel-sizes", default="2,1")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    opts = parser.parse_args()
    work = bd.Workload(opts.num_requests, 128, 256, seed=0)
    vocab = bd.PRESETS[opts.model].vocab_size
    for tp in map(int, opts.tensor_parallel_sizes.split(",")):
        args = bd.parse_args(["--tensor-parallel-size", str(tp), "--device", opts.device])
        with (
            bd.engine_process(opts.model, work, args) as (address, proc),
            EngineClient(address) as client,
        ):
            bd.connect(client, proc, args.engine_start_timeout)
            print(f"== {opts.model} TP={tp}", flush=True)
            print(burst(client, work.shorter(16, seed=1), vocab, "warmup"), flush=True)
            print(burst(client, work, vocab, "main"), flush=True)
            print(burst(client, work.shorter(256, seed=2), vocab, "fresh"), flush=True)
            print(burst(client, work, vocab, "again"), flush=True)


if __name__ == "__main__":
    main()
