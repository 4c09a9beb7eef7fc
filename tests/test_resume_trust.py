"""Checkpoints and resume you can trust: changed settings apply, nothing the user saved is deleted by
a resume, damage is found and routed around, no code runs from a file, one folder is one run's
history. One rank on the debug model, on CPU: in this process (train_here) where a function call
tests the same thing, as `python -m titanlike.train` where the process boundary is under test (a
second process, signals, ulimit). The two-rank paths are in test_checkpoint.py."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, _env, error_lines, metrics, run_python, train_here
from test_checkpoint import logged_steps, output, start, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BASE = ("--data.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--training.deterministic", "--validation.enable", "false")
K = ("--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2")


def args(dump: Path, corpus, *extra: str) -> list[str]:
    return ["-m", "titanlike.train", "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", str(dump), "--training.device", "cpu", "--data.path", corpus[0], *BASE, *extra]


def train(dump: Path, corpus, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """One rank in this process (train_here): what `python -m titanlike.train args(...)` does."""
    proc = train_here(dump, "--data.path", corpus[0], *BASE, *extra, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(dump)}


def steps_in(folder: Path) -> list[str]:
    names = [n for n in os.listdir(folder) if n.startswith("step-")]  # not the folder's lock file
    return sorted(names, key=lambda n: (int(n.split("-")[1].split(".")[0]), n))


@pytest.fixture(scope="module")
def ref(tmp_path_factory, corpus) -> Path:
    """Eight uninterrupted steps, a checkpoint every two."""
    dump = tmp_path_factory.mktemp("ref")
    train(dump, corpus, *K)
    assert sorted(losses(dump)) == list(range(1, 9))
    return dump


def only_steps(ref: Path, dump: Path, *steps: int) -> Path:
    for s in steps:
        shutil.copytree(ref / "checkpoint" / f"step-{s}", dump / "checkpoint" / f"step-{s}")
    return dump / "checkpoint"


# ---- 1. changed optimizer settings apply on resume ---------------------------------------------------


def test_resume_applies_the_configured_optimizer_and_schedule(ref, tmp_path, corpus):
    from titanlike.config import load_config
    from titanlike.optim import lr_factor

    only_steps(ref, tmp_path, 4)
    proc = train(tmp_path, corpus, *K, "--optimizer.lr", "1e-5", "--optimizer.weight_decay", "0.9",
                 "--optimizer.betas", "0.5,0.5", "--lr_scheduler.warmup_steps", "2")
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")])
    o, s = cfg.optimizer, cfg.lr_scheduler
    for line in (f"optimizer.lr: checkpoint {o.lr} → config 1e-05",
                 f"optimizer.weight_decay: checkpoint {o.weight_decay} → config 0.9",
                 f"optimizer.betas: checkpoint {list(o.betas)} → config [0.5, 0.5]",
                 f"lr_scheduler.warmup_steps: checkpoint {s.warmup_steps} → config 2"):
        assert line in proc.stderr
    lrs = {r["step"]: r["lr"] for r in metrics(tmp_path)}
    assert sorted(lrs) == [5, 6, 7, 8]
    for step, lr in lrs.items():  # the configured peak LR and schedule, at the step reached
        assert lr == pytest.approx(1e-5 * lr_factor(step, 8, 2, s.decay_ratio, s.decay_type, s.min_lr_factor))


def test_optimizer_state_load_keeps_the_configured_hyperparameters(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from titanlike.checkpoint.states import OptimizerState
    from titanlike.config.optimizer import Optimizer
    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import model_args
    from titanlike.optim import build_optimizer

    torch.manual_seed(0)
    model = Transformer(model_args("debug"))
    model.init_weights(seed=1, seq_len=16)
    saved = build_optimizer(model, Optimizer(lr=3e-3), "cpu")
    model(torch.randint(0, 200, (2, 16))).sum().backward()
    saved.step()
    model.zero_grad(set_to_none=True)  # as at a resume: before the first backward
    dcp.save({"optimizer": OptimizerState(model, saved).state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)

    resumed = build_optimizer(model, Optimizer(lr=1e-5, weight_decay=0.9, betas=[0.5, 0.5], eps=1e-6), "cpu")
    piece = OptimizerState(model, resumed)
    state = piece.state_dict()
    dcp.load({"optimizer": state}, checkpoint_id=str(tmp_path), no_dist=True)
    piece.load_state_dict(state)
    group = resumed.param_groups[0]
    assert (group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"]) == (1e-5, 0.9, (0.5, 0.5), 1e-6)
    for p in model.parameters():  # the moments are the checkpoint's
        assert torch.equal(resumed.state[p]["exp_avg"], saved.state[p]["exp_avg"])


# ---- 3. an older load_step sets the later checkpoints aside; pruning keeps what was written last -----


def test_load_step_sets_later_steps_aside_and_keeps_the_new_ones(ref, tmp_path, corpus):
    shutil.copytree(ref / "checkpoint", tmp_path / "checkpoint")
    proc = train(tmp_path, corpus, *K, "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k", "2")
    assert ("resumed from step 2: set aside the later checkpoints as step-4.abandoned, step-6.abandoned, "
            "step-8.abandoned") in proc.stderr
    assert steps_in(tmp_path / "checkpoint") == ["step-4.abandoned", "step-6", "step-6.abandoned", "step-8",
                                                 "step-8.abandoned"]
    assert f"checkpoint step 4: saved to {tmp_path}/checkpoint/step-4" in proc.stderr
    # A plain restart now resumes the new branch's newest step, never the abandoned one.
    again = train(tmp_path, corpus, "--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "2")
    assert f"resumed from {tmp_path}/checkpoint/step-8 at step 8" in again.stderr


# ---- 4. a damaged newest checkpoint: one line naming the file, fall back to the newest intact --------


def _zero_middle(step: Path) -> str:
    path = step / "__0_0.distcp"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(4096))
    return str(path)


def _empty(step: Path) -> str:
    (step / "__0_0.distcp").write_bytes(b"")
    return str(step / "__0_0.distcp")


def _no_metadata(step: Path) -> str:
    (step / ".metadata").unlink()
    return str(step / ".metadata")


def _garbage_metadata(step: Path) -> str:
    (step / ".metadata").write_bytes(b"\x80\x04garbage" * 10)
    return str(step / ".metadata")


@pytest.mark.parametrize("damage", [_zero_middle, _empty, _no_metadata, _garbage_metadata],
                         ids=["zeroed-bytes", "emptied-shard", "missing-metadata", "garbage-metadata"])
def test_damaged_newest_step_falls_back_to_the_newest_intact(ref, tmp_path, corpus, damage):
    folder = only_steps(ref, tmp_path, 4, 6)
    named = damage(folder / "step-6")
    proc = train(tmp_path, corpus, *K)
    warnings = [ln for ln in proc.stderr.splitlines() if "checkpoint damaged:" in ln]
    assert len(warnings) == 1 and named in warnings[0], proc.stderr[-3000:]
    assert "falling back to the newest intact checkpoint before step 6" in proc.stderr
    assert f"resumed from {folder}/step-4 at step 4" in proc.stderr
    assert "Traceback" not in proc.stderr
    full = losses(ref)
    assert losses(tmp_path) == {s: full[s] for s in range(5, 9)}  # bit for bit from the intact step
    assert "step-6.damaged" in os.listdir(folder)  # kept for a look, never loaded again


def test_no_intact_checkpoint_stops_with_exit_2(ref, tmp_path, corpus):
    folder = only_steps(ref, tmp_path, 4, 6)
    _zero_middle(folder / "step-4")
    _empty(folder / "step-6")
    proc = train(tmp_path, corpus, *K, check=False)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        f"error: no intact checkpoint in {folder}: steps 6, 4 are damaged (set aside as step-N.damaged); to start "
        f"afresh, move them out of the folder or use another --checkpoint.folder"]
    assert "train step" not in proc.stderr
    # A requeue of the same command keeps refusing: it never starts over at step 1 on its own.
    again = train(tmp_path, corpus, *K, check=False)
    assert again.returncode == 2 and "train step" not in again.stderr
    assert error_lines(again.stderr) == [
        f"error: every checkpoint in {folder} is damaged (step-4.damaged, step-6.damaged): nothing to resume from; "
        f"to start afresh, move them out of the folder or use another --checkpoint.folder"]



@pytest.mark.parametrize("failure", ["mismatch", "out-of-memory"])
def test_a_step_that_matches_its_checksums_but_does_not_load_is_kept_as_it_is(ref, tmp_path, corpus, monkeypatch,
                                                                               failure):
    """Every byte of step-6 is as saved, but loading it fails (a setting no check covers, memory): that
    is not damage, so nothing is renamed and the run does not fall back to step 4 (which would bury the
    newest save and train from an older one)."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = only_steps(ref, tmp_path, 4, 6)
    cause = "Size mismatch between saved torch.Size([320, 256]) and current torch.Size([384, 256])"

    def load(*args, **kwargs):
        if failure == "mismatch":
            raise RuntimeError(cause)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(dcp, "load", load)
    proc = train(tmp_path, corpus, *K, check=False)
    assert proc.returncode != 0 and "train step" not in proc.stderr
    assert steps_in(folder) == ["step-4", "step-6"]  # neither set aside as damaged nor abandoned
    assert "checkpoint damaged" not in proc.stderr and "falling back" not in proc.stderr
    if failure == "mismatch":
        assert proc.returncode == 2
        assert error_lines(proc.stderr) == [
            f"error: {folder}/step-6 matches its checksums but does not load into this run (RuntimeError: {cause}); "
            f"nothing was renamed or changed: resume with the settings it was saved with, start from its weights "
            f"alone with --checkpoint.initial_load_path {folder}/step-6 in a new --job.dump_folder, or move it out "
            f"of the folder to resume from the step before it"]
        assert "Traceback" not in proc.stderr
    else:
        lines = error_lines(proc.stderr)  # reported as what it is, the trainer's one line on memory
        assert len(lines) == 1 and lines[0].startswith("error: out of GPU memory on rank 0"), lines



