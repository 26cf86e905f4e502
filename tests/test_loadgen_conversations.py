"""The load generator's multi-turn chat workload (`--conversations C --turns T
--shared-prefix-len N`): what it sends, checked against an HTTP server on loopback that records
every request body and answers each with a reply text of its own; and the flags it refuses.

The real engine's side (prompt tokens growing turn by turn, prefix-cache hits) is in
tests/test_loadgen_multi_turn_live.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from frontend.cli import main as tandem_main
from loadgen.workload import Conversation, LenRange, WorkloadConfig, build_conversations

C, T, PREFIX, USER, OUT = 3, 3, 24, 6, 4  # conversations, turns, system, user, output tokens


class RecordingHandler(BaseHTTPRequestHandler):
    """/v1/models, and a streamed completion or chat answer whose text is unique per request
    ("reply N"), its body appended to the server's ``bodies``."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the load generator's lanes expect

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_body(json.dumps({"data": [{"id": "m", "root": "m"}]}), "application/json")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        server: RecordingServer = self.server  # type: ignore[assignment]
        with server.lock:
            server.bodies.append(body)
            reply = f" reply {len(server.bodies)}"
        chat = "messages" in body
        pieces = [reply[:4], reply[4:]]  # two text events: the reply is joined, not the last one
        events = [self.choice(text, None, chat) for text in pieces]
        events.append(self.choice("", "length", chat))
        events.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
        stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_body(stream, "text/event-stream")

    @staticmethod
    def choice(text: str, finish: str | None, chat: bool) -> dict[str, Any]:
        part = {"delta": {"content": text}} if chat else {"text": text}
        return {"choices": [{"index": 0, **part, "finish_reason": finish}]}

    def send_body(self, text: str, content_type: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class RecordingServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), RecordingHandler)
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def recorder() -> Iterator[RecordingServer]:
    server = RecordingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def bench(server: RecordingServer, tokenizer: Path, out: Path, *argv: str) -> dict[str, Any]:
    args = ["bench", "--url", server.url, "--tokenizer", str(tokenizer), "--no-progress"]
    args += ["--conversations", str(C), "--turns", str(T), "--shared-prefix-len", str(PREFIX)]
    args += ["--input-len", str(USER), "--output-len", str(OUT), "--ignore-eos"]
    args += ["--result-json", str(out)]
    assert tandem_main([*args, *argv]) == 0
    return json.loads(out.read_text())


def conversations_of(bodies: list[dict[str, Any]]) -> list[list[Any]]:
    """The bodies grouped into conversations by their first user message, in sending order."""
    groups: dict[str, list[Any]] = {}
    for body in bodies:
        groups.setdefault(body["messages"][1]["content"], []).append(body)
    return list(groups.values())


def test_chat_turns_carry_the_whole_conversation(
    recorder: RecordingServer, default_model_dir: Path, tmp_path: Path
) -> None:
    doc = bench(recorder, default_model_dir, tmp_path / "chat.json", "--backend", "openai-chat",
                "--warmup-runs", "1")  # fmt: skip
    warm_up, measured = recorder.bodies[: C * T], recorder.bodies[C * T :]
    assert len(measured) == C * T
    # The reply each request got, by the server's count: " reply N" for the N-th body.
    reply_of = {id(b): f" reply {i + 1}" for i, b in enumerate(recorder.bodies)}
    systems = set()
    for bodies in (warm_up, measured):
        convs = conversations_of(bodies)
        assert len(convs) == C and all(len(turns) == T for turns in convs)
        run_systems = {turn["messages"][0]["content"] for turns in convs for turn in turns}
        assert len(run_systems) == 1  # one system prompt shared by every conversation
        systems |= run_systems
        for turns in convs:
            for k, turn in enumerate(turns):
                messages = turn["messages"]
                assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * k + [
                    "user"
                ]
                assert turn["max_tokens"] == OUT and turn["ignore_eos"] is True
                if k:  # turn k = turn k-1's messages, the reply it got, a new user message
                    before = turns[k - 1]["messages"]
                    reply = {"role": "assistant", "content": reply_of[id(turns[k - 1])]}
                    assert messages[:-1] == [*before, reply]
                    assert messages[-1]["content"] not in [m["content"] for m in before]
    assert len(systems) == 2  # drawn afresh for each run: the warm-up's is not the run's
    # The records: one per turn, in conversation then turn order, each turn sent after the
    # previous one ended, its reply kept.
    (run,) = doc["runs"]
    records = run["requests"]
    assert [(r["conversation"], r["turn"]) for r in records] == [
        (c, k) for c in range(C) for k in range(T)
    ]
    for earlier, later in zip(records, records[1:], strict=False):
        if later["turn"]:
            assert later["submitted_at"] >= earlier["ended_at"]
    assert all(r["ok"] and r["reply"].startswith(" reply ") for r in records)
    assert run["summary"]["completed"] == C * T and doc["config"]["num_requests"] == C * T


