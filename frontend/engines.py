"""The engine cores `tandem serve` runs or reaches: planned once, started, connected, restarted.

``plan_engines`` describes every serving mode the same way, as a list of ``EngineSpec`` (one per
engine core): its address, the ``EngineProcess`` we run for it (None for a remote engine someone
else runs) and, when API processes serve from it, the ``EnginePidFile`` that tells them its pid.

- one engine: a child process on a fresh private ipc address (or ``--engine-address``);
- ``--data-parallel-size N``: N children, each on its own ipc address and, where the machine has
  enough GPUs, its own ``--tensor-parallel-size`` of them (CUDA_VISIBLE_DEVICES);
- ``--engine ADDRESS``: no child; the engine core already serving there (CURVE keys over tcp://).

An engine is `python -m engine_core --address ADDR --model DIR --parent-pid PID [engine
flags]` with the model folder the frontend resolved (so the default model's GGUF is converted
once). It never outlives us: it gets the death signal of ``common.processes.die_with_parent``,
and ``--parent-pid`` makes it poll for us as well.

``EngineSupervisor`` watches one engine process under a live server: when it exits, the requests
in flight on it fail (503, or a final SSE error event), the pool serves from the others if any,
and a new engine core is started on the same address with a new handshake; restarts in a row
back off (RESTART_BACKOFF_S).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType

from common import env
from common.processes import (
    STOP_FOR_GOOD,
    child_env,
    die_with_parent,
    pid_alive,
    python_module_argv,
)
from engine_core.config import EngineConfig
from frontend.engine_pool import EnginePool
from protocol.address import EngineAddress, private_ipc_address, remove_ipc_files
from protocol.client import AsyncEngineClient, EngineDeadError
from protocol.curve import CurveClientKeys

logger = logging.getLogger("tandem.frontend")

STOP_TIMEOUT_S = 10.0
EXIT_POLL_S = 0.1
# Seconds to wait before each restart in a row; a process that ran STABLE_AFTER_S resets it.
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 60.0
# EngineConfig fields that concern the frontend, not one engine core.
FRONTEND_ONLY_FIELDS = frozenset({"model", "data_parallel_size"})


class RestartBackoff:
    """The pause before the next restart of a process that keeps dying."""

    def __init__(self) -> None:
        self.in_a_row = 0
        self.started = time.monotonic()

    def next_delay(self) -> float:
        if time.monotonic() - self.started > STABLE_AFTER_S:
            self.in_a_row = 0
        delay = RESTART_BACKOFF_S[min(self.in_a_row, len(RESTART_BACKOFF_S) - 1)]
        self.in_a_row += 1
        return delay

    def restarted(self) -> None:
        self.started = time.monotonic()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `tandem serve` (from add_engine_args), passed on to `tandem engine`."""
    out: list[str] = []
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        flag = "--" + f.name.replace("_", "-")
        if f.name in FRONTEND_ONLY_FIELDS or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        else:
            out += [flag, str(value)]
    return out


