"""titanlike-prepare's output folder: what it refuses to write over, the folder it works in, and how a
finished dataset takes the place of an earlier one (--overwrite) without losing anything of the user's.

prepare writes OUT/train/, OUT/val/, OUT/dataset.json, OUT/tokenizer.json and OUT/val_documents.json,
and OUT/dataset.json records how many shards each split holds. --overwrite replaces exactly those: the
three files as regular files, train/ and val/ as folders holding only the shards recorded. Anything else
under those names (a folder where a file belongs, a link, a device, a file in train/ or val/ that prepare
did not write) stops it with its name, before any work and again just before the swap; any other entry
of OUT stays.

A run claims OUT first (fs.OutputClaim), so no other prepare works on OUT while it does. It works in
OUT.tmp-<pid>/, which it marks as its own (WORK_MARK) before writing there. A run killed with no chance to
clean up (SIGKILL, a power cut) leaves that folder; the next run into OUT, holding the claim and so the only
one at work there, removes from each marked folder what a prepare writes into one, and nothing else
(remove_work): a folder without the mark, or a file of the user's in a marked one, stays.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys

from titanlike import fs
from titanlike.config.dataset import DATASET_JSON
from titanlike.data.shards import shard_name
from titanlike.errors import UserError

# What titanlike-prepare writes into OUT; --overwrite replaces these and nothing else.
SPLITS = ("train", "val")
VAL_DOCUMENTS = "val_documents.json"  # which documents of each INPUT went to val (driver.Holdout)
FILES = (DATASET_JSON, "tokenizer.json", VAL_DOCUMENTS)
WRITTEN = (*SPLITS, *FILES)
WORK_MARK = ".titanlike-prepare-work"  # written first into a work folder: what makes it a prepare's to clean up
REPLACED = ".replaced"  # in the work folder: the earlier dataset's entries, moved aside by --overwrite
_SHARD = re.compile(r"shard-(\d+)\.bin")
_SHARD_WRITTEN = re.compile(r"shard-\d{5,}\.bin(\.tmp)?")  # a shard, or one ShardWriter had not finished
_TEMPORARY = re.compile(r"(.+)\.tmp-\d+")  # fs.write_text's file beside the one it writes


def work_folder(out: str) -> str:
    """OUT.tmp-<pid>: where this run writes the dataset before it moves into OUT."""
    return f"{os.path.abspath(out)}.tmp-{os.getpid()}"


def start_work(out: str) -> str:
    """Make this run's work folder, marked as a prepare's; a folder by that name that is there already is
    not this run's to empty or remove, and stops it."""
    tmp = work_folder(out)
    try:
        os.mkdir(tmp)
    except FileExistsError:
        raise UserError(f"{tmp} exists, and titanlike-prepare writes its work there: move it away and run "
                        f"again") from None
    mark = os.path.join(tmp, WORK_MARK)
    try:  # O_EXCL in the folder just made: nothing there to follow
        fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, json.dumps({"written_by": "titanlike-prepare", "out": os.path.abspath(out)}).encode())
        finally:
            os.close(fd)
    except BaseException:  # a full disk: said by the caller as the dataset that cannot be written
        if os.path.lexists(mark):
            os.unlink(mark)
        os.rmdir(tmp)
        raise
    return tmp


def _marked(folder: str) -> bool:
    mark = os.path.join(folder, WORK_MARK)
    try:
        if not stat.S_ISREG(os.lstat(mark).st_mode):
            return False
        record = fs.read_json(mark, "a work folder's mark", limit=65536)
    except (OSError, UserError):
        return False
    return isinstance(record, dict) and record.get("written_by") == "titanlike-prepare"


def remove_stale_work(out: str) -> tuple[list[str], list[str]]:
    """Clean up the OUT.tmp-<pid> folders that runs into OUT left when they were killed: those with the mark.
    Called while holding OUT's claim, so no run into OUT is at work in any of them. Returns the folders
    removed, and those kept because they hold something a prepare does not write (named by remove_work)."""
    parent, name = os.path.split(os.path.abspath(out))
    removed: list[str] = []
    kept: list[str] = []
    for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        path = os.path.join(parent, entry)
        if not re.fullmatch(re.escape(name) + r"\.tmp-\d+", entry) or os.path.islink(path) or not os.path.isdir(path):
            continue
        if _marked(path):
            (kept if remove_work(path) else removed).append(path)
    return removed, kept


def remove_work(folder: str) -> list[str]:
    """Remove from a work folder what a prepare writes into one (the mark, the three files and their
    temporaries, train/ and val/ with their shards, finished or not, and .replaced/ by the same rule),
    then each folder this empties. Returns what stays: anything else, which is never removed."""
    left: list[str] = []
    _remove_own(folder, left, top=True)
    return left


def _remove_own(folder: str, left: list[str], top: bool) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and entry.name in SPLITS:
            _remove_shards(entry.path, left)
        elif entry.is_dir(follow_symlinks=False) and top and entry.name == REPLACED:
            _remove_own(entry.path, left, top=False)
        elif entry.is_file(follow_symlinks=False) and _own_file(entry.name, top):
            _unlink(entry.path, left)
        else:
            left.append(entry.path)
    _rmdir(folder)


