"""The built-in corpus: this Python's standard library sources as byte tokens, built once per machine
into the per-machine cache (titanlike/cache.py), so that `./run_train.sh` with no arguments trains on
any machine without a download.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from titanlike import cache
from titanlike.data.shards import DataError, write_shard
from titanlike.data.tokenizer import ByteTokenizer

logger = logging.getLogger("titanlike")

# Bump when build_default_corpus changes what it writes: caches built by other versions are then left alone.
CORPUS_VERSION = 1


def stdlib_files() -> list[Path]:
    """The standard library's .py files; installed packages (site-packages) are pruned, not walked."""
    files = []
    for folder, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


def build_default_corpus(folder: str | os.PathLike) -> tuple[str, str]:
    """Shards made once from this Python's standard library sources: (train, validation).

    Every 50th file is held out for validation, so validation text was never trained on. The files
    are named by the Python that wrote them (whose standard library they hold) and CORPUS_VERSION;
    processes that ask at the same time build them once (cache.exclusive).
    """
    v = sys.version_info
    tag = f"{sys.implementation.name}{v.major}.{v.minor}.{v.micro}-v{CORPUS_VERSION}"
    train, val = Path(folder) / f"stdlib-{tag}-train.bin", Path(folder) / f"stdlib-{tag}-val.bin"
    if train.exists() and val.exists():
        return str(train), str(val)
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with cache.exclusive(Path(folder) / f"stdlib-{tag}"):
            if not (train.exists() and val.exists()):  # or another process built them while we waited
                _write_stdlib_shards(train, val)
    except OSError as e:
        raise DataError(f"cannot write the built-in corpus to {folder} ({e.strerror}); point {cache.ENV} at a "
                        f"writable folder, or give --data.path") from None
    return str(train), str(val)


def _write_stdlib_shards(train: Path, val: Path) -> None:
    logger.info(f"building the built-in corpus from this Python's standard library into {train.parent}, "
                f"once for this machine")
    tok = ByteTokenizer()
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    sep = np.array([tok.eos_id, tok.bos_id], dtype=np.uint16)
    for i, f in enumerate(stdlib_files()):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts["val" if i % 50 == 0 else "train"] += [tok.encode_batch([text])[0], sep]
    write_shard(train, np.concatenate(parts["train"]))
    write_shard(val, np.concatenate(parts["val"]))
