"""The files a run writes and the small files it is handed, through one gate each.

Writing: never through a symlink titanlike did not create. A file is written whole under a
temporary name in the same folder and renamed over the target (`write_text`, `write_json`):
a rename replaces a symlink itself, never its target. A file that grows (metrics.jsonl) or must
stay open (a lock) is opened with O_NOFOLLOW (`open_append`, `FolderLock`, `OutputClaim`): a symlink
there is refused with one line. Errors a user can fix (a full disk, a read-only folder, a name that is not
UTF-8) become one `FileError` line naming the file.

Reading: `read_text` and `read_json` read a small file a user may have been handed (a dataset.json,
a config.json, a tokenizer.json, a checkpoint's JSON) as a regular file of bounded size, decoded
as UTF-8, with one line for anything wrong. Checkpoint tensors go through the checkpoint's own gate
(titanlike/checkpoint/manifest.py).

Plain Python (no torch): the preflight uses it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from typing import Any

from titanlike.errors import UserError

# A JSON or tokenizer file of a real run is kilobytes to a few tens of megabytes (a large vocabulary's
# tokenizer.json); a larger one is not what it claims to be.
MAX_SMALL_FILE = 256 * 2**20


class FileError(UserError):
    """A file the run cannot read or write, named with the reason; the same on every rank that meets it."""


def describe_os_error(e: OSError, path: str | os.PathLike) -> str:
    """'PATH: reason' in words a user acts on (a full disk, a read-only folder, permissions)."""
    where = os.fsdecode(e.filename) if e.filename else os.fsdecode(path)
    if e.errno == errno.ENOSPC:
        return f"{where}: no space left on the device"
    if e.errno == errno.EROFS:
        return f"{where}: the file system is read-only"
    if e.errno == errno.ELOOP:
        return f"{where}: a symbolic link, and titanlike writes only files it created (remove the link)"
    return f"{where}: {e.strerror or e}"


def kind_of(mode: int) -> str:
    """What a path that is not a plain file is (its st_mode), in words for an error line."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def not_a_folder(path: str) -> str:
    """What `path`, which is not a folder, is instead: in words for an error line."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a link to {os.readlink(path)!r}, which does not exist"
    if not os.path.exists(path):
        return "no such folder"
    return "a file, not a folder" if os.path.isfile(path) else f"{kind_of(os.stat(path).st_mode)}, not a folder"


def check_path_text(path: str | os.PathLike, what: str) -> str:
    """The path as text; a name that is not valid UTF-8 (surrogate-escaped bytes) is one line."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        printable = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise FileError(f"{what} = {printable!r}: the name is not valid UTF-8; use a folder name in UTF-8") from None
    return text


# ---- writing --------------------------------------------------------------------------------------


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    """Write `path` whole: a temporary file beside it, renamed over it (a symlink at `path` is replaced,
    never followed). Raises FileError."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quietly(tmp)
        raise FileError(f"cannot write {describe_os_error(e, path)}") from None


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = None, fsync: bool = False) -> None:
    write_text(path, json.dumps(obj, indent=indent), fsync=fsync)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class AppendFile:
    """A text file that grows a line at a time (metrics.jsonl): opened without following a symlink;
    a write that fails (a full disk) is one FileError line."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise FileError(f"cannot write {describe_os_error(e, self.path)}") from None
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def write_line(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as e:
            raise FileError(f"cannot write {describe_os_error(e, self.path)}") from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # a flush that fails at exit: the lines already written are on disk


def write_probe(folder: str | os.PathLike, name: str) -> None:
    """Make `folder` and write, then remove, a small file `name` in it: raises the OSError a real
    write would (read-only, full, not a folder)."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, name)
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, b"ok")
    finally:
        os.close(fd)
    os.remove(probe)


# ---- one owner per folder ------------------------------------------------------------------------

LOCK = ".titanlike.lock"


class FolderInUse(UserError):
    pass


def _holder(folder: str) -> str:
    try:
        h = read_json(os.path.join(folder, LOCK), "a lock file", limit=65536)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (UserError, KeyError, TypeError):
        return "a process whose details are unreadable"


def _lock_record(**more: str) -> dict:
    """What a lock file says of its holder: the process, where and when it started, its command line."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": [a.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for a in sys.argv], **more}


class FolderLock:
    """An flock on `<folder>/.titanlike.lock`, held for the life of the process (or until release()):
    a second run into the same folder stops with one line naming the first. When the holder dies, the
    lock goes with it and the next run takes the folder over. The lock file is opened without
    following a symlink."""

    def __init__(self, folder: str, what: str):
        self.folder, self.what = folder, what
        self._fd: int | None = None
        self.previous: str | None = None  # the details a dead holder left behind

    def acquire(self) -> None:
        path = os.path.join(self.folder, LOCK)
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise FileError(f"{self.what} {self.folder} cannot be locked: {describe_os_error(e, path)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self.in_use() from None
        if os.fstat(fd).st_size:
            self.previous = _holder(self.folder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_lock_record()).encode(), 0)
        self._fd = fd

    def in_use(self) -> FolderInUse:
        return FolderInUse(f"{self.what} {self.folder} is in use by another run ({_holder(self.folder)}): wait for "
                           f"it, stop it, or use another {self.option()}")

    def option(self) -> str:
        return "--checkpoint.folder" if self.what.startswith("checkpoint") else "--job.dump_folder"

    def check_free(self) -> None:
        """For the preflight: raise FolderInUse when another process holds the lock (nothing is created)."""
        path = os.path.join(self.folder, LOCK)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return  # absent, or a link: the real acquire() reports it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self.in_use() from None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # empty: the run ended cleanly (a dead run's details stay)
            except OSError:
                pass
            os.close(self._fd)  # releases the lock
            self._fd = None


