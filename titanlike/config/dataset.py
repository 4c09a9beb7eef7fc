"""dataset.json: what `titanlike-prepare` records beside the shards it writes (the tokenizer, its
vocabulary and bos/eos ids, token counts), and the one record that describes a run's data. Plain Python
(no torch, no numpy): resolving a run sizes the model's vocabulary from it before any worker starts.

Layout of a prepared dataset:

    OUT/dataset.json     this record
    OUT/tokenizer.json   the tokenizer that made the shards (a copy)
    OUT/train/*.bin      token shards
    OUT/val/*.bin

A dataset.json is a file a user may have been handed: it is read through titanlike.fs's gate, every
field it needs is checked with one line for a wrong one, and the tokenizer file it names must lie in
its own folder (a name, not a path elsewhere on disk).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from titanlike import fs
from titanlike.config.sources import DataSchedule, Source
from titanlike.errors import UserError

DATASET_JSON = "dataset.json"
DATASET_FORMAT = "titanlike-dataset/1"
# The byte tokenizer's document markers (tokenizer.ByteTokenizer): the embedded corpus has no
# dataset.json, and the preflight, which reads no tokenizer, needs its end-of-document id.
BYTE_BOS_ID, BYTE_EOS_ID = 256, 257


class DatasetError(UserError):
    same_on_all_ranks = True


@dataclass(frozen=True)
class DatasetInfo:
    path: str
    """The dataset.json file."""
    vocab_size: int
    """The tokenizer's number of ids (before the model pads it to a multiple of 64)."""
    tokenizer_kind: str
    """byte (titanlike's byte tokenizer) or huggingface (a tokenizer.json)."""
    tokenizer_file: str | None
    """The tokenizer.json beside dataset.json (None: the byte tokenizer, which needs no file)."""
    bos_token: str | None = None
    eos_token: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    """The end-of-document id: what separates documents in the shards."""
    shards: dict[str, tuple[int, str]] | None = field(default=None, compare=False)
    """Each shard titanlike-prepare wrote: its path under the dataset's folder ("train/shard-00000.bin") →
    its token count and fingerprint (data/shards.py). None: a dataset.json from before they were recorded."""
    split_tokens: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False)
    """Each split's (tokens, shards) as titanlike-prepare recorded them: what an earlier dataset.json,
    without `shards`, says of its shards."""

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path)


def dataset_info_path(data_path: str) -> Path | None:
    """The dataset.json that describes these shards: in the shard folder or the one above it
    (titanlike-prepare writes OUT/dataset.json with OUT/train/ and OUT/val/)."""
    p = Path(data_path)
    folder = p if p.is_dir() else p.parent
    for candidate in (folder / DATASET_JSON, folder.parent / DATASET_JSON):
        if candidate.is_file():
            return candidate
    return None


def _optional_int(record: dict, key: str, where: str) -> int | None:
    value = record.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise DatasetError(f"{where}: {key} is {value!r}, not a token id")
    return value


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shard_records(record: dict, where: str, again: str) -> dict[str, tuple[int, str]] | None:
    """dataset.json's "shards": path under its folder → {"tokens": n, "fingerprint": hex} (None if absent)."""
    shards = record.get("shards")
    if shards is None:
        return None
    if not isinstance(shards, dict):
        raise DatasetError(f"{where}: \"shards\" is {type(shards).__name__}, not an object of shards; {again}")
    out = {}
    for name, entry in shards.items():
        tokens, mark = (entry.get("tokens"), entry.get("fingerprint")) if isinstance(entry, dict) else (None, None)
        if not _count(tokens) or not isinstance(mark, str):
            raise DatasetError(f"{where}: its \"shards\" entry {name!r} is not a shard's token count and fingerprint; "
                               f"{again}")
        out[name] = (tokens, mark)
    return out


def _split_tokens(record: dict) -> dict[str, tuple[int, int]]:
    """dataset.json's "splits": each split's (tokens, shards) where both are counts."""
    splits = record.get("splits")
    out = {}
    for name, entry in splits.items() if isinstance(splits, dict) else []:
        if isinstance(entry, dict) and _count(entry.get("tokens")) and _count(entry.get("shards")):
            out[name] = (entry["tokens"], entry["shards"])
    return out


