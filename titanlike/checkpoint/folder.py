"""The checkpoint folder on disk: its step folders, and what a failed save or load means in words.

    step-200/            a complete checkpoint (manifest.json written last)
    step-300.tmp/        a save in progress, or one a crash interrupted: never loaded, reported
    step-400.abandoned/  set aside: a resume from an earlier step (checkpoint.load_step) went another way
    step-500.damaged/    set aside: its files do not match its manifest, or it has no signed manifest

Renames and deletions are rank 0's; every rank lists. Nothing here runs a collective: the manager
(manager.py) puts barriers around these where ranks must agree.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
DAMAGED_DIR = re.compile(r"^step-(\d+)\.damaged(?:\.\d+)?$")


class StepFolders:
    def __init__(self, folder: str, is_main: bool):
        self.folder, self.is_main = folder, is_main

    def step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _matching(self, pattern: re.Pattern) -> list[int]:
        if not os.path.isdir(self.folder):
            return []
        return sorted({int(m.group(1)) for m in map(pattern.match, os.listdir(self.folder)) if m})

    def complete(self) -> list[int]:
        return self._matching(STEP_DIR)

    def incomplete(self) -> list[int]:
        return self._matching(TMP_DIR)

    def damaged(self) -> list[str]:
        return sorted(n for n in os.listdir(self.folder) if DAMAGED_DIR.match(n)) if os.path.isdir(self.folder) else []

    def aside_name(self, step: int, why: str) -> str:
        """Where step-N goes when set aside: step-N.<why>, or step-N.<why>.k if that is taken."""
        base = self.step_dir(step) + f".{why}"
        target, k = base, 1
        while os.path.exists(target):
            k += 1
            target = f"{base}.{k}"
        return target

    def set_aside(self, step: int, target: str) -> None:
        if self.is_main:
            os.replace(self.step_dir(step), target)

    def prune(self, keep: int, below: int) -> None:
        """Delete all but the newest `keep` complete steps before step `below` (rank 0). Never fewer
        than one: a failed save always leaves a checkpoint behind."""
        if self.is_main:
            older = [s for s in self.complete() if s < below]
            for old in older[: -max(keep, 1)]:
                shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def size_mb(self, step: int) -> float:
        path = Path(self.step_dir(step))
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**20 if path.is_dir() else 0.0


def failure_cause(e: BaseException, folder: str, keep_latest_k: int, checkpoint_mb: float,
                  on_disk: int = 0) -> str:
    """One readable cause of a failed save: the OSError's text and path where there is one, else what
    the file system says (free space, the file size limit), else the first line of the error, with
    its type named. `on_disk`: the complete checkpoints in the folder besides the one being saved;
    `checkpoint_mb`: the newest one's size, or (none on disk) an estimate of this one's."""
    from torch.distributed.checkpoint.api import CheckpointException

    free_mb = shutil.disk_usage(folder).free / 2**20 if os.path.isdir(folder) else float("inf")
    errors: list[BaseException] = []
    todo: list[BaseException] = [e]
    while todo and len(errors) < 50:  # DCP wraps each rank's error: (exception, traceback) per rank
        x = todo.pop()
        errors.append(x)
        for wrapped in (getattr(x, "failures", None) or {}).values():
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped))
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
    os_error = next((x for x in errors if isinstance(x, OSError) and x.strerror), None)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if (os_error and os_error.errno == errno.ENOSPC) or any("No space left" in str(x) for x in errors) or free_mb < 64:
        # A save keeps the newest complete checkpoint until the new one is whole: two on disk at the
        # peak whatever keep_latest_k is. keep_latest_k 2 deletes all but the newest before a save, so it
        # frees something only where more than one is on disk (and k is 0, keep all, or above 2).
        if not on_disk:  # nothing to remove yet: only the size can help the user plan
            need = f"; this run's checkpoint takes about {checkpoint_mb:.0f} MB" if checkpoint_mb else ""
        else:
            need = f"; a checkpoint takes {checkpoint_mb:.0f} MB and a save needs room for one more beside the " \
                f"newest" if checkpoint_mb else ""
        frees = on_disk > 1 and (keep_latest_k == 0 or keep_latest_k > 2)
        advice = (f"keep fewer with --checkpoint.keep_latest_k 2 (a save then deletes all but the newest: "
                  f"{on_disk - 1} of the {on_disk} here), " if frees else "")
        return (f"No space left on device: {free_mb:.0f} MB free{need}; {advice}free space, or point "
                f"--checkpoint.folder at a larger disk")
    size_limit = (f"this process may write files of at most {limit / 2**20:.0f} MB (ulimit -f); raise the limit"
                  if limit != resource.RLIM_INFINITY else "")
    if os_error:
        cause = f"{os_error.strerror}: {os_error.filename or folder}"
        return f"{cause}: {size_limit}" if os_error.errno == errno.EFBIG and size_limit else cause
    if size_limit:
        return f"a file could not be written in full: {size_limit}"
    # The error a rank met, not DCP's wrapper around it; its type named (a KeyError's text alone is a key).
    inner = next((x for x in errors if not isinstance(x, CheckpointException) and str(x).strip()), e)
    text = (str(inner).strip().splitlines() or [""])[0][:200]
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def _first_failure(e: BaseException) -> BaseException:
    """What went wrong in a load: DCP wraps each rank's exception in a CheckpointException ({rank:
    (exception, traceback)}); the first rank's, or `e` itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    failures = e.failures if isinstance(e, CheckpointException) else {}
    for wrapped in failures.values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return e


def unloadable(step_dir: str, e: BaseException) -> str | None:
    """The one line for a step whose every byte matches its checksum but that failed to load into this run,
    or None where `e` says best what it is (a UserError; running out of memory, which the trainer reports
    with its peak). Such a step is not damaged: the run differs from the one that saved it in a way no
    check names, or the read failed. Setting it aside would send the run back to an older step and bury
    the newest save, so it stays as it is."""
    import torch

    from titanlike.errors import UserError

    failure = _first_failure(e)
    if isinstance(e, UserError) or isinstance(failure, (MemoryError, torch.cuda.OutOfMemoryError)):
        return None
    cause = (str(failure).strip().splitlines() or [type(failure).__name__])[0][:200]
    return (f"{step_dir} matches its checksums but does not load into this run ({type(failure).__name__}: {cause}); "
            f"nothing was renamed or changed: resume with the settings it was saved with, start from its weights "
            f"alone with --checkpoint.initial_load_path {step_dir} in a new --job.dump_folder, or move it out of "
            f"the folder to resume from the step before it")
