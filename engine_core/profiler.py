"""A running engine under torch.profiler, between two controls (POST /start_profile, /stop_profile).

Off unless the engine starts with ``--profile-dir DIR``: the profiler slows every step, so it is
for finding where a served load's time goes, never for serving. START_PROFILE starts
torch.profiler in the engine core's process (CPU activities, and CUDA where the engine runs on a
GPU); STOP_PROFILE stops it and writes three files into DIR:

- ``tandem-engine-<pid>-<n>.trace.json.gz``: the Chrome trace (ui.perfetto.dev opens it as is);
- ``tandem-engine-<pid>-<n>.top.txt``: torch's table of the operations that took the most time,
  by their own device time on CUDA (CUDA-graph replays' kernels included), their own CPU time on
  the CPU.

- ``tandem-engine-<pid>-<n>.steps.jsonl``: a first line ``{"engine": ...}`` with what the
  attention of this engine's rank is (heads, page size, block tables' width, the cache's dtype,
  whether every layer is plain causal attention), then each step the engine launched in between, a
  line each, as its attention saw it: every sequence's new tokens (``new``) and its context once
  they are in (``lens``, the new ones included), in row order; the rows of the decode graph it
  replayed (``graph_rows``, its padding included; 0: eager, or a prefill or verify graph); and
  the shared-prefix tokens its decode rows attended once (``shared``). A kernel's time in the
  trace is known by its launch grid; these are the lengths it read, which `python -m benchmarks
  attention --replay` runs again through the engine's kernel and the peer's. With overlap
  scheduling a step launched just before START_PROFILE runs in the trace without a line, and
  the last line's step may end after STOP_PROFILE. The lines are held in memory until the stop:
  a trace is for seconds of a load, not minutes.

vLLM serves the same two routes (its traces under its own profiler directory), so one workload can
be profiled on both servers alike. With tensor parallelism only rank 0's process is traced (its
GPU's kernels); the other ranks run the same kernels on their shards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine_core.request import SchedulerOutput

logger = logging.getLogger(__name__)

TOP_ROWS = 40  # rows of the .top.txt table


class ProfilerError(Exception):
    """A control the profiler cannot follow (off, already on, not on); the message says why."""


def check_profile_dir(directory: str) -> None:
    """ValueError unless ``directory`` is, or can be made, a folder this process writes in:
    its nearest existing ancestor (itself, if it exists) is a writable folder."""
    path = Path(directory).absolute()
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as exc:  # a parent this process may not search
        raise ValueError(f"--profile-dir {directory}: {exc.strerror or exc}") from None
    if not existing.is_dir():
        raise ValueError(f"--profile-dir {directory}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--profile-dir {directory}: {existing} is not writable")


@dataclass(frozen=True)
class StepShape:
    """One step as its attention saw it: each sequence's new tokens, and its context once they
    are in (the new ones included), in row order; the rows of the decode graph it replayed (0:
    none), and the shared-prefix tokens its decode rows attended once (0: none)."""

    new: tuple[int, ...]
    lens: tuple[int, ...]
    graph_rows: int
    shared: int

    @classmethod
    def of(cls, plan: SchedulerOutput, graph_rows: int, shared: int) -> StepShape:
        rows = plan.scheduled
        new = tuple(r.num_new_tokens for r in rows)
        lens = tuple(r.start + r.num_new_tokens for r in rows)
        return cls(new, lens, graph_rows, shared)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


class RecordsSteps(Protocol):
    """What runs the steps (the model runner): it appends each step's shape to ``step_shapes``
    while that is a list (None: not recording), and says what its attention is."""

    step_shapes: list[StepShape] | None

    def attention_facts(self) -> dict[str, Any]: ...


class EngineProfiler:
    """The engine's profiler: one trace at a time, numbered, into ``directory`` (None: off), with
    the shapes of the steps ``steps`` ran while it traced."""

    def __init__(self, directory: str | None, cuda: bool, steps: RecordsSteps) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.cuda = cuda
        self.steps = steps
        self._profile: Any = None  # the torch.profiler.profile running, or None
        self._traces = 0

    def start(self) -> str:
        """Start tracing; the directory the trace will be written to."""
        from torch.profiler import ProfilerActivity, profile

        directory = self._directory()
        if self._profile is not None:
            raise ProfilerError("the profiler is already running: POST /stop_profile first")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # made unusable since start-up checked it (check_profile_dir)
            raise ProfilerError(f"--profile-dir {directory}: {exc.strerror or exc}") from None
        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.start()
        self.steps.step_shapes = []
        logger.info("profiler started (traces into %s)", directory)
        return str(directory)

    def stop(self) -> list[str]:
        """Stop tracing and write the trace, its table and the steps' shapes; their paths."""
        directory = self._directory()
        if self._profile is None:
            raise ProfilerError("the profiler is not running: POST /start_profile first")
        profile, self._profile = self._profile, None
        shapes, self.steps.step_shapes = self.steps.step_shapes or [], None
        profile.stop()
        self._traces += 1
        stem = f"tandem-engine-{os.getpid()}-{self._traces}"
        trace = directory / f"{stem}.trace.json.gz"
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = profile.key_averages().table(sort_by=sort_by, row_limit=TOP_ROWS)
        top = directory / f"{stem}.top.txt"
        steps = directory / f"{stem}.steps.jsonl"
        try:
            profile.export_chrome_trace(str(trace))
            top.write_text(table + "\n")
            header = json.dumps({"engine": self.steps.attention_facts()}) + "\n"
            steps.write_text(header + "".join(shape.to_json() + "\n" for shape in shapes))
        except OSError as exc:  # the folder gone or full: the trace is lost, the engine is not
            raise ProfilerError(f"--profile-dir {directory}: {exc.strerror or exc}") from None
        logger.info("profiler stopped: %s, %s, %s", trace, top, steps)
        return [str(trace), str(top), str(steps)]

    def _directory(self) -> Path:
        if self.directory is None:
            raise ProfilerError(
                "profiling is off: start the engine with --profile-dir DIR to enable "
                "/start_profile and /stop_profile"
            )
        return self.directory
