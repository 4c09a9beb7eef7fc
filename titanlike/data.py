"""Tokens in, batches out: the byte tokenizer, the token-shard format, sampling and loading.

Shard format (little-endian), one file per shard, read with pread (a file that shrinks mid-run is a
line naming it, where a memory map would die with SIGBUS):

    offset  size  field
    0       8     magic b"TLSHARD\\0"
    8       4     version (uint32) = 1
    12      4     bytes per token (uint32): 2 (uint16) or 4 (uint32)
    16      8     token count (uint64)
    24      8     largest token id in the shard (uint64), so a vocabulary check is O(1)
    32      ...   the tokens

Sampling is defined on the *global* sample sequence: optimizer step s consumes global positions
[s·B, (s+1)·B) of a per-epoch pseudo-random permutation of all windows (B = global batch).
Each data-parallel rank takes its own slice of every micro-batch. The samples of a step are
therefore the same whatever the number of ranks, which is what lets a checkpoint resume at a
different world size with the data order of the uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from titanlike import cache
from titanlike.errors import UserError
from titanlike.shard_format import HEADER, MAGIC, VERSION  # noqa: E402  (torch-free, for titanlike-prepare)
from titanlike.stopping import ignore_interrupts_in_loader_worker  # noqa: E402

logger = logging.getLogger("titanlike")


class DataError(UserError):
    same_on_all_ranks = True


class ShardFault(DataError):
    """Found by one rank while reading during training (the others may never see it): it reports itself."""

    same_on_all_ranks = False


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 begins and 257 ends a document. Needs no download."""

    bos_id, eos_id, vocab_size = 256, 257, 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


# ---- shards -------------------------------------------------------------------------------


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens as one shard, atomically (a reader never sees a half-written file)."""
    tokens = np.asarray(tokens)
    max_id = int(tokens.max()) if tokens.size else 0
    dtype = np.uint16 if max_id < 2**16 else np.uint32
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, np.dtype(dtype).itemsize, tokens.size, max_id))
        f.write(tokens.astype(dtype, copy=False).tobytes())
    os.replace(tmp, path)


class Shard:
    """A memory-mapped token shard with its header checked."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(HEADER.size)
        except OSError as e:
            raise DataError(f"cannot read token shard {self.path}: {e.strerror}") from None
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise DataError(
                f"{self.path} is not a token shard (bad magic); make shards with titanlike-prepare"
            )
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
        self.count, self.max_id = count, max_id
        self.dtype = np.dtype(np.uint16 if width == 2 else np.uint32)
        self._fd: int | None = None
        self._fd_pid = -1

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n), by pread rather than a memory map: a file that shrinks while the
        run reads it gives a short read and one line naming it, where a memory map would SIGBUS."""
        if self._fd is None or self._fd_pid != os.getpid():  # a loader worker opens its own
            self._fd, self._fd_pid = os.open(self.path, os.O_RDONLY), os.getpid()
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


# ---- the embedded default corpus ------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's .py files; installed packages (site-packages) are pruned, not walked."""
    files = []
    for folder, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


# Bump when build_default_corpus changes what it writes: caches built by other versions are then left alone.
CORPUS_VERSION = 1


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
        parts["val" if i % 50 == 0 else "train"] += [tok.encode(text), sep]
    write_shard(train, np.concatenate(parts["train"]))
    write_shard(val, np.concatenate(parts["val"]))


