"""End to end: `./run_train.sh` on the debug model, on CPU, as a user starts it."""

from __future__ import annotations

import math
import subprocess
import tomllib
from pathlib import Path

import pytest

from conftest import CACHE, ROOT, _env, metrics
from titanlike.model.shape import PRESETS, flops_per_token
from titanlike.optim import lr_factor

STEPS, LOCAL, SEQ, LR, WARMUP, DECAY = 30, 8, 64, 3e-3, 5, 0.3


def launch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`./run_train.sh <args>` in bash mode: NGPU=1, CONFIG_FILE unset (the debug model's TOML)."""
    env = _env()
    env.pop("CONFIG_FILE", None)
    env["NGPU"] = "1"
    return subprocess.run([str(ROOT / "run_train.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("e2e")
    proc = launch("--job.dump_folder", str(dump), "--training.device", "cpu", "--training.steps", str(STEPS),
                  "--training.local_batch_size", str(LOCAL), "--data.seq_len", str(SEQ),
                  "--optimizer.lr", str(LR), "--lr_scheduler.warmup_steps", str(WARMUP),
                  "--lr_scheduler.decay_ratio", str(DECAY), "--metrics.log_freq", "5",
                  "--validation.freq", "15", "--validation.steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dump, proc


def test_loss_falls(run):
    dump, _ = run
    records = metrics(dump)
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30]
    first, last = records[0]["loss"], records[-1]["loss"]
    # Untrained, the loss is about ln(vocab); 30 steps of bytes of Python source bring it well down.
    assert abs(first - math.log(PRESETS["debug"].vocab_size)) < 0.5
    assert last < first - 1.5, [r["loss"] for r in records]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)


def test_metrics_records(run):
    dump, _ = run
    records = metrics(dump)
    assert "first_step_s" in records[0] and records[0]["first_step_s"] > 0
    fpt = flops_per_token(PRESETS["debug"], SEQ)
    for r in records[1:]:
        for key in ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "tokens_seen", "data_share",
                    "float8_matmul_share"):
            assert key in r, (key, r)
        assert r["tps"] > 0 and 0 <= r["data_share"] < 1
        assert r["tflops"] == pytest.approx(r["tps"] * fpt / 1e12, rel=1e-9)
        assert r["mfu"] is None  # no bf16 peak on a CPU: n/a, never a guess
        assert r["tokens_seen"] == r["step"] * LOCAL * SEQ
        assert r["float8_matmul_share"] == 0.0
    for r in records:
        assert r["lr"] == pytest.approx(LR * lr_factor(r["step"], STEPS, WARMUP, DECAY, "linear", 0.0))
    assert records[-1]["lr"] == 0.0  # linear decay to min_lr_factor 0 at the last step


def test_validation_records(run):
    dump, _ = run
    val = metrics(dump, "val")
    assert [r["step"] for r in val] == [15, 30]
    for r in val:
        assert math.isfinite(r["loss"]) and r["ppl"] == pytest.approx(math.exp(r["loss"]))
    assert val[1]["loss"] < val[0]["loss"]


def test_tensorboard_scalars_read_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump, _ = run
    events = list((dump / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tps", "train/tflops", "val/loss", "val/ppl"} <= tags
    for kind, key in (("train", "loss"), ("train", "lr"), ("train", "grad_norm"), ("val", "loss")):
        from_tb = {e.step: e.value for e in acc.Scalars(f"{kind}/{key}")}
        from_jsonl = {r["step"]: r[key] for r in metrics(dump, kind)}
        assert from_tb.keys() == from_jsonl.keys()
        for step, value in from_jsonl.items():
            assert from_tb[step] == pytest.approx(value, rel=1e-6, abs=1e-12), (kind, key, step)


def test_config_toml_written(run):
    dump, _ = run
    cfg = tomllib.loads((dump / "config.toml").read_text())
    assert cfg["training"]["steps"] == STEPS and cfg["data"]["seq_len"] == SEQ
    assert cfg["job"]["dump_folder"] == str(dump)
    assert cfg["job"]["config_file"].endswith("train_configs/debug_model.toml")
    assert cfg["optimizer"]["lr"] == LR
    # The embedded corpus comes from the per-machine cache (the test run's, conftest), not the run folder.
    assert not (dump / "corpus").exists() and list(Path(CACHE).glob("stdlib-*-train.bin"))


def test_console_log(run):
    _, proc = run
    out = proc.stdout + proc.stderr
    assert "model debug:" in out and f"train step {STEPS:>6}/{STEPS}" in out and "done: 30 steps in " in out
    assert "error" not in proc.stderr.lower()
    # Not a terminal: plain log lines, no progress line drawn with carriage returns or escapes; each
    # line after the first carries the ETA (but the last); a CPU has no TFLOPS or MFU column.
    assert "\r" not in out and "\x1b" not in out
    train = [line for line in out.splitlines() if " train step " in line]
    assert len(train) == 7 and all(" | ETA " in line for line in train[1:-1]), train
    assert "ETA" not in train[-1] and "TFLOPS" not in out and "MFU" not in out


def test_non_finite_loss_stops_the_run(tmp_path):
    # lr 1e30: the first update throws the weights to ~1e29, the forward overflows within two steps.
    proc = launch("--job.dump_folder", str(tmp_path), "--training.device", "cpu", "--training.steps", "10",
                  "--training.local_batch_size", "2", "--data.seq_len", "32", "--optimizer.lr", "1e30",
                  "--metrics.log_freq", "5", "--validation.enable", "false")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0] == lines[-1]
    import re

    # A step whose gradient norm is already non-finite is caught before its update is trusted.
    m = re.match(r"error: (?:loss|gradient norm) became (nan|inf|-inf) at step (\d+); lower --optimizer.lr", errors[0])
    assert m, errors[0]
    step = int(m.group(2))
    # Losses are checked at log points (1, 5, ...), but the message names the step that diverged.
    assert 1 < step < 5
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1] and math.isfinite(records[0]["loss"])
    assert "done:" not in proc.stderr + proc.stdout


def test_the_run_folder_holds_the_runs_log(run, tmp_path, corpus):
    """train.log: what the run said on rank 0, from its first line (held until the folder's records were
    settled) to its last; a resume appends to it; a fresh run moves it away with the earlier run's records."""
    from conftest import train_here

    dump, proc = run
    log = (dump / "train.log").read_text()
    assert "run folder" in log.splitlines()[0] and "overrides of torch/torchao internals" in log
    assert log.rstrip().splitlines()[-1].split(" ", 2)[2].startswith("done: ")
    quick = ("--training.steps", "2", "--training.local_batch_size", "2", "--data.seq_len", "32",
             "--validation.enable", "false", "--checkpoint.enable")
    train_here(tmp_path, *quick, corpus=corpus)
    first = (tmp_path / "train.log").read_text()
    train_here(tmp_path, *quick[:-1], "--training.steps", "3", "--checkpoint.enable", corpus=corpus)  # resumes
    resumed = (tmp_path / "train.log").read_text()
    assert resumed.startswith(first) and "resumed from" in resumed[len(first):]
    train_here(tmp_path, *quick[:-1], "--training.steps", "2", corpus=corpus)  # afresh: no checkpoint read
    (earlier,) = (tmp_path / "earlier-runs").iterdir()
    assert (earlier / "train.log").read_text() == resumed
    assert "resumed from" not in (tmp_path / "train.log").read_text()