def test_a_sharded_load_failure_is_read_from_the_rank_that_raised_it():
    """Under DCP every rank's exception comes wrapped in one CheckpointException ({rank: (exception,
    traceback)}): the line names the rank's own error, and an out-of-memory inside stays one."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from titanlike.checkpoint.folder import unloadable

    mismatch = CheckpointException("CheckpointException ranks:dict_keys([1])",
                                   {1: (RuntimeError("Size mismatch for model.output.weight\nmore"), None)})
    line = unloadable("/c/step-6", mismatch)
    assert line is not None and line.startswith(
        "/c/step-6 matches its checksums but does not load into this run (RuntimeError: Size mismatch for "
        "model.output.weight); nothing was renamed or changed")
    oom = CheckpointException("x", {0: (torch.cuda.OutOfMemoryError("CUDA out of memory"), None)})
    assert unloadable("/c/step-6", oom) is None


def test_a_background_save_checksums_its_files_off_the_training_thread(ref, tmp_path, corpus, monkeypatch):
    """Reading a saved step back for its checksums is a fifth to a third of a save: for a background
    save it runs in the writer's own thread once the files are written, so the training thread only
    gathers the results. The last save (in the foreground) checksums where it runs. The steps resume
    bit for bit."""
    import threading

    from titanlike.checkpoint import writer

    threads: list[tuple[str, str]] = []
    real = writer.describe_files

    def describe(folder, names):
        threads.append((os.path.basename(folder), threading.current_thread().name))
        return real(folder, names)

    monkeypatch.setattr(writer, "describe_files", describe)
    train(tmp_path, corpus, *K, "--checkpoint.async_mode", "async")
    assert [folder for folder, _ in threads] == ["step-2.tmp", "step-4.tmp", "step-6.tmp", "step-8.tmp"]
    assert all(name.startswith("titanlike-checksum") for _, name in threads[:3]), threads
    assert threads[3][1] == threading.main_thread().name  # the last save waits for nothing else
    assert steps_in(tmp_path / "checkpoint") == ["step-2", "step-4", "step-6", "step-8"]
    resumed = tmp_path / "resumed"
    only_steps(tmp_path, resumed, 4)
    train(resumed, corpus, *K)
    full = losses(ref)
    assert losses(resumed) == {s: full[s] for s in range(5, 9)}


# ---- 2. no code from a file ---------------------------------------------------------------------------


def test_trainer_state_is_json_and_tensors(ref):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step = ref / "checkpoint" / "step-8"
    meta = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    pickled = [k for k, v in meta.items() if not isinstance(v, TensorStorageMetadata)]
    assert pickled == []  # DCP stores anything but a tensor as a pickle
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["states"]["train_state"]["step"] == 8
    assert set(json.loads((step / "rng-rank0.json").read_text())) >= {"python", "numpy", "torch"}


class _Payload:
    """Unpickling this makes a folder: the stand-in for any command a crafted pickle could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.slow
