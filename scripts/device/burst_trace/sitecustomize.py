"""Timestamps of a request burst's way through `tandem serve` (a diagnostic, not the product).

Put this folder first on the PYTHONPATH of the serve process and set BURST_TRACE_OUT to a
folder: Python imports this module at start-up in the API process and in the engine process
it spawns, and each then records, with ``time.monotonic()`` (one clock for every process of the
host), when

- the API process read an HTTP request (``http``), encoded prompts (``enc``: prompts, seconds),
  sent an AddRequest (``send``), took in a request's first token (``ft``) and its end (``fin``),
  and wrote a response's first body chunk (``chunk1``);
- the engine took a request in (``add``, once accepted), planned a step that runs something
  (``step``: prompt tokens, decode rows, running, waiting; a row of one token counts as a
  decode), applied one (``upd``: first tokens, finished requests) and aborted requests
  (``abort``: how many).

Every half second each process writes what it has to BURST_TRACE_OUT/trace-PID.json;
``python scripts/device/burst_trace_report.py FOLDER`` reads them. With one_api_process.sh:
``BURST_TRACE_OUT=$OUT/trace bash scripts/device/one_api_process.sh
now=.=/tmp/site:$PWD/scripts/device/burst_trace``.

It wraps a few functions of frontend/, protocol/, engine_core/ and uvicorn by name. A wrapper
costs a few microseconds, and each half-second dump holds the GIL while it writes. So a traced
run is a little slower than a plain one: compare traced runs with traced runs. When a name has
moved, it says so on stderr and records the rest.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_OUT = os.environ.get("BURST_TRACE_OUT")
_RECORDS: list[tuple[Any, ...]] = []
_now = time.monotonic


def _record(*item: Any) -> None:
    _RECORDS.append((_now(), *item))  # list.append is atomic under the GIL


def _dump_every(seconds: float) -> None:
    path = os.path.join(_OUT or ".", f"trace-{os.getpid()}.json")

    def loop() -> None:
        written = 0
        while True:
            time.sleep(seconds)
            if len(_RECORDS) != written:
                written = len(_RECORDS)
                with open(path + ".tmp", "w") as f:
                    json.dump(_RECORDS[:written], f)
                os.replace(path + ".tmp", path)

    threading.Thread(target=loop, name="burst-trace", daemon=True).start()


def _trace_engine() -> None:
    from engine_core.scheduler import Scheduler
    from protocol.messages import FinishReason

    def got_first_token(request: Any) -> bool:
        """Whether a request that waited for its first token has it now: stamped, or finished
        with tokens of its own (one that ends at its first token is not stamped); no abort."""
        if request.first_token_time:
            return True
        has_output = len(request.token_ids) > request.first_token_index
        return (
            request.is_finished and request.finish_reason is not FinishReason.ABORT and has_output
        )

    add, schedule, update = Scheduler.add_request, Scheduler.schedule, Scheduler.update_from_output
    abort = Scheduler.abort_requests

    def add_request(self: Scheduler, request: Any) -> None:
        add(self, request)  # raises for a request it refuses: that one is not recorded
        _record("add")

    def abort_requests(self: Scheduler, request_ids: Any) -> list[Any]:
        aborted = abort(self, request_ids)
        if aborted:
            _record("abort", len(aborted))
        return aborted

    def traced_schedule(self: Scheduler) -> Any:
        plan = schedule(self)
        if not plan.scheduled:
            return plan  # nothing runs (with overlap, the step that settles the last one)
        steps = [s.num_new_tokens for s in plan.scheduled]
        prompt_tokens = sum(n for n in steps if n > 1)
        _record("step", prompt_tokens, steps.count(1), len(self.running), len(self.waiting))
        return plan

    def update_from_output(self: Scheduler, plan: Any, sampled: list[int]) -> Any:
        awaiting = self._awaiting_first_token  # the scheduler replaces it with those still waiting
        events = update(self, plan, sampled)
        firsts = sum(1 for r in awaiting if got_first_token(r))
        _record("upd", firsts, sum(e.finish_reason is not None for e in events))
        return events

    Scheduler.add_request = add_request  # type: ignore[method-assign]
    Scheduler.abort_requests = abort_requests  # type: ignore[method-assign]
    Scheduler.schedule = traced_schedule  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]


def _trace_api() -> None:
    from uvicorn.protocols.http import httptools_impl

    from frontend.generation import Generation
    from frontend.tokenizer import Tokenizer
    from protocol.client import AsyncEngineClient

    receive, add, encode_all = Generation._receive, AsyncEngineClient._add, Tokenizer.encode_all
    cycle_send = httptools_impl.RequestResponseCycle.send
    complete = httptools_impl.HttpToolsProtocol.on_message_complete

    def traced_receive(self: Generation, group: Any, choice: Any, out: Any, now: float) -> int:
        first = choice.first_token_at is None
        taken = receive(self, group, choice, out, now)
        if first and choice.first_token_at is not None:
            _record("ft")
        if out.finish_reason is not None:
            _record("fin")
        return taken

    def traced_add(self: AsyncEngineClient, *args: Any) -> Any:
        _record("send")
        return add(self, *args)

    def traced_encode_all(self: Tokenizer, texts: list[str], *args: Any) -> Any:
        start = _now()
        ids = encode_all(self, texts, *args)
        _RECORDS.append((start, "enc", len(texts), _now() - start))
        return ids

    async def traced_send(self: Any, message: Any) -> None:
        first = message["type"] == "http.response.body" and not getattr(self, "_traced", False)
        if first and message.get("body"):
            self._traced = True
            _record("chunk1")
        await cycle_send(self, message)

    def on_message_complete(self: Any) -> None:
        _record("http")
        complete(self)

    Generation._receive = traced_receive  # type: ignore[method-assign]
    AsyncEngineClient._add = traced_add  # type: ignore[method-assign]
    Tokenizer.encode_all = traced_encode_all  # type: ignore[method-assign]
    httptools_impl.RequestResponseCycle.send = traced_send  # type: ignore[method-assign]
    httptools_impl.HttpToolsProtocol.on_message_complete = on_message_complete  # type: ignore


def _install(part: str, trace: Callable[[], None]) -> None:
    try:
        trace()
    except (ImportError, AttributeError) as exc:
        print(f"burst trace: the {part} is not traced: {exc}", file=sys.stderr)


if _OUT:
    _install("engine", _trace_engine)
    _install("API process", _trace_api)
    _dump_every(0.5)
