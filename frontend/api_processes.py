"""Several HTTP API processes in front of the engine cores (`tandem serve --api-servers N`).

One Python process parses JSON, detokenizes and writes SSE for every stream it serves; at a few
hundred concurrent streams that process, not the engine, sets the pace. With --api-servers N the
parent process (frontend/serve.py, which also starts the engine cores)

- binds the HTTP port once per API process (see ``bind_sockets``) and starts N API processes,
  `python -m frontend.api_processes`, each handed its socket's fd and its settings on stdin (the
  settings hold the API key: never argv, which any local user can read in ps);
- shakes hands with every engine core it runs and restarts each when it dies (--restart-engine):
  the engines' pid files (frontend/engines.py) tell the API processes at once;
- restarts an API process that exits, with the engines' backoff; its socket stays open in the
  parent meanwhile, so connections the kernel routed to it wait in its queue rather than fail;
- on SIGTERM or Ctrl-C stops the API processes (each drains its requests, uvicorn's graceful
  shutdown), then the engines. Every child gets the death signal of
  common.processes.die_with_parent, so none outlives a parent killed outright; an API process
  also polls for its parent.

Each API process is the usual frontend (frontend/http_server.py) with its own engine connections,
i.e. its own ZMQ identity: the engine's ROUTER routes each step's outputs to the process that sent
the request, exactly as it serves a `tandem client` beside the frontend. With several engine cores
each API process routes over all of them through its own EnginePool, by its own count of
outstanding requests (the kernel spreads connections evenly over the API processes, so every
process sees about the same share of the load). Per process, not shared: /metrics (the counters of
the requests it served; the engine gauges are the engine's, so any process shows them) and the
admission gate (its share of --max-num-seqs + --max-waiting-requests). Each response carries
``x-tandem-api-server: INDEX``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import event_loop
from common.hf_tokenizer import TokenizerError
from common.listen import address_family, probe_bind
from common.processes import (
    EXIT_UNSERVABLE,
    UnservableError,
    child_env,
    die_with_parent,
    exit_on_sigterm,
    python_module_argv,
    stop_on_sigterm,
)
from frontend.engine_pool import EnginePool
from frontend.engines import (
    EXIT_POLL_S,
    STOP_TIMEOUT_S,
    EnginePidFile,
    EngineSpec,
    EngineTimeouts,
    RestartBackoff,
    connect_engine,
    supervise_engines,
)
from frontend.http_server import ApiRole, announce, serve_http
from frontend.request_id import tag_log_records
from protocol.address import EngineAddress
from protocol.client import EngineDeadError, HandshakeError
from protocol.curve import client_keys_from_args

logger = logging.getLogger("tandem.frontend")

LISTEN_BACKLOG = 2048  # uvicorn's default


# ---- the shared port --------------------------------------------------------------------------


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one (host, port), one per API process, with SO_REUSEPORT.

    Why not one socket shared by all: with a single accept queue the process that wakes first
    takes every connection waiting (asyncio accepts in a loop), so a burst of clients (a
    benchmark opening 256 streams) lands mostly on one process. With SO_REUSEPORT each process
    has its own queue and the kernel spreads new connections over them by a hash of the
    addresses: even, and in the kernel. The parent binds them all before any child starts, so a
    port in use fails once, up front, and port 0 becomes one concrete port for all. A plain probe
    bind comes first: a bind with SO_REUSEPORT would silently join another server's group on the
    same port (one of ours still running, say), and the plain one fails instead.
    """
    family = address_family(host)
    port = probe_bind(host, port)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)  # connections queue here until the process serves
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


# ---- the API processes, seen from the parent --------------------------------------------------


