"""`first-token`: where an idle server's first token goes, one request at a time, seen from
three places.

    python -m benchmarks first-token --model random:llama-1b --trials 20 --json OUT.json

Starts `tandem serve` and, on an otherwise idle server, sends one request at a time (a fresh
random prompt of exactly --prompt-len tokens each, so no prefix cache helps; greedy; one output
token), taking turns between

- ``http``: a streamed /v1/completions with a text prompt, timed from sending the request to
  the first SSE event that carries the token, over a kept-alive connection;
- ``chat``: the same through /v1/chat/completions (its template adds tokens);
- ``zmq``: the raw ZMQ client on the same engine core, token ids in and out.

The engine reports its own ``queue`` (arrival to its first step) and ``prefill`` (first step to
the token on the host) times with every finished request; the HTTP trials read theirs from the
server's /metrics before and after each. The table splits the first token into the engine's
time, the raw path's wake-up and IPC (zmq less queue and prefill) and the frontend's share
(HTTP less its own engine time, less that wake-up and IPC), with the tokenizer's part of it.

Random presets take the default model's tokenizer ($TANDEM_TOKENIZER_DIR where the default
model is absent, as on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import Provenance, fmt, format_table, percentile, write_json
from benchmarks.servers import Server, context_bound, start, stop, tandem_serve_command

# The API process's running sums of the engine's own queue and prefill times, over the requests
# it has finished: their change over one HTTP trial is that request's (one request at a time).
ENGINE_TIME_SAMPLES = {
    f"tandem_request_{kind}_time_seconds_{stat}": f"{kind}_{stat}"
    for kind in ("queue", "prefill")
    for stat in ("sum", "count")
}


@dataclass
class Trials:
    """Every kept trial's figures, in ms (prompt lengths in tokens)."""

    http: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    zmq: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    tokenize: list[float] = field(default_factory=list)
    http_engine: list[float] = field(default_factory=list)  # the HTTP request's queue + prefill
    chat_engine: list[float] = field(default_factory=list)
    http_prompt_tokens: list[int] = field(default_factory=list)  # as the server counted them
    chat_prompt_tokens: list[int] = field(default_factory=list)

    def extend(self, other: Trials) -> None:
        for name, values in asdict(other).items():
            getattr(self, name).extend(values)

    def wakeup_ipc(self) -> list[float]:
        """The raw path's time outside the engine's steps: zmq - queue - prefill."""
        return [z - q - p for z, q, p in zip(self.zmq, self.queue, self.prefill, strict=True)]

    def frontend(self, door: str) -> list[float]:
        """An HTTP door's time less its own engine time, less the raw path's wake-up and IPC."""
        totals, engine = getattr(self, door), getattr(self, f"{door}_engine")
        return [t - e - i for t, e, i in zip(totals, engine, self.wakeup_ipc(), strict=True)]


def random_prompt(rng: random.Random, tokenizer: Any, length: int) -> tuple[list[int], str]:
    """A random text of exactly ``length`` tokens, and the ids the frontend sends for it.

    Random ids decode to a text that tokenizes to a few more: sent as text, it would prefill
    more tokens over HTTP than over raw ZMQ, and the longer prefill would be booked as the
    frontend's. So the text is tokenized again and cut to ``length`` until it tokenizes back to
    itself. The ids carry the tokenizer's special tokens (a BOS, where it adds one), as the
    frontend tokenizes a completions prompt."""
    vocab = tokenizer.get_vocab_size()
    ids = [rng.randrange(1000, vocab) for _ in range(length)]
    for _ in range(10):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False).ids
        if again == ids:
            return tokenizer.encode(text).ids, text
        ids = again[:length]
        ids += [rng.randrange(1000, vocab) for _ in range(length - len(ids))]
    raise RuntimeError(f"no random text of {length} tokens that tokenizes back to itself")