class OutputClaim:
    """A claim on an output folder that a command builds elsewhere and then moves into place (titanlike-prepare's
    dataset, titanlike-export's folder): an flock on `<out>.titanlike.lock` beside it, taken before any work and
    held until the output is in place, so that a second run into the same folder stops at once with one line
    naming the first (both used to work, and the later one replaced the other's output). The kernel drops an
    flock with its process: a killed run leaves the file, with its details, but no lock. The file is opened
    without following a symlink, must be a regular file holding nothing but such details (a file of the user's
    by that name is refused, never emptied), and is removed when the claim ends; a run that opened it just
    before then finds, once it holds the lock, that the name no longer leads to its file, and opens it again."""

    def __init__(self, out: str, command: str, what: str):
        parent, name = os.path.split(os.path.abspath(out))
        self.out, self.command, self.what, self.parent = out, command, what, parent
        self.path = os.path.join(parent, f"{name}.titanlike.lock")
        self._fd: int | None = None
        self._made: list[str] = []  # the folders above OUT that the claim created: removed with it if still empty

    def __enter__(self) -> OutputClaim:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            missing = self.parent
            while not os.path.lexists(missing):
                self._made.append(missing)
                missing = os.path.dirname(missing)
            os.makedirs(self.parent, exist_ok=True)
            for _ in range(100):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
                try:
                    if self._take(fd):
                        return
                except BaseException:
                    if self._fd is None:
                        os.close(fd)
                    self.release()  # locked, but its details could not be written (a full disk): removed
                    raise
                os.close(fd)
        except OSError as e:
            self._remove_made()
            raise FileError(f"cannot write {self.what}: {describe_os_error(e, self.path)}") from None
        except BaseException:
            self._remove_made()
            raise
        raise FileError(f"cannot write {self.what}: {self.path} was replaced again and again while it was locked")

    def _take(self, fd: int) -> bool:
        """Lock the open file and write this process's details into it; False when the name no longer leads
        to it (its holder removed it as it finished)."""
        mine = os.fstat(fd)
        if not stat.S_ISREG(mine.st_mode):
            raise FileError(f"cannot write {self.what}: {self.path} is {kind_of(mine.st_mode)}, not the lock file "
                            f"titanlike writes beside {self.out}: move it away")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._details(fd)
            who = f"another run is writing {self.out}"
            if holder:
                who = (f"another {holder.get('command', 'titanlike run')} is writing {self.out} (pid {holder['pid']} "
                       f"on {holder['host']}, started {holder['started']})")
            raise UserError(f"{who}: wait for it to finish or stop it, or choose another output folder") from None
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            return False
        if os.fstat(fd).st_size and self._details(fd) is None:
            raise FileError(f"cannot write {self.what}: {self.path} holds something other than the details "
                            f"titanlike writes into the lock file beside {self.out}: move it away")
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_lock_record(command=self.command, out=os.path.abspath(self.out))).encode(), 0)
        return True

    @staticmethod
    def _details(fd: int) -> dict | None:
        """The holder's details in the lock file, or None when it holds none (or something else)."""
        try:
            record = json.loads(os.pread(fd, 65536, 0))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and {"pid", "host", "started"} <= set(record) else None

    def release(self) -> None:
        if self._fd is None:
            return
        try:  # only the file this claim locked: one put in its place is not ours to remove
            mine, now = os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)  # releases the lock
        self._fd = None
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:  # the deepest first; one that holds anything stays, and those above it
            try:
                os.rmdir(folder)
            except OSError:
                break
        self._made = []


# ---- reading what a user may have been handed ------------------------------------------------------


def read_text(path: str | os.PathLike, what: str, *, limit: int = MAX_SMALL_FILE) -> str:
    """A small UTF-8 text file: a regular file (not a FIFO or a device) of at most `limit` bytes."""
    data = read_bytes(path, what, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(f"{what} {os.fspath(path)} is not UTF-8 text (byte {e.start})") from None


def read_bytes(path: str | os.PathLike, what: str, *, limit: int = MAX_SMALL_FILE) -> bytes:
    """A small file's bytes: a regular file (not a FIFO or a device, which could block or never end) of at
    most `limit` bytes."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise FileError(f"cannot read {what} {describe_os_error(e, path)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(f"{what} {path} is not a regular file")
        if info.st_size > limit:
            raise FileError(f"{what} {path} has {info.st_size:,} bytes, more than such a file holds "
                            f"({limit:,} at most): it is not what it claims to be")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(limit + 1)
    except OSError as e:
        raise FileError(f"cannot read {what} {describe_os_error(e, path)}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    return data


def read_json(path: str | os.PathLike, what: str, *, limit: int = MAX_SMALL_FILE) -> Any:
    text = read_text(path, what, limit=limit)
    try:
        return json.loads(text)
    except RecursionError:  # arrays or objects nested thousands deep: Python's reader recurses once a level
        raise FileError(f"{what} {os.fspath(path)} is not valid JSON for titanlike: it nests arrays or objects "
                        f"deeper than the JSON reader goes") from None
    except ValueError as e:  # not JSON, or a number of more digits than Python converts (4300)
        raise FileError(f"{what} {os.fspath(path)} is not valid JSON ({e})") from None
