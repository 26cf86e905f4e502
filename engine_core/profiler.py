"""A running engine under torch.profiler, between two controls (POST /start_profile, /stop_profile).

Off unless the engine starts with ``--profile-dir DIR``: the profiler slows every step, so it is
for finding where a served load's time goes, never for serving. START_PROFILE starts
torch.profiler in the engine core's process (CPU activities, and CUDA where the engine runs on a
GPU); STOP_PROFILE stops it and writes two files into DIR:

- ``tandem-engine-<pid>-<n>.trace.json.gz``: the Chrome trace (ui.perfetto.dev opens it as is);
- ``tandem-engine-<pid>-<n>.top.txt``: torch's table of the operations that took the most time,
  by their own device time on CUDA (CUDA-graph replays' kernels included), their own CPU time on
  the CPU.

vLLM serves the same two routes (its traces under its own profiler directory), so one workload can
be profiled on both servers alike. With tensor parallelism only rank 0's process is traced (its
GPU's kernels); the other ranks run the same kernels on their shards.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

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


class EngineProfiler:
    """The engine's profiler: one trace at a time, numbered, into ``directory`` (None: off)."""

    def __init__(self, directory: str | None, cuda: bool) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.cuda = cuda
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
        logger.info("profiler started (traces into %s)", directory)
        return str(directory)

    def stop(self) -> list[str]:
        """Stop tracing and write the trace and its table; their paths."""
        directory = self._directory()
        if self._profile is None:
            raise ProfilerError("the profiler is not running: POST /start_profile first")
        profile, self._profile = self._profile, None
        profile.stop()
        self._traces += 1
        stem = f"tandem-engine-{os.getpid()}-{self._traces}"
        trace = directory / f"{stem}.trace.json.gz"
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = profile.key_averages().table(sort_by=sort_by, row_limit=TOP_ROWS)
        top = directory / f"{stem}.top.txt"
        try:
            profile.export_chrome_trace(str(trace))
            top.write_text(table + "\n")
        except OSError as exc:  # the folder gone or full: the trace is lost, the engine is not
            raise ProfilerError(f"--profile-dir {directory}: {exc.strerror or exc}") from None
        logger.info("profiler stopped: %s, %s", trace, top)
        return [str(trace), str(top)]

    def _directory(self) -> Path:
        if self.directory is None:
            raise ProfilerError(
                "profiling is off: start the engine with --profile-dir DIR to enable "
                "/start_profile and /stop_profile"
            )
        return self.directory
