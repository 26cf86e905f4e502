"""A real `tandem engine` process on the default model, driven over ZMQ by the raw client."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq

from protocol.address import EngineAddress, private_ipc_address, remove_ipc_files
from protocol.client import EngineClient
from protocol.messages import (
    PROTOCOL_VERSION,
    ControlKind,
    FinishReason,
    MsgType,
    RequestError,
    SamplingParams,
    StepOutputs,
)
from tests.server_fixture import outputs_of

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How do I boil an egg?",
    "Say hello in Spanish.",
]


@dataclass
class Engine:
    address: EngineAddress
    process: subprocess.Popen


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    address = private_ipc_address()
    cmd = [
        sys.executable,
        "-m",
        "frontend.cli",
        "engine",
        "--model",
        "default",
        "--address",
        str(address),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "64",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd)
    try:
        with EngineClient(address) as probe:
            probe.connect(timeout=180)
        yield Engine(address, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        remove_ipc_files(address)


@pytest.fixture(scope="module")
def chat_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from engine_core.model_dir import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    out = []
    for text in CHATS:
        templated = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        out.append(tok.encode(templated, add_special_tokens=False))
    return out


def hf_greedy(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from engine_core.model_dir import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir("default")), dtype=torch.float32
    ).eval()
    results = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
        results.append(out[0, len(ids) :].tolist())
    return results


def collect(client: EngineClient, expected: set[str], timeout: float = 300) -> dict[str, list]:
    """Read StepOutputs until every expected id has finished: id -> [tokens, reason]."""
    return {
        rid: [[t for out in outs for t in out.new_token_ids], outs[-1].finish_reason]
        for rid, outs in outputs_of(client, expected, timeout).items()
    }


def assert_all_blocks_free(client: EngineClient) -> None:
    stats = client.control(ControlKind.STATS).stats
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
    assert client.control(ControlKind.CHECK_INTEGRITY).ok


def test_fifty_concurrent_requests_match_hf(engine: Engine, chat_prompts: list[list[int]]) -> None:
    max_tokens = 12
    expected = hf_greedy(chat_prompts, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with EngineClient(engine.address) as client:
        client.connect(timeout=30)
        ids = {}
        for i in range(50):
            rid = f"req-{i}"
            ids[rid] = i % len(chat_prompts)
            client.add_request(rid, chat_prompts[ids[rid]], params)
        results = collect(client, set(ids))
        for rid, prompt_index in ids.items():
            tokens, reason = results[rid]
            assert tokens == expected[prompt_index], rid
            eos_stop = tokens and tokens[-1] == 2
            assert reason == (FinishReason.STOP if eos_stop else FinishReason.LENGTH)
        assert_all_blocks_free(client)


def test_abort_mid_generation_returns_every_block(
    engine: Engine, chat_prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    with EngineClient(engine.address) as client:
        client.connect(timeout=30)
        client.add_request("long", chat_prompts[0], params)
        seen = 0
        while seen < 3:
            msg = client.recv(timeout=30)
            if isinstance(msg, StepOutputs):
                seen += sum(len(o.new_token_ids) for o in msg.outputs)
        client.abort(["long"])
        results = collect(client, {"long"})
        assert results["long"][1] == FinishReason.ABORT
        assert len(results["long"][0]) < 500
        assert_all_blocks_free(client)


def test_an_output_interval_sends_tokens_in_runs_of_that_many(
    engine: Engine, chat_prompts: list[list[int]]
) -> None:
    """A request's first token comes alone, then its tokens come ``output_interval`` at a time
    (one token a step), then what is left with its end: HF's greedy tokens all the same, with
    one logprob per token when asked for."""
    max_tokens = 14
    prompts = chat_prompts[:3]
    expected = hf_greedy(prompts, max_tokens)
    requests = {  # id -> (prompt index, output interval, logprobs)
        "every-step": (0, 1, None),
        "by-4": (1, 4, None),
        "by-5-logprobs": (2, 5, 2),
        "by-13": (0, 13, 0),
        "longer-than-the-output": (1, 1000, None),
    }
    with EngineClient(engine.address) as client:
        client.connect(timeout=30)
        for rid, (i, interval, logprobs) in requests.items():
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                logprobs=logprobs,
                prompt_logprobs=1 if rid == "by-4" else None,
            )
            client.add_request(rid, prompts[i], params, output_interval=interval)
        outputs = outputs_of(client, set(requests))
        # Prompt logprobs come with the first token, not held back with the tokens after it.
        prompt_logprobs = [out.prompt_logprobs for out in outputs["by-4"]]
        assert len(prompt_logprobs[0]) == len(prompts[1]) - 1
        assert prompt_logprobs[1:] == [None] * (len(prompt_logprobs) - 1)
        for rid, (i, interval, logprobs) in requests.items():
            runs = [len(out.new_token_ids) for out in outputs[rid]]
            tokens = [t for out in outputs[rid] for t in out.new_token_ids]
            assert tokens == expected[i], rid
            assert runs[0] == 1, (rid, runs)
            assert all(n == interval for n in runs[1:-1]), (rid, runs)
            assert 1 <= runs[-1] <= interval or len(runs) == 1, (rid, runs)
            assert [out.finish_reason is not None for out in outputs[rid]][-1]
            for out in outputs[rid]:
                if logprobs is None:
                    assert out.logprobs is None
                else:
                    assert len(out.logprobs) == len(out.new_token_ids), rid
                    assert all(len(lp.top_token_ids) == logprobs for lp in out.logprobs)
        assert_all_blocks_free(client)


def test_an_abort_drops_the_held_tokens_and_frees_the_blocks(
    engine: Engine, chat_prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    with EngineClient(engine.address) as client:
        client.connect(timeout=30)
        client.add_request("held", chat_prompts[0], params, output_interval=10_000)
        first: list[int] = []
        deadline = time.monotonic() + 300
        while not first:
            assert time.monotonic() < deadline, "no first token"
            msg = client.recv(timeout=1.0)
            if isinstance(msg, StepOutputs):
                first = [t for o in msg.outputs for t in o.new_token_ids]
        assert len(first) == 1  # the first token comes at once
        steps = client.control(ControlKind.STATS).stats.num_steps
        while client.control(ControlKind.STATS).stats.num_steps < steps + 5:
            time.sleep(0.01)  # the request ran on, its tokens held back
        client.abort(["held"])
        results = collect(client, {"held"})
        assert results["held"] == [[], FinishReason.ABORT]
        assert_all_blocks_free(client)


def _bad_frames() -> list[bytes]:
    rng = random.Random(0)
    good = msgpack.packb([int(MsgType.ABORT), PROTOCOL_VERSION, ["x"]])
    return [
        b"",
        bytes(rng.randrange(256) for _ in range(64)),
        good[:-2],  # truncated
        msgpack.packb([int(MsgType.ABORT), PROTOCOL_VERSION + 7, ["x"]]),  # wrong version
        msgpack.packb([99, PROTOCOL_VERSION]),  # unknown type
        msgpack.packb([int(MsgType.ABORT), PROTOCOL_VERSION, "not-a-list"]),  # wrong field type
        msgpack.packb({"type": 2}),
        msgpack.packb([int(MsgType.ADD_REQUEST), PROTOCOL_VERSION, "bad", 12345, None]),
    ]


def test_malformed_frames_are_rejected_and_engine_keeps_serving(
    engine: Engine, chat_prompts: list[list[int]]
) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(engine.address.input)
    try:
        for frame in _bad_frames():
            raw.send(frame)
        raw.send_multipart([b"two", b"frames"])
    finally:
        time.sleep(0.2)
        raw.close()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with EngineClient(engine.address) as client:
        client.connect(timeout=30)
        client.add_request("after-garbage", chat_prompts[2], params)
        tokens, reason = collect(client, {"after-garbage"})["after-garbage"]
        assert len(tokens) >= 1 and reason is not None
        # A readable id with invalid fields is answered with an error for that id.
        client.add_request("bad-token", [10**9], params)
        assert next_error(client).request_id == "bad-token"
        # A readable frame whose fields the input thread refuses (max_tokens 0) is answered
        # with an error for its id too: the input thread hands it to the busy loop to send.
        from tests.test_engine_burst_intake import max_tokens_zero_frame

        client._input.send(max_tokens_zero_frame("refused-by-decoder"))
        error = next_error(client)
        assert error.request_id == "refused-by-decoder" and "max_tokens" in error.message
        assert_all_blocks_free(client)


def next_error(client: EngineClient, timeout: float = 30.0) -> RequestError:
    """The next RequestError the client receives (other messages skipped); fails at timeout."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        msg = client.recv(timeout=left)
        if isinstance(msg, RequestError):
            return msg
    raise AssertionError(f"no RequestError within {timeout:.0f} s")