def test_a_pickle_from_elsewhere_runs_nothing(ref, tmp_path, corpus):
    import pickle

    evil = tmp_path / "downloaded" / "step-8"
    shutil.copytree(ref / "checkpoint" / "step-8", evil)
    marker = tmp_path / "code-ran"
    (evil / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))

    # A copy of one of our steps with its .metadata swapped: the signed manifest no longer matches.
    proc = train(tmp_path / "run", corpus, "--training.steps", "1", "--checkpoint.initial_load_path", str(evil),
                 check=False)
    assert proc.returncode == 2 and not marker.exists()
    assert error_lines(proc.stderr) == [f"error: {evil}/.metadata is not the one its manifest was signed with; "
                                        f"it cannot be loaded"]
    # Without a manifest signed on this account (a folder from elsewhere): the trust flag is the way.
    (evil / "manifest.json").unlink()
    proc = train(tmp_path / "run", corpus, "--training.steps", "1", "--checkpoint.initial_load_path", str(evil),
                 check=False)
    assert proc.returncode == 2 and not marker.exists()
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {evil} is a DCP checkpoint that titanlike did not write on this account")
    assert "--checkpoint.trust_pickled_dcp" in line

    exported = run_python("-m", "titanlike.hf.export", str(evil), str(tmp_path / "hf"))
    assert exported.returncode == 2 and not marker.exists()
    assert "--trust-pickled-dcp" in error_lines(exported.stderr)[0]

    # The run's own checkpoint (its manifest signed on this account) loads without the flag.
    own = train(tmp_path / "own", corpus, "--training.steps", "1", "--checkpoint.initial_load_path",
                str(ref / "checkpoint" / "step-8"))
    assert "initial weights loaded from" in own.stderr
    assert losses(tmp_path / "own")[1] < losses(ref)[1] - 0.5  # trained weights, not a fresh init