def parse(record: object, where: str) -> DatasetInfo:
    """A DatasetInfo from a dataset.json record; one DatasetError line for what is missing or wrong."""
    again = "re-make the data with titanlike-prepare"
    if not isinstance(record, dict):
        raise DatasetError(f"{where} is not a titanlike dataset.json (a JSON object is expected); {again}")
    vocab = record.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= 2**24:
        raise DatasetError(f"{where}: vocab_size is {vocab!r}, not a vocabulary size; {again}")
    tokenizer = record.get("tokenizer")
    if tokenizer in ("byte", {"kind": "byte"}):
        tokenizer = {"kind": "byte"}
    if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in ("byte", "huggingface"):
        raise DatasetError(f"{where} names no tokenizer (a \"tokenizer\" entry of kind byte or huggingface, as "
                           f"titanlike-prepare writes); {again}")
    kind, file = tokenizer["kind"], None
    if kind == "huggingface":
        name = tokenizer.get("file")
        # Only a file of the dataset's own folder: a path elsewhere would copy any file into the run.
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise DatasetError(f"{where}: tokenizer file {name!r} must be a file name in the dataset's own folder")
        file = os.path.join(os.path.dirname(where), name)
        if not os.path.isfile(file) or os.path.islink(file):
            raise DatasetError(f"{where} names tokenizer file {name!r}, which is not a file in its folder; {again}")
    tokens = {k: tokenizer.get(k) for k in ("bos_token", "eos_token")}
    if any(v is not None and not isinstance(v, str) for v in tokens.values()):
        raise DatasetError(f"{where}: the tokenizer's bos_token and eos_token must be strings")
    info = DatasetInfo(path=where, vocab_size=vocab, tokenizer_kind=kind, tokenizer_file=file,
                       bos_token=tokens["bos_token"], eos_token=tokens["eos_token"],
                       bos_id=_optional_int(record, "bos_id", where), eos_id=_optional_int(record, "eos_id", where),
                       shards=_shard_records(record, where, again), split_tokens=_split_tokens(record))
    for key in ("bos_id", "eos_id"):
        value = getattr(info, key)
        if value is not None and value >= vocab:
            raise DatasetError(f"{where}: {key} {value} is not below vocab_size {vocab}; {again}")
    return info


def read_dataset_info(data_path: str) -> DatasetInfo | None:
    """The dataset.json of these shards, or None if they have none."""
    path = dataset_info_path(data_path)
    if path is None:
        return None
    return parse(fs.read_json(path, "the dataset record"), str(path))


# ---- the record of a run's data ------------------------------------------------------------------


def _tokenizer_of(info: DatasetInfo) -> tuple:
    digest = ""
    if info.tokenizer_file is not None:
        with open(info.tokenizer_file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return info.tokenizer_kind, info.vocab_size, info.bos_id, info.eos_id, digest


def _words(info: DatasetInfo, sig: tuple) -> str:
    file = f", tokenizer.json {sig[4]}" if sig[4] else ""
    return f"{info.path}: {info.tokenizer_kind} tokenizer, {info.vocab_size} ids, eos {info.eos_id}{file}"


def schedule_dataset_info(schedule: DataSchedule) -> DatasetInfo | None:
    """The dataset.json that describes the run's data: data.path's (if any), or that of every source of a
    mixture, which must all exist and name one tokenizer (a DatasetError line otherwise)."""
    if schedule.mixed:
        return shared_dataset_info(schedule.sources)
    return None if schedule.builtin_corpus else read_dataset_info(schedule.phases[0].sources[0].path)


def shared_dataset_info(sources: Iterable[Source]) -> DatasetInfo | None:
    """The dataset.json of the first source, once every source has one and all name one tokenizer."""
    first: tuple[Source, DatasetInfo, tuple] | None = None
    for s in sources:
        info = read_dataset_info(s.path)
        if info is None:
            raise DatasetError(f"data source {s.name}: {s.path} has no dataset.json; a mixture's sources are folders "
                               f"titanlike-prepare wrote (each records its tokenizer)")
        sig = _tokenizer_of(info)
        if first is None:
            first = (s, info, sig)
        elif sig != first[2]:
            raise DatasetError(f"data sources {first[0].name} ({_words(first[1], first[2])}) and {s.name} "
                               f"({_words(info, sig)}) were tokenized differently; a mixture needs one tokenizer: "
                               f"re-make one with the other's (titanlike-prepare --tokenizer)")
    return first[1] if first else None
