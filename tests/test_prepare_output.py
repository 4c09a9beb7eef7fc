"""titanlike-prepare's output folder: --overwrite replaces only what a prepare wrote, the work folder a killed
run left is cleaned of a prepare's own files only, and one run at a time writes an OUT (its claim, held for the
whole run, and the checks made again just before the dataset moves into place)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _env, call
from test_prepare import HANGING_PREPARE
from titanlike import fs
from titanlike.data.prepare import driver, output
from titanlike.data.prepare.cli import main
from titanlike.data.prepare.driver import prepare
from titanlike.errors import UserError


def snapshot(folder: Path) -> dict:
    """Every entry under `folder`: a link's target, a file's bytes, a folder's name, another kind by its mode."""
    out = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        out[str(path.relative_to(folder))] = (os.readlink(path) if stat.S_ISLNK(mode) else path.read_bytes()
                                              if stat.S_ISREG(mode) else stat.S_IFMT(mode))
    return out


def one_error(rc: int, err: str, *fragments: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def train_text(out: Path) -> bytes:
    """The bytes of the documents in OUT/train (byte tokenizer: a token is a byte, 256 and 257 the BOS and EOS)."""
    from titanlike.data.shards import find_shards

    return bytes(t for s in find_shards(str(out / "train")) for t in s.tokens if t < 256)


@pytest.fixture
def earlier(tmp_path) -> Path:
    """A dataset of one document in train and one in val (both splits, every file prepare writes)."""
    for name, text in (("a.txt", "the earlier dataset's text " * 4), ("b.txt", "more of the earlier text " * 4)):
        (tmp_path / name).write_text(text)
    out = tmp_path / "earlier"
    prepare(str(out), [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], workers=1, val_fraction=0.4)
    assert sorted(os.listdir(out)) == ["dataset.json", "tokenizer.json", "train", "val", "val_documents.json"]
    (tmp_path / "new.txt").write_text("the new text")
    return out


def _folder(path: Path, name: str) -> None:  # the user's folder where prepare writes a file
    path.unlink()
    path.mkdir()
    (path / name).write_text("the user's only copy")


CASES = {  # how the user's things came to stand where prepare writes, and how the refusal names them
    "val_documents.json a folder": (lambda out, mine: _folder(out / "val_documents.json", "precious.txt"),
                                    "val_documents.json (a folder)"),
    "tokenizer.json a folder": (lambda out, mine: _folder(out / "tokenizer.json", "notes.txt"),
                                "tokenizer.json (a folder)"),
    "dataset.json a folder": (lambda out, mine: _folder(out / "dataset.json", "notes.txt"), "dataset.json (a folder)"),
    "tokenizer.json a link": (lambda out, mine: ((out / "tokenizer.json").unlink(),
                                                 (out / "tokenizer.json").symlink_to(mine)), "tokenizer.json (a link)"),
    "val_documents.json a FIFO": (lambda out, mine: ((out / "val_documents.json").unlink(),
                                                     os.mkfifo(out / "val_documents.json")),
                                  "val_documents.json (a FIFO)"),
    "train a link": (lambda out, mine: (shutil.move(out / "train", mine.parent / "elsewhere"),
                                        (out / "train").symlink_to(mine.parent / "elsewhere")), "/train (a link)"),
    "a shard a link": (lambda out, mine: ((out / "val" / "shard-00000.bin").unlink(),
                                          (out / "val" / "shard-00000.bin").symlink_to(mine)),
                       "val/shard-00000.bin (a link)"),
    "a folder in train": (lambda out, mine: (out / "train" / "shard-00001.bin").mkdir(),
                          "train/shard-00001.bin (a folder)"),
}


@pytest.mark.parametrize("case", CASES)
def test_overwrite_refuses_what_prepare_did_not_write_under_its_names(tmp_path, earlier, case):
    """--overwrite replaces regular files of the names prepare writes and its own shard folders; a folder of
    the user's where a file belongs, a link, a FIFO, a folder among the shards is refused up front in one
    line naming it, and nothing moves (a folder by val_documents.json's name was moved aside, said to have come
    in while prepare ran, and deleted by the next prepare into OUT)."""
    change, named = CASES[case]
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's file elsewhere")
    change(earlier, mine)
    before, around = snapshot(earlier), sorted(os.listdir(tmp_path))
    rc, err = call(main, str(earlier), str(tmp_path / "new.txt"), "--overwrite", "--val-fraction", "0")
    line = one_error(rc, err, named, "did not write", "nothing was changed")
    assert f"{earlier}/" in line
    assert snapshot(earlier) == before and sorted(os.listdir(tmp_path)) == around  # no OUT.tmp-<pid>, no lock
    assert mine.read_text() == "the user's file elsewhere"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_work_folder_loses_only_what_a_prepare_writes(tmp_path, monkeypatch, capsys):
    """The next prepare into OUT cleans up after a killed one: of a work folder it marked, what a prepare writes
    there (shards, its files, the earlier dataset moved aside), and nothing else; a folder by such a name that
    no prepare marked stays whole."""
    (tmp_path / "a.txt").write_text("some text for the dataset")
    out = tmp_path / "out"
    killed, with_users, unmarked = (tmp_path / f"out.tmp-{pid}" for pid in (dead_pid(), dead_pid(), dead_pid()))
    for folder in (killed, with_users):  # as a run killed while it swapped the datasets leaves it
        monkeypatch.setattr(output.os, "getpid", lambda folder=folder: int(folder.name.rsplit("-", 1)[1]))
        assert output.start_work(str(out)) == str(folder)
        for split in ("train", ".replaced/train", ".replaced/val"):
            (folder / split).mkdir(parents=True)
            (folder / split / "shard-00000.bin").write_bytes(b"tokens")
        (folder / "train" / "shard-00001.bin.tmp").write_bytes(b"half")
        (folder / "dataset.json").write_text("{}")
        (folder / "tokenizer.json.tmp-12").write_text("{}")
        (folder / ".replaced" / "tokenizer.json").write_text("{}")
    monkeypatch.undo()
    (with_users / ".replaced" / "val_documents.json").mkdir()  # the user's folder, moved aside by an old prepare
    (with_users / ".replaced" / "val_documents.json" / "precious.txt").write_text("the user's only copy")
    (with_users / ".replaced" / "val" / "notes.txt").write_text("the user's note")
    unmarked.mkdir()
    (unmarked / "train").mkdir()
    (unmarked / "train" / "shard-00000.bin").write_bytes(b"the user's own")
    before = snapshot(unmarked)
    prepare(str(out), [str(tmp_path / "a.txt")], workers=1, val_fraction=0.0)
    assert not killed.exists() and snapshot(unmarked) == before
    assert snapshot(with_users) == {".replaced": stat.S_IFDIR, ".replaced/val": stat.S_IFDIR,
                                    ".replaced/val/notes.txt": b"the user's note",
                                    ".replaced/val_documents.json": stat.S_IFDIR,
                                    ".replaced/val_documents.json/precious.txt": b"the user's only copy"}
    err = capsys.readouterr().err
    assert f"removed {killed}: an earlier titanlike-prepare into {out} was killed" in err
    assert f"note: kept {with_users}" in err and str(unmarked) not in err
    # Kept, it is never emptied by a later run either.
    prepare(str(out), [str(tmp_path / "a.txt")], workers=1, val_fraction=0.0, overwrite=True)
    assert (with_users / ".replaced" / "val_documents.json" / "precious.txt").read_text() == "the user's only copy"


def test_a_second_run_into_a_claimed_output_stops_at_once(tmp_path):
    """While a run holds OUT's claim, another into OUT (new, or an earlier dataset with --overwrite) stops in
    one line naming it, before any work and with nothing written; once the claim is released, the run goes
    and leaves no lock file behind."""
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "out"
    with fs.OutputClaim(str(out), "titanlike-prepare", "the dataset"):
        rc, err = call(main, str(out), str(tmp_path / "a.txt"), "--val-fraction", "0")
        one_error(rc, err, f"another titanlike-prepare is writing {out} (pid {os.getpid()} on ", "wait for it")
        assert sorted(os.listdir(tmp_path)) == ["a.txt", "out.titanlike.lock"]
    assert call(main, str(out), str(tmp_path / "a.txt"), "--val-fraction", "0")[0] == 0
    before = snapshot(out)
    with fs.OutputClaim(str(out), "titanlike-export", "the export"):
        rc, err = call(main, str(out), str(tmp_path / "a.txt"), "--val-fraction", "0", "--overwrite")
        one_error(rc, err, f"another titanlike-export is writing {out}")
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["a.txt", "out"]


def test_an_output_that_comes_into_being_while_prepare_runs_is_not_replaced(tmp_path, earlier, monkeypatch):
    """OUT made (by another prepare, say) after the check at the start: without --overwrite the run stops
    rather than replace it; with --overwrite it is checked again as the start checks an earlier output."""
    real = driver.tokenized
    make = []

    def tokenized(*args, **kwargs):  # OUT comes into being while the inputs are tokenized
        make.pop()()
        yield from real(*args, **kwargs)

    monkeypatch.setattr(driver, "tokenized", tokenized)
    out = tmp_path / "out"
    make.append(lambda: shutil.copytree(earlier, out))
    with pytest.raises(UserError, match=f"{out} came into being while titanlike-prepare ran"):
        prepare(str(out), [str(tmp_path / "new.txt")], workers=1, val_fraction=0)
    assert snapshot(out) == snapshot(earlier)
    make.append(lambda: _folder(out / "val_documents.json", "precious.txt"))
    with pytest.raises(UserError, match=r"val_documents.json \(a folder\)"):
        prepare(str(out), [str(tmp_path / "new.txt")], workers=1, val_fraction=0, overwrite=True)
    assert (out / "val_documents.json" / "precious.txt").read_text() == "the user's only copy"
    assert train_text(out) == train_text(earlier)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "earlier", "new.txt", "out"]