class ApiServerProcess:
    """One API process: `python -m frontend.api_processes`, settings on stdin, socket by fd."""

    def __init__(self, index: int, sock: socket.socket, settings: dict[str, Any]) -> None:
        self.index = index
        self.sock = sock
        self.settings = {**settings, "index": index, "fd": sock.fileno()}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> None:
        """Spawn it; from the main thread, as EngineProcess.start says why."""
        argv = python_module_argv("frontend.api_processes")
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, pass_fds=(self.sock.fileno(),),
            preexec_fn=die_with_parent(), env=child_env(),
        )  # fmt: skip
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: the supervisor sees it
            self.process.stdin.write(json.dumps(self.settings).encode())
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def terminate(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.terminate()

    def wait(self, timeout: float) -> None:
        """Wait for it to exit; SIGKILL it after ``timeout`` s."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("API server %d did not stop within %.0f s: killing it", self.index,
                           timeout)  # fmt: skip
            self.process.kill()
            self.process.wait()

    async def keep_running(self) -> None:
        """Start it, and start it again whenever it exits, backing off like the engines; its
        first run's exit with EXIT_UNSERVABLE (which a restart cannot cure) raises
        UnservableError. Once it has served, a restart that meets the same error (the folder
        briefly unreadable) is retried like any other exit."""
        backoff = RestartBackoff()
        first = True
        while True:
            self.start()
            backoff.restarted()
            while self.alive():
                await asyncio.sleep(EXIT_POLL_S)
            if first and self.returncode == EXIT_UNSERVABLE:
                raise UnservableError(f"API server {self.index} cannot serve (its error above)")
            first = False
            delay = backoff.next_delay()
            logger.error("API server %d exited (code %s); restarting it in %.0f s",
                         self.index, self.returncode, delay)  # fmt: skip
            await asyncio.sleep(delay)


class ApiProcesses:
    """The API processes of `tandem serve --api-servers N`, from their parent: ``run`` starts
    and keeps them (and the engines' supervisors) running, ``stop`` ends them."""

    def __init__(
        self,
        args: argparse.Namespace,
        model_dir: Path,
        specs: list[EngineSpec],
        listeners: list[socket.socket],
    ) -> None:
        self.args = args
        self.specs = specs
        settings = child_settings(args, model_dir, specs)
        self.servers = [ApiServerProcess(i, s, settings) for i, s in enumerate(listeners)]

    async def run(self) -> None:
        """Start the API processes (they load while the engines do), wait for every engine's
        handshake, then keep the API processes and the engines running until a signal. An API
        process that cannot serve (UnservableError) ends it, during the handshakes too."""
        timeouts = EngineTimeouts.from_args(self.args)
        tasks = [asyncio.ensure_future(s.keep_running()) for s in self.servers]
        pool = EnginePool([])  # the parent's own connections: handshakes and restarts
        handshakes = asyncio.ensure_future(self.connect_all(pool, timeouts))
        with stop_on_sigterm():
            try:
                done, _ = await asyncio.wait([handshakes, *tasks], return_when="FIRST_COMPLETED")
                for task in done:
                    task.result()  # a handshake's error, or an API process's UnservableError
                if self.args.restart_engine:
                    tasks += supervise_engines(self.specs, pool, timeouts)
                port = self.servers[0].sock.getsockname()[1]
                pids = [s.pid for s in self.servers if s.pid is not None]
                announce(self.args, self.specs, pool.ready, port, pids)
                await close_remote(self.specs, pool)
                await asyncio.gather(*tasks)
            finally:
                for task in (handshakes, *tasks):
                    task.cancel()
                await asyncio.gather(handshakes, *tasks, return_exceptions=True)
                await pool.close()

    async def connect_all(self, pool: EnginePool, timeouts: EngineTimeouts) -> None:
        """Every engine's handshake into ``pool``: they load in parallel, each waits in turn."""
        for spec in self.specs:
            pool.engines.append(await connect_engine(spec, timeouts))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM all at once (each drains in parallel), then wait for each in turn."""
        for server in self.servers:
            server.terminate()
        deadline = time.monotonic() + timeout
        for server in self.servers:
            server.wait(max(0.0, deadline - time.monotonic()))


async def close_remote(specs: list[EngineSpec], pool: EnginePool) -> None:
    """The parent needs only the handshake of an engine it does not run: say goodbye."""
    for spec in specs:
        if spec.process is None:
            await pool.engines[spec.index].close("the handshake was all the parent needed")


def child_settings(
    args: argparse.Namespace, model_dir: Path, specs: list[EngineSpec]
) -> dict[str, Any]:
    """What every API process needs, as JSON: the flags and where the engine cores are."""
    flags = {k: v for k, v in vars(args).items() if not callable(v)}
    return {
        "args": flags,
        "count": args.api_servers,
        "parent_pid": os.getpid(),
        "model_dir": str(model_dir),
        "engines": [
            {
                "address": str(s.address),
                "pid_file": str(s.pid_file.path) if s.pid_file is not None else None,
            }
            for s in specs
        ],
    }


# ---- one API process --------------------------------------------------------------------------


def main() -> int:
    """`python -m frontend.api_processes`, started by the parent with its settings on stdin."""
    settings = json.loads(sys.stdin.buffer.read())
    args = argparse.Namespace(**settings["args"])
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [api {settings['index']}]%(request_tag)s: "
        "%(message)s",
    )
    tag_log_records()
    exit_on_sigterm()  # uvicorn drains, then the SystemExit ends the run
    role = ApiRole(
        settings["index"],
        settings["count"],
        socket.socket(fileno=settings["fd"]),
        settings["parent_pid"],
    )
    specs = child_specs(args, settings)
    try:
        event_loop.run(serve_http(args, Path(settings["model_dir"]), specs, role))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, HandshakeError, TimeoutError) as exc:
        logger.error("could not reach the engine core: %s", exc)
        return 1
    except TokenizerError as exc:
        logger.error("%s", exc)
        return EXIT_UNSERVABLE
    return 0


def child_specs(args: argparse.Namespace, settings: dict[str, Any]) -> list[EngineSpec]:
    """The engine cores as an API process sees them: run by its parent (known by pid file) or
    remote (reached with the client keys of the flags)."""
    curve = client_keys_from_args(args)
    return [
        EngineSpec(
            i,
            EngineAddress.parse(e["address"]),
            pid_file=EnginePidFile(e["pid_file"]) if e["pid_file"] else None,
            curve=curve,
        )
        for i, e in enumerate(settings["engines"])
    ]


if __name__ == "__main__":
    sys.exit(main())
