"""Several HTTP API processes in front of the engine core(s) (`tandem serve --api-servers N`).

One Python process parses JSON, detokenizes and writes SSE for every stream it serves; at a few
hundred concurrent streams that process, not the engine, sets the pace. With --api-servers N the
parent process

- starts the engine core as `tandem serve` does, or with --data-parallel-size M the M engine
  cores of frontend/data_parallel.py, restarts each when it dies (--restart-engine), and writes
  each one's pid to a file that the API processes read to see its death at once;
- binds the HTTP port once per API process (see ``bind_sockets``) and starts N API processes,
  `python -m frontend.api_servers`, each handed its socket's fd and its settings on stdin (the
  settings hold the API key: never argv, which any local user can read in ps);
- restarts an API process that exits, with the engine's backoff; its socket stays open in the
  parent meanwhile, so connections the kernel routed to it wait in its queue rather than fail;
- on SIGTERM or Ctrl-C stops the API processes (each drains its requests, uvicorn's graceful
  shutdown), then the engine. Every child gets the death signal of launcher.die_with_parent, so
  none outlives a parent killed outright; an API process also polls for its parent.

Each API process is the usual frontend with its own engine connection, i.e. its own ZMQ identity:
the engine's ROUTER routes each step's outputs to the process that sent the request, exactly as it
serves a `tandem client` beside the frontend. With several engine cores each API process connects
to all of them and routes its requests over them through an EnginePool, by its own count of
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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend.launcher import (
    RESTART_BACKOFF_S,
    STABLE_AFTER_S,
    STOP_TIMEOUT_S,
    EngineProcess,
    die_with_parent,
)

logger = logging.getLogger("tandem.frontend")

HEADER = "x-tandem-api-server"
LISTEN_BACKLOG = 2048  # uvicorn's default
PARENT_POLL_S = 1.0
_EXIT_POLL_S = 0.1


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
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
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


# ---- the engine's pid, for the API processes --------------------------------------------------


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, an exited child not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class EnginePidFile:
    """The engine core's pid, written by the parent at each start and read by the API processes,
    so that they fail requests in flight as soon as it dies (as a single-process server does)
    rather than after --engine-timeout of silence, and take the new engine back once it is up."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.pid: int | None = None  # the last pid read

    def write(self, pid: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(pid))
        os.replace(tmp, self.path)  # readers never see a half-written file

    def alive(self) -> bool:
        try:
            self.pid = int(self.path.read_text())
        except (OSError, ValueError):
            return False
        return process_alive(self.pid)


class EngineWatch:
    """What launcher.EngineSupervisor needs of a serving context, for the parent, which serves
    no requests: its own engine connection (``engine``) and ``metrics.record_restart``, which
    here publishes the new engine's pid once its handshake succeeded."""

    def __init__(self, engine: Any, proc: EngineProcess, pid_file: EnginePidFile) -> None:
        self.engine = engine
        self.proc = proc
        self.pid_file = pid_file
        self.metrics = self

    def record_restart(self) -> None:
        if self.proc.pid is not None:
            self.pid_file.write(self.proc.pid)


