"""The engine core served over ZeroMQ (``EngineServer``, the engine-core process): an input
thread beside a lock-free busy loop.

    input thread:  ROUTER recv (a burst at a time) -> decode/validate -> inbox queue
    busy loop:     drain inbox (block only when idle) -> EngineCore.step() -> encode -> ROUTER send

Only the busy loop touches the EngineCore, so the scheduler, block manager and runner need no
locks. It also owns the output socket and sends every message itself: a ZMQ send only hands the
frame to ZMQ's own I/O thread (high-water marks are off, so it never blocks), while handing it to
a Python output thread made the busy loop wait for the interpreter lock about 1.6 times a step
(see ``_send``). Client request ids are scoped by the client's socket identity, so two clients may
reuse an id. A client the output socket can no longer reach has its requests aborted, so a
vanished client's requests never hold KV blocks. With ``parent_pid`` the engine exits on its own
within about a second of that process vanishing, even where no death signal reaches it. If the
input thread dies or a send fails, the process ends with the cause logged (``SocketFailed``): an
engine that can no longer hear requests or send outputs must not live on looking healthy, and its
supervisor starts a new one. Run as `tandem engine` or ``python -m engine_core``.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.processes import (
    STOP_FOR_GOOD,
    ParentWatch,
    freeze_startup_heap,
    spread_young_collections,
)
from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.profiler import EngineProfiler, ProfilerError
from engine_core.request import EngineOutput, HeldTokens, Request
from protocol.address import EngineAddress
from protocol.codec import StepOutputsFrame
from protocol.messages import (
    DROPPED_UNREACHABLE,
    HEARTBEAT_INTERVAL_S,
    Abort,
    AddRequest,
    ClientMessage,
    Control,
    ControlKind,
    ControlReply,
    EngineMessage,
    FinishReason,
    Heartbeat,
    Hello,
    Ready,
    RequestError,
    StepOutputs,
    TokenLogprobs,
)
from protocol.output_interval import IntervalCounter, OutputInterval

if TYPE_CHECKING:
    from protocol.curve import CurveServerKeys

logger = logging.getLogger("tandem.engine")

PARENT_POLL_S = 1.0
# Forgotten clients kept with their dropped requests' ids: clients that come back do so within a
# second or two, and each that never does (an API process killed) costs a short list.
FORGOTTEN_KEPT = 64
PARENT_GRACE_S = 5.0  # after the parent is gone: time for a clean stop before os._exit
_POLL_MS = 100
# A burst (requests sent together: a client's batch, a benchmark's 64 at once) should meet an idle
# engine whole. Woken by its first message alone, the busy loop would prefill that one while
# holding the GIL, and this thread would decode the rest only in the gaps of that step: the burst
# would take two or three prefill steps, not one (measured: a first step of 1-6 requests that
# waited 2-4 ms of its 4-9 ms for the GIL; docs/design/overlap-scheduling.md, "Burst intake in
# the input thread"). So where a second message is already queued behind the first, the input
# thread keeps reading while more arrive within BURST_GAP_S of the last (BURST_MAX_S in all)
# before it wakes the busy loop. A lone request never waits. A stepping engine gets what is
# queued without waiting (it takes new requests in at every step anyway), and a long backlog in
# slices of BURST_MAX_S of reading.
BURST_GAP_S = 0.0005
BURST_MAX_S = 0.004


class _Wake:
    """Internal inbox item: wakes an idle busy loop (to see that ``running`` went False)."""


class SocketFailed(RuntimeError):
    """The input thread died or a send raised: the process must end (and be restarted)."""


class _ThreadDied:
    """Internal inbox item: a socket thread raised ``error``; the busy loop raises in turn."""

    def __init__(self, name: str, error: BaseException) -> None:
        self.name = name
        self.error = error


def scoped_id(client: bytes, request_id: str) -> str:
    return f"{client.hex()}/{request_id}"


class EngineServer:
    def __init__(
        self,
        config: EngineConfig,
        address: EngineAddress,
        curve: CurveServerKeys | None = None,
        parent_pid: int | None = None,
    ) -> None:
        self.address = address
        self.curve = curve
        self.parent_pid = parent_pid
        # From the input thread: requests, and its refusals of malformed ones (RequestError) for
        # the busy loop to send, as it owns the output socket.
        self.inbox: queue.Queue[
            tuple[bytes, ClientMessage | RequestError | _Wake | _ThreadDied]
        ] = queue.Queue()
        self.out_sock: Any = None  # the output ROUTER, bound in run(); only the busy loop sends
        self.clients: set[bytes] = set()
        # Clients a send could not reach (forgotten), by the ids of the requests that dropped,
        # oldest first: one that speaks again is told (_welcome_back). At most FORGOTTEN_KEPT.
        self.forgotten: dict[bytes, list[str]] = {}
        self.running = True
        # Set with running = False where no restart will follow (stop_on_signals).
        self.stopped_for_good = False
        # Written by the busy loop only: True while it blocks on an empty inbox.
        self.waiting_for_work = False
        self._last_heartbeat = 0.0
        # Clients an announcement inside a step could not reach, forgotten after the step.
        self._unreachable: list[bytes] = []
        if parent_pid is not None:  # before loading: a parent may die while the weights load
            threading.Thread(target=self._watch_parent, daemon=True).start()
        self.core = EngineCore(config)
        self.core.announce_long_step = self._announce_long_step
        runner = self.core.runner
        self.profiler = EngineProfiler(config.profile_dir, runner.device.type == "cuda", runner)
        mc = self.core.model_config
        self.ready = Ready(
            model=config.model,
            max_model_len=self.core.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids),
            block_size=config.block_size,
            num_kv_blocks=self.core.runner.num_kv_blocks,
            max_num_seqs=self.core.config.max_num_seqs,  # as the runner resolved it
            embedding=mc.embedding,
            scheduling_policy=config.policy,
            pixel_dtype=str(self.core.runner.dtype).removeprefix("torch."),
        )

    # ---- threads ------------------------------------------------------------------------------

    def run(self) -> None:
        import zmq

        from protocol.address import bind_engine_sockets
        from protocol.curve import start_authenticator

        ctx = zmq.Context()
        auth = start_authenticator(ctx, self.curve) if self.curve is not None else None
        try:
            in_sock, out_sock = bind_engine_sockets(ctx, self.address, curve=self.curve)
        except BaseException:
            if auth is not None:
                auth.stop()
            ctx.term()
            raise
        self.out_sock = out_sock
        input_thread = self._socket_thread("input", self._input_loop, in_sock)
        input_thread.start()
        frozen = freeze_startup_heap()
        logger.debug("froze %d start-up objects out of the garbage collector's reach", frozen)
        spread_young_collections()
        try:
            self.busy_loop()
        finally:
            self.running = False
            input_thread.join(timeout=5)
            in_sock.close(linger=0)
            out_sock.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _socket_thread(self, name: str, loop: Callable[[Any], None], sock: Any) -> threading.Thread:
        """A daemon thread running ``loop(sock)``; if it raises, the busy loop is told at once."""

        def run() -> None:
            try:
                loop(sock)
            except BaseException as exc:
                logger.critical("the engine's %s thread died", name, exc_info=exc)
                self.inbox.put((b"", _ThreadDied(name, exc)))

        return threading.Thread(target=run, name=f"engine-{name}", daemon=True)

    def _watch_parent(self) -> None:
        """Stop when the parent process is gone; exit hard if a long step keeps us past the
        grace period, so an orphaned engine never holds the GPU."""
        assert self.parent_pid is not None
        parent = ParentWatch(self.parent_pid)
        while self.running:
            time.sleep(PARENT_POLL_S)
            if not parent.alive():
                break
        else:
            return
        logger.error("parent process %d is gone: stopping", self.parent_pid)
        self.running = False
        self.inbox.put((b"", _Wake()))
        time.sleep(PARENT_GRACE_S)
        logger.error("still running %.0f s after the parent died: exiting", PARENT_GRACE_S)
        os._exit(1)

    def _input_loop(self, sock: Any) -> None:
        while self.running:
            if sock.poll(_POLL_MS):
                for item in self._read_burst(sock):
                    self.inbox.put(item)

    def _read_burst(self, sock: Any) -> list[tuple[bytes, ClientMessage]]:
        """The message that woke the socket and every one queued behind it, decoded; while the
        busy loop waits for work and a burst is arriving, also those that follow within
        BURST_GAP_S of the last (see there why). Reading stops after BURST_MAX_S however many
        remain, so a long backlog reaches the busy loop in slices."""
        import zmq

        taken: list[tuple[bytes, ClientMessage]] = []
        self._decode_into(taken, sock.recv_multipart())
        start = last = time.perf_counter()
        burst = False
        while time.perf_counter() - start <= BURST_MAX_S:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                idle_burst = burst and self.waiting_for_work
                if not idle_burst or time.perf_counter() - last > BURST_GAP_S:
                    return taken
                time.sleep(BURST_GAP_S / 5)
                continue
            burst = True
            self._decode_into(taken, parts)
            last = time.perf_counter()
        return taken

    def _decode_into(self, taken: list[tuple[bytes, ClientMessage]], parts: list[bytes]) -> None:
        """Decode one (client, frame, *payloads) message onto ``taken``; a malformed one is
        dropped, and refused to its client where it names a request."""
        from protocol.codec import ProtocolError, decode_client_message

        if len(parts) < 2:
            logger.warning("dropped a message of %d frames (expected 2 or more)", len(parts))
            return
        client, frame, *payloads = parts
        try:
            taken.append((client, decode_client_message(frame, payloads)))
        except ProtocolError as exc:
            logger.warning("rejected a malformed message: %s", exc)
            if exc.request_id is not None:
                self.inbox.put((client, RequestError(exc.request_id, str(exc), 400)))

    # ---- sending (busy loop only) ---------------------------------------------------------------

    def _send(self, client: bytes, msg: EngineMessage | bytes) -> None:
        """Send one message (step outputs come encoded) to ``client`` on the output ROUTER.

        The busy loop sends itself: with high-water marks off the send never blocks, it only
        queues the frame for ZMQ's I/O thread (a few microseconds). An output thread cost more:
        each hand-off woke it, and it took the interpreter lock in the middle of the next step
        (at a torch call that let go of it), so the busy loop slept about 1.6 times a step
        waiting to get it back (the step's host work ran up to 0.25 ms slower over ZMQ than in
        process; docs/design/overlap-scheduling.md, "The engine process's threads").

        A client the ROUTER does not know (not connected yet, or gone) is forgotten; any other
        failure, encoding included, ends the engine (``SocketFailed``)."""
        if not self._deliver(client, msg):
            self._forget(client)

    def _deliver(self, client: bytes, msg: EngineMessage | bytes) -> bool:
        """``_send`` but for forgetting: whether the ROUTER knew ``client``."""
        from protocol.address import send_to_client
        from protocol.codec import encode

        try:
            frame = msg if type(msg) is bytes else encode(msg)
            return send_to_client(self.out_sock, client, frame)
        except Exception as exc:
            logger.critical("the engine's output socket failed", exc_info=exc)
            self.running = False
            raise SocketFailed(f"the output socket failed: {exc!r}") from exc

    # ---- busy loop ----------------------------------------------------------------------------

    def busy_loop(self) -> None:
        while self.running:
            self._drain_inbox(block=not self.core.has_unfinished())
            if self.running and self.core.has_unfinished():
                self._step()
            self._maybe_heartbeat()

    def _drain_inbox(self, block: bool) -> None:
        if block:
            self.waiting_for_work = True  # read by the input thread (see BURST_GAP_S)
            try:
                item = self.inbox.get(timeout=HEARTBEAT_INTERVAL_S)
            except queue.Empty:
                return
            finally:
                self.waiting_for_work = False
            self._handle(*item)
        while True:
            try:
                self._handle(*self.inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(
        self, client: bytes, msg: ClientMessage | RequestError | _Wake | _ThreadDied
    ) -> None:
        if client in self.forgotten:
            self._welcome_back(client)
        match msg:
            case AddRequest():
                self._add(client, msg)
            case Abort():
                self._abort(client, msg.request_ids)
            case Hello():
                self.clients.add(client)
                self._send(client, self.ready)
            case Control():
                self._control(client, msg)
            case RequestError():  # the input thread refused a malformed request
                self._send(client, msg)
            case _Wake():
                pass
            case _ThreadDied():
                self.running = False
                raise SocketFailed(
                    f"the {msg.name} socket thread died: {msg.error!r}"
                ) from msg.error

    def _forget(self, client: bytes) -> None:
        """The client is unreachable: stop heart-beating it and free what its requests hold. A
        dropped connection that ZMQ makes again looks the same from here, so the dropped
        requests are kept by id, for the client to hear of if it speaks again."""
        self.clients.discard(client)
        live = self.core.scheduler.requests.values()
        mine = [r for r in live if r.client_id == client]
        if mine:
            logger.warning("client %s is gone: aborting its %d requests", client.hex(), len(mine))
            self.core.abort([r.request_id for r in mine])
        dropped = self.forgotten.pop(client, [])  # moved to the end: the latest forgotten
        self.forgotten[client] = dropped + [r.client_request_id for r in mine]
        while len(self.forgotten) > FORGOTTEN_KEPT:  # clients that never came back
            del self.forgotten[next(iter(self.forgotten))]

    def _welcome_back(self, client: bytes) -> None:
        """A forgotten client speaks again (its connection dropped and was made again): heart-
        beat it again, and fail each request dropped meanwhile as DROPPED_UNREACHABLE, which
        the client may send again, rather than leave it waiting for outputs that never come."""
        dropped = self.forgotten.pop(client)
        self.clients.add(client)
        if not dropped:  # a handshake that had not reached the output socket yet, or idle
            return
        logger.warning(
            "client %s is back: telling it of its %d dropped requests", client.hex(), len(dropped)
        )
        message = "the engine could not reach this client for a moment and dropped the request"
        for i, request_id in enumerate(dropped):
            self._send(client, RequestError(request_id, message, DROPPED_UNREACHABLE))
            if client in self.forgotten:  # unreachable again: this one and the rest wait
                self.forgotten[client] += dropped[i:]
                return

    def _add(self, client: bytes, msg: AddRequest) -> None:
        request = Request.resumed(
            scoped_id(client, msg.request_id),
            msg.prompt_token_ids,
            msg.num_output_tokens,
            msg.params,
            client_id=client,
            client_request_id=msg.request_id,
            pooling=msg.pooling,
            lora=msg.lora,
            images=msg.images,
            priority=msg.priority,
        )
        if msg.output_interval > 1:
            request.held = HeldTokens(IntervalCounter(OutputInterval(msg.output_interval)))
        try:
            self.core.add_request(request)
        except ValueError as exc:
            self._send(client, RequestError(msg.request_id, str(exc), 400))

    def _abort(self, client: bytes, request_ids: list[str]) -> None:
        aborted = self.core.abort([scoped_id(client, rid) for rid in request_ids])
        if aborted:
            finished = {r.client_request_id: FinishReason.ABORT for r in aborted}
            self._send(client, StepOutputs([], finished))

    def _control(self, client: bytes, msg: Control) -> None:
        reply = ControlReply(msg.kind, msg.token)
        if msg.kind == ControlKind.STATS:
            reply = ControlReply(msg.kind, msg.token, stats=self.core.stats())
        elif msg.kind == ControlKind.CHECK_INTEGRITY:
            try:
                self.core.scheduler.block_manager.check_integrity()
            except AssertionError as exc:
                reply = ControlReply(msg.kind, msg.token, ok=False, message=str(exc))
        elif msg.kind in (ControlKind.START_PROFILE, ControlKind.STOP_PROFILE):
            reply = self._profile(msg)
        elif msg.kind == ControlKind.SHUTDOWN:
            logger.info("shutdown requested by a client")
            self.running = False
        self._send(client, reply)

    def _profile(self, msg: Control) -> ControlReply:
        try:
            if msg.kind == ControlKind.START_PROFILE:
                message = self.profiler.start()
            else:
                message = "\n".join(self.profiler.stop())
        except ProfilerError as exc:
            return ControlReply(msg.kind, msg.token, ok=False, message=str(exc))
        return ControlReply(msg.kind, msg.token, message=message)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except SocketFailed:  # an announcement's send: the process ends, as any send's failure
            raise
        except Exception as exc:  # never die silently with requests in flight: fail them instead
            self.core.runner.step_failed(exc)  # unless the runner cannot go on (and exits)
            logger.exception("engine step failed; failing the requests in flight")
            self._forget_unreachable()
            self._fail_all(f"engine step failed: {exc}")
            return
        self._forget_unreachable()
        with self.core.step_stats.phase("send"):
            for client, frame in self._frames_by_client(outputs).items():
                self._send(client, frame.encode())

    def _forget_unreachable(self) -> None:
        unreachable, self._unreachable = self._unreachable, []
        for client in dict.fromkeys(unreachable):
            self._forget(client)

    def _frames_by_client(self, outputs: list[EngineOutput]) -> dict[bytes, StepOutputsFrame]:
        """The step's outputs as one STEP_OUTPUTS frame per client (``step_frames``); a request
        that failed gets its RequestError instead, sent here."""
        errors: list[tuple[bytes, RequestError]] = []
        frames = step_frames(outputs, errors)
        for client, error in errors:
            self._send(client, error)
        return frames

    def _fail_all(self, message: str) -> None:
        sched = self.core.scheduler
        live = [r.request_id for r in [*sched.running, *sched.waiting]]
        for r in self.core.abort(live):
            self._send(r.client_id, RequestError(r.client_request_id, message, 500))

    def _announce_long_step(self, busy_for_s: float) -> None:
        """A heartbeat before a step expected to take ``busy_for_s``, in which nothing is sent:
        clients count silence from its expected end (engine_core/step_clock.py). Called inside
        the step, between its plan and its forward: a client found gone is forgotten (its
        requests aborted) only after the step (``_step``)."""
        self._last_heartbeat = time.monotonic()
        frame = Heartbeat(self.core.num_steps, busy_for_s)
        for client in self.clients:
            if not self._deliver(client, frame):
                self._unreachable.append(client)

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_INTERVAL_S:
            self._last_heartbeat = now
            for client in list(self.clients):  # a failed send forgets its client
                self._send(client, Heartbeat(self.core.num_steps))


def step_frames(
    outputs: list[EngineOutput], errors: list[tuple[bytes, RequestError]]
) -> dict[bytes, StepOutputsFrame]:
    """A step's outputs as one STEP_OUTPUTS frame per client, built in the busy loop in one
    pass. A request that failed goes to ``errors`` (client, its RequestError) instead. Held
    tokens (an output interval) wait for ``release_held``.
    """
    frames: dict[bytes, StepOutputsFrame] = {}
    for out in outputs:
        r = out.request
        if out.error is not None:
            errors.append((r.client_id, RequestError(r.client_request_id, out.error, 400)))
            continue
        tokens, logprobs = out.new_token_ids, out.logprobs
        if r.held is not None:
            released = release_held(r.held, out)
            if released is None:
                continue  # held back until the request's output interval fills
            tokens, logprobs = released
        frame = frames.get(r.client_id)
        if frame is None:
            frame = frames[r.client_id] = StepOutputsFrame()
        reason = out.finish_reason
        if reason is None and logprobs is None and out.prompt_logprobs is None:
            frame.add_tokens(r.client_request_id, tokens)
            continue
        frame.add(
            r.client_request_id,
            tokens,
            reason,
            logprobs,
            out.prompt_logprobs,
            None if reason is None else r.timings(),
            out.embedding,
        )
    return frames


def release_held(
    held: HeldTokens, out: EngineOutput
) -> tuple[list[int], list[TokenLogprobs] | None] | None:
    """A request with an output interval: hold this step's tokens (and logprobs) back and
    return None, or return every held token and logprob to send now, as the interval says (its
    first token, once enough have gathered, and with its end; an output without tokens carries
    something else and goes at once). An abort or an error drops what is held: the client gets
    no more tokens of an aborted or failed request anyway."""
    held.token_ids += out.new_token_ids
    if out.logprobs is not None:
        held.logprobs += out.logprobs
    ending = out.finish_reason is not None or not out.new_token_ids
    if not held.counter.add(len(out.new_token_ids), ending):
        return None
    held.counter.went_on()
    tokens, held.token_ids = held.token_ids, []
    logprobs = None
    if held.logprobs:  # one per held token, when the request asked for them
        logprobs, held.logprobs = held.logprobs, []
    return tokens, logprobs


# Longer than `tandem serve`'s stop before it stops the engine itself: its drain
# (frontend/http_server.py GRACEFUL_SHUTDOWN_S, 5 s), its requests' last answers (1 s) and the
# export of its last traces (up to 10 s). Timed by SIGALRM: no thread started in a handler.
SUPERVISED_SIGTERM_DELAY_S = 30.0


def stop_on_signals(proc: EngineServer, supervised: bool) -> None:
    """SIGTERM and SIGINT stop a standalone engine for good. `tandem serve` (--parent-pid)
    restarts its engine after any exit, so there only its STOP_FOR_GOOD is for good. SIGINT (a
    terminal's Ctrl-C, which reaches the whole process group) is left to the parent: it ends
    its API processes' requests first, then stops the engine. So is SIGTERM, for
    SUPERVISED_SIGTERM_DELAY_S (a SIGALRM timer): sent to the whole group (systemd's stop,
    ``kill -- -PGID``) it reaches the parent too, whose drain needs the engine; sent to the
    engine alone it stops it after that delay, as a death would (the parent restarts it)."""

    def stop(for_good: bool) -> Callable[[int, object], None]:
        def handler(signum: int, _frame: object) -> None:
            logger.info("signal %d: stopping%s", signum, " for good" if for_good else "")
            proc.stopped_for_good = proc.stopped_for_good or for_good
            proc.running = False

        return handler

    def stop_later(signum: int, _frame: object) -> None:
        delay = SUPERVISED_SIGTERM_DELAY_S
        logger.info("signal %d: stopping in %.0f s unless the parent stops it first", signum, delay)
        if signal.getitimer(signal.ITIMER_REAL)[0] == 0:  # a second SIGTERM keeps the first's time
            signal.setitimer(signal.ITIMER_REAL, delay)

    def delay_over(_signum: int, _frame: object) -> None:
        logger.info("%.0f s after SIGTERM: stopping", SUPERVISED_SIGTERM_DELAY_S)
        proc.running = False  # not for good: the parent restarts it (a death, to it)

    signal.signal(STOP_FOR_GOOD, stop(True))
    signal.signal(signal.SIGTERM, stop_later if supervised else stop(True))
    signal.signal(signal.SIGALRM, delay_over)
    signal.signal(signal.SIGINT, signal.SIG_IGN if supervised else stop(True))
