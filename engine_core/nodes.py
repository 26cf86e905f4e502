"""One engine's ranks over several hosts: the nodes' rendezvous and watch.

With ``--nnodes N`` the engine core's ranks (tensor x pipeline parallel size of them,
``EngineConfig.world_size``) are split into N nodes of k = world size / N consecutive ranks.
Node 0 is the engine process (rank 0, which schedules and samples) and the workers it spawns
for ranks 1..k-1 (engine_core/tp_runner.py); node R is a launcher process
(engine_core/worker_node.py) that spawns ranks R*k..R*k+k-1 and nothing else.

Node 0 opens a TCPStore on ``--master-addr:--master-port`` (bound to that address only) and a
session: a random nonce. Each node R connects, reads the nonce, and writes a hello: the nonce,
its proof of the shared secret (HMAC-SHA256 of the nonce and its node rank under the contents of
``--dist-secret-file``; the secret itself never crosses the network), its engine configuration
and its launcher's random id. Node 0 answers each hello with a verdict for that launcher:
admitted, or why not (a wrong secret, a stale session, engine flags that differ from its own); a
second launcher with the same node rank learns that another was taken. Only admitted nodes
start their ranks, and
no rank joins the torch.distributed group before its node is admitted, so no step's data reaches
a node that failed the check. What the secret does not do: encrypt or authenticate the traffic
after it (torch.distributed's store and gloo/NCCL connections have no such thing), so a host on
the same network path can still read or disturb it. See docs/security.md.

While the engine runs, each node's launcher beats (a counter in the store, every BEAT_S) and
reports a rank of its own that died; node 0 watches both (``NodeWatch``) and ends its process
when a node is lost, as for a lost local worker. Nodes R > 0 see node 0 go through their store
connection, and their ranks through their collectives' connections. Node 0 stopping for good
(a signal, not a death that `tandem serve` follows with a restart) says so in the store first,
and each node exits with it instead of waiting --dist-timeout for an engine that will not come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch.distributed as dist

from engine_core.config import EngineConfig
from engine_core.parallel import HOST, connect_store

logger = logging.getLogger("tandem.nodes")

SESSION_KEY = "tandem/session"
_HELLO_KEY = "tandem/node{}/hello"
_VERDICT_KEY = "tandem/node{}/verdict"
_READ_KEY = "tandem/node{}/verdict_read"
_LOST_KEY = "tandem/node{}/lost"
_BEAT_KEY = "tandem/node{}/beat"
_STOPPED_KEY = "tandem/stopped"
_STOPPED_READ_KEY = "tandem/node{}/stopped_read"
BEAT_S = 1.0  # a node's heartbeat period
SILENT_AFTER_S = 15.0  # a node with no heartbeat for this long is lost
_POLL_S = 0.05
_REFUSAL_READ_S = 5.0  # node 0 waits this long for a refused node to read why, then exits
_STOP_READ_S = 3.0  # node 0 stopping for good waits this long for the nodes to read it (beats)
MIN_SECRET_BYTES = 16
# Flags that may differ between nodes: each node's own place, and where it keeps the secret
# (the secret's contents are checked through the proof).
_PER_NODE_FIELDS = ("node_rank", "dist_secret_file")


class NodeRefused(RuntimeError):
    """Node 0 did not admit a node (or a node failed node 0's check): no retry will help."""


@dataclass(frozen=True)
class NodeLayout:
    """Which of the group's ranks run on this node."""

    nnodes: int
    node_rank: int
    ranks_per_node: int

    @classmethod
    def of(cls, config: EngineConfig) -> NodeLayout:
        k = config.world_size // config.nnodes
        return cls(config.nnodes, config.node_rank, k)

    @property
    def ranks(self) -> range:
        """This node's ranks (node 0's include rank 0, the engine process itself)."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def local_rank(self, rank: int) -> int:
        """The rank's GPU on its node."""
        return rank % self.ranks_per_node


def rendezvous_host(config: EngineConfig) -> str:
    return config.master_addr if config.nnodes > 1 and config.master_addr else HOST


def read_secret(path: str | None) -> bytes | None:
    """The shared secret in ``path`` (None without one); ValueError for a file others may read
    (as ssh and our CURVE keys refuse), or one too short to be a secret."""
    if path is None:
        return None
    file = Path(path)
    try:
        if stat.S_IMODE(file.stat().st_mode) & 0o077:
            raise ValueError(
                f"--dist-secret-file {path}: a secret must not be readable by others (chmod 600)"
            )
        secret = file.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--dist-secret-file {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"--dist-secret-file {path} holds {len(secret)} bytes; a secret needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
        )
    return secret


def proof(secret: bytes | None, session: bytes, node_rank: int) -> bytes:
    """What node ``node_rank`` shows for ``secret`` in ``session`` (empty without a secret)."""
    if secret is None:
        return b""
    return hmac.new(secret, session + b"/node%d" % node_rank, hashlib.sha256).digest()


def compared_config(config: EngineConfig) -> dict[str, Any]:
    """The engine configuration every node must share (the model as the engine loads it)."""
    from engine_core.model_dir import resolve_for_serving

    fields = dataclasses.asdict(config)
    for name in _PER_NODE_FIELDS:
        fields.pop(name)
    fields["model"] = resolve_for_serving(config.model)[0]
    return fields


# ---- node 0 -----------------------------------------------------------------------------------


def open_session(store: dist.TCPStore) -> bytes:
    session = os.urandom(32)
    store.set(SESSION_KEY, session)
    return session


def admit_nodes(
    store: dist.TCPStore,
    config: EngineConfig,
    session: bytes,
    check_local: Callable[[], None],
) -> None:
    """Wait for every other node's hello and admit it, or raise: NodeRefused for a node that
    fails the check (it is told why too), TimeoutError for one that does not come within
    --dist-timeout. ``check_local()`` raises if one of node 0's own workers died meanwhile."""
    secret = read_secret(config.dist_secret_file)
    # Through msgpack as the hellos came, so that a tuple compares equal to its list.
    ours = msgpack.unpackb(msgpack.packb(compared_config(config)))
    pending = set(range(1, config.nnodes))
    deadline = time.monotonic() + config.dist_timeout
    while pending:
        for node in sorted(pending):
            if store.check([_HELLO_KEY.format(node)]):
                hello = store.get(_HELLO_KEY.format(node))
                why = judge(hello, node, session, secret, ours)
                verdict = [why is None, why or "", caller_of(hello)]
                store.set(_VERDICT_KEY.format(node), msgpack.packb(verdict))
                if why is not None:
                    wait_until_read(store, node)
                    raise NodeRefused(f"node {node} refused: {why}")
                logger.info("node %d admitted", node)
                pending.discard(node)
        check_local()
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"node(s) {sorted(pending)} of --nnodes {config.nnodes} did not join within "
                f"--dist-timeout {config.dist_timeout:g} s (is the same command with their "
                f"--node-rank running there, and can it reach {config.master_addr}:"
                f"{config.master_port}?)"
            )
        time.sleep(_POLL_S)


