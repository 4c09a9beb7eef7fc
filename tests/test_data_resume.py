"""Exact resume of the data order through the trainer, in this process (conftest.train_here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    assert data == {folder: {"shards": 1, "tokens": data[folder]["tokens"]}} and data[folder]["tokens"] > 0
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
