"""The dump folder is one run's home: locked against a second run, checked writable before step 1,
and its records (metrics.jsonl, TensorBoard, config.toml) read as one run's history.

- A second run into a folder in use stops with one line naming the first (host, pid). The lock is
  an flock held for the run's life: when that run dies, the lock goes with it, and the next run
  takes the folder over.
- A fresh run (not a resume) into a folder that holds another run's records moves them to
  `earlier-runs/<time>/` first, and says so.
- A resumed run drops the records of the steps after the checkpoint it resumed from (the attempt
  that was interrupted): they move from metrics.jsonl to metrics.dropped.jsonl, and TensorBoard
  purges them (purge_step).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import socket
import sys
import time

from titanlike.errors import UserError

logger = logging.getLogger("titanlike")

LOCK = ".titanlike.lock"
RECORDS = ("metrics.jsonl", "metrics.dropped.jsonl", "tb", "config.toml")


class RunFolderError(UserError):
    """Raised by rank 0 only (the one that locks and writes the folder)."""


def write_probe(path: str, name: str) -> None:
    """Make `path` and write, then remove, a small file `name` in it: raises the OSError a save would."""
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, name)
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def _writable(path: str) -> None:
    try:
        write_probe(path, f".write-test-{os.getpid()}")
    except OSError as e:
        raise RunFolderError(f"job.dump_folder {path} is not writable ({e.strerror}: {e.filename or path}); "
                             f"set --job.dump_folder to a writable path") from None


def _holder(path: str) -> str:
    try:
        with open(os.path.join(path, LOCK)) as f:
            h = json.load(f)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose details are unreadable"


def _in_use(path: str) -> RunFolderError:
    return RunFolderError(f"job.dump_folder {path} is in use by another run ({_holder(path)}): wait for it, "
                          f"stop it, or use another --job.dump_folder")


def check_not_in_use(path: str) -> None:
    """For the launcher's preflight: fail before torchrun when another run holds the folder."""
    lock_file = os.path.join(path, LOCK)
    if not os.path.exists(lock_file):
        return
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return  # the real lock attempt reports it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path) from None
    finally:
        os.close(fd)


class RunFolder:
    def __init__(self, path: str, is_main: bool):
        self.path, self.is_main = path, is_main
        self._lock_fd: int | None = None
        if is_main:
            _writable(path)
            self._lock()

    def _lock(self) -> None:
        lock_file = os.path.join(self.path, LOCK)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(self.path) from None
        previous = _holder(self.path) if os.path.getsize(lock_file) else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}).encode(), 0)
        self._lock_fd = fd
        atexit.register(self.close)  # also when the run stops before the trainer exists
        if previous:
            logger.info(f"took over {self.path} from a run that ended without releasing it ({previous})")

    def start_records(self, resumed_step: int | None) -> int | None:
        """Make the folder's records one run's history; returns TensorBoard's purge_step (or None)."""
        if not self.is_main:
            return None
        if resumed_step is None:
            found = [n for n in RECORDS if os.path.exists(os.path.join(self.path, n))]
            if found:
                written = os.path.getmtime(os.path.join(self.path, found[0]))
                stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(written))
                target = os.path.join(self.path, "earlier-runs", stamp)
                k = 1
                while os.path.exists(target):
                    k += 1
                    target = os.path.join(self.path, "earlier-runs", f"{stamp}-{k}")
                os.makedirs(target)
                for name in found:
                    os.replace(os.path.join(self.path, name), os.path.join(target, name))
                logger.info(f"{self.path} held another run's records: moved {', '.join(found)} to {target}/ "
                            f"(this run starts afresh, not from a checkpoint)")
            return None
        self._drop_metrics_after(resumed_step)
        return resumed_step + 1

    def _drop_metrics_after(self, step: int) -> None:
        path = os.path.join(self.path, "metrics.jsonl")
        if not os.path.exists(path):
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
        with open(os.path.join(self.path, "metrics.dropped.jsonl"), "a") as f:
            f.writelines(drop)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
        logger.info(f"metrics.jsonl: {len(drop)} records after step {step} (the interrupted attempt's) moved to "
                    f"metrics.dropped.jsonl; TensorBoard drops those steps too")

    def close(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)  # empty: the run ended cleanly (a dead run's details stay)
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
