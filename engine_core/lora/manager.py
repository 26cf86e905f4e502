"""Where adapters live in the engine core: host memory, then one of a fixed number of slots.

The one owner of adapter state. A request names its adapter (``LoraRef``: name and folder).
``prepare`` starts reading it on a worker thread unless host memory holds it; the scheduler
admits the request only once ``acquire`` gave it a slot: the adapter's own where it is
resident, else a slot no running request uses (empty, or the least recently used), into which
its weights are copied. A request holds its slot until it finishes or is preempted
(``release``), so a slot is never rewritten under a request that reads it. Host memory keeps at
most ``max_cpu_loras`` adapters, least recently used out first; one evicted is read again from
its folder when a request next names it.

A slot written while the previous step still runs on the GPU is safe for the same reason freed
KV blocks are: the copy is enqueued on the engine's one stream, after that step.

Under tensor parallelism every rank has a manager and slots of its own share; rank 0's decides.
The reads it started and the slots it wrote since the last step (``take_changes``) travel with
the next step's inputs, and each worker's manager makes the same ones (``follow``): it reads the
same folders and writes the same slots before that step's forward.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.lora.adapter import LoraAdapter, LoraError
from engine_core.lora.batch import NO_SLOT
from engine_core.lora.layers import LoraModule
from protocol.messages import LoraRef

logger = logging.getLogger(__name__)


@dataclass
class LoraChanges:
    """What rank 0's manager did since the last step, for the workers' managers to do too."""

    reads: list[LoraRef] = field(default_factory=list)  # folders it started reading
    writes: list[tuple[int, LoraRef]] = field(default_factory=list)  # (slot, adapter) in order


class LoraManager:
    def __init__(
        self,
        layers: dict[tuple[int, str], LoraModule],
        load: Callable[[str], LoraAdapter],
        max_loras: int,
        max_cpu_loras: int,
        share_changes: bool = False,
    ) -> None:
        self.layers = layers
        self._load = load  # folder -> adapter, checked against the model (adapter.py)
        self.max_cpu_loras = max_cpu_loras
        self._host: OrderedDict[LoraRef, LoraAdapter] = OrderedDict()  # oldest use first
        self._loading: dict[LoraRef, concurrent.futures.Future[LoraAdapter]] = {}
        self._errors: dict[LoraRef, str] = {}  # reads that failed, until take_errors
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._slots: list[LoraRef | None] = [None] * max_loras
        self._users: list[set[str]] = [set() for _ in range(max_loras)]
        self._slot_used: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self._slot_of: dict[str, int] = {}  # request id -> its slot
        self.loads = 0  # slot writes, for the tests and the log
        self.reads = 0  # folders read
        # Under tensor parallelism: the reads and writes since the last take_changes.
        self._changes: LoraChanges | None = LoraChanges() if share_changes else None

    # ---- host memory ---------------------------------------------------------------------------

    def prepare(self, ref: LoraRef) -> None:
        """Start reading ``ref`` unless host memory holds it or a read is under way."""
        if ref in self._host:
            self._host.move_to_end(ref)
        elif ref not in self._loading:
            self._loading[ref] = self._pool.submit(self._load, ref.path)
            self.reads += 1
            if self._changes is not None:
                self._changes.reads.append(ref)

    def take_errors(self) -> dict[LoraRef, str]:
        """The adapters whose read failed since the last call, with why (a missing folder, a
        refused config...): the engine core fails the waiting requests that name them. A later
        request naming one reads its folder again."""
        for ref in list(self._loading):
            self._settle(ref)
        errors, self._errors = self._errors, {}
        return errors

    @property
    def has_errors(self) -> bool:
        return any(future.done() for future in self._loading.values()) or bool(self._errors)

    def loading_futures(self) -> list[concurrent.futures.Future[LoraAdapter]]:
        return list(self._loading.values())

    def _settle(self, ref: LoraRef) -> bool:
        """Move a finished read into host memory (or its error aside); True once it is there."""
        future = self._loading.get(ref)
        if future is not None and future.done():
            del self._loading[ref]
            try:
                self._keep(ref, future.result())
            except LoraError as exc:
                self._errors[ref] = str(exc)
            except Exception as exc:  # an unreadable file is this request's error, not the engine's
                self._errors[ref] = f"adapter {ref.name!r} ({ref.path}) failed to load: {exc!r}"
        return ref in self._host

    def _keep(self, ref: LoraRef, adapter: LoraAdapter) -> None:
        self._host[ref] = adapter
        while len(self._host) > self.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            logger.info("LoRA adapter %r left host memory (--max-cpu-loras)", evicted.name)

    # ---- slots ---------------------------------------------------------------------------------

    def acquire(self, request_id: str, ref: LoraRef) -> bool:
        """Give the request a slot holding its adapter; False (it waits) while the adapter is
        still being read or every slot serves other running requests."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return True
        if ref in self._slots:
            return self._pin(request_id, self._slots.index(ref))
        idle = [s for s in self._slot_used if not self._users[s]]  # least recently used first
        if not idle:
            return False  # checked first: a read now could evict a copy that gets a slot sooner
        if not self._settle(ref):
            if ref not in self._errors:
                self.prepare(ref)  # evicted from host memory since its request came: read again
            return False
        free = next((s for s in idle if self._slots[s] is None), idle[0])
        self._write(free, ref)
        return self._pin(request_id, free)

    def release(self, request_id: str) -> None:
        """The request no longer runs (finished, aborted or preempted): its slot may change."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._users[slot].discard(request_id)

    def slot_of(self, request_id: str) -> int:
        return self._slot_of.get(request_id, NO_SLOT)

    def resident(self) -> list[str]:
        """The names of the adapters in slots."""
        return [ref.name for ref in self._slots if ref is not None]

    def _pin(self, request_id: str, slot: int) -> bool:
        self._users[slot].add(request_id)
        self._slot_of[request_id] = slot
        self._slot_used.move_to_end(slot)
        ref = self._slots[slot]
        if ref is not None and ref in self._host:
            self._host.move_to_end(ref)
        return True

    def _write(self, slot: int, ref: LoraRef) -> None:
        adapter = self._host[ref]
        for key, layer in self.layers.items():
            parts = adapter.weights.get(key)
            if parts:
                layer.write_slot(slot, parts)
            else:
                layer.clear_slot(slot)
        self._slots[slot] = ref
        self.loads += 1
        if self._changes is not None:
            self._changes.writes.append((slot, ref))
        logger.info("LoRA adapter %r in slot %d", ref.name, slot)

    # ---- tensor parallelism --------------------------------------------------------------------

    def take_changes(self) -> LoraChanges:
        """Rank 0: the reads started and slots written since the last call."""
        assert self._changes is not None, "a manager built without share_changes"
        changes, self._changes = self._changes, LoraChanges()
        return changes

    def follow(self, changes: LoraChanges) -> None:
        """A worker: start the reads rank 0 started, and write the slots it wrote, reading a
        folder now where this rank has no copy yet. A folder rank 0 could read and this rank
        cannot (changed in between) fails the step, which ends the engine core (tp_runner.py):
        the ranks would otherwise serve different weights."""
        for ref in changes.reads:
            self._read_again(ref)
        for slot, ref in changes.writes:
            self._read_again(ref)
            future = self._loading.get(ref)
            if future is not None:
                future.result()  # raises this rank's read error
            if not self._settle(ref):
                raise RuntimeError(f"LoRA adapter {ref.name!r}: {self._errors.pop(ref, '')}")
            self._write(slot, ref)
        if self._changes is not None:
            self._changes = LoraChanges()  # a worker's own record is never sent

    def _read_again(self, ref: LoraRef) -> None:
        """``prepare``, after forgetting a read of ``ref`` that failed here (rank 0 read it
        again: its folder may have been fixed)."""
        self._settle(ref)
        self._errors.pop(ref, None)
        self.prepare(ref)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