# ---- 5. preempted without checkpoint.enable: the same command resumes ----------------------------------


@pytest.mark.slow
def test_preempted_run_without_checkpoint_enable_resumes_with_the_same_command(ref, tmp_path, corpus):
    same = args(tmp_path, corpus, "--training.steps", "8")
    logs = tmp_path / "preempted"
    proc = start([sys.executable, *same], logs)
    try:
        wait_for(lambda: logged_steps(tmp_path) >= 2, "step 2", proc, logs)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = max(losses(tmp_path))
    assert f"preempted: stopped after step {stopped}" in output(logs)

    again = run_python(*same[0:], timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {tmp_path}/checkpoint/step-{stopped} at step {stopped}" in again.stderr
    full, now = losses(ref), losses(tmp_path)
    assert sorted(now) == list(range(1, 9))  # one history, the interrupted attempt's later steps dropped
    assert {s: now[s] for s in range(stopped + 1, 9)} == {s: full[s] for s in range(stopped + 1, 9)}
    # Done: the preemption save is gone, so a third run of the same command does not resume from it.
    assert f"removed the preemption save {tmp_path}/checkpoint/step-{stopped}: this run got past it" in again.stderr
    assert [n for n in os.listdir(tmp_path / "checkpoint") if not n.startswith(".")] == []  # the lock file stays


# ---- 6. another number of loader workers on resume ---------------------------------------------------


def test_resume_with_another_number_of_workers_is_exact(ref, tmp_path, corpus):
    only_steps(ref, tmp_path, 4)
    proc = train(tmp_path, corpus, *K, "--data.num_workers", "2")
    assert "data position and RNG restored" in proc.stderr
    full = losses(ref)
    assert losses(tmp_path) == {s: full[s] for s in range(5, 9)}


# ---- 7/8. unwritable folders before step 1; a failed save names its cause ------------------------------


def test_unwritable_folders_are_found_before_step_1(tmp_path, corpus):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad_dump = train(blocker / "run", corpus, "--training.steps", "2", check=False)
    assert bad_dump.returncode == 2
    assert error_lines(bad_dump.stderr) == [
        f"error: job.dump_folder {blocker}/run is not writable ({blocker}/run: Not a directory); "
        f"set --job.dump_folder to a writable path"]
    bad_ckpt = train(tmp_path / "run", corpus, *K, "--checkpoint.folder", str(blocker / "ckpt"), check=False)
    assert bad_ckpt.returncode == 2
    assert error_lines(bad_ckpt.stderr) == [
        f"error: checkpoint folder {blocker}/ckpt is not writable ({blocker}/ckpt: Not a directory); "
        f"set --checkpoint.folder to a writable path"]
    assert "train step" not in bad_ckpt.stderr


@pytest.mark.slow
def test_a_save_over_the_file_size_limit_says_so_in_one_line(tmp_path, corpus):
    limit = 20 * 2**20  # a checkpoint file of the debug model is 40 MB

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, *args(tmp_path, corpus, *K)], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=600, preexec_fn=small_files)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert line == (f"error: saving the checkpoint of step 2 to {tmp_path}/checkpoint failed: File too large: "
                    f"{tmp_path}/checkpoint: this process may write files of at most 20 MB (ulimit -f); raise the "
                    f"limit; no earlier checkpoint exists")
    assert not (tmp_path / "checkpoint" / "step-2.tmp").exists()


