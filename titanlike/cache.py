"""The per-machine cache (~/.cache/titanlike, or $TITANLIKE_CACHE): things built once and reused by
every run on the machine, such as the built-in corpus.

Several processes may want the same entry at once (the ranks of a run, runs started side by side):
`exclusive` serialises them with a lock file, so the first builds and the others wait, then find it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

ENV = "TITANLIKE_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "titanlike")


@contextlib.contextmanager
def exclusive(entry: Path) -> Iterator[None]:
    """Hold `<entry>.lock` while building `entry`; the lock is released when the process ends, too."""
    with open(f"{entry}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
