"""Profiling: torch.profiler traces of a window of steps, and CUDA memory snapshots.

The trainer builds one `Profiler` once it knows the step it starts from, calls `step(step)` at the
end of every training step and `close()` at the end of the run (and `oom_snapshot()` when a step
runs out of GPU memory). Nothing else in the run knows about it.

Windows are fixed on the global step, so a resumed run profiles the same steps: a window ends at
every multiple of `profiling.freq`; its last `active` steps are recorded, after `warmup` steps in
which the profiler runs but throws away what it saw (the first steps of a trace are distorted by
the profiler's own start-up). With freq 100, warmup 3, active 1: steps 97-99 warm up, step 100 is
recorded, then 197-199 and 200, and so on.

What it writes, under <job.dump_folder>/<profiling.folder>/ (one file per rank):

    step-N/rank{R}_trace.json              chrome trace of the window that ended at step N: open it
                                           in https://ui.perfetto.dev or chrome://tracing
    step-N/rank{R}_memory_snapshot.pickle  CUDA allocator history up to step N (profiling.memory_snapshot:
                                           the first window only): drop it on https://pytorch.org/memory_viz
    oom-after-step-N/rank{R}_memory_snapshot.pickle  written when the run ran out of GPU memory
                                           after N completed steps

Memory history is recorded from the moment the profiler is built (after the model is built and any
checkpoint loaded) until the end of the run, so an out-of-memory snapshot shows the stack trace of
every allocation the training steps made; earlier allocations appear without one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titanlike.config.schema import Profiling
from titanlike.overrides import cuda

logger = logging.getLogger("titanlike")


@contextlib.contextmanager
def _each_window_alone():
    """Each window's trace holds that window's events only, which is what we want; torch warns about it as it
    starts a window (in start() and step()). Quieted where it is said, not for the process: a filter set once at
    import is lost wherever the filters are reset (pytest resets them for every test)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        yield

# Allocator events kept in the memory history ring buffer (the PyTorch docs' suggested size).
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int):
        self.cfg = cfg
        self.rank = rank
        self.folder = cfg.folder if os.path.isabs(cfg.folder) else os.path.join(dump_folder, cfg.folder)
        self.next_step = start_step + 1  # the global step the profiler is set up for
        self.recorded: list[int] = []  # steps recorded since the last trace was written
        # The allocator's history is torch's private API (overrides/cuda.py): a torch without it skips the
        # snapshots with one line, as a device without CUDA does, and the run goes on.
        missing = cuda.memory_history_problem() if cfg.memory_snapshot and device.type == "cuda" else None
        self.memory = cfg.memory_snapshot and device.type == "cuda" and missing is None
        self.snapshot_taken = False
        if cfg.memory_snapshot and not self.memory and rank == 0:
            why = missing or f"nothing to record on {device.type}"
            logger.warning(f"profiling.memory_snapshot records the CUDA allocator: {why}, skipped")
        if self.memory:
            cuda.record_memory_history(MEMORY_HISTORY_ENTRIES)
        self.torch_profiler = None
        if cfg.enable:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.torch_profiler = torch.profiler.profile(
                activities=activities, schedule=self._schedule, on_trace_ready=self._write_trace, record_shapes=True,
            )
            with _each_window_alone():
                self.torch_profiler.start()

    def phase(self, step: int) -> ProfilerAction:
        """What the profiler does during global step `step`."""
        until_window_end = -step % self.cfg.freq
        if until_window_end < self.cfg.active:
            return ProfilerAction.RECORD_AND_SAVE if until_window_end == 0 else ProfilerAction.RECORD
        if until_window_end < self.cfg.active + self.cfg.warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _schedule(self, _: int) -> ProfilerAction:
        # torch.profiler asks with its own count of steps since it started; we answer for the global
        # step, which stays right after a resume or a rollback (training.nonfinite).
        return self.phase(self.next_step)

    def step(self, step: int) -> None:
        """Called once at the end of each training step `step`."""
        self.next_step = step + 1
        if self.torch_profiler is not None:
            if self.phase(step) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
                self.recorded.append(step)
            with _each_window_alone():
                self.torch_profiler.step()  # may write the trace of the window that ends at this step
        if self.memory and not self.snapshot_taken and step % self.cfg.freq == 0:
            self.snapshot_taken = True
            self._dump_memory(f"step-{step}")

    def _path(self, subfolder: str, name: str) -> str:
        folder = os.path.join(self.folder, subfolder)
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"rank{self.rank}_{name}")

    def _write_trace(self, prof) -> None:
        if not self.recorded:  # the run ended before any step of this window ran
            return
        steps, self.recorded = self.recorded, []
        start = time.perf_counter()
        path = self._path(f"step-{steps[-1]}", "trace.json")
        prof.export_chrome_trace(path)
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        logger.info(f"profiling: trace of {which} written to {path} in {time.perf_counter() - start:.1f}s")

    def _dump_memory(self, subfolder: str) -> str:
        path = self._path(subfolder, "memory_snapshot.pickle")
        cuda.dump_memory_snapshot(path)
        logger.info(f"profiling: CUDA memory snapshot written to {path}")
        return path

    def oom_snapshot(self, steps_done: int) -> str | None:
        """The run ran out of GPU memory after `steps_done` steps: dump what the allocator holds and
        which code allocated it (profiling.memory_snapshot only)."""
        if not self.memory:
            return None
        path = self._dump_memory(f"oom-after-step-{steps_done}")
        logger.warning(f"out of GPU memory after {steps_done} completed steps: memory snapshot in {path}")
        return path

    def close(self) -> None:
        """Stop the profiler (a window cut short by the end of the run is written) and the memory history."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.memory:
            cuda.stop_memory_history()
            self.memory = False