def carries_token(event: dict[str, Any]) -> bool:
    """Whether an SSE event of a completion or chat stream carries the token: text, or the
    finish (a token whose text is still an incomplete character comes out with it)."""
    for choice in event.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text or choice.get("finish_reason"):
            return True
    return False


def parse_engine_time_sums(text: str) -> dict[str, float]:
    """ENGINE_TIME_SAMPLES' values in a /metrics text, each summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(ENGINE_TIME_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (key := ENGINE_TIME_SAMPLES.get(sample.name)) is not None:
                sums[key] += sample.value
    return sums


def sse_events(
    client: Any, url: str, body: dict[str, Any], timeout_s: float = 120
) -> Iterator[dict[str, Any]]:
    """Each JSON event of the stream that POSTing ``body`` to ``url`` answers, as it arrives."""
    with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[len("data: ") :])


def first_sse_token(client: Any, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """(ms from sending a streamed request to its first SSE event with the token, the prompt
    tokens the server counted in its usage chunk). Reads to the end, so the next trial starts
    on an idle server."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start_s = time.perf_counter()
    elapsed = prompt_tokens = None
    for event in sse_events(client, url, body):
        if elapsed is None and carries_token(event):
            elapsed = (time.perf_counter() - start_s) * 1e3
        if event.get("usage"):
            prompt_tokens = event["usage"]["prompt_tokens"]
    if elapsed is None or prompt_tokens is None:
        raise RuntimeError(f"no token or no usage came back from {url}")
    return elapsed, prompt_tokens


def http_trial(client: Any, root: str, door: str, body: dict[str, Any], into: Trials) -> None:
    """One HTTP trial through ``door`` ("http": completions, "chat"), with its own engine time
    from the server's /metrics before and after it."""
    path = "completions" if door == "http" else "chat/completions"
    before = parse_engine_time_sums(client.get(f"{root}/metrics").text)
    ms, prompt_tokens = first_sse_token(client, f"{root}/v1/{path}", body)
    after = parse_engine_time_sums(client.get(f"{root}/metrics").text)
    if after["prefill_count"] - before["prefill_count"] != 1:
        raise RuntimeError(f"/metrics did not count exactly one finished request for {path}")
    engine_s = sum(after[f"{k}_sum"] - before[f"{k}_sum"] for k in ("queue", "prefill"))
    getattr(into, door).append(ms)
    getattr(into, f"{door}_engine").append(engine_s * 1e3)
    getattr(into, f"{door}_prompt_tokens").append(prompt_tokens)


def zmq_trial(client: Any, rid: str, ids: list[int], into: Trials) -> None:
    """The raw client's first token, and the engine's own queue and prefill times."""
    from protocol.messages import RequestError, SamplingParams, StepOutputs

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start_s = time.perf_counter()
    client.add_request(rid, ids, params)
    while True:
        msg = client.recv(timeout=120.0)
        if msg is None:
            raise TimeoutError("the engine sent nothing for 120 s")
        if isinstance(msg, RequestError):
            raise RuntimeError(f"the engine refused {rid}: {msg.message}")
        if not isinstance(msg, StepOutputs):
            continue
        for out in msg.outputs:
            if out.request_id == rid and out.new_token_ids:
                into.zmq.append((time.perf_counter() - start_s) * 1e3)
                if out.timings is None:
                    raise RuntimeError("the engine sent no timings with a finished request")
                into.queue.append(out.timings.queue_s * 1e3)
                into.prefill.append(out.timings.prefill_s * 1e3)
                return


def run_trials(root: str, tokenizer: Any, args: argparse.Namespace) -> Trials:
    import httpx

    from protocol.client import EngineClient

    rng = random.Random(args.seed)
    trials = Trials()
    with httpx.Client() as http:
        address = http.get(f"{root}/v1/engine").json()["address"]
        model = http.get(f"{root}/v1/models").json()["data"][0]["id"]
        with EngineClient(address) as raw:
            raw.connect()
            for trial in range(args.warmup + args.trials):
                sample = one_round(http, raw, root, model, tokenizer, rng, args, trial)
                if trial >= args.warmup:
                    trials.extend(sample)
    return trials


