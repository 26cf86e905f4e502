"""One run of the load generator: dispatch a workload on its arrival schedule, record everything.

Every request gets its record before the first one is sent, and each record ends either
completed or failed with its error (an exception, a timeout, or "not sent" when the run was cut
short), so a run can never lose a request: completed + failed == sent + unsent == requests.

Conversations follow the arrival schedule as a whole (the schedule says when each one starts, a
concurrency cap how many are under way); inside one, each turn is sent as soon as the previous
turn's reply has ended, and a failed turn fails the turns after it ("not sent").
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from tqdm import tqdm

from loadgen.arrival import Arrival
from loadgen.backends import Backend
from loadgen.metrics import RequestRecord
from loadgen.workload import Conversation, RequestSpec


@dataclass(frozen=True)
class RunPlan:
    """How one run offers its load."""

    arrival: Arrival
    max_concurrency: int | None = None
    request_timeout: float = 600.0
    progress: bool = True
    label: str = "run"


class RunInterrupted(Exception):
    """Ctrl-C during a run: the records of the requests that had ended before it. The rest,
    cut short or never sent, are left out: their times say nothing about the server."""

    def __init__(self, finished: list[RequestRecord], total: int, positions: list[int]) -> None:
        super().__init__(f"interrupted with {len(finished)} of {total} requests ended")
        self.finished = finished
        self.total = total
        self.positions = positions  # each finished record's place in the run's request order


SESSION = uuid.uuid4().hex[:8]  # request ids stay unique between load generators on one engine
CUT_SHORT = "cancelled: the run was interrupted"  # a request in flight at Ctrl-C


def _ended_before_the_cut(records: list[RequestRecord]) -> list[int]:
    """At Ctrl-C (the run's task cancelled, as asyncio.Runner does on SIGINT): the positions of
    the requests that had ended, not those its cancellation cut short. The cancellation is
    taken back (``uncancel``), since the run ends with RunInterrupted instead."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return [
        i for i, rec in enumerate(records) if rec.ended_at is not None and rec.error != CUT_SHORT
    ]


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> bool:
    """Cancel the run's tasks (those still running) and wait for them. True where Ctrl-C
    landed in that wait: the run had ended as it came, and is reported as cut there."""
    for t in tasks:
        t.cancel()
    try:
        await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        return True
    return False


def _interrupted(records: list[RequestRecord], ended: list[int]) -> RunInterrupted:
    return RunInterrupted([records[i] for i in ended], len(records), ended)


async def run_once(
    backend: Backend, specs: list[RequestSpec], plan: RunPlan, run_index: int
) -> list[RequestRecord]:
    """Send ``specs`` on the plan's schedule and wait for all of them; one record each."""
    clock = backend.clock
    records = [
        RequestRecord(f"lg{SESSION}-{run_index}-{i}", s.prompt_len, s.output_len, 0.0)
        for i, s in enumerate(specs)
    ]
    gaps = plan.arrival.gaps(len(specs), run_index)
    slots = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    bar = tqdm(total=len(specs), desc=plan.label, unit="req", disable=not plan.progress)
    tasks: list[asyncio.Task[None]] = []
    ended: list[int] | None = None  # set where Ctrl-C cuts the run short
    clock.start()
    try:
        due = last_sent = 0.0
        for spec, rec, gap in zip(specs, records, gaps, strict=True):
            due = (last_sent if plan.arrival.relative else due) + gap
            rec.scheduled_at = due
            # A loop, not one sleep: uvloop's timers count whole milliseconds and may fire
            # a fraction of one early, and a request must never go before its time.
            while (wait := due - clock.now()) > 0:
                await asyncio.sleep(wait)
            if slots is not None:
                await slots.acquire()
            last_sent = clock.now()
            tasks.append(asyncio.create_task(_send_one(backend, spec, rec, plan, slots, bar)))
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:  # Ctrl-C: asyncio.Runner cancels the main task
        ended = _ended_before_the_cut(records)
    finally:
        if await _cancel_all(tasks):
            ended = _ended_before_the_cut(records)
        bar.close()
        for rec in records:
            if rec.ended_at is None:
                rec.fail("not sent: the run was interrupted", clock.now())
    if ended is not None:
        raise _interrupted(records, ended)
    return records