def changed_engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given other values than their defaults."""
    defaults = EngineConfig()
    return [
        "--" + f.name.replace("_", "-")
        for f in fields(EngineConfig)
        if f.name not in FRONTEND_ONLY_FIELDS
        and getattr(args, f.name, None) != getattr(defaults, f.name)
    ]


class EngineProcess:
    """One engine-core subprocess serving ``address``; stop() (or leaving ``with``) ends it.

    ``visible_devices``: the GPUs it may see (CUDA_VISIBLE_DEVICES), restarts included."""

    def __init__(
        self,
        model_dir: Path | str,
        flags: list[str],
        address: EngineAddress,
        log_level: str = "INFO",
        owns_address: bool = True,
        visible_devices: str | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.flags = flags
        self.address = address
        self.log_level = log_level
        self.owns_address = owns_address  # remove the ipc directory when done
        self.visible_devices = visible_devices
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        return [
            *python_module_argv("engine_core"),
            "--address", str(self.address), "--model", self.model_dir,
            "--parent-pid", str(os.getpid()),
            "--log-level", self.log_level, *self.flags,
        ]  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def start(self) -> None:
        """Spawn the engine. Call from the main thread (the event loop's, not an executor's):
        the death signal fires when the thread that spawned the child exits."""
        env = child_env()
        if self.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible_devices
            logger.info("starting an engine core on GPUs %s", self.visible_devices)
        logger.info("starting the engine core: %s", " ".join(self.argv))
        self.process = subprocess.Popen(self.argv, preexec_fn=die_with_parent(), env=env)

    def restart(self) -> None:
        """Kill what is left of the old process and start a new one on the same address (the
        ipc directory stays; the new engine replaces the stale socket files when it binds)."""
        self.kill()
        self.start()

    def kill(self) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop it for good (STOP_FOR_GOOD: no restart follows, which its other nodes are told),
        then SIGKILL if it is still there after ``timeout`` s; idempotent."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.send_signal(STOP_FOR_GOOD)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("engine core did not stop within %.0f s: killing it", timeout)
                proc.kill()
                proc.wait()
        if self.owns_address:
            remove_ipc_files(self.address)

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class EnginePidFile:
    """An engine core's pid, written by the process that runs it at each start and read by the
    API processes, so that they fail requests in flight as soon as it dies (as a single-process
    server does) rather than after --engine-timeout of silence, and take the new one back."""

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
        return pid_alive(self.pid)


@dataclass
class EngineSpec:
    """One engine core to serve from (see the module docstring)."""

    index: int
    address: EngineAddress
    process: EngineProcess | None = None  # None: someone else runs it
    pid_file: EnginePidFile | None = None  # published for API processes
    curve: CurveClientKeys | None = None  # our keys, for a remote engine on tcp://

    @property
    def pid(self) -> int | None:
        """The engine's pid as this process knows it (None for a remote engine)."""
        if self.process is not None:
            return self.process.pid
        return self.pid_file.pid if self.pid_file is not None else None

    def liveness(self) -> Callable[[], bool] | None:
        """How this process tells whether the engine's process lives, if it can."""
        if self.process is not None:
            return self.process.alive
        return self.pid_file.alive if self.pid_file is not None else None

    def start(self) -> None:
        if self.process is not None:
            self.process.start()
            self.publish_pid()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def publish_pid(self) -> None:
        """Tell the API processes the engine's pid. After a restart only once the new engine has
        shaken hands: an API process that read the new pid at once could miss the old one's
        death, and keep requests on a connection the new engine does not know yet."""
        if self.pid_file is not None and self.process is not None and self.process.pid:
            self.pid_file.write(self.process.pid)


@dataclass(frozen=True)
class EngineTimeouts:
    start_s: float  # for the handshake (--engine-start-timeout): loading a model takes time
    silence_s: float  # of silence before requests in flight fail (--engine-timeout)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineTimeouts:
        return cls(args.engine_start_timeout, args.engine_timeout)


def plan_engines(
    args: argparse.Namespace,
    engine_model: str,
    curve: CurveClientKeys | None = None,
    pid_dir: Path | None = None,
) -> list[EngineSpec]:
    """Every engine core of this `tandem serve`, none started yet; with ``pid_dir`` each one we
    run publishes its pid there, for API processes."""
    if args.remote_engine:
        return [EngineSpec(0, EngineAddress.parse(args.engine_address), curve=curve)]
    count = args.data_parallel_size
    flags = engine_flags(args)
    per_engine = args.tensor_parallel_size * args.pipeline_parallel_size
    slices = gpu_slices(count, per_engine, args.device) if count > 1 else None
    specs = []
    for i in range(count):
        if args.engine_address:  # one engine (serve.py refuses it with several)
            address, owns = EngineAddress.parse(args.engine_address), False
        else:
            address, owns = private_ipc_address("engine" if count == 1 else f"engine{i}"), True
        devices = slices[i] if slices is not None else None
        process = EngineProcess(engine_model, flags, address, args.log_level, owns, devices)
        pid_file = EnginePidFile(pid_dir / f"engine{i}.pid") if pid_dir is not None else None
        specs.append(EngineSpec(i, address, process, pid_file))
    return specs


def gpu_slices(num_engines: int, per_engine: int, device: str) -> list[str] | None:
    """Each engine's CUDA_VISIBLE_DEVICES, or None where there are too few GPUs to give each its
    own (then they share what the frontend sees)."""
    if device == "cpu":
        return None
    ids = env.cuda_visible_devices()
    if ids is None:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if not ids:
        return None
    if len(ids) < num_engines * per_engine:
        logger.warning(
            "%d engine cores x %d GPUs each need %d GPUs, %d visible: they share them",
            num_engines, per_engine, num_engines * per_engine, len(ids),
        )  # fmt: skip
        return None
    return [",".join(ids[i * per_engine : (i + 1) * per_engine]) for i in range(num_engines)]