def wait_until_read(store: dist.TCPStore, node: int) -> None:
    """Node 0 holds the store open until the refused node has read why (it would otherwise
    only see the store vanish, and retry), or for at most _REFUSAL_READ_S."""
    with contextlib.suppress(RuntimeError):
        store.wait([_READ_KEY.format(node)], timedelta(seconds=_REFUSAL_READ_S))


def read_hello(hello: bytes) -> list[Any] | None:
    """[session, proof, configuration, caller] as a node sent them, or None if unreadable. The
    hello came through an unauthenticated store: it is parsed as plain data, its shape checked."""
    try:
        fields = msgpack.unpackb(hello)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(fields, list) or len(fields) != 4 or not isinstance(fields[3], bytes):
        return None
    return fields


def caller_of(hello: bytes) -> bytes:
    """Which launcher process sent ``hello`` (b"": unreadable)."""
    fields = read_hello(hello)
    return b"" if fields is None else fields[3]


def judge(
    hello: bytes, node: int, session: bytes, secret: bytes | None, ours: dict[str, Any]
) -> str | None:
    """Why node ``node``'s hello is refused, or None to admit it."""
    fields = read_hello(hello)
    if fields is None:
        return "its join message is not readable"
    their_session, their_proof, theirs, _ = fields
    if not isinstance(their_session, bytes) or not isinstance(their_proof, bytes):
        return "its join message is not readable"
    if their_session != session:
        return "it answered another session of this rendezvous"
    if not hmac.compare_digest(their_proof, proof(secret, session, node)):
        return (
            "it does not prove node 0's --dist-secret-file (a different secret, or one of the "
            "two has none)"
        )
    if not isinstance(theirs, dict):
        return "its join message is not readable"
    differences = [
        f"--{name.replace('_', '-')} (node 0: {value!r}, node {node}: {theirs.get(name)!r})"
        for name, value in ours.items()
        if theirs.get(name) != value
    ]
    if differences:
        return "its engine flags differ from node 0's: " + ", ".join(differences)
    return None