async def _send_one(
    backend: Backend,
    spec: RequestSpec,
    rec: RequestRecord,
    plan: RunPlan,
    slots: asyncio.Semaphore | None,
    bar: tqdm,
) -> None:
    """Send one request; whatever happens, its record ends completed or failed."""
    now = backend.clock.now
    try:
        await asyncio.wait_for(backend.send(spec, rec), plan.request_timeout)
    except TimeoutError:
        rec.fail(f"timed out after {plan.request_timeout:g} s", now())
    except asyncio.CancelledError:
        rec.fail(CUT_SHORT, now())
        raise
    except Exception as exc:
        rec.fail(f"{type(exc).__name__}: {exc}", now())
    else:
        if rec.ended_at is None:
            rec.ended_at = now()
    finally:
        if slots is not None:
            slots.release()
        bar.update(1)


async def run_conversations(
    backend: Backend, conversations: list[Conversation], plan: RunPlan, run_index: int
) -> list[RequestRecord]:
    """Run every conversation, each started on the plan's schedule; one record per turn, in
    conversation order and then turn order."""
    clock = backend.clock
    records = [
        [
            RequestRecord(
                f"lg{SESSION}-{run_index}-c{c.index}-t{k}",
                0,
                out,
                0.0,
                conversation=c.index,
                turn=k,
            )
            for k, out in enumerate(c.output_lens)
        ]
        for c in conversations
    ]
    gaps = plan.arrival.gaps(len(conversations), run_index)
    slots = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    every = [rec for recs in records for rec in recs]  # the run's records, in the order returned
    bar = tqdm(total=len(every), desc=plan.label, unit="req", disable=not plan.progress)
    tasks: list[asyncio.Task[None]] = []
    ended: list[int] | None = None  # set where Ctrl-C cuts the run short
    clock.start()
    try:
        due = last_sent = 0.0
        for conversation, recs, gap in zip(conversations, records, gaps, strict=True):
            due = (last_sent if plan.arrival.relative else due) + gap
            recs[0].scheduled_at = due
            while (wait := due - clock.now()) > 0:
                await asyncio.sleep(wait)
            if slots is not None:
                await slots.acquire()
            last_sent = clock.now()
            talk = _converse(backend, conversation, recs, plan, slots, bar)
            tasks.append(asyncio.create_task(talk))
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:  # Ctrl-C: asyncio.Runner cancels the main task
        ended = _ended_before_the_cut(every)
    finally:
        if await _cancel_all(tasks):
            ended = _ended_before_the_cut(every)
        bar.close()
        for rec in every:
            if rec.ended_at is None:
                rec.fail("not sent: the run was interrupted", clock.now())
    if ended is not None:
        raise _interrupted(every, ended)
    return every


async def _converse(
    backend: Backend,
    conversation: Conversation,
    records: list[RequestRecord],
    plan: RunPlan,
    slots: asyncio.Semaphore | None,
    bar: tqdm,
) -> None:
    """The conversation's turns one after another, each reply fed into the next prompt; the
    conversation's slot (under a concurrency cap) is held until its last turn ends."""
    try:
        for k, rec in enumerate(records):
            if k:
                rec.scheduled_at = records[k - 1].ended_at or backend.clock.now()
            await _send_one(backend, conversation.turn(k), rec, plan, None, bar)
            if not rec.ok or rec.reply is None:
                _fail_rest(records[k + 1 :], k, backend.clock.now(), bar)
                return
            conversation.add_reply(rec.reply)
    finally:
        if slots is not None:
            slots.release()


def _fail_rest(records: list[RequestRecord], failed_turn: int, now: float, bar: tqdm) -> None:
    for rec in records:
        rec.scheduled_at = now
        rec.fail(f"not sent: turn {failed_turn} of its conversation failed", now)
        bar.update(1)