def test_a_killed_run_leaves_no_claim(tmp_path):
    """Two processes: a second prepare into OUT stops while the first tokenizes, naming its pid; once the first
    is killed (SIGKILL: no handler runs) the kernel has released its claim, and the next run takes OUT, removes
    the work folder the killed one left, and leaves no lock file."""
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", HANGING_PREPARE, str(out), str(tmp_path / "a.txt"), "--workers",
                              "1"], env=_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)
    work = tmp_path / f"out.tmp-{first.pid}"
    try:
        deadline = time.monotonic() + 60
        while not work.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.05)
        rc, err = call(main, str(out), str(tmp_path / "a.txt"), "--val-fraction", "0")
        one_error(rc, err, f"another titanlike-prepare is writing {out} (pid {first.pid} on ")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert json.loads((tmp_path / "out.titanlike.lock").read_text())["pid"] == first.pid  # left, but not held
    rc, err = call(main, str(out), str(tmp_path / "a.txt"), "--val-fraction", "0")
    assert rc == 0 and f"removed {work}" in err, err
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"] and train_text(out) == b"some text"


def test_the_lock_file_is_never_written_through_a_link_nor_over_a_users_file(tmp_path):
    """The claim's file beside OUT: a link there is refused (its target untouched), and so is a file of the
    user's by that name, kept as it was."""
    (tmp_path / "a.txt").write_text("some text")
    target = tmp_path / "target.txt"
    target.write_text("the user's file")
    lock = tmp_path / "out.titanlike.lock"
    lock.symlink_to(target)
    one_error(*call(main, str(tmp_path / "out"), str(tmp_path / "a.txt")), f"{lock}: a symbolic link")
    lock.unlink()
    lock.write_text("the user's notes")
    one_error(*call(main, str(tmp_path / "out"), str(tmp_path / "a.txt")), f"{lock} holds something other than")
    assert target.read_text() == "the user's file" and lock.read_text() == "the user's notes"
    assert not (tmp_path / "out").exists()


