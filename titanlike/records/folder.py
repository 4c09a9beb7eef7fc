"""The dump folder is one run's home: locked against a second run, checked writable before step 1,
and its records (metrics.jsonl, TensorBoard, config.toml) read as one run's history.

- A second run into a folder in use stops with one line naming the first (host, pid): an flock held
  for the run's life (titanlike.fs.FolderLock). When that run dies the lock goes with it, and the next
  run takes the folder over. The checkpoint folder has a lock of its own (checkpoint/manager.py), so
  two runs never share one through different dump folders either.
- A fresh run (not a resume) into a folder that holds another run's records moves them to
  `earlier-runs/<time>/` first, and says so.
- A resumed run drops the records of the steps after the checkpoint it resumed from (the attempt
  that was interrupted): they move from metrics.jsonl to metrics.dropped.jsonl, and TensorBoard
  purges them (purge_step).
- The folder records which run its records are (`run-id`): drawn when a run starts afresh, kept by
  its resumes. Every checkpoint records it too, so a resume can tell a step of this run from one
  copied in from another run (checkpoint/manager.py decides what then happens).
- `train.log` holds what the run's log says on rank 0 (a resume appends to it): the lines from the
  start of the run are held until the records are settled, then written.

Nothing here imports torch: the preflight uses `check_not_in_use`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from logging.handlers import MemoryHandler

from titanlike import fs
from titanlike.errors import UserError

logger = logging.getLogger("titanlike")

RUN_ID = "run-id"
# A run's records, which a fresh run moves to earlier-runs/ together: its tokenizer goes with them, so that
# the earlier run's checkpoints are never exported with the next run's.
RECORDS = ("metrics.jsonl", "metrics.dropped.jsonl", "tb", "wandb", "config.toml", RUN_ID, "tokenizer.json",
           "tokenizer_info.json", "train.log")
LOG_FORMAT, LOG_DATES = "%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"


class LogFile(logging.Handler):
    """The run's log lines, appended to train.log (never through a link). A write that fails (a full
    disk) ends the file, not the run: metrics.jsonl says the same in its own line."""

    def __init__(self, path: str):
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATES))
        self.file: fs.AppendFile | None = fs.AppendFile(path)

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is None:
            return
        try:
            self.file.write_line(self.format(record))
        except UserError:
            self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        super().close()


class RunFolderError(UserError):
    """Raised by rank 0 only (the one that locks and writes the folder)."""


def check_not_in_use(path: str, checkpoint_folder: str | None = None) -> None:
    """For the preflight: fail before torchrun when another run holds the dump folder or the checkpoint
    folder (nothing is created)."""
    fs.FolderLock(path, "job.dump_folder").check_free()
    if checkpoint_folder:
        fs.FolderLock(checkpoint_folder, "checkpoint.folder").check_free()


class RunFolder:
    def __init__(self, path: str, is_main: bool):
        self.path, self.is_main = fs.check_path_text(path, "job.dump_folder"), is_main
        self.lock = fs.FolderLock(path, "job.dump_folder")
        if is_main:
            try:
                fs.write_probe(path, f".write-test-{os.getpid()}")
            except OSError as e:
                raise RunFolderError(f"job.dump_folder {path} is not writable ({fs.describe_os_error(e, path)}); "
                                     f"set --job.dump_folder to a writable path") from None
            self.lock.acquire()
            atexit.register(self.close)  # also when the run stops before the trainer exists
            # The log from here on, held until start_records settles whose records the folder holds.
            self.log: logging.Handler = MemoryHandler(capacity=1_000_000, flushLevel=logging.CRITICAL + 1)
            logger.addHandler(self.log)
            if self.lock.previous:
                logger.info(f"took over {path} from a run that ended without releasing it ({self.lock.previous})")
        self.run_id = self._recorded_run() if is_main else None
        """The run this folder's records are of (rank 0; None when it holds none)."""
        if self.run_id is not None:
            self._check_records()

    def _check_records(self) -> None:
        """In a folder that holds a run's records, which a resume goes on writing: refuse one the run could not
        write, before anything changes (a resume sets later checkpoints aside and moves later metrics records,
        which a refusal after them would leave done). A link where a record goes (titanlike writes through
        none), a folder where a file goes, or the reverse. (A folder with no run's records has them moved
        aside whole by a fresh run, links included: start_records.)"""
        for name in RECORDS:
            path = os.path.join(self.path, name)
            if os.path.islink(path):
                raise RunFolderError(f"cannot write {path}: a symbolic link, and titanlike writes only files it "
                                     f"created (remove the link); nothing was changed")
            folder = name in ("tb", "wandb")
            if os.path.exists(path) and not (os.path.isdir(path) if folder else os.path.isfile(path)):
                what = "a file" if os.path.isfile(path) else fs.kind_of(os.stat(path).st_mode)
                raise RunFolderError(f"cannot write {path}: {what} where the run keeps its "
                                     f"{'folder' if folder else 'file'} of records (move it away); nothing was "
                                     f"changed")

    def _recorded_run(self) -> str | None:
        target = os.path.join(self.path, RUN_ID)
        if not os.path.isfile(target) or os.path.islink(target):
            return None
        try:
            with open(target, encoding="utf-8", errors="replace") as f:
                text = f.read(200).strip()
        except OSError:
            return None
        return text if text.isalnum() else None  # an id is hex: anything else is no run of ours

    def write(self, name: str, text: str) -> None:
        """A file of the run's own (config.toml), written whole, never through a link (rank 0)."""
        if self.is_main:
            fs.write_text(os.path.join(self.path, name), text)

    def start_records(self, resumed_step: int | None, run_id: str, branched: bool = False) -> int | None:
        """Make the folder's records one run's history, that of `run_id`; returns TensorBoard's purge_step
        (or None). `branched`: resumed from another run's checkpoint, so the folder's records (of the run
        it held) are not this run's history: they move away as for a fresh run."""
        if not self.is_main:
            return None
        purge_step = self._start_records(resumed_step, branched)
        fs.write_text(os.path.join(self.path, RUN_ID), run_id + "\n")
        self.run_id = run_id
        self._open_log()
        return purge_step

    def _open_log(self) -> None:
        """The held log lines into train.log, and every line after them."""
        held = self.log
        self.log = LogFile(os.path.join(self.path, "train.log"))
        logger.addHandler(self.log)
        logger.removeHandler(held)
        if isinstance(held, MemoryHandler):
            held.setTarget(self.log)
            held.flush()
        held.close()

    def _start_records(self, resumed_step: int | None, branched: bool) -> int | None:
        if resumed_step is None or branched:
            found = [n for n in RECORDS if os.path.lexists(os.path.join(self.path, n))]
            if found:
                written = os.lstat(os.path.join(self.path, found[0])).st_mtime
                stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(written))
                earlier = os.path.join(self.path, "earlier-runs")
                if os.path.islink(earlier) or (os.path.lexists(earlier) and not os.path.isdir(earlier)):
                    # Moving the records through a link would write wherever it points.
                    what = "a symbolic link" if os.path.islink(earlier) else "not a folder"
                    raise RunFolderError(f"{earlier} is {what}; a fresh run moves the earlier run's records "
                                         f"({', '.join(found)}) into a folder there that it creates: move it away, "
                                         f"or use another --job.dump_folder")
                target = os.path.join(earlier, stamp)
                k = 1
                while os.path.lexists(target):
                    k += 1
                    target = os.path.join(earlier, f"{stamp}-{k}")
                os.makedirs(target)
                for name in found:
                    os.replace(os.path.join(self.path, name), os.path.join(target, name))
                how = ("this run branches from another run's checkpoint" if branched
                       else "this run starts afresh, not from a checkpoint")
                logger.info(f"{self.path} held another run's records: moved {', '.join(found)} to {target}/ ({how})")
            return None
        self._drop_metrics_after(resumed_step)
        return resumed_step + 1

    def _drop_metrics_after(self, step: int) -> None:
        path = os.path.join(self.path, "metrics.jsonl")
        if not os.path.isfile(path) or os.path.islink(path):
            return
        keep: list[str] = []
        drop: list[str] = []
        with open(path) as f:
            for line in f:
                try:
                    later = int(json.loads(line).get("step", 0)) > step
                except (ValueError, AttributeError, TypeError):
                    later = False  # a torn last line, say: keep it where it is
                (drop if later else keep).append(line)
        if not drop:
            return
        dropped = fs.AppendFile(os.path.join(self.path, "metrics.dropped.jsonl"))
        for line in drop:
            dropped.write_line(line.rstrip("\n"))
        dropped.close()
        fs.write_text(path, "".join(keep))
        logger.info(f"metrics.jsonl: {len(drop)} records after step {step} (the interrupted attempt's) moved to "
                    f"metrics.dropped.jsonl; TensorBoard drops those steps too")

    def close(self) -> None:
        if hasattr(self, "log"):
            logger.removeHandler(self.log)
            self.log.close()
        self.lock.release()