def wait_idle(client: EngineClient, timeout: float = 60.0) -> Any:
    """Poll STATS until nothing runs or waits and every block is free; the last Stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.control(ControlKind.STATS).stats
        free = stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
        if stats.num_running == 0 and stats.num_waiting == 0 and free:
            return stats
        assert time.monotonic() < deadline, f"engine not idle after {timeout:.0f} s: {stats}"
        time.sleep(0.05)


def test_fuzzed_frames_leave_the_engine_serving(
    engine: Engine, chat_prompts: list[list[int]]
) -> None:
    """Hundreds of random and mutated frames on the input socket. Those that happen to decode
    to a valid AddRequest run until their first output finds no one to receive it, and are then
    aborted; a decoded SHUTDOWN is skipped (it is a legitimate command, not garbage)."""
    from protocol.codec import ProtocolError, decode_client_message, encode
    from protocol.messages import Abort, AddRequest, Control, Hello
    from tests.test_protocol import mutate_bytes

    rng = random.Random(5)
    seeds = [
        encode(Hello("fuzz")),
        encode(AddRequest("f", chat_prompts[0][:8], SamplingParams(max_tokens=4))),
        encode(Abort(["f", "g"])),
        encode(Control(ControlKind.STATS, 9)),
    ]
    frames = [rng.randbytes(rng.randrange(0, 80)) for _ in range(300)]
    for _ in range(500):
        frame = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            mutate_bytes(rng, frame)
        frames.append(bytes(frame))

    def is_shutdown(frame: bytes) -> bool:
        try:
            msg = decode_client_message(frame)
        except ProtocolError:
            return False
        return isinstance(msg, Control) and msg.kind == ControlKind.SHUTDOWN

    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(engine.address.input)
    try:
        for frame in frames:
            if not is_shutdown(frame):
                raw.send(frame)
        for _ in range(20):
            raw.send_multipart([rng.randbytes(8) for _ in range(rng.randrange(2, 5))])
    finally:
        time.sleep(0.2)
        raw.close()
    assert engine.process.poll() is None, "the engine died of garbage"
    with EngineClient(engine.address) as client:
        client.connect(timeout=30)
        client.add_request("after-fuzz", chat_prompts[1], SamplingParams(max_tokens=4))
        tokens, reason = collect(client, {"after-fuzz"})["after-fuzz"]
        assert len(tokens) == 4 and reason == FinishReason.LENGTH
        wait_idle(client)
        assert client.control(ControlKind.CHECK_INTEGRITY).ok


def test_a_vanished_client_has_its_requests_aborted(
    engine: Engine, chat_prompts: list[list[int]]
) -> None:
    """A raw client that disconnects without an Abort (killed, say): the engine's next output
    for it finds no one, and the engine aborts its requests instead of running them out."""
    max_tokens = 900
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with EngineClient(engine.address) as watcher:
        watcher.connect(timeout=30)
        steps_before = watcher.control(ControlKind.STATS).stats.num_steps
        gone = EngineClient(engine.address)
        gone.connect(timeout=30)
        gone.add_request("orphan", chat_prompts[3], params)
        while not isinstance(gone.recv(timeout=30), StepOutputs):
            pass  # it is generating
        gone.close()  # no Abort: the connection just goes away
        stats = wait_idle(watcher)
        assert stats.num_steps - steps_before < max_tokens  # cut short, not run to the end
        assert watcher.control(ControlKind.CHECK_INTEGRITY).ok


def test_python_dash_m_engine_core_is_the_engine_command() -> None:
    """`tandem serve` starts its engine cores as ``python -m engine_core``: it takes the same
    flags as `tandem engine` and refuses a bad one the same way (exit status 2, the flag named)."""
    for argv in (["-m", "engine_core"], ["-m", "frontend.cli", "engine"]):
        done = subprocess.run(
            [sys.executable, *argv, "--max-num-seqs", "0"], capture_output=True, text=True
        )
        assert done.returncode == 2, done.stderr
        assert "max_num_seqs" in done.stderr or "max-num-seqs" in done.stderr, done.stderr