# ---- 9. one run per dump folder ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_into_a_folder_in_use_refuses_and_a_dead_runs_folder_is_taken_over(tmp_path, corpus):
    first_args = args(tmp_path, corpus, "--training.steps", "500")
    logs = tmp_path.parent / f"{tmp_path.name}-first"
    first = start([sys.executable, *first_args], logs)
    try:
        wait_for(lambda: logged_steps(tmp_path) >= 1, "step 1", first, logs)
        second = train(tmp_path, corpus, "--training.steps", "2", check=False)
        assert second.returncode == 2
        (line,) = error_lines(second.stderr)
        assert line.startswith(f"error: job.dump_folder {tmp_path} is in use by another run "
                               f"(pid {first.pid} on {socket.gethostname()}, started ")
        assert "use another --job.dump_folder" in line
    finally:
        first.kill()
        first.wait()
    third = train(tmp_path, corpus, "--training.steps", "2")
    assert f"took over {tmp_path} from a run that ended without releasing it (pid {first.pid} on" in third.stderr
    assert sorted(losses(tmp_path)) == [1, 2]  # a fresh run: the dead run's records were moved aside


# ---- 15.4 / 12. one folder, one run's history ---------------------------------------------------------------


def test_a_fresh_run_moves_another_runs_records_aside(ref, tmp_path, corpus):
    for name in ("metrics.jsonl", "config.toml", "tb"):
        src = ref / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    proc = train(tmp_path, corpus, "--training.steps", "2")
    moved = [ln for ln in proc.stderr.splitlines() if "held another run's records: moved" in ln]
    assert len(moved) == 1 and "metrics.jsonl, tb, config.toml" in moved[0]
    (earlier,) = (tmp_path / "earlier-runs").iterdir()
    assert sorted(losses(earlier)) == list(range(1, 9))
    assert sorted(losses(tmp_path)) == [1, 2]
    assert len(os.listdir(tmp_path / "tb")) == 1


def test_a_resumed_run_drops_the_interrupted_attempts_records(ref, tmp_path, corpus):
    shutil.copytree(ref, tmp_path / "run")
    dump = tmp_path / "run"
    proc = train(dump, corpus, *K, "--checkpoint.load_step", "4")
    assert ("metrics.jsonl: 4 records after step 4 (the interrupted attempt's) moved to metrics.dropped.jsonl"
            in proc.stderr)
    steps = [r["step"] for r in metrics(dump)]
    assert steps == list(range(1, 9))  # each step once, in order
    assert [json.loads(ln)["step"] for ln in (dump / "metrics.dropped.jsonl").read_text().splitlines()] == [5, 6, 7, 8]


