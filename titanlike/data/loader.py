"""Batches for training and validation: windows over token shards, the global sample order, and a
loader that resumes at any data position with any number of ranks and workers.

Sampling is defined on the *global* sample sequence: optimizer step s consumes global positions
[s·B, (s+1)·B) of a per-epoch pseudo-random permutation of all windows (B = global batch; the
permutations are order.py's).
Each data-parallel rank takes its own slice of every micro-batch. The samples of a step are
therefore the same whatever the number of ranks, which is what lets a checkpoint resume at a
different world size with the data order of the uninterrupted run. The loader's state is the
number of global batches read and the kind of order (`TrainLoader.state_dict`), which the checkpoint
manager saves.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from titanlike import cache
from titanlike.data.corpus import build_default_corpus
from titanlike.data.order import AFFINE, ORDERS
from titanlike.data.recorded import check_against_record
from titanlike.data.shards import DataError, Shard, ShardFault, id_advice, open_shards
from titanlike.process import lifeline

logger = logging.getLogger("titanlike")

# ---- datasets and sampling --------------------------------------------------------------------


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets) over shards.
    Every window is checked against `vocab_size` ids (`limit_source` says whose: the model's, or the
    tokenizer's that dataset.json names)."""

    def __init__(self, shards: list[Shard], seq_len: int, vocab_size: int | None = None,
                 limit_source: str = "the model's vocabulary"):
        self.shards, self.seq_len, self.vocab_size, self.limit_source = shards, seq_len, vocab_size, limit_source
        per_shard = [max(0, (s.count - 1) // seq_len) for s in shards]
        self.offsets = np.cumsum([0] + per_shard)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def identity(self) -> dict[str, dict]:
        """What the windows are read from, cheaply told apart from data made again, changed or reordered in
        place: the shards' folder → its shard count, tokens and fingerprint (of the shards' fingerprints, in
        the order they are read: shards.py says what one reads)."""
        where = os.path.commonpath([os.path.dirname(s.path) for s in self.shards]) if self.shards else ""
        marks = hashlib.blake2b("".join(s.fingerprint for s in self.shards).encode(), digest_size=16).hexdigest()
        return {where: {"shards": len(self.shards), "tokens": sum(s.count for s in self.shards), "fingerprint": marks}}

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
                f"{s.path} holds token id {int(window.max())} (at token {at}), but {self.limit_source} has "
                f"{self.vocab_size} ids (its header claims the largest id is {s.max_id}); "
                f"{id_advice(self.limit_source, int(window.max()))}"
            )
        return torch.from_numpy(window.astype(np.int64))


class MixedWindows(torch.utils.data.Dataset):
    """The windows of a mixture's sources as one dataset: source s's windows are numbered from
    offsets[s] (as mixture.MixturePlan numbers them)."""

    def __init__(self, parts: list[TokenWindows]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def identity(self) -> dict[str, dict]:
        return {k: v for part in self.parts for k, v in part.identity().items()}

    def __getitem__(self, index: int) -> torch.Tensor:
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[source][index - int(self.offsets[source])]


class SamplePlan(Protocol):
    """Which window each global sample position reads: order.EpochOrder or mixture.MixturePlan."""

    kind: str
    """The kind of epoch order (order.ORDERS), which a checkpoint records."""

    def windows(self, positions: np.ndarray) -> np.ndarray: ...


class GlobalBatchSampler:
    """Yields this rank's micro-batches of window indices, epoch after epoch: forever, or up to global
    batch `end_batch` (a stage's end: the next stage reads other windows).

    `plan` says which window each global sample position reads (`plan.windows(positions)`): one
    source's epoch order (order.py), or a mixture of sources (mixture.py). Both are pure functions
    of the position, so this rank's micro-batches follow from (step, rank, world size) alone. Global
    batch `first_batch` (a stage's first) reads from plan position `first_position` on.
    """

    def __init__(self, plan: SamplePlan, local_batch: int, global_batch: int, dp_rank: int, dp_world: int,
                 start_step: int = 0, first_batch: int = 0, first_position: int = 0, end_batch: int | None = None):
        self.plan, self.local, self.global_batch = plan, local_batch, global_batch
        self.rank, self.world, self.start_step = dp_rank, dp_world, start_step
        self.first_batch, self.first_position, self.end_batch = first_batch, first_position, end_batch
        self.accum = global_batch // (local_batch * dp_world)

    def window(self, position: int) -> int:
        return int(self.plan.windows(np.array([position]))[0])

    def position(self, batch: int) -> int:
        """The plan position of global batch `batch`'s first sample."""
        return self.first_position + (batch - self.first_batch) * self.global_batch

    def positions(self, step: int, micro: int) -> np.ndarray:
        """The plan positions of this rank's micro-batch `micro` of global batch `step`."""
        base = self.position(step) + (micro * self.world + self.rank) * self.local
        return np.arange(base, base + self.local)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while self.end_batch is None or step < self.end_batch:
            for micro in range(self.accum):
                yield self.plan.windows(self.positions(step, micro)).tolist()
            step += 1


def validation_steps(windows: int, global_batch: int, steps: int) -> int:
    """The global batches one evaluation reads of a held-out set of `windows`: validation.steps (0 = the
    whole set), never more than the set holds (each window read at most once). A set smaller than one
    global batch is read as one, wrapping around (its windows twice or more, a bounded cost)."""
    whole = max(1, windows // global_batch)
    return whole if steps == 0 else min(steps, whole)


def validation_clamp_line(sets: dict[str, int], global_batch: int, steps: int, *, named: bool) -> str | None:
    """The start line when validation.steps asks for more global batches than a held-out set holds
    (`sets`: each source's windows; `named`: a mixture, whose sources the line names); None otherwise."""
    short = {name: n for name, n in sets.items() if steps > validation_steps(n, global_batch, 0)}
    if not short:
        return None
    held = ", ".join(f"{f'{name}: ' if named else ''}{n:,} windows, {validation_steps(n, global_batch, 0):,} "
                     f"global batch(es) of {global_batch}" for name, n in short.items())
    return (f"validation.steps = {steps:,} is more than the held-out data holds ({held}): each evaluation reads "
            f"{'each of these' if named else 'the whole held-out set'} once instead (validation.steps = 0 says so)")


def validation_batches(dataset: TokenWindows, local_batch: int, dp_rank: int, dp_world: int,
                       micro_batches: int) -> Iterator[torch.Tensor]:
    """This rank's micro-batches of the leading windows (wrapping around a set smaller than one global
    batch; validation_steps keeps every other set's reads inside it).

    Over all ranks the windows are [0, micro_batches × dp_world × local_batch): with
    micro_batches = steps × gradient-accumulation, that is `steps` global batches whatever the
    world size, so validation losses compare across world sizes.
    """
    for micro in range(micro_batches):
        base = (micro * dp_world + dp_rank) * local_batch
        yield torch.stack([dataset[(base + j) % len(dataset)] for j in range(local_batch)])


def data_changes(saved: object, now: dict[str, dict]) -> str:
    """What differs between a checkpoint's data identity and the data's now, in words ("" = nothing; a
    checkpoint saved before identities were recorded says nothing, and one saved before they held a
    fingerprint is compared by its counts)."""
    if not isinstance(saved, dict):
        return ""
    out = []
    for where, was in saved.items():
        have = now.get(where)
        if not isinstance(was, dict) or have is None:
            continue  # a source no longer read is a config change, which the resume says itself
        counted = (was.get("tokens"), was.get("shards")) == (have["tokens"], have["shards"])
        if counted and was.get("fingerprint", have["fingerprint"]) == have["fingerprint"]:
            continue
        out.append(f"{where}: the same {have['tokens']:,} tokens in {have['shards']} shard(s), other contents or "
                   f"another order of them" if counted else
                   f"{where}: {was.get('tokens', 0):,} → {have['tokens']:,} tokens in {was.get('shards', 0)} → "
                   f"{have['shards']} shard(s)")
    return "; ".join(out)


def start_loader_worker(worker_id: int, parent: int) -> None:
    """Data-loader workers share the trainer's process group, so a stop sent to the group (Ctrl-C,
    SIGTERM, SIGHUP, SIGUSR1) reaches them too; they must keep serving the step being finished, and ignore
    it. They end with the trainer (`parent`), at once, even when it is killed outright (torch's own check
    takes seconds)."""
    lifeline.ignore_stops(parent)
    lifeline.end_with(parent)


class TrainLoader:
    """This rank's training micro-batches, positioned by a number: the global batches read. Its state
    (torch's Stateful protocol) is that number and the kind of epoch order (order.py) the run
    started with, since the sampler is a function of both; so a resume works with any world size and
    any number of loader workers. A state without the order kind was saved before there was a choice:
    it means affine, so such a checkpoint resumes with the windows its run would have read.

    With stages (config/stages.py), `later` holds each later stage's windows and sampler (its
    first_batch on): the stage of the next batch follows from the number read, and at a stage's end
    the loader (and its workers) start again over the next stage's windows."""

    def __init__(self, dataset: torch.utils.data.Dataset, sampler: GlobalBatchSampler, num_workers: int,
                 pin_memory: bool, later: Sequence[tuple[torch.utils.data.Dataset, GlobalBatchSampler]] = ()):
        self.parts = [(dataset, sampler), *later]
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._batches: Iterator[torch.Tensor] | None = None
        self.batches_read = sampler.start_step  # global batches whose micro-batches were all handed out
        self._micro = 0  # micro-batches handed out of the batch being read

    @property
    def stage(self) -> int:
        """The stage (index into the parts) of the next global batch."""
        return max(i for i, (_, s) in enumerate(self.parts) if s.first_batch <= self.batches_read or i == 0)

    @property
    def sampler(self) -> GlobalBatchSampler:
        """The sampler of the next global batch's stage."""
        return self.parts[self.stage][1]

    def _start(self) -> Iterator[torch.Tensor]:
        dataset, sampler = self.parts[self.stage]
        sampler.start_step = self.batches_read
        # The workers start here, with the stops held until each ignores them (torch sets SIGTERM to kill
        # a worker before start_loader_worker runs).
        with lifeline.signals_held(lifeline.STOP_SIGNALS):
            return iter(torch.utils.data.DataLoader(
                dataset, batch_sampler=sampler, num_workers=self.num_workers, pin_memory=self.pin_memory,
                worker_init_fn=functools.partial(start_loader_worker, parent=os.getpid()) if self.num_workers
                else None))

    def seek(self, batches_read: int) -> None:
        """Global batches read so far; workers, if any, restart from there at the next batch."""
        self.batches_read = batches_read
        self._micro = 0
        self._batches = None

    def next_positions(self) -> np.ndarray:
        """The global sample positions of the micro-batch the next `next()` hands out (workers read
        ahead, but always in this order)."""
        return self.sampler.positions(self.batches_read, self._micro)

    def identity(self) -> dict[str, dict]:
        """Each source's shard count, tokens and fingerprint (TokenWindows.identity), over every stage's windows."""
        return {k: v for dataset, _ in self.parts for k, v in getattr(dataset, "identity", dict)().items()}

    def state_dict(self) -> dict:
        assert self._micro == 0, "saved between steps, never inside a global batch"
        return {"batches_read": self.batches_read, "order": self.sampler.plan.kind, "data": self.identity()}

    @staticmethod
    def batches_in(state: dict) -> int:
        """The global batches a saved state had read (0 for none)."""
        return int(state.get("batches_read", 0))

    @staticmethod
    def state_at(batches_read: int) -> dict:
        """The state of a loader that has read `batches_read` global batches in the first order there was
        (a checkpoint that saved only the run's counters)."""
        return {"batches_read": batches_read}

    def load_state_dict(self, state: dict) -> None:
        kind = state.get("order", AFFINE)
        if kind not in ORDERS:
            raise DataError(f"the checkpoint's data order {kind!r} is unknown to this titanlike (known: "
                            f"{', '.join(ORDERS)}); resume it with the titanlike that wrote it")
        for _, sampler in self.parts:
            sampler.plan.kind = kind
        self.seek(int(state["batches_read"]))
        changed = data_changes(state.get("data"), self.identity())
        if changed:
            logger.info(f"the data changed since the checkpoint was saved ({changed}): the run goes on from the same "
                        f"position, global batch {self.batches_read}, over what is there now")

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = self._start()
        try:
            batch = next(self._batches)
        except Exception as e:
            # A worker's error arrives re-raised with the worker's traceback in its message: keep its line.
            lines = str(e).strip().splitlines()
            if isinstance(e, ShardFault) and len(lines) == 1:
                raise
            fault = next((ln.split("ShardFault: ", 1)[1] for ln in reversed(lines) if "ShardFault: " in ln), None)
            if fault is None:
                raise
            raise ShardFault(fault) from None
        self._micro += 1
        sampler = self.sampler
        if self._micro == sampler.accum:
            self._micro, self.batches_read = 0, self.batches_read + 1
            if self.batches_read == sampler.end_batch:
                self._batches = None  # the stage's last batch: the next one starts over the next stage's windows
        return batch


# ---- building it all from the config ------------------------------------------------------------


def resolve_paths(data_path: str, val_path: str) -> tuple[str, str]:
    """(train, validation) shard paths; the embedded corpus, from the per-machine cache, when data.path is empty."""
    if not data_path:
        return build_default_corpus(cache.cache_dir())
    return data_path, val_path


def open_dataset(path: str, seq_len: int, vocab_size: int, what: str, tokenizer: tuple[int, str] | None = None
                 ) -> TokenWindows:
    """The windows of the shards at `path`, checked against the model's `vocab_size` or, when the data's
    dataset.json names a tokenizer, `tokenizer` = (its size, the dataset.json path): an id between the
    tokenizer's size and the padded vocabulary is no token the tokenizer made."""
    limit, source = (tokenizer[0], f"its tokenizer ({tokenizer[1]})") if tokenizer else (vocab_size,
                                                                                      "the model's vocabulary")
    shards = open_shards(path, seq_len, limit, source, what)
    check_against_record(shards, path, contents=True)  # the shards its dataset.json records, if it has one
    windows = TokenWindows(shards, seq_len, limit, source)
    windows.identity()  # every shard's fingerprint read now (32 KiB each), not at the first save
    return windows