def test_a_folder_by_the_work_folders_name_is_never_emptied(tmp_path, monkeypatch):
    """OUT.tmp-<this pid> that is there already, and no prepare's (a pid used again, a user's name): the run
    stops, naming it, and the folder stays whole (it was removed to make room for the run's own)."""
    (tmp_path / "a.txt").write_text("some text")
    users = tmp_path / "out.tmp-4242"
    (users / "train").mkdir(parents=True)
    (users / "train" / "shard-00000.bin").write_bytes(b"the user's own")
    monkeypatch.setattr(output.os, "getpid", lambda: 4242)
    with pytest.raises(UserError, match=f"{users} exists, and titanlike-prepare writes its work there"):
        prepare(str(tmp_path / "out"), [str(tmp_path / "a.txt")], workers=1, val_fraction=0)
    monkeypatch.undo()
    assert snapshot(users) == {"train": stat.S_IFDIR, "train/shard-00000.bin": b"the user's own"}
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "out.tmp-4242"]


def test_a_swap_that_fails_puts_the_earlier_dataset_back(tmp_path, earlier, monkeypatch):
    """A rename that fails while --overwrite swaps the datasets (the earlier one's entries aside, some of the new
    ones in): the earlier dataset goes back in place before the one line, rather than being removed with the
    work folder."""
    real, calls = os.rename, []
    before = snapshot(earlier)

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == 8:  # five entries aside, two new ones in
            raise OSError(5, "Input/output error", dst)
        real(src, dst)

    monkeypatch.setattr(output.os, "rename", rename)
    with pytest.raises(UserError, match="cannot write the dataset: .*Input/output error"):
        prepare(str(earlier), [str(tmp_path / "new.txt")], workers=1, val_fraction=0, overwrite=True)
    monkeypatch.undo()
    assert snapshot(earlier) == before
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "earlier", "new.txt"]