class NodeWatch:
    """Node 0's view of the other nodes while the engine runs: why one is lost, or None."""

    def __init__(self, config: EngineConfig, port: int) -> None:
        # A connection of its own: it is polled from the watch thread.
        host = rendezvous_host(config)
        self.store = connect_store(port, config.world_size, host)
        self.nodes = range(1, config.nnodes)
        now = time.monotonic()
        self.beats = {node: (-1, now) for node in self.nodes}
        self._lock = threading.Lock()  # the watch thread and a failed step may both ask

    def lost(self) -> str | None:
        with self._lock:
            return self._lost()

    def announce_stop(self) -> None:
        """Tell the other nodes that this engine stops for good, and give them up to
        _STOP_READ_S (a few of their heartbeats) to read it before the ranks are stopped. A
        node that did not read it in time waits for a next engine as after a death."""
        keys = [_STOPPED_READ_KEY.format(node) for node in self.nodes]
        with self._lock:
            try:
                self.store.set(_STOPPED_KEY, b"1")
            except RuntimeError as exc:  # a node's store client may have broken it off
                logger.warning("could not tell the other nodes that the engine stops: %s", exc)
                return
            with contextlib.suppress(RuntimeError):  # as wait_until_read: the time is up
                self.store.wait(keys, timedelta(seconds=_STOP_READ_S))

    def _lost(self) -> str | None:
        now = time.monotonic()
        for node in self.nodes:
            if self.store.check([_LOST_KEY.format(node)]):
                return f"node {node}: {self.store.get(_LOST_KEY.format(node)).decode()}"
            beat = self.store.add(_BEAT_KEY.format(node), 0)
            last, since = self.beats[node]
            if beat != last:
                self.beats[node] = (beat, now)
            elif now - since > SILENT_AFTER_S:
                return f"node {node} sent no heartbeat for {SILENT_AFTER_S:g} s"
        return None


# ---- nodes 1..N-1 -----------------------------------------------------------------------------


def join_session(
    config: EngineConfig, timeout_s: float, last: bytes | None, caller: bytes
) -> JoinedSession:
    """Connect to node 0's store, prove the secret and wait to be admitted.

    ``last``: the session this node served before; while node 0 still shows it (its engine is
    ending), wait for the next one. ``caller``: this launcher's random id, the same in every
    attempt, so that node 0's verdict names whom it admitted. NodeRefused when node 0 refuses
    this node or admitted another process as the same node; RuntimeError (torch.distributed's)
    when node 0 cannot be reached within ``timeout_s``.
    """
    secret = read_secret(config.dist_secret_file)
    deadline = time.monotonic() + timeout_s
    store = connect_store(
        config.master_port,
        config.world_size,
        rendezvous_host(config),
        timedelta(seconds=timeout_s),
    )
    session = store.get(SESSION_KEY)
    while session == last:
        if time.monotonic() > deadline:
            raise TimeoutError(f"node 0's engine did not restart within {timeout_s:g} s")
        time.sleep(BEAT_S)
        session = store.get(SESSION_KEY)
    node = config.node_rank
    hello = [session, proof(secret, session, node), compared_config(config), caller]
    store.set(_HELLO_KEY.format(node), msgpack.packb(hello))
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store.wait([_VERDICT_KEY.format(node)], left)
    admitted, why, admitted_caller = read_verdict(store.get(_VERDICT_KEY.format(node)))
    if admitted_caller != caller:
        raise NodeRefused(
            f"node 0 took another process as node {node}: is --node-rank {node} given to two nodes?"
        )
    store.set(_READ_KEY.format(node), b"")
    if not admitted:
        raise NodeRefused(f"node 0 refused node {node}: {why}")
    return JoinedSession(store, session)


def read_verdict(verdict: bytes) -> tuple[bool, str, bytes]:
    """(admitted, why not, whom) as node 0 wrote them; NodeRefused if unreadable (the store is
    unauthenticated: anything may have written it)."""
    try:
        admitted, why, caller = msgpack.unpackb(verdict)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise NodeRefused("node 0's verdict is not readable") from None
    if not isinstance(admitted, bool) or not isinstance(why, str) or not isinstance(caller, bytes):
        raise NodeRefused("node 0's verdict is not readable")
    return admitted, why, caller


@dataclass(frozen=True)
class JoinedSession:
    store: dist.TCPStore
    session: bytes

    def beat(self, node: int) -> None:
        """One heartbeat; raises (torch.distributed's RuntimeError) once node 0 is gone."""
        self.store.add(_BEAT_KEY.format(node), 1)

    def stop_announced(self, node: int) -> bool:
        """Whether node 0 said its engine stops for good (NodeWatch.announce_stop), read back
        to it if so; raises (torch.distributed's RuntimeError) once node 0 is gone."""
        if not self.store.check([_STOPPED_KEY]):
            return False
        self.store.set(_STOPPED_READ_KEY.format(node), b"1")
        return True

    def report_lost(self, node: int, why: str) -> None:
        """Tell node 0 that one of this node's ranks died (best effort: it may be gone too)."""
        with contextlib.suppress(RuntimeError):
            self.store.set(_LOST_KEY.format(node), why)