def test_completions_turns_join_the_same_texts(
    recorder: RecordingServer, default_model_dir: Path, tmp_path: Path
) -> None:
    bench(recorder, default_model_dir, tmp_path / "text.json", "--backend", "openai-completions")
    prompts = [b["prompt"] for b in recorder.bodies]
    assert len(prompts) == C * T and all("messages" not in b for b in recorder.bodies)
    reply_of = {p: f" reply {i + 1}" for i, p in enumerate(prompts)}
    # Each later turn's prompt begins with an earlier turn's prompt and the reply it got.
    followed = [
        p for p in prompts if any(p.startswith(q + "\n" + reply_of[q] + "\n") for q in prompts)
    ]
    assert len(followed) == C * (T - 1)
    heads = {p.split("\n")[0] for p in prompts}
    assert len(heads) == 1  # every prompt opens with the one system prompt


def test_conversations_share_the_system_prompt_and_draw_fresh_users() -> None:
    tok = FakeTokenizer()
    cfg = WorkloadConfig(
        num_requests=6, input_len=LenRange(3, 5), output_len=LenRange(7, 7), seed=11,
        conversations=2, turns=3, shared_prefix_len=10,
    )  # fmt: skip
    first, second = build_conversations(cfg, 0, tok), build_conversations(cfg, 1, tok)
    assert first[0].system == first[1].system and len(first[0].system.split()) == 10
    assert first[0].system != second[0].system
    assert first[0].users != first[1].users and first[0].output_lens == [7, 7, 7]
    assert all(3 <= len(u.split()) <= 5 for c in first for u in c.users)


def test_a_turn_needs_the_replies_before_it() -> None:
    conversation = Conversation(0, None, ["a", "b"], [1, 1])
    assert conversation.turn(0).messages == [{"role": "user", "content": "a"}]
    with pytest.raises(ValueError, match="turn 1 of conversation 0 before turn 0's reply"):
        conversation.turn(1)
    conversation.add_reply("r")
    spec = conversation.turn(1)
    assert spec.prompt_text == "a\nr\nb" and spec.keep_reply and spec.output_len == 1


class FakeTokenizer:
    """Ids as words: a decoded text's words are its ids."""

    all_special_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{i}" for i in ids)

    def __len__(self) -> int:
        return 100


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--turns", "2"], "--turns and --shared-prefix-len need --conversations"),
        (["--shared-prefix-len", "8"], "need --conversations"),
        (["--conversations", "2", "-n", "4"], "-n/--num-requests"),
        (["--conversations", "2", "--backend", "zmq"], "--backend zmq"),
        (["--conversations", "2", "--pretok"], "--pretok"),
        (["--conversations", "2", "--sweep", "rate=1,2"], "--sweep"),
        (["--conversations", "2", "--prompt", "hi"], "--prompt"),
        (["--conversations", "0"], "--conversations and --turns must be >= 1"),
    ],
)
def test_flags_a_conversation_cannot_honour_are_refused(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tandem_main(["bench", "--url", "http://127.0.0.1:9", *argv]) == 2
    assert named in capsys.readouterr().err
