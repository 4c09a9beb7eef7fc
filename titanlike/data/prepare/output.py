"""titanlike-prepare's output folder: what it refuses to write over, and how a finished dataset takes
the place of an earlier one (--overwrite) without losing anything of the user's.

prepare writes OUT/train/, OUT/val/, OUT/dataset.json, OUT/tokenizer.json and OUT/val_documents.json,
and OUT/dataset.json records how many shards each split holds: those shards and those three files are
what --overwrite may remove. Any other file in OUT stays; any other file in train/ or val/ stops it, with its name.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from titanlike import fs
from titanlike.config.dataset import DATASET_JSON
from titanlike.data.shards import shard_name
from titanlike.errors import UserError

# What titanlike-prepare writes into OUT; --overwrite replaces these and nothing else.
SPLITS = ("train", "val")
VAL_DOCUMENTS = "val_documents.json"  # which documents of each INPUT went to val (driver.Holdout)
WRITTEN = (*SPLITS, DATASET_JSON, "tokenizer.json", VAL_DOCUMENTS)
_SHARD = re.compile(r"shard-(\d+)\.bin")


def remove_stale_work(out: str) -> list[str]:
    """Remove the OUT.tmp-<pid> folders that a prepare into OUT left when it was killed (SIGKILL, a
    power cut: no handler ran): those whose process is gone. A prepare still running keeps its own.
    Returns what was removed."""
    parent, name = os.path.split(os.path.abspath(out))
    removed = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        match = re.fullmatch(re.escape(name) + r"\.tmp-(\d+)", entry)
        path = os.path.join(parent, entry)
        if not match or os.path.islink(path) or not os.path.isdir(path) or _alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or not a pid at all: leave it be)
    return True


def check_output(out: str, files: list[str], overwrite: bool) -> None:
    """Refuse an OUT that would cost the user data: one that holds an input, or one that exists and
    is not a dataset this tool wrote, or whose train/ or val/ hold files it did not write
    (--overwrite replaces only its own files)."""
    real_out = os.path.realpath(out)
    for f in files:
        real = os.path.realpath(f)
        if real == real_out or real.startswith(real_out + os.sep):
            raise UserError(f"input {f} lies inside the output folder {out}; write the dataset elsewhere")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise UserError(f"{out} exists; choose another output folder or pass --overwrite to replace it")
    if not os.path.isdir(out) or os.path.islink(out) or not os.path.isfile(os.path.join(out, DATASET_JSON)):
        raise UserError(f"{out} is not a dataset titanlike-prepare wrote (no {DATASET_JSON}); --overwrite replaces "
                        f"only such a folder: choose another output folder")
    check_foreign(out, recorded_shards(out))


def recorded_shards(out: str) -> dict[str, int]:
    """How many shards OUT/dataset.json says each split holds: the shards this tool wrote there."""
    where = os.path.join(out, DATASET_JSON)
    record = fs.read_json(where, "the dataset record")
    splits = record.get("splits") if isinstance(record, dict) else None
    counts = {}
    for split in SPLITS:
        entry = splits.get(split) if isinstance(splits, dict) else None
        count = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise UserError(f"{where} does not record how many shards titanlike-prepare wrote to {split}/, so "
                            f"--overwrite cannot tell them from other files: choose another output folder")
        counts[split] = count
    return counts


def _own_shard(name: str, count: int) -> bool:
    m = _SHARD.fullmatch(name)
    return m is not None and int(m.group(1)) < count and name == shard_name(int(m.group(1)))


def check_foreign(out: str, counts: dict[str, int]) -> None:
    """Refuse when OUT/train or OUT/val hold anything but the shards recorded in dataset.json: replacing
    the split would lose it, and a .bin file left beside the new shards would be read as training data."""
    foreign = []
    for split in SPLITS:
        folder = os.path.join(out, split)
        if os.path.islink(folder):  # the link itself is replaced; where it points is not ours to empty
            continue
        if os.path.isdir(folder):
            foreign += sorted(e.path for e in os.scandir(folder)
                              if e.is_dir(follow_symlinks=False) or not _own_shard(e.name, counts[split]))
        elif os.path.lexists(folder):
            foreign.append(folder)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{out}: --overwrite replaces train/ and val/, which hold {len(foreign)} file(s) "
                        f"titanlike-prepare did not write: {shown}; move them elsewhere (a shard left there would "
                        f"be read as training data) or choose another output folder")


def publish(tmp: str, out: str) -> None:
    """Move the finished dataset in `tmp` to `out`. Over an earlier output (--overwrite), only the entries
    prepare writes are replaced, and the old ones go only once the new ones are in place."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    counts = recorded_shards(out)
    check_foreign(out, counts)  # again: the user may have added files while the inputs were tokenized
    old = os.path.join(tmp, ".replaced")
    os.mkdir(old)
    for name in WRITTEN:
        if os.path.lexists(os.path.join(out, name)):
            os.rename(os.path.join(out, name), os.path.join(old, name))
    for name in WRITTEN:
        if os.path.lexists(os.path.join(tmp, name)):  # no val/ when nothing was held out
            os.rename(os.path.join(tmp, name), os.path.join(out, name))
    _remove_replaced(old, counts)
    try:
        os.rmdir(old)
        os.rmdir(tmp)
    except OSError:  # something of the user's came into train/ or val/ after the last check: it stays
        print(f"note: kept {old}: it holds files that came into {out}/train or {out}/val while prepare ran",
              file=sys.stderr)


def _remove_replaced(old: str, counts: dict[str, int]) -> None:
    """Delete the entries --overwrite replaced: a file or link itself (never a link's target), and of a
    split folder only the shards dataset.json recorded, then the folder once that empties it."""
    for name in os.listdir(old):
        path = os.path.join(old, name)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        elif name in counts:
            for entry in os.scandir(path):
                if not entry.is_dir(follow_symlinks=False) and _own_shard(entry.name, counts[name]):
                    os.unlink(entry.path)
            try:
                os.rmdir(path)
            except OSError:
                pass  # not empty: what is left is not ours to delete