@pytest.mark.slow
def test_keep_latest_k_makes_room_before_a_save(tmp_path, corpus):
    """With keep_latest_k = 2 a full disk needs room for two checkpoints, not three: the oldest goes
    before the new one is written (and, with k = 1, only after: never fewer than one complete)."""
    seen = tmp_path / "seen.jsonl"
    hooked = tmp_path / "listing_train.py"
    hooked.write_text(
        "import json, os, sys\n"
        "import torch.distributed.checkpoint.filesystem as fs\n"
        "real = fs._FileSystemWriter.write_data\n"
        "def listing(self, plan, planner):\n"
        "    folder = os.path.dirname(str(self.path))\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps(sorted(n for n in os.listdir(folder) if n.startswith('step-'))) + '\\n')\n"
        "    return real(self, plan, planner)\n"
        "fs._FileSystemWriter.write_data = listing\n"
        "from titanlike.train import main\n"
        "sys.exit(main())\n")
    for k, want in (("2", [["step-2.tmp"], ["step-2", "step-4.tmp"], ["step-4", "step-6.tmp"]]),
                    ("1", [["step-2.tmp"], ["step-2", "step-4.tmp"], ["step-4", "step-6.tmp"]])):
        seen.unlink(missing_ok=True)
        dump = tmp_path / f"k{k}"
        run = args(dump, corpus, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
                   "--checkpoint.keep_latest_k", k)[2:]  # without "-m titanlike.train": the hooked script
        proc = subprocess.run([sys.executable, str(hooked), *run], env=_env(), cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        listings = [json.loads(ln) for ln in seen.read_text().splitlines()]
        assert listings == want, (k, listings)
        steps = sorted(n for n in os.listdir(dump / "checkpoint") if n.startswith("step-"))
        assert steps == (["step-6"] if k == "1" else ["step-4", "step-6"])


# ---- a checkpoint of another run of one's own ----------------------------------------------------------------


def test_another_runs_checkpoint_is_resumed_only_when_load_step_names_it(ref, tmp_path, corpus):
    """A step copied in from another run (same user, same key: it passes the signature) is not silently
    taken for this run's: the resume stops with one line naming both runs and leaves everything as it
    was; `--checkpoint.load_step` naming it branches from it as a new run, exactly, whose records start
    afresh; a dump folder that holds no run yet simply continues the checkpoint's run."""
    ref_run = (ref / "run-id").read_text().strip()
    dump = tmp_path / "other"
    train(dump, corpus, *BASE, "--training.steps", "2", "--checkpoint.enable")  # a run of its own, saved at 2
    own_run = (dump / "run-id").read_text().strip()
    assert own_run != ref_run and json.loads((dump / "checkpoint" / "step-2" / "trainer_state.json").read_text()
                                             )["run"]["run_id"] == own_run
    only_steps(ref, dump, 6)
    before = {p: p.read_bytes() for p in dump.rglob("*") if p.is_file() and p.name != ".lock"}

    proc = train(dump, corpus, *K, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert (f"{dump}/checkpoint/step-6 was saved by run {ref_run} (dump folder {ref}), not by this dump folder's "
            f"run {own_run} ({dump})" in line and "--checkpoint.load_step 6" in line), line
    assert "resumed from /" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 4, proc.stderr
    assert {p: p.read_bytes() for p in dump.rglob("*") if p.is_file() and p.name != ".lock"} == before

    proc = train(dump, corpus, *K, "--checkpoint.load_step", "6")
    assert "branching from it (checkpoint.load_step = 6)" in proc.stderr
    branch = (dump / "run-id").read_text().strip()
    assert branch not in (ref_run, own_run)
    assert losses(dump) == {s: v for s, v in losses(ref).items() if s > 6}  # its records only, exact
    (earlier,) = (dump / "earlier-runs").iterdir()
    assert sorted(losses(earlier)) == [1, 2] and (earlier / "run-id").read_text().strip() == own_run
    saved = json.loads((dump / "checkpoint" / "step-8" / "trainer_state.json").read_text())["run"]
    assert (saved["run_id"], saved["dump_folder"]) == (branch, str(dump))

    fresh = tmp_path / "fresh"  # no run here yet: the checkpoint's run goes on in this folder
    only_steps(ref, fresh, 6)
    train(fresh, corpus, *K)
    assert (fresh / "run-id").read_text().strip() == ref_run and sorted(losses(fresh)) == [7, 8]
