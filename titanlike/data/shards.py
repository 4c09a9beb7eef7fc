"""The token-shard file format: one writer, one reader. Numpy only (no torch), so that
titanlike-prepare starts in a fraction of a second and its workers stay light.

One file per shard, little-endian, read with pread (a file that shrinks mid-run is a line naming
it, where a memory map would die with SIGBUS):

    offset  size  field
    0       8     magic b"TLSHARD\\0"
    8       4     version (uint32) = 1
    12      4     bytes per token (uint32): 2 (uint16) or 4 (uint32)
    16      8     token count (uint64)
    24      8     largest token id in the shard (uint64), so a vocabulary check is O(1)
    32      ...   the tokens

A shard's fingerprint (`fingerprint`) tells it from other data cheaply: a hash of its size and of
FINGERPRINT_BLOCKS blocks of FINGERPRINT_BYTES spread evenly over the file, first and last included
(the whole file when it is smaller). titanlike-prepare records it in dataset.json, and a run's data
position carries it, so that data replaced or reordered in place is seen without reading every byte
of a corpus at each start (docs/data.md says what it does not see).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from titanlike import fs
from titanlike.errors import UserError

MAGIC = b"TLSHARD\0"
FINGERPRINT_BLOCKS, FINGERPRINT_BYTES = 8, 4096
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes/token, count, max token id
assert HEADER.size == 32


class DataError(UserError):
    same_on_all_ranks = True


class ShardFault(DataError):
    """Found by one rank while reading during training (the others may never see it): it reports itself."""

    same_on_all_ranks = False


def fingerprint(fd: int, size: int) -> str:
    """A shard file's fingerprint, read from `fd` (`size` bytes): the hash of its size and of
    FINGERPRINT_BLOCKS blocks spread evenly over it, first and last included: 32 KiB read, whatever the
    shard's size (a whole-file hash of a corpus of terabytes would take minutes at every start)."""
    digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BYTES:
        starts: list[int] = list(range(0, size, FINGERPRINT_BYTES))
    else:
        last = size - FINGERPRINT_BYTES
        starts = [last * i // (FINGERPRINT_BLOCKS - 1) for i in range(FINGERPRINT_BLOCKS)]
    for start in starts:
        digest.update(os.pread(fd, FINGERPRINT_BYTES, start))
    return digest.hexdigest()


def fingerprint_file(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return fingerprint(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token type that holds ids below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def shard_name(index: int) -> str:
    """The file name of a split's shard number `index`, as titanlike-prepare writes it."""
    return f"shard-{index:05d}.bin"


class ShardWriter:
    """Token shards of exactly `shard_tokens` tokens (the last one shorter), named `name(index)` in
    `folder`. Each is written under a temporary name and renamed once complete, so a reader never
    sees a half-written shard."""

    def __init__(self, folder: str | os.PathLike, shard_tokens: int, dtype, name: Callable[[int], str] = shard_name):
        self.folder, self.shard_tokens, self.dtype, self.name = os.fspath(folder), shard_tokens, np.dtype(dtype), name
        self.file: BinaryIO | None = None  # the shard being written
        self.index = self.count = self.max_id = self.total = self.documents = 0
        self.written: list[tuple[str, int, str]] = []  # each shard's file name, token count and fingerprint

    def _path(self) -> str:
        return os.path.join(self.folder, self.name(self.index))

    def _open(self) -> BinaryIO:
        os.makedirs(self.folder, exist_ok=True)
        self.file = file = open(self._path() + ".tmp", "wb")
        file.write(b"\0" * HEADER.size)  # the header, once the count is known
        self.count = self.max_id = 0
        return file

    def _close(self) -> None:
        assert self.file is not None
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.count, self.max_id))
        self.file.close()
        os.replace(self._path() + ".tmp", self._path())
        self.written.append((os.path.basename(self._path()), self.count, fingerprint_file(self._path())))
        self.file, self.index = None, self.index + 1

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            file = self.file if self.file is not None else self._open()
            take = tokens[: self.shard_tokens - self.count]
            file.write(take.astype(self.dtype, copy=False).tobytes())
            self.count += take.size
            self.total += take.size
            self.max_id = max(self.max_id, int(take.max()))
            tokens = tokens[take.size :]
            if self.count == self.shard_tokens:
                self._close()

    def finish(self, at_least_one: bool = False) -> None:
        """Close the shard being written; with `at_least_one`, write an empty shard if none was."""
        if self.file is None and at_least_one and self.index == 0:
            self._open()
        if self.file is not None:
            self._close()


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` as one shard file at `path`, whole or not at all."""
    tokens = np.asarray(tokens)
    largest = int(tokens.max()) if tokens.size else 0
    writer = ShardWriter(os.path.dirname(os.fspath(path)) or ".", max(tokens.size, 1), token_dtype(largest + 1),
                         name=lambda _: os.path.basename(os.fspath(path)))
    writer.add(tokens)
    writer.finish(at_least_one=True)


class Shard:
    """A token shard with its header checked; tokens are read with pread."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:  # non-blocking: a FIFO in place of a shard would block open() until a writer came
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise DataError(f"token shard {self.path} is not a regular file ({fs.kind_of(info.st_mode)}); make "
                                    f"shards with titanlike-prepare")
                size, head = info.st_size, os.pread(fd, HEADER.size, 0)
            finally:
                os.close(fd)
        except OSError as e:
            raise DataError(f"cannot read token shard {self.path}: {e.strerror}") from None
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise DataError(f"{self.path} is not a token shard (bad magic); make shards with titanlike-prepare")
        _, version, width, count, max_id = HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{self.path}: shard format version {version}, this titanlike reads version {VERSION}")
        if width not in (2, 4):
            raise DataError(f"{self.path}: {width} bytes per token in the header; valid: 2 (uint16) or 4 (uint32)")
        if size < HEADER.size + width * count:
            raise DataError(
                f"{self.path} is truncated: the header promises {count} tokens "
                f"({HEADER.size + width * count} bytes), the file has {size} bytes"
            )
        if width == 2 and max_id >= 2**16:
            raise DataError(f"{self.path}: largest token id {max_id} does not fit the shard's uint16 tokens")
        self.count, self.max_id, self.size = count, max_id, size
        self.dtype = np.dtype(np.uint16 if width == 2 else np.uint32)
        self._fd: int | None = None
        self._fd_pid = -1
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        """The shard's fingerprint (module docstring), read once."""
        if self._fingerprint is None:
            try:
                self._fingerprint = fingerprint_file(self.path)
            except OSError as e:
                raise DataError(f"cannot read token shard {self.path}: {e.strerror}") from None
        return self._fingerprint

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n), by pread rather than a memory map: a file that shrinks while the
        run reads it gives a short read and one line naming it, where a memory map would SIGBUS."""
        if self._fd is None or self._fd_pid != os.getpid():  # a loader worker opens its own
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # never waits on a FIFO put in its place
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ShardFault(f"token shard {self.path} became {fs.kind_of(os.stat(self.path).st_mode)} while "
                                 f"training read it; a shard must not change during a run (restore it, then resume)")
            self._fd, self._fd_pid = fd, os.getpid()
        want = n * self.dtype.itemsize
        data = os.pread(self._fd, want, HEADER.size + start * self.dtype.itemsize)
        if len(data) < want:
            raise ShardFault(
                f"{self.path} became shorter while training read it: tokens {start}..{start + n} are past its end "
                f"({os.path.getsize(self.path)} bytes now); a shard must not change during a run "
                f"(restore it, then resume)"
            )
        return np.frombuffer(data, dtype=self.dtype)

    @property
    def tokens(self) -> np.ndarray:
        return self.read(0, self.count)

    def __getstate__(self) -> dict:  # to loader workers: without the open file
        return {**self.__dict__, "_fd": None, "_fd_pid": -1}


def find_shards(path: str) -> list[Shard]:
    p = Path(path)
    files = sorted(p.glob("*.bin")) if p.is_dir() else [p]
    if not files:
        raise DataError(f"data folder {path} holds no *.bin token shards; make them with titanlike-prepare")
    return [Shard(f) for f in files]


def open_shards(path: str, seq_len: int, limit: int, limit_source: str, what: str) -> list[Shard]:
    """The shards at `path` (a .bin file or a folder of them), their headers checked: every token id
    below `limit` (the ids of `limit_source`), and at least one sample of seq_len + 1 tokens."""
    if not os.path.exists(path):
        raise DataError(f"{what} = {path!r}: no such file or folder")
    shards = find_shards(path)
    for s in shards:
        if s.max_id >= limit:
            raise DataError(f"{s.path} holds token id {s.max_id} but {limit_source} has {limit} ids; "
                            f"{id_advice(limit_source, s.max_id)}")
    if sum(max(0, (s.count - 1) // seq_len) for s in shards) == 0:
        total = sum(s.count for s in shards)
        raise DataError(f"{what} = {path!r} holds {total} tokens, fewer than one sample of data.seq_len + 1 = "
                        f"{seq_len + 1}")
    return shards


def id_advice(limit_source: str, largest: int) -> str:
    if limit_source.startswith("the model"):
        return f"set --model.vocab_size {largest + 1} or more, or re-tokenize"
    return "the shards do not come from that tokenizer: re-make them with titanlike-prepare"
