"""Several HTTP API processes in front of one engine core (`tandem serve --api-servers N`).

One Python process parses JSON, detokenizes and writes SSE for every stream it serves; at a few
hundred concurrent streams that process, not the engine, sets the pace. With --api-servers N the
parent process

- starts the engine core as `tandem serve` does (and restarts it when it dies, --restart-engine),
  and writes its pid to a file that the API processes read to see its death at once;
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
serves a `tandem client` beside the frontend. Per process, not shared: /metrics (the counters of
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
    from frontend.serve import _exit_on_signal, plan_engine

    try:
        sockets = bind_sockets(args.host, args.port, args.api_servers)
    except OSError as exc:
        logger.error("cannot listen on %s port %s: %s", args.host, args.port, exc)
        return 1
    engine_model, model_dir = resolve_for_serving(args.model)
    address, proc = plan_engine(args, engine_model)
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-api-"))  # 0700: only we read the pid
    pid_file = EnginePidFile(run_dir / "engine.pid") if proc is not None else None
    settings = child_settings(args, model_dir, address, pid_file)
    servers = [ApiServerProcess(i, sock, settings) for i, sock in enumerate(sockets)]
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so the finally below runs on SIGTERM too
    try:
        if proc is not None:
            proc.start()
            assert pid_file is not None and proc.pid is not None
            pid_file.write(proc.pid)
        asyncio.run(supervise(args, proc, address, servers, pid_file))
    except (KeyboardInterrupt, SystemExit):
        pass
    except (EngineDeadError, TimeoutError) as exc:
        logger.error("the engine core did not come up: %s", exc)
        return 1
    finally:
        stop_api_servers(servers)  # first: their requests end before the engine goes
        if proc is not None:
            proc.stop()
        for sock in sockets:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        logger.info("stopped")
    return 0


def child_settings(
    args: argparse.Namespace, model_dir: Path, address: Any, pid_file: EnginePidFile | None
) -> dict[str, Any]:
    """What every API process needs, as JSON: the flags and where the engine is."""
    flags = {k: v for k, v in vars(args).items() if not callable(v)}
    return {
        "args": flags,
        "count": args.api_servers,
        "parent_pid": os.getpid(),
        "model_dir": str(model_dir),
        "engine_address": str(address),
        "engine_pid_file": str(pid_file.path) if pid_file is not None else None,
    }


async def supervise(
    args: argparse.Namespace,
    proc: EngineProcess | None,
    address: Any,
    servers: list[ApiServerProcess],
    pid_file: EnginePidFile | None,
) -> None:
    """Start the API processes (they load while the engine does), wait for the engine's
    handshake, then keep the API processes and the engine running until a signal."""
    from frontend.launcher import EngineSupervisor, connect_engine
    from protocol.curve import client_keys_from_args

    tasks = [asyncio.ensure_future(keep_running(s)) for s in servers]
    watch = None
    try:
        curve = client_keys_from_args(args)
        engine = await connect_engine(
            proc, args.engine_start_timeout, args.engine_timeout, address, curve
        )
        if proc is not None and pid_file is not None:
            watch = EngineWatch(engine, proc, pid_file)
            if args.restart_engine:
                ctx: Any = watch  # stands in for the serving context: see EngineWatch
                supervisor = EngineSupervisor(
                    proc, ctx, {}, args.engine_start_timeout, args.engine_timeout
                )
                tasks.append(asyncio.ensure_future(supervisor.run()))
        announce(args, address, proc, engine, servers)
        if watch is None:
            await engine.close()  # a remote engine: the parent needed only the handshake
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if watch is not None:
            await watch.engine.close()


def announce(
    args: argparse.Namespace,
    address: Any,
    proc: EngineProcess | None,
    engine: Any,
    servers: list[ApiServerProcess],
) -> None:
    ready = engine.ready
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = servers[0].sock.getsockname()[1]
    where = f"pid {proc.pid}" if proc is not None else "remote"
    pids = ", ".join(str(s.pid) for s in servers)
    print(
        f"tandem serve: model {args.served_model_name or args.model} "
        f"(max_model_len {ready.max_model_len}, {ready.num_kv_blocks} KV blocks)\n"
        f"  OpenAI API:  http://{host}:{port}/v1 ({len(servers)} API processes: pids {pids})\n"
        f"  engine core: {address} ({where}); "
        f"raw client: tandem client --address {address}",
        flush=True,
    )


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
    """The usual frontend (frontend/serve.py) on the socket the parent bound."""
    import uvicorn

    from frontend.launcher import connect_engine
    from frontend.serve import build, load_tokenizer, uvicorn_config
    from frontend.server import build_app
    from protocol.address import EngineAddress
    from protocol.curve import client_keys_from_args

    index, model_dir = settings["index"], Path(settings["model_dir"])
    address = EngineAddress.parse(settings["engine_address"])
    path = settings["engine_pid_file"]
    pid_file = EnginePidFile(path) if path is not None else None
    tokenizer = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, model_dir)
    if pid_file is not None:
        await wait_for_engine(pid_file, args.engine_start_timeout)
    engine = await connect_engine(
        None, args.engine_start_timeout, args.engine_timeout, address,
        client_keys_from_args(args), pid_file.alive if pid_file is not None else None,
    )  # fmt: skip
    follower = None
    try:
        share = (index, settings["count"])
        state = build(args, model_dir, address, None, engine, await tokenizer, share)
        state.engine_info.update(api_server=index, api_server_pid=os.getpid())
        if pid_file is not None:
            state.engine_info["pid"] = pid_file.pid  # read by the handshake's liveness checks
        app = build_app(state)
        server = uvicorn.Server(uvicorn_config(args, app, headers=[(HEADER, str(index))]))
        follower = asyncio.ensure_future(
            follow_parent(server, settings["parent_pid"], state.engine_info, pid_file)
        )
        await server.serve(sockets=[socket.socket(fileno=settings["fd"])])
    finally:
        if follower is not None:
            follower.cancel()
        await engine.close()


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
    server: Any, parent_pid: int, info: dict[str, Any], pid_file: EnginePidFile | None
) -> None:
    """Keep /v1/engine's pid current and stop the server once the parent is gone (the death
    signal covers that on Linux; this covers what it misses)."""
    while os.getppid() == parent_pid:
        if pid_file is not None:
            info["pid"] = pid_file.pid
        await asyncio.sleep(PARENT_POLL_S)
    logger.error("the parent process %d is gone: stopping", parent_pid)
    server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