def one_round(
    http: Any, raw: Any, root: str, model: str, tokenizer: Any, rng: random.Random,
    args: argparse.Namespace, trial: int,
) -> Trials:  # fmt: skip
    """One trial through each door, each with a prompt of its own."""
    sample = Trials()
    ids, text = random_prompt(rng, tokenizer, args.prompt_len)
    began = time.perf_counter()
    tokenizer.encode(text)
    sample.tokenize.append((time.perf_counter() - began) * 1e3)
    body = {"model": model, "max_tokens": 1, "temperature": 0}
    http_trial(http, root, "http", body | {"prompt": text}, sample)
    _, text = random_prompt(rng, tokenizer, args.prompt_len)
    http_trial(http, root, "chat", body | {"messages": [{"role": "user", "content": text}]}, sample)
    ids, _ = random_prompt(rng, tokenizer, args.prompt_len)
    zmq_trial(raw, f"first-token-{trial}", ids, sample)
    return sample


def format_trials(trials: Trials) -> str:
    rows = [
        ("first token over HTTP, /v1/completions", trials.http),
        ("  its engine time: queue + prefill (/metrics)", trials.http_engine),
        ("first token over HTTP, /v1/chat/completions", trials.chat),
        ("  its engine time: queue + prefill (/metrics)", trials.chat_engine),
        ("first token over raw ZMQ (token ids)", trials.zmq),
        ("  engine: arrival to first step (queue)", trials.queue),
        ("  engine: first step to first token on the host (prefill)", trials.prefill),
        ("  wake-up, IPC and send (zmq - queue - prefill)", trials.wakeup_ipc()),
        ("frontend, completions (less its engine time, wake-up, IPC)", trials.frontend("http")),
        ("frontend, chat (less its engine time, wake-up, IPC)", trials.frontend("chat")),
        ("  of which tokenizing the prompt (in this process)", trials.tokenize),
    ]  # fmt: skip
    cells = [[label, fmt(percentile(v, 50)), fmt(percentile(v, 90))] for label, v in rows]
    table = format_table(["part", "median ms", "p90 ms"], cells)
    counts = (
        f"prompt tokens as the server counted them, median: completions "
        f"{fmt(percentile(trials.http_prompt_tokens, 50), 'g')}, chat "
        f"{fmt(percentile(trials.chat_prompt_tokens, 50), 'g')} (its template's included)"
    )
    return f"{table}\n{counts}"


def load_tokenizer(args: argparse.Namespace) -> Any:
    from tokenizers import Tokenizer

    from engine_core.model_dir import resolve_model_dir, tokenizer_dir_for_random

    if args.tokenizer:
        folder = Path(args.tokenizer)
    elif args.model.startswith("random:"):
        folder = tokenizer_dir_for_random()
    else:
        folder = resolve_model_dir(args.model)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random:llama-1b", help="default: %(default)s")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model's own)")
    parser.add_argument("--trials", type=int, default=20, help="kept trials per door")
    parser.add_argument("--warmup", type=int, default=3, help="trials run first, not kept")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens (default: 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8160)
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    parser.add_argument("--json", type=Path, help="write the provenance and every trial here")


def run(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args)
    extra = shlex.split(args.tandem_args)
    server = Server(
        "tandem",
        tandem_serve_command(args.model, args.port, context_bound(args.model, 2048), extra),
        args.port,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-first-token-"))
    start(server, log_dir / "tandem-server.log")
    try:
        trials = run_trials(server.url, tokenizer, args)
    finally:
        stop(server)
    provenance = Provenance.here(args.argv)
    print(f"\n{provenance.format()}\nserver: {server.shown()}")
    print(f"{args.model}, prompt {args.prompt_len} tokens, {len(trials.zmq)} trials a door\n")
    print(format_trials(trials))
    if args.json:
        write_json(args.json, provenance, trials)
    return 0
