"""Exact resume of the data order through the trainer, in this process (conftest.train_here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import losses, seal, train_here

RUN = ("--training.steps", "4", "--data.seq_len", "32", "--training.local_batch_size", "2",
       "--training.global_batch_size", "4", "--metrics.log_freq", "1", "--validation.enable", "false",
       "--checkpoint.enable", "--checkpoint.interval", "2", "--training.deterministic",
       "--metrics.enable_tensorboard", "false")


def resumed_from_step_2(ref: Path, dump: Path, *overrides: str, edit=None) -> dict[int, float]:
    """Losses of a run that resumes from `ref`'s step-2 checkpoint (its trainer_state.json edited by `edit`)."""
    shutil.copytree(ref / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    state_file = dump / "checkpoint" / "step-2" / "trainer_state.json"
    if edit is not None:
        state = json.loads(state_file.read_text())
        edit(state)
        state_file.write_text(json.dumps(state))
        seal(str(state_file.parent), 2)  # as a titanlike save of that state would have signed it
    train_here(dump, *RUN, *overrides)
    return losses(dump)


def test_resume_is_exact_and_an_old_checkpoint_keeps_the_affine_order(tmp_path, corpus):
    ref = tmp_path / "ref"
    train_here(ref, *RUN, corpus=corpus)
    want = losses(ref)
    step4 = json.loads((ref / "checkpoint" / "step-4" / "trainer_state.json").read_text())
    data = step4["states"]["dataloader"].pop("data")
    assert step4["states"]["dataloader"] == {"batches_read": 4, "order": "feistel"}
    folder = str(Path(corpus[0]).parent)
    from titanlike.data.shards import Shard

    assert data == {folder: {"shards": 1, "tokens": Shard(corpus[0]).count,
                             "fingerprint": data[folder]["fingerprint"]}} and len(data[folder]["fingerprint"]) == 32
    got = resumed_from_step_2(ref, tmp_path / "resumed", "--data.path", corpus[0])
    assert {s: got[s] for s in (3, 4)} == {s: want[s] for s in (3, 4)}

    def without_order(state):  # as titanlike wrote it before the Feistel order
        del state["states"]["dataloader"]["order"]

    old = tmp_path / "old"
    got = resumed_from_step_2(ref, old, "--data.path", corpus[0], edit=without_order)
    again = json.loads((old / "checkpoint" / "step-4" / "trainer_state.json").read_text())
    assert again["states"]["dataloader"] == {"batches_read": 4, "order": "affine", "data": data}
    assert got[3] != want[3]  # the affine order's windows, not the Feistel order's


def test_data_made_again_in_place_is_said_on_resume(tmp_path):
    """`titanlike-prepare --overwrite` into the folder a run reads, then a resume: one line says what changed
    (tokens and shards), where it was silent."""
    from titanlike.data.prepare.driver import prepare

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("the first corpus, small. " * 400)
    prepare(str(tmp_path / "data"), [str(texts)], workers=1, val_fraction=0.0)
    data = ("--data.path", str(tmp_path / "data" / "train"))
    train_here(tmp_path / "run", *RUN[:1], "2", *RUN[2:], *data)
    (texts / "b.txt").write_text("a second file, made later. " * 2000)
    prepare(str(tmp_path / "data"), [str(texts)], workers=1, val_fraction=0.0, overwrite=True)
    proc = train_here(tmp_path / "run", *RUN, *data)
    line = next(x for x in proc.stderr.splitlines() if "the data changed since the checkpoint was saved" in x)
    assert f"{tmp_path / 'data' / 'train'}: 10,002 → 64,004 tokens in 1 → 1 shard(s)" in line, line
    assert "the run goes on from the same position, global batch 2" in line
    # Resumed again over the same data: nothing to say.
    proc = train_here(tmp_path / "run", *RUN[:1], "5", *RUN[2:], *data)
    assert "the data changed" not in proc.stderr


# ---- data changed in place with the same counts ---------------------------------------------------------


def resumed_line(folder: Path, change, caplog) -> str:
    """The data line of a loader that resumes the state saved over the shards in `folder` after `change(folder)`
    ("" when it says nothing)."""
    import logging

    from conftest import build_train_loader
    from titanlike.data.loader import open_dataset

    def loader():
        return build_train_loader(open_dataset(str(folder), 8, 320, "data.path"), 2, 4, 0, 1, seed=3,
                                  num_workers=0, pin_memory=False)

    first = loader()
    for _ in range(2):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json keeps it
    change(folder)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlike"):
        loader().load_state_dict(state)
    return " ".join(r.getMessage() for r in caplog.records if "the data changed" in r.getMessage())


def test_data_changed_in_place_with_the_same_counts_is_said_on_resume(tmp_path, caplog):
    """A shard's tokens reversed, or shards renamed so that the corpus reads in another order: the same token and
    shard counts, which were all a resume compared, so it went on silently. The data position now carries each
    source's fingerprint (of its shards', in reading order), and the resume says what changed."""
    import numpy as np

    from titanlike.data.shards import Shard, write_shard

    def shards(folder: Path) -> Path:
        folder.mkdir()
        write_shard(folder / "a.bin", np.arange(401) % 300)
        write_shard(folder / "b.bin", (np.arange(401) * 7) % 300)
        return folder

    def reverse(folder: Path) -> None:
        write_shard(folder / "a.bin", Shard(folder / "a.bin").tokens[::-1].copy())

    def reorder(folder: Path) -> None:  # a.bin renamed c.bin: b.bin is read first now
        (folder / "a.bin").rename(folder / "c.bin")

    def unchanged(folder: Path) -> None:
        (folder / "a.bin").touch()  # a new mtime, the same bytes: nothing to say

    said = "the same 802 tokens in 2 shard(s), other contents or another order of them"
    for name, change in (("reversed", reverse), ("reordered", reorder)):
        folder = shards(tmp_path / name)
        line = resumed_line(folder, change, caplog)
        assert f"the data changed since the checkpoint was saved ({folder}: {said})" in line, (name, line)
    assert resumed_line(shards(tmp_path / "same"), unchanged, caplog) == ""


def test_a_checkpoint_from_before_fingerprints_compares_the_counts(tmp_path):
    """A data position saved before it held a fingerprint says nothing of data with the same counts."""
    from titanlike.data.loader import data_changes

    now = {"/d": {"shards": 1, "tokens": 10, "fingerprint": "ab"}}
    assert data_changes({"/d": {"shards": 1, "tokens": 10}}, now) == ""
    assert data_changes({"/d": {"shards": 1, "tokens": 12}}, now) == "/d: 12 → 10 tokens in 1 → 1 shard(s)"


# ---- a shard that is not the one dataset.json records ---------------------------------------------------


@pytest.fixture
def two_datasets(tmp_path) -> tuple[Path, Path]:
    """Two byte-tokenized datasets (one vocabulary size) of other texts, in shards of 4,000 tokens: web's train
    split holds 10,002 tokens (4,000 + 4,000 + 2,002), code's 14,502."""
    from titanlike.data.prepare.driver import prepare

    made = []
    for name, text in (("web", "the first corpus, small. " * 400), ("code", "def other(text): return text\n" * 500)):
        (tmp_path / f"{name}-texts").mkdir()
        (tmp_path / f"{name}-texts" / "a.txt").write_text(text)
        prepare(str(tmp_path / name), [str(tmp_path / f"{name}-texts")], workers=1, val_fraction=0.0,
                shard_tokens=4000)
        made.append(tmp_path / name)
    return made[0], made[1]


def refusal(path: Path, contents: bool = True) -> str:
    """The line opening `path` for training ends with ("" when it opens): as the run opens it (`contents`), or as
    the preflight does."""
    from titanlike.data.loader import open_dataset
    from titanlike.data.recorded import check_against_record
    from titanlike.data.shards import DataError, open_shards

    try:
        if contents:
            open_dataset(str(path), 32, 320, "data.path", (258, "dataset.json"))
        else:
            check_against_record(open_shards(str(path), 32, 258, "its tokenizer", "data.path"), str(path), False)
    except DataError as e:
        return str(e)
    return ""


def test_a_shard_of_other_data_in_a_prepared_dataset_is_refused(two_datasets):
    """A shard of another tokenizer's data (here: other text, one vocabulary size) copied over one of a prepared
    dataset, or beside them, trained silently although dataset.json records another token count. dataset.json now
    records each shard's tokens and fingerprint: the run and its preflight refuse another count, a shard it does
    not name and one missing, in one line; the run also refuses the same count in other contents (it reads 32 KiB
    of each shard, which the preflight leaves to it)."""
    from titanlike.data.shards import Shard, write_shard

    web, code = two_datasets
    train, record_file = web / "train", web / "dataset.json"
    record = json.loads(record_file.read_text())
    first, last = train / "shard-00000.bin", train / "shard-00002.bin"
    assert len(record["shards"]) == 3 and record["shards"]["train/shard-00002.bin"] == {
        "tokens": 2002, "fingerprint": Shard(last).fingerprint}
    assert refusal(train) == refusal(train, contents=False) == ""
    kept = {p: p.read_bytes() for p in (first, last)}
    again = "re-make the data with titanlike-prepare"

    shutil.copyfile(code / "train" / "shard-00003.bin", last)  # 2,502 tokens over 2,002
    said = (f"{last} holds 2,502 tokens, but {record_file} records 2,002 for it: it is not the shard titanlike-prepare "
            f"wrote there (copied from other data, or made again); put the dataset's own back, or {again}")
    assert refusal(train) == refusal(train, contents=False) == said
    last.write_bytes(kept[last])

    shutil.copyfile(code / "train" / "shard-00000.bin", first)  # 4,000 tokens over 4,000
    said = (f"{first} is not the shard {record_file} records: the same 4,000 tokens, other contents (copied from "
            f"other data, made again or edited); put the dataset's own back, or {again}")
    assert refusal(train) == said and refusal(train, contents=False) == ""
    first.write_bytes(kept[first])
    write_shard(first, Shard(first).tokens[::-1].copy())  # the dataset's own tokens, reversed in place
    assert refusal(train) == said
    first.write_bytes(kept[first])

    shutil.copyfile(code / "train" / "shard-00003.bin", train / "shard-00003.bin")  # beside them
    assert refusal(train) == refusal(train, contents=False) == (
        f"{train / 'shard-00003.bin'} is not among the shards {record_file} records: a shard of other data put beside "
        f"them; move it out (a --data.mix source is a folder of its own), or {again}")
    (train / "shard-00003.bin").unlink()

    (train / "shard-00001.bin").unlink()
    assert refusal(train) == refusal(train, contents=False) == (
        f"{train} lacks 1 of the shards {record_file} records (train/shard-00001.bin first): restore them, or {again}")


def test_an_earlier_dataset_json_checks_its_split_totals(two_datasets):
    """A dataset.json from before shards were recorded: the split folder must hold the tokens and shards it
    records."""
    web, code = two_datasets
    record = json.loads((web / "dataset.json").read_text())
    del record["shards"]
    (web / "dataset.json").write_text(json.dumps(record))
    assert refusal(web / "train") == ""
    shutil.copyfile(code / "train" / "shard-00002.bin", web / "train" / "shard-00002.bin")  # 4,000 tokens over 2,002
    assert record["splits"]["train"] | {"documents": 0} == {"tokens": 10_002, "shards": 3, "documents": 0}
    assert refusal(web / "train") == refusal(web / "train", contents=False) == (
        f"{web / 'train'} holds 12,000 tokens in 3 shard(s), but {web / 'dataset.json'} records 10,002 in 3: shards "
        f"were added, removed or replaced since titanlike-prepare wrote it; re-make the data with titanlike-prepare")
