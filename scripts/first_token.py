"""Where an idle server's first token goes: one request at a time, seen from three places.

    python scripts/first_token.py [--model random:llama-1b] [--trials 20] [--prompt-len 128] \\
        [--json OUT] [-- extra tandem serve flags]

Starts ``tandem serve`` and, on an otherwise idle server, sends one request at a time (a fresh
random prompt each, so no prefix cache helps; greedy; one output token), alternating between

- ``http``: a streamed /v1/completions with a text prompt (validated, tokenized, sent to the
  engine, the token detokenized and written as SSE), timed from the request's first byte to the
  first SSE event that carries text, over a kept-alive connection;
- ``chat``: the same through /v1/chat/completions (the chat template applied too);
- ``zmq``: the raw ZMQ client (protocol/client.py) on the same engine core, token ids in and out,
  timed from ``add_request`` to the output that carries the token.

Every request's finishing output carries the engine's own timings (RequestTimings, on the
engine's clock): ``queue`` (arrival in the engine to its first step) and ``prefill`` (first step
to first token sampled and known on the host: schedule, prepare, forward, sample, copy). The raw
client reads them, and so the table splits the first token into:

- engine: queue + prefill;
- engine wake-up, IPC both ways and the send: zmq - queue - prefill;
- frontend (HTTP, JSON, tokenizer, detokenizer, SSE): http - zmq, and chat - zmq (whose
  prefill also holds the chat template's tokens); and the same less each HTTP request's own
  engine time (queue + prefill, from the server's /metrics before and after it) rather than
  the raw trial's, with the raw trials' wake-up and IPC;
- of which the tokenizer: the same prompt text tokenized in this process (the frontend's
  tokenizer, HF tokenizers).

Prints the medians (and p90) of each in ms, and the command. Random presets take the default
model's tokenizer ($TANDEM_TOKENIZER_DIR where the default model is absent, as on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_core.loader import tokenizer_dir_for_random  # noqa: E402
from protocol.client import EngineClient  # noqa: E402
from protocol.messages import RequestError, SamplingParams, StepOutputs  # noqa: E402

ENGINE_ADDRESS = re.compile(r"engine core: (\S+) \(pid")
# The API process's running sums of the engine's own queue and prefill times, over the requests
# it has finished: their change over one HTTP trial is that request's (one request at a time).
ENGINE_TIME_SAMPLES = {
    f"tandem_request_{kind}_time_seconds_{stat}": f"{kind}_{stat}"
    for kind in ("queue", "prefill")
    for stat in ("sum", "count")
}


@dataclass
class Trials:
    """Every trial's figures, in ms."""

    http: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    zmq: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    tokenize: list[float] = field(default_factory=list)
    http_prompt_tokens: list[int] = field(default_factory=list)  # as the server counted them
    chat_prompt_tokens: list[int] = field(default_factory=list)  # the chat template's included
    zmq_prompt_tokens: list[int] = field(default_factory=list)
    http_engine: list[float] = field(default_factory=list)  # the HTTP request's queue + prefill
    chat_engine: list[float] = field(default_factory=list)


def start_server(model: str, port: int, extra: list[str], log: Path) -> tuple[Any, str]:
    """``tandem serve`` on ``port``; returns its process and its engine core's raw address."""
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", model, "--port", str(port)]
    cmd += ["--max-model-len", "2048", *extra]
    print("$", shlex.join(cmd[1:]), flush=True)
    out = open(log, "w+b")  # noqa: SIM115 (held open for the server's whole life)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=False)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}; see {log}")
        match = ENGINE_ADDRESS.search(log.read_text(errors="replace"))
        if match and ready(port):
            return proc, match.group(1)
        time.sleep(0.5)
    raise RuntimeError("tandem serve was not ready after 600 s")


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def random_prompt(rng: random.Random, tokenizer: Any, length: int) -> tuple[list[int], str]:
    """A random text of exactly ``length`` tokens, and the ids the frontend sends for it.

    Random ids decode to a text that tokenizes to a few more (134 for 128 on SmolLM2's
    vocabulary): a prompt sent as text would then prefill more tokens over HTTP than the raw
    ZMQ trial, and its longer prefill would be counted as the frontend's. So the text is
    tokenized again and cut to ``length``, until it tokenizes back to itself (one round, as a
    rule). The ids returned are the text's with the tokenizer's special tokens (a BOS, where it
    adds one), as the frontend tokenizes a completions prompt."""
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