@dataclass
class EngineSpec:
    """One engine core behind the API processes: its address and, unless it is remote, the
    process the parent runs for it and the file that publishes that process's pid."""

    address: Any
    proc: EngineProcess | None = None
    pid_file: EnginePidFile | None = None

    def start(self) -> None:
        if self.proc is not None and self.pid_file is not None:
            self.proc.start()
            assert self.proc.pid is not None
            self.pid_file.write(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def plan_engines(args: argparse.Namespace, engine_model: str, run_dir: Path) -> list[EngineSpec]:
    """The engine cores to serve: the one of `tandem serve` (perhaps remote), or the
    --data-parallel-size ones; none started yet."""
    from frontend.serve import plan_engine

    if args.data_parallel_size > 1:
        from frontend.data_parallel import engine_processes

        procs = engine_processes(args, engine_model)
    else:
        address, proc = plan_engine(args, engine_model)
        if proc is None:
            return [EngineSpec(address)]
        procs = [proc]
    return [
        EngineSpec(p.address, p, EnginePidFile(run_dir / f"engine{i}.pid"))
        for i, p in enumerate(procs)
    ]


# ---- the API processes, seen from the parent --------------------------------------------------


class ApiServerProcess:
    """One API process: `python -m frontend.api_servers`, settings on stdin, socket by fd."""

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
        argv = [sys.executable, "-m", "frontend.api_servers"]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, pass_fds=(self.sock.fileno(),),
            preexec_fn=die_with_parent(),
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


def stop_api_servers(servers: list[ApiServerProcess], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM all at once (each drains in parallel), then wait for each in turn."""
    for server in servers:
        server.terminate()
    deadline = time.monotonic() + timeout
    for server in servers:
        server.wait(max(0.0, deadline - time.monotonic()))


async def keep_running(server: ApiServerProcess) -> None:
    """Start ``server`` and start it again whenever it exits, backing off like the engine."""
    in_a_row = 0
    while True:
        server.start()
        started = time.monotonic()
        while server.alive():
            await asyncio.sleep(_EXIT_POLL_S)
        if time.monotonic() - started > STABLE_AFTER_S:
            in_a_row = 0
        delay = RESTART_BACKOFF_S[min(in_a_row, len(RESTART_BACKOFF_S) - 1)]
        in_a_row += 1
        logger.error("API server %d exited (code %s); restarting it in %.0f s",
                     server.index, server.returncode, delay)  # fmt: skip
        await asyncio.sleep(delay)


# ---- `tandem serve --api-servers N`: the parent -----------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`tandem serve` with --api-servers > 1 (called by frontend/serve.py)."""
    from engine_core.loader import resolve_for_serving
    from frontend.engine_client import EngineDeadError
    from frontend.serve import _exit_on_signal

    try:
        sockets = bind_sockets(args.host, args.port, args.api_servers)
    except OSError as exc:
        logger.error("cannot listen on %s port %s: %s", args.host, args.port, exc)
        return 1
    engine_model, model_dir = resolve_for_serving(args.model)
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-api-"))  # 0700: only we read the pids
    engines = plan_engines(args, engine_model, run_dir)
    settings = child_settings(args, model_dir, engines)
    servers = [ApiServerProcess(i, sock, settings) for i, sock in enumerate(sockets)]
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so the finally below runs on SIGTERM too
    try:
        for engine in engines:  # they load in parallel
            engine.start()
        asyncio.run(supervise(args, engines, servers))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, TimeoutError) as exc:
        logger.error("an engine core did not come up: %s", exc)
        return 1
    finally:
        stop_api_servers(servers)  # first: their requests end before the engines go
        for engine in engines:
            engine.stop()
        for sock in sockets:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        logger.info("stopped")
    return 0


def child_settings(
    args: argparse.Namespace, model_dir: Path, engines: list[EngineSpec]
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
                "address": str(e.address),
                "pid_file": str(e.pid_file.path) if e.pid_file is not None else None,
            }
            for e in engines
        ],
    }


async def supervise(
    args: argparse.Namespace, engines: list[EngineSpec], servers: list[ApiServerProcess]
) -> None:
    """Start the API processes (they load while the engines do), wait for every engine's
    handshake, then keep the API processes and the engines running until a signal."""
    from frontend.data_parallel import EnginePool
    from frontend.launcher import EngineSupervisor, connect_engine
    from protocol.curve import client_keys_from_args

    tasks = [asyncio.ensure_future(keep_running(s)) for s in servers]
    connections: list[Any] = []  # the parent's own, one per engine: handshakes and restarts
    watches: list[EngineWatch] = []
    try:
        curve = client_keys_from_args(args)
        for spec in engines:  # they load in parallel; the handshakes just wait for each in turn
            engine = await connect_engine(
                spec.proc, args.engine_start_timeout, args.engine_timeout, spec.address, curve
            )
            connections.append(engine)
            if spec.proc is None or spec.pid_file is None:
                continue  # a remote engine: the parent needs only its handshake
            watch = EngineWatch(engine, spec.proc, spec.pid_file)
            watches.append(watch)
            if args.restart_engine:
                ctx: Any = watch  # stands in for the serving context: see EngineWatch
                supervisor = EngineSupervisor(
                    spec.proc, ctx, {}, args.engine_start_timeout, args.engine_timeout
                )
                tasks.append(asyncio.ensure_future(supervisor.run()))
        announce(args, engines, EnginePool(connections).ready, servers)
        for spec, engine in zip(engines, connections, strict=True):
            if spec.proc is None:
                await engine.close()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A watch's connection is replaced at each restart: close the one it holds now.
        remote = [c for s, c in zip(engines, connections, strict=False) if s.proc is None]
        for engine in remote + [w.engine for w in watches]:
            await engine.close()


def announce(
    args: argparse.Namespace,
    engines: list[EngineSpec],
    ready: Any,
    servers: list[ApiServerProcess],
) -> None:
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = servers[0].sock.getsockname()[1]
    pids = ", ".join(str(s.pid) for s in servers)
    in_all = " in all" if len(engines) > 1 else ""
    lines = [
        f"tandem serve: model {args.served_model_name or args.model} "
        f"(max_model_len {ready.max_model_len}, {ready.num_kv_blocks} KV blocks{in_all})",
        f"  OpenAI API:  http://{host}:{port}/v1 ({len(servers)} API processes: pids {pids})",
    ]
    for i, spec in enumerate(engines):
        name = "engine core" if len(engines) == 1 else f"engine core {i}"
        where = f"pid {spec.proc.pid}" if spec.proc is not None else "remote"
        raw = f"raw client: tandem client --address {spec.address}"
        lines.append(f"  {name}: {spec.address} ({where}); {raw}")
    print("\n".join(lines), flush=True)


