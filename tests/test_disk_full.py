"""A full disk during a save: the run stops with one clear line, the previous checkpoint stays loadable."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from conftest import losses, run_train


@pytest.mark.slow
def test_disk_full_keeps_previous_checkpoint(tmp_path, corpus):
    small = tmp_path / "small_disk"
    small.mkdir()
    # 60 MB holds one checkpoint of the debug model (weights + two AdamW moments, ~40 MB), not two.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60M", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root; cannot simulate a full disk here")
    try:
        ckpt = small / "ckpt"
        proc = run_train(tmp_path / "run", "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                         "--checkpoint.folder", str(ckpt), "--metrics.log_freq", "1", corpus=corpus, check=False)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, proc.stderr[-3000:]
        assert "No space left on device" in errors[0] and "step-2 is intact" in errors[0], errors[0]
        assert "Traceback" not in proc.stderr.split(errors[0])[0]
        assert (ckpt / "step-2").is_dir()
        assert not (ckpt / "step-4").exists() and not (ckpt / "step-4.tmp").exists()
        saved = tmp_path / "saved"
        shutil.copytree(ckpt, saved)
    finally:
        subprocess.run(["umount", str(small)], check=False)

    # The surviving checkpoint loads, and the run continues to the end on a disk with room.
    resumed = run_train(tmp_path / "resume", "--training.steps", "4", "--checkpoint.enable",
                        "--checkpoint.interval", "2",
                        "--checkpoint.folder", str(saved), "--metrics.log_freq", "1", corpus=corpus)
    assert "resumed from" in resumed.stdout + resumed.stderr
    first = losses(tmp_path / "run")
    after = losses(tmp_path / "resume")
    assert sorted(after) == [3, 4]
    assert 2 in first and after[3] > 0


@pytest.mark.parametrize("free_pages", [0, 1, 2, 3, 16])
def test_a_full_dump_folder_is_one_line(tmp_path, corpus, free_pages):
    """The dump folder's disk fills at the write probe, tokenizer.json, config.toml, the metrics or
    TensorBoard's records (which one depends on the room left): the run either finishes or stops with
    one error line naming the file, never a traceback."""
    from conftest import fill, small_disk, train_here

    with small_disk(tmp_path / "disk", "1m") as mount:
        fill(mount)
        os.truncate(mount / "filler", max(0, os.path.getsize(mount / "filler") - free_pages * 4096))
        proc = train_here(mount / "run", "--training.steps", "3", "--metrics.log_freq", "1", "--data.seq_len", "64",
                          "--training.local_batch_size", "2", corpus=corpus, check=False)
    if free_pages <= 3:  # the probe, config.toml, TensorBoard, metrics.jsonl in turn
        assert proc.returncode == 2, proc.stderr[-3000:]
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "no space left on the device" in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def full_disk_line(folder, steps_on_disk: list[int], keep_latest_k: int = 0) -> str:
    """The line a save of step 8 that met a full disk ends with, `steps_on_disk` complete in `folder`."""
    import errno

    from titanlike.checkpoint.folder import StepFolders
    from titanlike.checkpoint.writer import CheckpointError, StepWriter

    for step in steps_on_disk:
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "weights").write_bytes(b"\0" * 3 * 2**20)
    writer = StepWriter(StepFolders(str(folder), True), keep_latest_k=keep_latest_k, pinned=False, rank=0, world=1,
                        group=None, save_group=None, cuda=False, eight_bit=False)
    writer.estimate_mb = 123.4
    with pytest.raises(CheckpointError) as e:
        writer._fail(8, OSError(errno.ENOSPC, "No space left on device", str(folder / "step-8.tmp")))
    return str(e.value)


def test_a_full_disk_advises_keep_latest_k_only_where_it_frees_a_checkpoint(tmp_path):
    """At the first save there is no checkpoint to keep fewer of: the line gives this run's checkpoint size. With one
    on disk, keep_latest_k 2 would delete nothing (it advised it): the line gives the room a save needs. Only with
    more than one on disk (and keep_latest_k 0 or above 2) does it say what keep_latest_k 2 deletes."""
    first = full_disk_line(tmp_path / "none", [])
    assert "this run's checkpoint takes about 123 MB" in first and "keep_latest_k" not in first, first
    one = full_disk_line(tmp_path / "one", [4])
    assert "a checkpoint takes 3 MB and a save needs room for one more beside the newest" in one, one
    assert "keep_latest_k" not in one and "step-4 is intact" in one, one
    three = full_disk_line(tmp_path / "three", [2, 4, 6])
    assert "keep fewer with --checkpoint.keep_latest_k 2 (a save then deletes all but the newest: 2 of the 3 " \
           "here)" in three, three
    two_kept = full_disk_line(tmp_path / "two", [4, 6], keep_latest_k=2)  # it already keeps no more than that
    assert "keep_latest_k" not in two_kept, two_kept


def test_a_save_knows_about_how_large_it_is():
    from titanlike.checkpoint.writer import tensor_bytes

    state = {"model": {"w": torch.zeros(4, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "step": 3,
             "moments": [torch.zeros(2, 2)]}
    assert tensor_bytes(state) == 4 * 8 * 4 + 8 * 2 + 4 * 4