# ---- datasets and sampling --------------------------------------------------------------------


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets) over shards."""

    def __init__(self, shards: list[Shard], seq_len: int, vocab_size: int | None = None):
        self.shards, self.seq_len, self.vocab_size = shards, seq_len, vocab_size
        per_shard = [max(0, (s.count - 1) // seq_len) for s in shards]
        self.offsets = np.cumsum([0] + per_shard)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        start = (index - int(self.offsets[shard])) * self.seq_len
        window = self.shards[shard].read(start, self.seq_len + 1)
        # The header's largest id is a claim: an id past the vocabulary would reach the embedding
        # as an index error (or a device assert) without the shard's name, so check every window.
        if self.vocab_size is not None and window.size and int(window.max()) >= self.vocab_size:
            s = self.shards[shard]
            at = start + int(np.argmax(window >= self.vocab_size))
            raise ShardFault(
                f"{s.path} holds token id {int(window.max())} (at token {at}), but the model's vocabulary has "
                f"{self.vocab_size} ids (its header claims the largest id is {s.max_id}); re-tokenize it, or set "
                f"--model.vocab_size {int(window.max()) + 1} or more"
            )
        return torch.from_numpy(window.astype(np.int64))


class GlobalBatchSampler:
    """Yields this rank's micro-batches of window indices, forever, epoch after epoch.

    Global position p maps to window perm_e(p mod N) with e = p div N; the permutation of an
    epoch is the affine map i -> (a·i + c) mod N with a coprime to N, drawn from (seed, epoch):
    O(1) memory for any corpus size, and neighbouring positions land far apart.
    """

    def __init__(self, num_windows: int, local_batch: int, global_batch: int, dp_rank: int,
                 dp_world: int, seed: int, start_step: int = 0):
        self.n, self.local, self.global_batch = num_windows, local_batch, global_batch
        self.rank, self.world, self.seed, self.start_step = dp_rank, dp_world, seed, start_step
        self.accum = global_batch // (local_batch * dp_world)
        self._epoch_maps: dict[int, tuple[int, int]] = {}

    def _affine(self, epoch: int) -> tuple[int, int]:
        if epoch not in self._epoch_maps:
            rng = np.random.default_rng([self.seed, epoch])
            while True:
                a = int(rng.integers(1, max(2, self.n)))
                if math.gcd(a, self.n) == 1:
                    break
            self._epoch_maps = {epoch: (a, int(rng.integers(0, self.n)))}
        return self._epoch_maps[epoch]

    def window(self, position: int) -> int:
        epoch, i = divmod(position, self.n)
        a, c = self._affine(epoch)
        return (a * i + c) % self.n

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            for micro in range(self.accum):
                base = step * self.global_batch + (micro * self.world + self.rank) * self.local
                yield [self.window(base + j) for j in range(self.local)]
            step += 1


def validation_batches(dataset: TokenWindows, local_batch: int, dp_rank: int, dp_world: int,
                       micro_batches: int) -> Iterator[torch.Tensor]:
    """This rank's micro-batches of the leading windows (wrapping around a small set).

    Over all ranks the windows are [0, micro_batches × dp_world × local_batch): with
    micro_batches = steps × gradient-accumulation, that is `steps` global batches whatever the
    world size, so validation losses compare across world sizes.
    """
    for micro in range(micro_batches):
        base = (micro * dp_world + dp_rank) * local_batch
        yield torch.stack([dataset[(base + j) % len(dataset)] for j in range(local_batch)])


# ---- building it all from the config ------------------------------------------------------------


def resolve_paths(data_path: str, val_path: str) -> tuple[str, str]:
    """(train, validation) shard paths; the embedded corpus, from the per-machine cache, when data.path is empty."""
    if not data_path:
        return build_default_corpus(cache.cache_dir())
    return data_path, val_path


def open_dataset(path: str, seq_len: int, vocab_size: int, what: str) -> TokenWindows:
    if not os.path.exists(path):
        raise DataError(f"{what} = {path!r}: no such file or folder")
    shards = find_shards(path)
    for s in shards:
        if s.max_id >= vocab_size:
            raise DataError(
                f"{s.path} holds token id {s.max_id} but the model's vocabulary has {vocab_size} ids; "
                f"set --model.vocab_size {s.max_id + 1} or more, or re-tokenize"
            )
    ds = TokenWindows(shards, seq_len, vocab_size)
    if len(ds) == 0:
        total = sum(s.count for s in shards)
        raise DataError(f"{what} = {path!r} holds {total} tokens, "
                        f"fewer than one sample of data.seq_len + 1 = {seq_len + 1}")
    return ds


class TrainLoader:
    """This rank's training micro-batches, positioned by a number: seek(n) makes the next batch the
    first of global batch n + 1. The position is all a checkpoint needs (the sampler is a function of
    it), so a resume works with any world size and any number of loader workers."""

    def __init__(self, dataset: TokenWindows, sampler: GlobalBatchSampler, num_workers: int, pin_memory: bool):
        self.sampler = sampler
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
            worker_init_fn=ignore_interrupts_in_loader_worker if num_workers else None)
        self._batches: Iterator[torch.Tensor] | None = None

    def seek(self, batches_read: int) -> None:
        """Global batches read so far; workers, if any, restart from there at the next batch."""
        self.sampler.start_step = batches_read
        self._batches = None

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except Exception as e:
            # A worker's error arrives re-raised with the worker's traceback in its message: keep its line.
            lines = str(e).strip().splitlines()
            if isinstance(e, ShardFault) and len(lines) == 1:
                raise
            fault = next((ln.split("ShardFault: ", 1)[1] for ln in reversed(lines) if "ShardFault: " in ln), None)
            if fault is None:
                raise
            raise ShardFault(fault) from None


def build_train_loader(dataset: TokenWindows, local_batch: int, global_batch: int, dp_rank: int,
                       dp_world: int, seed: int, num_workers: int, pin_memory: bool,
                       start_step: int = 0) -> TrainLoader:
    if len(dataset) < global_batch:
        raise DataError(
            f"the training data has {len(dataset)} samples of data.seq_len + 1 tokens, fewer than one "
            f"global batch of {global_batch}; use more data, a shorter data.seq_len or a smaller batch"
        )
    sampler = GlobalBatchSampler(len(dataset), local_batch, global_batch, dp_rank, dp_world, seed, start_step)
    return TrainLoader(dataset, sampler, num_workers, pin_memory)