# ---- one API process --------------------------------------------------------------------------


def main() -> int:
    """`python -m frontend.api_servers`, started by the parent with its settings on stdin."""
    from frontend.engine_client import EngineDeadError
    from frontend.serve import _exit_on_signal

    settings = json.loads(sys.stdin.buffer.read())
    args = argparse.Namespace(**settings.pop("args"))
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [api {settings['index']}]: %(message)s",
    )
    signal.signal(signal.SIGTERM, _exit_on_signal)  # uvicorn drains, then this ends the run
    try:
        asyncio.run(serve_one(args, settings))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, TimeoutError) as exc:
        logger.error("could not reach the engine core: %s", exc)
        return 1
    return 0


async def serve_one(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """The usual frontend (frontend/serve.py) on the socket the parent bound, over one engine
    connection or, with several engine cores, over a pool of them (frontend/data_parallel.py)."""
    import uvicorn

    from frontend.data_parallel import EnginePool, describe_pool
    from frontend.serve import build, load_tokenizer, uvicorn_config
    from frontend.server import build_app
    from protocol.address import EngineAddress

    index, model_dir = settings["index"], Path(settings["model_dir"])
    addresses = [EngineAddress.parse(e["address"]) for e in settings["engines"]]
    pid_files = [
        EnginePidFile(e["pid_file"]) if e["pid_file"] else None for e in settings["engines"]
    ]
    tokenizer = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, model_dir)
    connections: list[Any] = []
    follower = None
    try:
        for address, pid_file in zip(addresses, pid_files, strict=True):
            connections.append(await connect_to_engine(args, address, pid_file))
        engine = connections[0] if len(connections) == 1 else EnginePool(connections)
        share = (index, settings["count"])
        state = build(args, model_dir, addresses[0], None, engine, await tokenizer, share)
        state.engine_info.update(api_server=index, api_server_pid=os.getpid())
        if isinstance(engine, EnginePool):
            describe_pool(state, engine, addresses, [None] * len(addresses))
        publish_engine_pids(state.engine_info, pid_files)  # read by the handshake's checks
        app = build_app(state)
        server = uvicorn.Server(uvicorn_config(args, app, headers=[(HEADER, str(index))]))
        follower = asyncio.ensure_future(
            follow_parent(server, settings["parent_pid"], state.engine_info, pid_files)
        )
        await server.serve(sockets=[socket.socket(fileno=settings["fd"])])
    finally:
        if follower is not None:
            follower.cancel()
        for connection in connections:
            await connection.close()


async def connect_to_engine(
    args: argparse.Namespace, address: Any, pid_file: EnginePidFile | None
) -> Any:
    """This process's connection to one engine core, once its handshake succeeded."""
    from frontend.launcher import connect_engine
    from protocol.curve import client_keys_from_args

    if pid_file is not None:
        await wait_for_engine(pid_file, args.engine_start_timeout)
    return await connect_engine(
        None, args.engine_start_timeout, args.engine_timeout, address,
        client_keys_from_args(args), pid_file.alive if pid_file is not None else None,
    )  # fmt: skip


def publish_engine_pids(info: dict[str, Any], pid_files: list[EnginePidFile | None]) -> None:
    """Put in /v1/engine's ``info`` the engine pids that the pid files last read (they change
    with each restart): ``pid`` for the first engine, and each one's in ``engines``, if any."""
    if pid_files[0] is not None:
        info["pid"] = pid_files[0].pid
    for entry, pid_file in zip(info.get("engines", ()), pid_files, strict=False):
        if pid_file is not None:
            entry["pid"] = pid_file.pid


async def wait_for_engine(pid_file: EnginePidFile, timeout: float) -> None:
    """Wait until the engine's pid is a live process. An API process restarted while the parent
    restarts the engine too would otherwise fail its handshake at once and start over."""
    from frontend.engine_client import EngineDeadError

    deadline = time.monotonic() + timeout
    while not pid_file.alive():
        if time.monotonic() > deadline:
            raise EngineDeadError(f"no live engine core within {timeout:g} s")
        await asyncio.sleep(_EXIT_POLL_S)


async def follow_parent(
    server: Any, parent_pid: int, info: dict[str, Any], pid_files: list[EnginePidFile | None]
) -> None:
    """Keep /v1/engine's pids current and stop the server once the parent is gone (the death
    signal covers that on Linux; this covers what it misses)."""
    while os.getppid() == parent_pid:
        publish_engine_pids(info, pid_files)
        await asyncio.sleep(PARENT_POLL_S)
    logger.error("the parent process %d is gone: stopping", parent_pid)
    server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
