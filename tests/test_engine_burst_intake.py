"""The engine process's input thread reads a burst whole (engine_core/server.py, BURST_GAP_S):
real ZMQ sockets and the real codec, with the arrivals during its short waits played by a stand-in
for ``time.sleep`` so that nothing depends on this machine's timing."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import msgpack
import pytest
import zmq

import engine_core.server as proc
from engine_core.server import EngineServer
from protocol.codec import encode
from protocol.messages import AddRequest, Hello, RequestError, SamplingParams


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A ROUTER (the engine's input side) and a DEALER client connected to it in process."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://burst")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("inproc://burst")
    yield router, dealer
    dealer.close(linger=0)
    router.close(linger=0)
    ctx.term()


def _reader(waiting_for_work: bool) -> EngineServer:
    """An EngineServer with only what the input thread touches (no model behind it)."""
    engine = object.__new__(EngineServer)
    engine.waiting_for_work = waiting_for_work
    engine.inbox = queue.Queue()
    return engine


def _add(i: int) -> bytes:
    return encode(AddRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2)))


def _ids(taken: list) -> list[str]:
    return [msg.request_id for _, msg in taken]


def _wait_queued(router: zmq.Socket) -> None:
    assert router.poll(2000), "the message never reached the socket"


def test_lone_message_is_handed_over_without_waiting(sockets, monkeypatch) -> None:
    router, dealer = sockets
    waits: list[float] = []
    monkeypatch.setattr(proc.time, "sleep", waits.append)
    dealer.send(_add(0))
    _wait_queued(router)
    assert _ids(_reader(waiting_for_work=True)._read_burst(router)) == ["r0"]
    assert waits == []  # nothing queued behind it: not a burst, no wait


def test_idle_engine_takes_a_burst_still_arriving_whole(sockets, monkeypatch) -> None:
    router, dealer = sockets
    later = [_add(i) for i in range(2, 7)]

    def arrive(_seconds: float) -> None:  # the rest of the burst lands during the short waits
        if later:
            dealer.send(later.pop(0))
            _wait_queued(router)

    monkeypatch.setattr(proc.time, "sleep", arrive)
    dealer.send(_add(0))
    dealer.send(_add(1))
    _wait_queued(router)
    taken = _reader(waiting_for_work=True)._read_burst(router)
    assert _ids(taken) == [f"r{i}" for i in range(7)]
    assert later == []


def test_busy_engine_gets_what_is_queued_without_waiting(sockets, monkeypatch) -> None:
    router, dealer = sockets
    waits: list[float] = []
    monkeypatch.setattr(proc.time, "sleep", waits.append)
    for i in range(3):
        dealer.send(_add(i))
    _wait_queued(router)
    taken = _reader(waiting_for_work=False)._read_burst(router)
    # Everything already on the socket comes at once, but a stepping engine never waits.
    assert waits == []
    rest = _reader(waiting_for_work=False)
    while len(taken) < 3 and router.poll(2000):
        taken += rest._read_burst(router)
    assert _ids(taken) == ["r0", "r1", "r2"]


def test_burst_wait_is_bounded_by_burst_max(sockets, monkeypatch) -> None:
    router, dealer = sockets
    monkeypatch.setattr(proc, "BURST_GAP_S", 10.0)  # the gap rule alone would never end it
    sent = iter(range(2, 1_000_000))
    clock = iter(i * 0.0001 for i in range(1_000_000))  # every reading 0.1 ms later

    def arrive(_seconds: float) -> None:
        dealer.send(_add(next(sent)))
        _wait_queued(router)

    monkeypatch.setattr(proc.time, "sleep", arrive)
    monkeypatch.setattr(proc.time, "perf_counter", lambda: next(clock))
    dealer.send(_add(0))
    dealer.send(_add(1))
    _wait_queued(router)
    taken = _reader(waiting_for_work=True)._read_burst(router)
    # Arrivals never stop, but the wait ends at the first reading past BURST_MAX_S (at most a
    # message a reading, 0.1 ms apart), with the arrivals read so far.
    assert 2 < len(taken) <= 2 + int(proc.BURST_MAX_S / 0.0001)


def test_long_backlog_reaches_a_stepping_engine_in_slices(sockets, monkeypatch) -> None:
    router, dealer = sockets
    for i in range(40):
        dealer.send(_add(i))
    _wait_queued(router)
    clock = iter(i * 0.001 for i in range(1_000_000))  # every reading 1 ms later
    monkeypatch.setattr(proc.time, "perf_counter", lambda: next(clock))
    reader = _reader(waiting_for_work=False)
    first = reader._read_burst(router)
    # The first slice ends once BURST_MAX_S has passed on the (1 ms a reading) clock ...
    assert 1 < len(first) <= int(proc.BURST_MAX_S / 0.001) + 2
    # ... and the rest follow, in order, none lost.
    taken = list(first)
    while len(taken) < 40 and router.poll(2000):
        taken += reader._read_burst(router)
    assert _ids(taken) == [f"r{i}" for i in range(40)]


def test_malformed_message_in_a_burst_is_refused_and_the_rest_kept(sockets, monkeypatch) -> None:
    router, dealer = sockets
    monkeypatch.setattr(proc.time, "sleep", lambda _s: None)
    dealer.send(_add(0))
    dealer.send(max_tokens_zero_frame("bad"))
    dealer.send(b"\xc1 not msgpack")
    dealer.send(encode(Hello("test")))
    dealer.send(_add(1))
    _wait_queued(router)
    reader = _reader(waiting_for_work=True)
    taken: list = []
    while len(taken) < 3 and router.poll(2000):
        taken += reader._read_burst(router)
    assert [type(msg).__name__ for _, msg in taken] == ["AddRequest", "Hello", "AddRequest"]
    assert _ids([t for t in taken if isinstance(t[1], AddRequest)]) == ["r0", "r1"]
    refusals = [reader.inbox.get_nowait()[1] for _ in range(reader.inbox.qsize())]
    # The frame that names its request is refused to it (through the busy loop, which sends);
    # the unreadable one is only dropped.
    assert [(type(r), r.request_id) for r in refusals] == [(RequestError, "bad")]


def max_tokens_zero_frame(request_id: str) -> bytes:
    """A readable ADD_REQUEST for ``request_id`` whose max_tokens (0) the engine must refuse."""
    fields = msgpack.unpackb(encode(AddRequest(request_id, [1])), raw=False)
    fields[4][0] = 0  # the sampling parameters' first field: max_tokens
    return msgpack.packb(fields)
