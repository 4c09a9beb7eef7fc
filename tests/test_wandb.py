"""Weights & Biases as a second metrics sink, in W&B's offline mode (no account, no network): what a run
logs is read back from the offline run files under the dump folder."""

from __future__ import annotations

import importlib.util
import json
import struct
import time
from pathlib import Path

import pytest
import torch

from conftest import metrics, train_here
from titanlike import preflight
from titanlike.records.metrics import MetricsLogger

wandb = pytest.importorskip("wandb")

SHORT = ["--training.steps", "4", "--training.local_batch_size", "2", "--data.seq_len", "32",
         "--metrics.log_freq", "2", "--validation.freq", "4", "--validation.steps", "1"]


def history(run_file: Path) -> list[dict]:
    """The history rows of an offline run's `run-<id>.wandb`: a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of chunks: CRC, length, type) of W&B's protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, record = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + size], pos + 7 + size
        record = chunk if kind in (1, 2) else record + chunk  # full, first | middle, last
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(record)
            if r.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def offline_runs(dump: Path) -> list[Path]:
    return sorted((dump / "wandb").glob("offline-run-*/run-*.wandb"))


def settled_history(run_file: Path, steps: set[int]) -> list[dict]:
    """`history(run_file)` once it holds a train loss at each of `steps`. W&B writes the file from a process of
    its own: on a loaded machine its last records may land a moment after the run has finished (read at once,
    the file held no train row: once after a resume, once after a first run while CI's two torch legs ran)."""
    deadline = time.monotonic() + 30
    while True:
        rows = history(run_file)
        found = {r["step"] for r in rows if "train/loss" in r}
        if found == steps:
            return rows
        assert time.monotonic() < deadline, sorted(found)
        time.sleep(0.5)


def test_offline_run_holds_the_records_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = tmp_path / "my-run"
    train_here(dump, *SHORT, "--metrics.enable_wandb", "--checkpoint.enable", "--checkpoint.interval", "4")
    [first] = offline_runs(dump)
    run_id = (dump / "wandb" / "titanlike-run-id").read_text().strip()
    assert first.name == f"run-{run_id}.wandb"
    logged = {r["step"]: r["loss"] for r in metrics(dump)}
    rows = settled_history(first, set(logged))
    # The train records' losses, keyed as TensorBoard's scalars, at the training step.
    wb_loss = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert wb_loss == pytest.approx(logged)
    assert any("train/lr" in r for r in rows) and any("train/grad_norm" in r for r in rows)
    assert [r["step"] for r in rows if "val/loss" in r] == [4]

    # A resumed run goes on in the same W&B run (offline: a second folder with the same id). The folder is
    # named by the second W&B started in: a run of a real length never resumes within the same second.
    time.sleep(1.0)
    # A resumed run goes on in the same W&B run (offline: a second folder with the same id).
    train_here(dump, *SHORT[:1], "6", *SHORT[2:], "--metrics.enable_wandb", "--checkpoint.enable",
               "--checkpoint.interval", "4")
    runs = offline_runs(dump)
    assert len(runs) == 2 and all(r.name == f"run-{run_id}.wandb" for r in runs)
    settled_history(runs[1], {5, 6})

    # A fresh run into the folder (no checkpoint to resume) moves W&B's files aside with the other records,
    # and starts a W&B run of its own.
    train_here(dump, *SHORT, "--metrics.enable_wandb")
    [moved] = (dump / "earlier-runs").iterdir()
    assert (moved / "wandb" / "titanlike-run-id").read_text().strip() == run_id
    [fresh] = offline_runs(dump)
    assert fresh.name != f"run-{run_id}.wandb"


def test_only_the_writer_rank_opens_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), is_writer=False, tensorboard=False, device=torch.device("cpu"),
                      constants={}, wandb=("titanlike", ""))
    m.log(1, {"loss": 1.0})
    m.close()
    assert m.wandb is None and not (tmp_path / "wandb").exists()


def test_without_wandb_installed_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    args = ["--job.dump_folder", str(tmp_path / "run"), "--metrics.enable_wandb"]
    assert preflight.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: metrics.enable_wandb needs the wandb package")
    assert "pip install 'titanlike[wandb]'" in err
    # The trainer started without the launcher checks it too, before it builds anything.
    proc = train_here(tmp_path / "run", "--metrics.enable_wandb", check=False)
    assert proc.returncode == 2 and "pip install 'titanlike[wandb]'" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
