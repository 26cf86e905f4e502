"""The engine cores an API process serves from, behind one interface: ``EnginePool``.

The serving code always talks to a pool: of one engine core (the usual `tandem serve`, or a remote
engine) or of the N of `tandem serve --data-parallel-size N`. It holds one AsyncEngineClient per
engine core and

- ``open()`` sends all engine requests of one HTTP request (its prompts and its n choices) to one
  engine core, the live one with the fewest unfinished engine requests (ties rotate), so they
  share that engine's prefix cache;
- an abort reaches the owning engine through that engine's RequestGroup, which ``open()`` returned;
- ``healthy`` only while every engine core answers; while some are down, new requests go to the
  others (``dead_reason`` is set only when none is left), and each engine's supervisor restarts
  its own process;
- ``stats()`` sums the engines' counters for the existing gauges and, with several engines,
  records each engine's under an ``engine`` label (``tandem_engine_*{engine="i"}``); its
  ``counts`` are the engines' ``EngineCounts`` summed over engines and over each engine's
  restarts (``EngineCountTotals``), so the counters made of them never go backwards;
- ``replace(index, client)``: the supervisor of a restarted engine core swaps in its new
  connection, while the others serve on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from protocol.client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineRequest,
    RequestGroup,
    wait_while_dead,
)
from protocol.messages import ControlKind, ControlReply, EngineCounts, Ready, Stats

WAIT_POLL_S = 0.05


class EngineGauges:
    """Per-engine metric families (label ``engine``), in the server's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_engines: int) -> None:
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.up = gauge("tandem_engine_up", "1 while this engine core answers, else 0.")
        self.running = gauge("tandem_engine_num_requests_running", "Requests running.")
        self.waiting = gauge("tandem_engine_num_requests_waiting", "Requests waiting.")
        self.kv_usage = gauge(
            "tandem_engine_kv_cache_usage_perc", "KV-cache blocks held by requests, as a fraction."
        )
        self.in_flight = gauge(
            "tandem_engine_requests_in_flight", "Engine requests routed here and not finished."
        )
        self.routed = Counter(
            "tandem_engine_requests_routed",
            "Engine requests routed here.",
            labels,
            registry=registry,
        )
        self._names = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]
        for name in self._names:  # every engine present from the first scrape
            self.routed.labels(**name)

    def record_routed(self, index: int, count: int) -> None:
        self.routed.labels(**self._names[index]).inc(count)

    def record(self, index: int, engine: AsyncEngineClient, stats: Stats | None) -> None:
        name = self._names[index]
        self.up.labels(**name).set(1.0 if engine.healthy else 0.0)
        self.in_flight.labels(**name).set(engine.num_requests)
        if stats is not None:
            self.running.labels(**name).set(stats.num_running)
            self.waiting.labels(**name).set(stats.num_waiting)
            self.kv_usage.labels(**name).set(stats.kv_cache_usage)


class EngineCountTotals:
    """Engine counts summed over the engines, and over each engine's runs: an engine core that
    restarts (a new run id) counts from zero again, so the last counts seen of its previous run
    are kept; a dead engine's last counts stay in the sum. The total never goes backwards."""

    def __init__(self) -> None:
        self._last: dict[int, EngineCounts] = {}  # by engine index: its run's latest counts
        self._ended = EngineCounts()  # runs that ended, summed
        self.new_runs = 0  # engine cores seen to start after an earlier run (restarts)

    def update(self, index: int, counts: EngineCounts) -> None:
        last = self._last.get(index)
        if last is not None and last.run_id != counts.run_id:
            self._ended += last
            self.new_runs += 1
        self._last[index] = counts

    def total(self) -> EngineCounts:
        return sum(self._last.values(), self._ended)


def each_engine(reasons: Iterable[tuple[int, str | None]]) -> str:
    """(engine index, why it is down) pairs as one message: "engine 0: ...; engine 1: ..."."""
    return "; ".join(f"engine {i}: {reason}" for i, reason in reasons)