async def connect_engine(spec: EngineSpec, timeouts: EngineTimeouts) -> AsyncEngineClient:
    """This process's connection to one engine core, once its handshake succeeded.

    Fails fast with EngineDeadError if the engine's process exits first, HandshakeError if its
    reply does not decode (another protocol version), TimeoutError after ``timeouts.start_s``.
    An API process first waits for the engine's pid to be a live process: restarted while its
    parent restarts the engine too, it would otherwise fail at once."""
    if spec.process is None and spec.pid_file is not None:
        await wait_for_pid(spec.pid_file, timeouts.start_s)
    engine = AsyncEngineClient(
        spec.address,
        name="tandem-frontend",
        curve=spec.curve,
        is_process_alive=spec.liveness(),
        dead_after_s=timeouts.silence_s,
    )
    try:
        await engine.connect(timeouts.start_s)
    except BaseException:
        await engine.close("the handshake failed")
        raise
    return engine


async def wait_for_pid(pid_file: EnginePidFile, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pid_file.alive():
        if time.monotonic() > deadline:
            raise EngineDeadError(f"no live engine core within {timeout:g} s")
        await asyncio.sleep(EXIT_POLL_S)


class EngineSupervisor:
    """Restarts one engine core whenever its process exits, under a live server.

    The old connection is closed first (failing what is in flight and dropping whatever its
    sockets still queue, so no stale request reaches the new engine), then a new process is
    started and handshaken, then the pool serves through the new connection and ``on_restart``
    runs. Meanwhile /health answers 503 and, with no other engine core, new requests get 503.
    """

    def __init__(
        self,
        spec: EngineSpec,
        pool: EnginePool,
        timeouts: EngineTimeouts,
        on_restart: Callable[[], None] = lambda: None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        assert spec.process is not None, "only an engine we run can be restarted"
        self.stopping = stopping  # the server is shutting down: an exit is not to be undone
        self.spec = spec
        self.process = spec.process
        self.pool = pool
        self.timeouts = timeouts
        self.on_restart = on_restart
        self.restarts = 0
        self.backoff = RestartBackoff()

    async def run(self) -> None:
        while True:
            while self.process.alive():
                await asyncio.sleep(EXIT_POLL_S)
            if self.stopping():
                logger.warning(
                    "the engine process exited (code %s) while the server stops: not restarting "
                    "it", self.process.returncode,
                )  # fmt: skip
                return
            await self.replace()

    async def replace(self) -> None:
        delay = self.backoff.next_delay()
        reason = f"the engine process exited (code {self.process.returncode}); restarting it"
        logger.error("%s in %.0f s", reason, delay)
        await self.pool.engines[self.spec.index].close(reason)
        await asyncio.sleep(delay)
        if self.stopping():  # the server began to stop during the pause: run() gives up
            return
        self.process.restart()  # on the loop's thread: see EngineProcess.start
        try:
            engine = await connect_engine(self.spec, self.timeouts)
        except Exception as exc:  # EngineDeadError, TimeoutError, a socket error
            logger.error("the new engine core did not come up: %s", exc)
            self.process.kill()  # run() sees it gone and tries again, after a longer pause
            return
        self.spec.publish_pid()
        self.pool.replace(self.spec.index, engine)
        self.restarts += 1
        self.backoff.restarted()
        self.on_restart()
        logger.warning("engine core restarted (pid %s); serving again", self.process.pid)


def supervise_engines(
    specs: list[EngineSpec],
    pool: EnginePool,
    timeouts: EngineTimeouts,
    on_restart: Callable[[], None] = lambda: None,
    stopping: Callable[[], bool] = lambda: False,
) -> list[asyncio.Task[None]]:
    """A running supervisor for every engine core this process runs (not for remote ones),
    none restarting one once ``stopping`` says the server is shutting down."""
    return [
        asyncio.ensure_future(EngineSupervisor(spec, pool, timeouts, on_restart, stopping).run())
        for spec in specs
        if spec.process is not None
    ]