def first_sse_text(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """(ms from sending a streamed request to the first SSE event that carries its token, the
    prompt tokens the server counted in its usage chunk)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    elapsed = prompt_tokens = None
    with client.stream("POST", url, json=body, timeout=120) as resp:
        resp.raise_for_status()
        # Read to the end, so the next trial starts on an idle server.
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if elapsed is None and carries_token(event):
                elapsed = (time.perf_counter() - start) * 1e3
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
    if elapsed is None or prompt_tokens is None:
        raise RuntimeError(f"no token or no usage came back from {url}")
    return elapsed, prompt_tokens


def engine_time_sums(client: httpx.Client, root: str) -> dict[str, float]:
    """{"queue_sum", "queue_count", "prefill_sum", "prefill_count"} from the server's /metrics."""
    return parse_engine_time_sums(client.get(f"{root}/metrics").text)


def parse_engine_time_sums(text: str) -> dict[str, float]:
    """ENGINE_TIME_SAMPLES' values in a /metrics text, each summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(ENGINE_TIME_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (key := ENGINE_TIME_SAMPLES.get(sample.name)) is not None:
                sums[key] += sample.value
    return sums


def http_trial(
    client: httpx.Client, root: str, path: str, body: dict[str, Any]
) -> tuple[float, int, float]:
    """(first_sse_text's ms and prompt tokens, the engine's queue + prefill ms for the request,
    read from the server's /metrics before and after it)."""
    before = engine_time_sums(client, root)
    ms, prompt_tokens = first_sse_text(client, f"{root}/v1/{path}", body)
    after = engine_time_sums(client, root)
    if after["prefill_count"] - before["prefill_count"] != 1:
        raise RuntimeError(f"/metrics did not count exactly one finished request for {path}")
    engine_s = sum(after[f"{kind}_sum"] - before[f"{kind}_sum"] for kind in ("queue", "prefill"))
    return ms, prompt_tokens, engine_s * 1e3


def zmq_first_token(client: EngineClient, rid: str, ids: list[int], trials: Trials) -> None:
    """The raw client's first token, and the engine's own queue and prefill times."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
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
                trials.zmq.append((time.perf_counter() - start) * 1e3)
                if out.timings is None:
                    raise RuntimeError("the engine sent no timings with a finished request")
                trials.queue.append(out.timings.queue_s * 1e3)
                trials.prefill.append(out.timings.prefill_s * 1e3)
                return


def run_trials(port: int, address: str, args: argparse.Namespace) -> Trials:
    from tokenizers import Tokenizer

    tokenizer_dir = tokenizer_dir_for_random() if args.model.startswith("random:") else None
    tokenizer = Tokenizer.from_file(str((tokenizer_dir or Path(args.tokenizer)) / "tokenizer.json"))
    rng = random.Random(args.seed)
    trials = Trials()
    root = f"http://127.0.0.1:{port}"
    with httpx.Client() as http, EngineClient(address) as raw:
        raw.connect()
        model = http.get(f"{root}/v1/models").json()["data"][0]["id"]
        for trial in range(args.warmup + args.trials):
            keep = trial >= args.warmup
            sample = Trials()
            ids, text = random_prompt(rng, tokenizer, args.prompt_len)
            start = time.perf_counter()
            tokenizer.encode(text)
            sample.tokenize.append((time.perf_counter() - start) * 1e3)
            body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
            ms, prompt_tokens, engine_ms = http_trial(http, root, "completions", body)
            sample.http.append(ms)
            sample.http_prompt_tokens.append(prompt_tokens)
            sample.http_engine.append(engine_ms)
            _, text = random_prompt(rng, tokenizer, args.prompt_len)
            chat = {"messages": [{"role": "user", "content": text}]}
            chat |= {k: body[k] for k in ("model", "max_tokens", "temperature")}
            ms, prompt_tokens, engine_ms = http_trial(http, root, "chat/completions", chat)
            sample.chat.append(ms)
            sample.chat_prompt_tokens.append(prompt_tokens)
            sample.chat_engine.append(engine_ms)
            ids, _ = random_prompt(rng, tokenizer, args.prompt_len)
            zmq_first_token(raw, f"first-token-{trial}", ids, sample)
            sample.zmq_prompt_tokens.append(len(ids))
            if keep:
                for name, values in asdict(sample).items():
                    getattr(trials, name).extend(values)
    return trials


def count_summary(counts: list[int]) -> str:
    return f"{statistics.median(counts):g} ({min(counts)}-{max(counts)})"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(trials: Trials, args: argparse.Namespace) -> None:
    med = {name: statistics.median(v) for name, v in asdict(trials).items()}
    p90 = {name: quantile(v, 0.9) for name, v in asdict(trials).items()}
    ipc = [z - q - p for z, q, p in zip(trials.zmq, trials.queue, trials.prefill, strict=True)]
    rows = [
        ("first token over HTTP, /v1/completions (text prompt)", "http"),
        ("  its engine time: queue + prefill (the server's /metrics)", "http_engine"),
        ("first token over HTTP, /v1/chat/completions", "chat"),
        ("  its engine time: queue + prefill (the server's /metrics)", "chat_engine"),
        ("first token over raw ZMQ (token ids)", "zmq"),
        ("  engine: arrival to first step (queue)", "queue"),
        ("  engine: first step to first token on the host (prefill)", "prefill"),
    ]
    print(f"\n{args.model}, prompt {args.prompt_len} tokens, {len(trials.zmq)} trials each")
    completions, chat = trials.http_prompt_tokens, trials.chat_prompt_tokens
    print(
        f"prompt tokens as the server counted them, median (range): completions "
        f"{count_summary(completions)}, chat {count_summary(chat)} (its template's included); "
        f"raw ZMQ {count_summary(trials.zmq_prompt_tokens)}"
    )
    print("| part | median ms | p90 ms |\n|---|---|---|")
    for label, name in rows:
        print(f"| {label} | {med[name]:.2f} | {p90[name]:.2f} |")
    print(
        f"|   wake-up, IPC and send (zmq - queue - prefill) | "
        f"{statistics.median(ipc):.2f} | {quantile(ipc, 0.9):.2f} |"
    )
    for label, name in (("completions", "http"), ("chat", "chat")):
        diff = [h - z for h, z in zip(getattr(trials, name), trials.zmq, strict=True)]
        print(
            f"| frontend, {label} ({name} - zmq) | {statistics.median(diff):.2f} | "
            f"{quantile(diff, 0.9):.2f} |"
        )
        # Its own engine time, not the raw trial's: the two requests' prefills may differ.
        engine = getattr(trials, f"{name}_engine")
        own = [h - e - i for h, e, i in zip(getattr(trials, name), engine, ipc, strict=True)]
        print(
            f"|   the same, less its own engine time ({name} - {name}_engine - wake-up and "
            f"IPC) | {statistics.median(own):.2f} | {quantile(own, 0.9):.2f} |"
        )
    print(
        f"|   of which tokenizing the prompt (here) | {med['tokenize']:.2f} | "
        f"{p90['tokenize']:.2f} |"
    )


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-1b")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model's own)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="trials run first and not counted")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every trial's figures here")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    return args, extra


def main() -> None:
    args, extra = parse_args()
    if args.tokenizer is None and not args.model.startswith("random:"):
        from engine_core.loader import resolve_model_dir

        args.tokenizer = str(resolve_model_dir(args.model))
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"first-token-serve-{args.port}.log"
    proc, address = start_server(args.model, args.port, extra, log)
    try:
        trials = run_trials(args.port, address, args)
    finally:
        stop(proc)
    print_table(trials, args)
    print(f"\ncommand: python {shlex.join(sys.argv)}")
    if args.json:
        args.json.write_text(json.dumps(asdict(trials), indent=1) + "\n")


if __name__ == "__main__":
    main()
