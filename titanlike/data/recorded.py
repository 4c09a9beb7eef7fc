"""Shards against the dataset.json that titanlike-prepare wrote beside them. A shard copied in from other
data passes every check of its own (a tokenizer of the same vocabulary size makes ids as small), and one
removed leaves a smaller corpus that trains as well: dataset.json records each shard's token count and
fingerprint (data/shards.py), so either is one line before the run reads anything. A dataset.json from
before those were recorded says how many tokens and shards each split holds: a split folder must hold
as many."""

from __future__ import annotations

import os

from titanlike.config.dataset import DatasetInfo, read_dataset_info
from titanlike.data.shards import DataError, Shard

AGAIN = "re-make the data with titanlike-prepare"


def check_against_record(shards: list[Shard], path: str, contents: bool) -> None:
    """Refuse, in one DataError line, shards at `path` (a shard or a folder of them) that are not those its
    dataset.json records: another token count, a shard it does not name, one it names that is missing, and
    with `contents` another fingerprint (which reads 32 KiB of each shard: the preflight leaves it to the run).
    Shards without a dataset.json are not checked."""
    info = read_dataset_info(path)
    if info is None:
        return
    if info.shards is None:
        _check_split_totals(shards, path, info)
        return
    opened = {}
    for s in shards:
        name = _under(s.path, info)
        opened[name] = s
        if name not in info.shards:
            raise DataError(f"{s.path} is not among the shards {info.path} records: a shard of other data put "
                            f"beside them; move it out (a --data.mix source is a folder of its own), or {AGAIN}")
        tokens, mark = info.shards[name]
        if s.count != tokens:
            raise DataError(f"{s.path} holds {s.count:,} tokens, but {info.path} records {tokens:,} for it: it is "
                            f"not the shard titanlike-prepare wrote there (copied from other data, or made again); "
                            f"put the dataset's own back, or {AGAIN}")
        if contents and s.fingerprint != mark:
            raise DataError(f"{s.path} is not the shard {info.path} records: the same {s.count:,} tokens, other "
                            f"contents (copied from other data, made again or edited); put the dataset's own back, "
                            f"or {AGAIN}")
    if os.path.isdir(path):
        split = _under(path, info).removeprefix(".")  # "" for shards beside dataset.json
        missing = sorted(n for n in info.shards if os.path.dirname(n) == split and n not in opened)
        if missing:
            raise DataError(f"{path} lacks {len(missing)} of the shards {info.path} records ({missing[0]} first): "
                            f"restore them, or {AGAIN}")


def _under(path: str, info: DatasetInfo) -> str:
    """`path` as dataset.json names it: relative to its folder, with "/" between names."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(info.folder)).replace(os.sep, "/")


def _check_split_totals(shards: list[Shard], path: str, info: DatasetInfo) -> None:
    """An earlier dataset.json: a split folder (train/, val/) holds the tokens and shards it records."""
    recorded = info.split_tokens.get(_under(path, info)) if os.path.isdir(path) else None
    if recorded is None:
        return
    tokens, count = recorded
    have = sum(s.count for s in shards)
    if (have, len(shards)) != recorded:
        raise DataError(f"{path} holds {have:,} tokens in {len(shards)} shard(s), but {info.path} records {tokens:,} "
                        f"in {count}: shards were added, removed or replaced since titanlike-prepare wrote it; "
                        f"{AGAIN}")