class EnginePool:
    """The engine connections of one API process (see the module docstring)."""

    def __init__(self, engines: Sequence[AsyncEngineClient]) -> None:
        self.engines = list(engines)
        self.gauges: EngineGauges | None = None  # per-engine metrics, with several engines
        self.totals = EngineCountTotals()
        self._next = 0  # where the next tie-break starts

    def replace(self, index: int, engine: AsyncEngineClient) -> None:
        """Serve engine ``index`` through a new connection (its core was restarted)."""
        self.engines[index] = engine

    # ---- state --------------------------------------------------------------------------------

    @property
    def ready(self) -> Ready:
        """One engine's handshake, with the pool's capacity: the sums of KV blocks and of
        running sequences, and the smallest max_model_len."""
        readies = [e.ready for e in self.engines if e.ready is not None]
        return dataclasses.replace(
            readies[0],
            max_model_len=min(r.max_model_len for r in readies),
            num_kv_blocks=sum(r.num_kv_blocks for r in readies),
            max_num_seqs=sum(r.max_num_seqs for r in readies),
        )

    @property
    def healthy(self) -> bool:
        return all(e.healthy for e in self.engines)

    def degraded(self) -> str | None:
        """Where some of several engine cores are down and another serves: which are down
        (the server still takes requests; /health says so with a 200). None otherwise."""
        down = [(i, e) for i, e in enumerate(self.engines) if not e.healthy]
        if not down or len(down) == len(self.engines):
            return None
        return each_engine((i, e.dead_reason or "its process is not running") for i, e in down)

    @property
    def dead_reason(self) -> str | None:
        """Set only when no engine core can take a request."""
        if any(e.dead_reason is None for e in self.engines):
            return None
        if len(self.engines) == 1:
            return self.engines[0].dead_reason
        return each_engine((i, e.dead_reason) for i, e in enumerate(self.engines))

    @property
    def num_requests(self) -> int:
        return sum(e.num_requests for e in self.engines)

    async def wait_until_serving(self, timeout: float) -> float:
        """Return once some engine core takes requests (at once while one does: with data
        parallelism the others serve on), with the seconds waited; EngineDeadError after
        ``timeout`` s."""
        return await wait_while_dead(lambda: self.dead_reason, timeout, WAIT_POLL_S)

    # ---- routing ------------------------------------------------------------------------------

    def pick(self) -> int:
        """The live engine with the fewest unfinished requests; ties rotate."""
        n = len(self.engines)
        live = [i for i, e in enumerate(self.engines) if e.dead_reason is None] or list(range(n))
        best = min(live, key=lambda i: (self.engines[i].num_requests, (i - self._next) % n))
        self._next = (best + 1) % n
        return best

    def open(self, requests: Sequence[EngineRequest], wake_every: int | None = 1) -> RequestGroup:
        """The requests go to one engine (see ``pick``); its group aborts them there."""
        index = self.pick()
        if self.gauges is not None:
            self.gauges.record_routed(index, len(requests))
        return self.engines[index].open(requests, wake_every)

    # ---- control ------------------------------------------------------------------------------

    async def stats(self, timeout: float = 2.0) -> Stats | None:
        """Every live engine's counters, summed; each is also recorded under its label (a dead
        one's as down)."""
        self.record_dead_engines()
        live = self._live()
        replies = await asyncio.gather(
            *(self.engines[i].stats(timeout) for i in live), return_exceptions=True
        )
        got: list[Stats] = []
        for i, reply in zip(live, replies, strict=True):
            stats = reply if isinstance(reply, Stats) else None
            if self.gauges is not None:
                self.gauges.record(i, self.engines[i], stats)
            if stats is not None:
                got.append(stats)
                self.totals.update(i, stats.counts)
        if not got:
            failure = next((r for r in replies if isinstance(r, BaseException)), None)
            raise failure or EngineDeadError("no engine core answered")
        gauges = (f.name for f in dataclasses.fields(Stats) if f.name != "counts")
        summed = {name: sum(getattr(s, name) for s in got) for name in gauges}
        return Stats(**summed, counts=self.totals.total())

    def record_dead_engines(self) -> None:
        """Each dead engine's gauges as down (not polled: its last poll's would stay)."""
        if self.gauges is None:
            return
        for i, engine in enumerate(self.engines):
            if engine.dead_reason is not None:
                self.gauges.record(i, engine, None)

    async def control_all(self, kind: ControlKind, timeout: float) -> list[ControlReply]:
        """Send control ``kind`` to every live engine; their replies, in engine order."""
        replies = (self.engines[i].control(kind, timeout) for i in self._live())
        return list(await asyncio.gather(*replies))

    def _live(self) -> list[int]:
        """The indices of the engines not known dead; EngineDeadError where none is left."""
        live = [i for i, e in enumerate(self.engines) if e.dead_reason is None]
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core")
        return live

    async def close(self, reason: str = "the frontend is shutting down") -> None:
        await asyncio.gather(*(e.close(reason) for e in self.engines))