def _own_file(name: str, top: bool) -> bool:
    temporary = _TEMPORARY.fullmatch(name)
    return name in FILES or (temporary is not None and temporary.group(1) in FILES) or (top and name == WORK_MARK)


def _remove_shards(folder: str, left: list[str]) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_file(follow_symlinks=False) and _SHARD_WRITTEN.fullmatch(entry.name):
            _unlink(entry.path, left)
        else:
            left.append(entry.path)
    _rmdir(folder)


def _unlink(path: str, left: list[str]) -> None:
    try:
        os.unlink(path)
    except OSError:
        left.append(path)


def _rmdir(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass  # not empty: what is left is not ours to remove


def check_output(out: str, files: list[str], overwrite: bool) -> None:
    """Refuse an OUT that would cost the user data: one that holds an input, or one that exists and is not
    a dataset this tool wrote, or holds, by the names this tool writes, what it did not write (--overwrite
    replaces only its own files)."""
    real_out = os.path.realpath(out)
    for f in files:
        real = os.path.realpath(f)
        if real == real_out or real.startswith(real_out + os.sep):
            raise UserError(f"input {f} lies inside the output folder {out}; write the dataset elsewhere")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise UserError(f"{out} exists; choose another output folder or pass --overwrite to replace it")
    check_replaceable(out)


def check_replaceable(out: str) -> dict[str, int]:
    """What --overwrite may replace in OUT, checked: a dataset this tool wrote, whose entries by the names it
    writes are all its own (the files regular files, the splits real folders of the shards dataset.json
    records). Returns how many shards each split holds."""
    if not os.path.isdir(out) or os.path.islink(out) or not os.path.lexists(os.path.join(out, DATASET_JSON)):
        raise UserError(f"{out} is not a dataset titanlike-prepare wrote (no {DATASET_JSON}); --overwrite replaces "
                        f"only such a folder: choose another output folder")
    foreign = [p for p in (os.path.join(out, name) for name in FILES)
               if os.path.lexists(p) and not stat.S_ISREG(os.lstat(p).st_mode)]
    counts: dict[str, int] = {}
    if not foreign:  # dataset.json a file: what it records can be read
        counts = recorded_shards(out)
        for split in SPLITS:
            folder = os.path.join(out, split)
            if not os.path.lexists(folder):
                continue
            if os.path.islink(folder) or not os.path.isdir(folder):
                foreign.append(folder)
                continue
            foreign += sorted(e.path for e in os.scandir(folder)
                              if not (e.is_file(follow_symlinks=False) and _own_shard(e.name, counts[split])))
    if foreign:
        shown = ", ".join(_said(p) for p in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{out}: --overwrite replaces only what titanlike-prepare wrote, and {len(foreign)} entr"
                        f"{'y' if len(foreign) == 1 else 'ies'} there by the names it writes it did not write: "
                        f"{shown}; move them elsewhere (a shard left in train/ or val/ would be read as training "
                        f"data) or choose another output folder (nothing was changed)")
    return counts


def _said(path: str) -> str:
    """`path`, with what it is when it is not a plain file: 'OUT/val_documents.json (a folder)'."""
    mode = os.lstat(path).st_mode
    return path if stat.S_ISREG(mode) else f"{path} ({'a link' if stat.S_ISLNK(mode) else fs.kind_of(mode)})"


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


def publish(tmp: str, out: str, overwrite: bool) -> None:
    """Move the finished dataset in `tmp` to `out`. What was checked at the start is checked again here: an
    OUT that came into being while prepare ran is replaced only with --overwrite, and only as an earlier
    output is. Over an earlier output, only the entries prepare writes are replaced, the old ones moved
    aside into `tmp` until the new ones are in place."""
    if not os.path.lexists(out):
        os.unlink(os.path.join(tmp, WORK_MARK))  # the dataset's folder holds only the dataset
        try:
            os.rename(tmp, out)  # refused by the kernel when OUT came into being since (unless an empty folder)
            return
        except OSError:
            if not os.path.lexists(out):
                raise
    if not overwrite:
        raise UserError(f"{out} came into being while titanlike-prepare ran (it did not exist when it started); "
                        f"choose another output folder or pass --overwrite to replace it (nothing was written)")
    check_replaceable(out)  # again: the user may have changed OUT while the inputs were tokenized
    old = os.path.join(tmp, REPLACED)
    os.mkdir(old)
    aside: list[str] = []
    moved: list[str] = []
    try:
        for name in WRITTEN:
            if os.path.lexists(os.path.join(out, name)):
                os.rename(os.path.join(out, name), os.path.join(old, name))
                aside.append(name)
        for name in WRITTEN:
            if os.path.lexists(os.path.join(tmp, name)):  # no val/ when nothing was held out
                os.rename(os.path.join(tmp, name), os.path.join(out, name))
                moved.append(name)
    except OSError:  # the earlier dataset back in place before the error is said (and `tmp` removed)
        for name in moved:
            os.rename(os.path.join(out, name), os.path.join(tmp, name))
        for name in aside:
            os.rename(os.path.join(old, name), os.path.join(out, name))
        raise
    left = remove_work(tmp)
    if left:  # came into OUT between the check just above and the renames: kept, and said where
        print(f"note: kept {tmp}: it holds {', '.join(left[:3])}{' and more' if len(left) > 3 else ''}, which came "
              f"into {out} as prepare replaced it; move them back", file=sys.stderr)
