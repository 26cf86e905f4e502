"""What `tandem serve` / `tandem engine` run with ``--node-rank R`` (R > 0): this node's ranks.

No API and no engine sockets: the launcher joins node 0's rendezvous (engine_core/nodes.py),
spawns the ranks R*k..R*k+k-1 as tensor-parallel workers (engine_core/tp_runner.py, the same
workers node 0 spawns for its own ranks), beats every second and watches them. When they end
(node 0 lost, or one of them died) it goes back to the rendezvous and waits up to --dist-timeout
for node 0's next engine: `tandem serve` on node 0 restarts a dead engine core, and this node
follows it. It exits when node 0 stops for good (0: it says so first), when node 0 does not
come back in that time (1), when node 0 refuses it (2: a restart would be refused again), or on
SIGTERM / SIGINT (0).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from engine_core.config import EngineConfig
from engine_core.nodes import BEAT_S, JoinedSession, NodeLayout, NodeRefused, join_session
from engine_core.tp_runner import first_line, spawn_workers, stop_processes

logger = logging.getLogger("tandem.nodes")

_STOP_TIMEOUT_S = 5.0  # a rank of a lost engine has this long to exit before it is killed
_ATTEMPT_S = 10.0  # one try at node 0's rendezvous
_WATCH_POLL_S = 0.2  # how often the launcher looks at its ranks


def serve_node(config: EngineConfig) -> int:
    """Run this node's ranks for each of node 0's engines in turn; the exit status."""
    # Node 0 resolves the unset limits as every node does over several hosts (the step budget
    # by device, the small --max-num-seqs default), and the nodes compare them as resolved.
    from engine_core.model_runner import resolve_max_num_seqs

    config = resolve_max_num_seqs(config)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    layout = NodeLayout.of(config)
    where = f"{config.master_addr}:{config.master_port}"
    last: bytes | None = None
    caller = os.urandom(16)  # this launcher, in its hellos to node 0
    while not stop.is_set():
        try:
            joined = join_until(config, last, caller, stop)
        except NodeRefused as exc:
            logger.error("%s", exc)
            return 2
        except (RuntimeError, TimeoutError) as exc:
            logger.error(
                "node 0 at %s did not admit this node within --dist-timeout %g s: %s",
                where, config.dist_timeout, first_line(exc),
            )  # fmt: skip
            return 1
        if joined is None:
            break  # stopped while waiting
        logger.info("node %d admitted by %s: running ranks %s", config.node_rank, where,
                    list(layout.ranks))  # fmt: skip
        if run_ranks(config, layout, joined, stop):
            logger.info("node 0 stopped its engine for good: node %d exits", config.node_rank)
            return 0
        last = joined.session
    return 0


def join_until(
    config: EngineConfig, last: bytes | None, caller: bytes, stop: threading.Event
) -> JoinedSession | None:
    """Join node 0's next session, retrying while it cannot be reached (it may be starting or
    restarting) until --dist-timeout has passed; None if stopped first."""
    deadline = time.monotonic() + config.dist_timeout
    while not stop.is_set():
        left = deadline - time.monotonic()
        try:
            # Short attempts, so that a signal is seen between them.
            return join_session(config, max(1.0, min(left, _ATTEMPT_S)), last, caller)
        except NodeRefused:
            raise
        except (RuntimeError, TimeoutError):
            if time.monotonic() >= deadline:
                raise
            stop.wait(BEAT_S)
    return None


def run_ranks(
    config: EngineConfig, layout: NodeLayout, joined: JoinedSession, stop: threading.Event
) -> bool:
    """This node's ranks for one engine, until they end, node 0 is gone, or we are stopped;
    whether node 0 said first that its engine stops for good."""
    node = config.node_rank
    workers = spawn_workers(config, config.master_port, layout.ranks)
    last_beat = 0.0
    for_good = False
    try:
        while not stop.wait(_WATCH_POLL_S):
            dead = next((p for p in workers if p.exitcode is not None), None)
            if dead is not None:
                if dead.exitcode == 0:  # node 0 stopped them: had it said why in time?
                    return for_good or _stop_announced(joined, node)
                if not for_good:
                    why = f"tensor-parallel worker {dead.name} exited with {dead.exitcode}"
                    logger.error("node %d: %s", node, why)
                    joined.report_lost(node, why)
                return for_good
            if time.monotonic() - last_beat >= BEAT_S:
                last_beat = time.monotonic()
                try:
                    joined.beat(node)
                    for_good = for_good or joined.stop_announced(node)
                except RuntimeError as exc:
                    if not for_good:
                        logger.error(
                            "node 0 is gone (%s): stopping this node's ranks", first_line(exc)
                        )
                    return for_good
        return for_good
    finally:
        # Ranks of a lost engine may wait in a collective that will never complete.
        stop_processes(workers, timeout=_STOP_TIMEOUT_S)


def _stop_announced(joined: JoinedSession, node: int) -> bool:
    """JoinedSession.stop_announced, False once node 0 is gone: its store holds the word for as
    long as it shuts down, past the few seconds it waits for every node to read it."""
    try:
        return joined.stop_announced(node)
    except RuntimeError:
        return False
