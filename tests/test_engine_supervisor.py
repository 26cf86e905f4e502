"""EngineSupervisor's decision to restart an engine core, against stand-ins for the process and
the pool (restarts with real processes are tested in tests/test_faults.py and
tests/test_api_servers.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from frontend.engines import EngineSupervisor, EngineTimeouts


class ExitedProcess:
    """An engine process that has exited; counts the restarts asked of it."""

    returncode = -9
    pid = 1234

    def __init__(self) -> None:
        self.restarts = 0

    def alive(self) -> bool:
        return False

    def restart(self) -> None:
        self.restarts += 1

    def kill(self) -> None:
        pass


class ClosingEngine:
    """The pool's connection to the dead engine: closing it is where serve starts to stop."""

    def __init__(self, server: SimpleNamespace) -> None:
        self.server = server

    async def close(self, reason: str) -> None:
        self.server.stopping = True


def test_a_server_that_starts_stopping_during_the_pause_restarts_no_engine() -> None:
    server = SimpleNamespace(stopping=False)
    process = ExitedProcess()
    spec = SimpleNamespace(process=process, index=0)
    pool = SimpleNamespace(engines=[ClosingEngine(server)])
    supervisor = EngineSupervisor(
        spec,  # type: ignore[arg-type]
        pool,  # type: ignore[arg-type]
        EngineTimeouts(start_s=1.0, silence_s=1.0),
        stopping=lambda: server.stopping,
    )
    asyncio.run(asyncio.wait_for(supervisor.run(), timeout=10))
    assert process.restarts == 0
    assert supervisor.restarts == 0
