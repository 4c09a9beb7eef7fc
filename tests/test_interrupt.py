"""Ctrl-C: the run finishes the step in flight, saves a checkpoint, says so in one line and exits 130;
a second Ctrl-C stops it at once. The signal goes to the launcher's whole process group, as a
terminal sends it (data-loader workers included); so does a SIGTERM, as `timeout` sends it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, _env, metrics

NOTICE = "Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again stops at once)"


def start(dump: Path, corpus, *overrides: str, ngpu: int = 1, device: str = "cpu",
          ignoring: bool = False) -> tuple[subprocess.Popen, Path]:
    """`./run_train.sh` in a process group of its own (a terminal's foreground job); output to a file.
    `ignoring`: started with Ctrl-C ignored, as a script's `./run_train.sh … &` starts it."""
    log = dump.parent / f"{dump.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command(dump, corpus, *overrides, device=device), env=dict(_env(), NGPU=str(ngpu)),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=background_signals if ignoring else terminal_signals)
    return proc, log


def command(dump: Path, corpus, *overrides: str, device: str = "cpu") -> list[str]:
    return [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), "--training.device", device,
            "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--data.path", corpus[0], "--data.num_workers", "1", *overrides]


def terminal_signals() -> None:
    """Ctrl-C and Ctrl-\\ at their default actions, as in a terminal's job. When the test suite itself
    runs in the background of a non-interactive shell (`pytest &`), it inherits them ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def background_signals() -> None:
    """Ctrl-C and Ctrl-\\ ignored, as a non-interactive shell starts `cmd &`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def wait_for(text: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {text!r}:\n{log.read_text()[-4000:]}")
        assert time.monotonic() < deadline, f"no {text!r} yet:\n{log.read_text()[-4000:]}"
        time.sleep(0.02)


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the foreground process group


def complete_checkpoints(dump: Path) -> list[int]:
    folder = dump / "checkpoint"
    names = os.listdir(folder) if folder.exists() else []
    return sorted(int(n.split("-")[1]) for n in names if n.startswith("step-") and not n.endswith(".tmp"))


def check_interrupted(dump: Path, proc: subprocess.Popen, log: Path) -> int:
    """Exit 130, one line, no traceback, and a checkpoint of the last finished step; returns that step."""
    rc = proc.wait(timeout=300)
    out = log.read_text()
    assert rc == 130, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert out.count(NOTICE) == 1
    stopped = [line for line in out.splitlines() if "interrupted: stopped after step" in line]
    assert len(stopped) == 1, out[-4000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    # No --checkpoint.enable was given: saved anyway, and the same command resumes from it.
    assert stopped[0].endswith(f"checkpoint at {dump / 'checkpoint' / f'step-{step}'}; run the same command "
                               f"to resume"), stopped[0]
    assert stopped[0] == out.rstrip().splitlines()[-1]  # the last word
    assert complete_checkpoints(dump) == [step]
    # The step in flight was finished: its record was written, and nothing after it.
    assert metrics(dump)[-1]["step"] == step and step >= 3
    return step


def test_ctrl_c_finishes_the_step_saves_and_exits_130(tmp_path, corpus):
    dump = tmp_path / "run"
    proc, log = start(dump, corpus, "--training.steps", "500")
    wait_for("train step      3/500", proc, log)
    ctrl_c(proc)
    step = check_interrupted(dump, proc, log)

    # The same command with --checkpoint.enable resumes there; the summary counts what this run trained.
    proc, log = start(dump, corpus, "--training.steps", str(step + 2), "--checkpoint.enable")
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    out = log.read_text()
    assert f"resumed from {dump / 'checkpoint' / f'step-{step}'} at step {step}" in out
    assert f"done: steps {step + 1}-{step + 2} (2 steps, resumed at step {step}) in " in out, out[-2000:]


def test_sigterm_to_the_process_group_saves_with_loader_workers(tmp_path, corpus):
    """SIGTERM to the run's whole process group (what `timeout`, `kill -TERM -- -PGID` and a scheduler
    do), data-loader workers included: they ignore it and serve the step being finished; the run saves,
    says so in its last line and exits 0, with no worker death and no traceback."""
    dump = tmp_path / "run"
    proc, log = start(dump, corpus, "--training.steps", "500", "--data.num_workers", "2", "--checkpoint.enable",
                      "--checkpoint.interval", "1000")
    wait_for("train step      3/500", proc, log)
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=300)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out and "killed by signal" not in out, out[-4000:]
    last = out.rstrip().splitlines()[-1]
    step = int(last.split("preempted: stopped after step ")[1].split(";")[0])
    assert last.endswith(f"preempted: stopped after step {step}; checkpoint at {dump / 'checkpoint' / f'step-{step}'}"
                         f"; run the same command to resume"), last
    assert complete_checkpoints(dump) == [step] and step >= 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_preemption_while_the_run_builds_is_one_line(tmp_path, corpus, monkeypatch, sig):
    """SIGTERM (a scheduler's preemption, `timeout`) before the training loop ended the run by the signal's default
    action: exit 143, not a word. Now one line says nothing was saved, with the same exit code. In this process:
    the signal comes from the build itself (the trainer stands in), once the run has taken it over."""
    from conftest import train_here

    def build(cfg):
        # Before: the default action, which would end this test process too.
        assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN), "the build is deaf to a preemption"
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler runs before this ends
        raise AssertionError("the signal did not stop the build")

    monkeypatch.setattr("titanlike.train.Trainer", build)
    previous = signal.signal(sig, signal.SIG_DFL)  # as a run starts (a test runner may have its own)
    try:
        proc = train_here(tmp_path / "run", "--training.steps", "2", corpus=corpus, check=False)
    finally:
        signal.signal(sig, previous)
    assert proc.returncode == 128 + sig, proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"preempted before training started ({signal.Signals(sig).name}): nothing saved; run the same command to "
        f"start again"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ctrl_c_stops_a_run_started_with_it_ignored_even_while_it_builds(tmp_path, corpus):
    """A script's `./run_train.sh … &` starts the run with SIGINT ignored, which Python keeps: a Ctrl-C
    (or `kill -INT`) while the run was built was lost. Now it stops there, as in a terminal."""
    dump = tmp_path / "run"
    proc, log = start(dump, corpus, "--training.steps", "20", ignoring=True)
    wait_for("run folder", proc, log)  # the build has begun; the model, data and optimizer are to come
    ctrl_c(proc)
    rc = proc.wait(timeout=300)
    out = log.read_text()
    assert rc == 130, out[-4000:]
    assert out.rstrip().splitlines()[-1] == "interrupted before training started: nothing saved", out[-4000:]
    assert "Traceback" not in out and complete_checkpoints(dump) == []


@pytest.mark.slow
def test_ctrl_c_with_the_output_into_a_closed_pipe_still_saves(tmp_path, corpus):
    """Ctrl-C on `run_train.sh … 2>&1 | tee log`: the terminal's signal ends tee at once, and the run's
    next line went into a pipe with no reader; the run ended (exit 1) before its save. Now the console
    goes quiet, the run saves, and its train.log says so."""
    dump = tmp_path / "run"
    proc = subprocess.Popen(command(dump, corpus, "--training.steps", "500", "--data.num_workers", "0"),
                            env=dict(_env(), NGPU="1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=terminal_signals)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "train step      3/500" in line:
            break
    proc.stdout.close()  # tee, ended by the Ctrl-C before the run has finished its step
    time.sleep(0.2)  # the signal comes mid-step, not while the run writes the line just read
    ctrl_c(proc)
    assert proc.wait(timeout=300) == 130
    log = (dump / "train.log").read_text().rstrip().splitlines()
    step = int(log[-1].split("interrupted: stopped after step ")[1].split(";")[0])
    saved = dump / "checkpoint" / f"step-{step}"
    assert log[-1].endswith(f"interrupted: stopped after step {step}; checkpoint at {saved}; run the same command "
                            f"to resume"), log[-3:]
    assert sum("the console is gone (stderr: Broken pipe): the run goes on, its log in train.log only" in line
               for line in log) == 1
    assert complete_checkpoints(dump) == [step] and step >= 3


def ctrl_c_twice(dump: Path, corpus, ngpu: int = 1) -> tuple[int, str]:
    """Ctrl-C once the run trains, again once it has said it will finish the step: (exit code, log)."""
    proc, log = start(dump, corpus, "--training.steps", "500", ngpu=ngpu)
    wait_for("train step      2/500", proc, log)
    ctrl_c(proc)
    wait_for(NOTICE, proc, log)
    ctrl_c(proc)
    rc = proc.wait(timeout=300)
    return rc, log.read_text()


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once(tmp_path, corpus):
    dump = tmp_path / "run"
    rc, out = ctrl_c_twice(dump, corpus)
    # Killed by the signal itself (a shell shows 130), before the step could finish or a save begin.
    assert rc == -signal.SIGINT, out[-4000:]
    assert "interrupted: stopped after" not in out and ": saved to " not in out
    assert complete_checkpoints(dump) == []


@pytest.mark.slow
def test_ctrl_c_through_the_launcher_with_two_ranks(tmp_path, corpus):
    """NGPU=2: the launcher passes Ctrl-C to torchrun, which passes it to the workers; both ranks stop
    after the same step, save it, and the launcher exits 130 with the workers' one line last."""
    dump = tmp_path / "run"
    proc, log = start(dump, corpus, "--training.steps", "500", ngpu=2)
    wait_for("train step      3/500", proc, log)
    ctrl_c(proc)
    step = check_interrupted(dump, proc, log)
    saved = json.loads((dump / "checkpoint" / f"step-{step}" / "model_args.json").read_text())
    assert saved  # a complete checkpoint, written by both ranks (DCP's metadata is in place)
    assert (dump / "checkpoint" / f"step-{step}" / ".metadata").exists()
    assert "death signal" not in log.read_text()  # torchrun's own notice is not repeated


@pytest.mark.slow
def test_ctrl_c_through_a_launcher_started_with_it_ignored(tmp_path, corpus):
    """NGPU=2 started as a script's `… &` (SIGINT ignored, which bash can never trap): the launcher starts
    itself again with it at its default, so a Ctrl-C stops the run with a save, as from a terminal
    (the run trained on to its end and exited 0)."""
    dump = tmp_path / "run"
    proc, log = start(dump, corpus, "--training.steps", "500", ngpu=2, ignoring=True)
    wait_for("train step      3/500", proc, log)
    ctrl_c(proc)
    check_interrupted(dump, proc, log)


@pytest.mark.slow
def test_second_ctrl_c_through_the_launcher_stops_the_workers_at_once(tmp_path, corpus):
    dump = tmp_path / "run"
    rc, out = ctrl_c_twice(dump, corpus, ngpu=2)
    assert rc == 130, out[-4000:]
    assert "Traceback" not in out and "interrupted: stopped after" not in out and ": saved to " not in out
    assert complete_checkpoints(dump) == []
