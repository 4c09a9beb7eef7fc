"""`run_train.sh` in bash mode (torchrun, 2 ranks): a scheduler's SIGTERM / SIGUSR1 saves and exits 0; a
worker's error ends in one line and its exit code."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from conftest import ROOT, _env
from test_lifeline import descendants


@pytest.mark.slow
@pytest.mark.parametrize("sig,to", [(signal.SIGUSR1, "launcher"),
                                    (signal.SIGHUP, "launcher"),  # a closed terminal or ssh
                                    (signal.SIGTERM, "every process")],  # SLURM, `pkill -f run_train.sh`
                         ids=["SIGUSR1", "SIGHUP", "SIGTERM to every process"])
def test_launcher_signal_saves_and_exits_zero(tmp_path, corpus, sig, to):
    """To every process: the launcher, torchrun, the ranks and their data-loader workers, which ignore it
    (their trainer's to act on) instead of dying of it under a rank that then could not save."""
    env = dict(_env(), NGPU="2")
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--training.device", "cpu",
           "--training.steps", "500", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
           "--checkpoint.enable", "--checkpoint.interval", "1000",
           "--data.path", corpus[0], "--data.val_path", corpus[1], "--data.num_workers", "2"]
    # SIGHUP at its default in the launcher, as a terminal or ssh starts it: under nohup (a CI job started
    # with it) the launcher inherits it ignored, and rightly ignores it, so the run trained on to the end.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "train step      3" in line:
            run = [proc.pid, *(descendants(proc.pid) if to == "every process" else ())]
            assert len(run) in (1, 8), run  # launcher, torchrun, 2 ranks, 2 loader workers each
            for pid in run:  # to the launcher alone, it forwards it to torchrun, which forwards it to the ranks
                os.kill(pid, sig)
            break
    lines += proc.stdout.readlines()
    rc = proc.wait(timeout=300)
    out = "".join(lines)
    assert rc == 0, out[-3000:]
    assert "preempted: stopped after step" in out
    saved = [d for d in os.listdir(tmp_path / "checkpoint") if d.startswith("step-") and not d.endswith(".tmp")]
    assert len(saved) == 1 and 3 <= int(saved[0].split("-")[1]) < 500
    assert out.rstrip().endswith("run the same command to resume")
    assert "Traceback" not in out and "killed by signal" not in out, out[-3000:]


@pytest.mark.slow
def test_launcher_worker_error_is_one_line_and_its_exit_code(tmp_path, corpus):
    """A mistake only the workers can see (here: the loss is NaN at step 2 with nothing to roll back
    to) ends in the worker's one `error:` line and torchrun's one-line summary, with no traceback,
    and the launcher exits 2 as a one-process run would."""
    env = dict(_env(), NGPU="2", TITANLIKE_NAN_BATCHES="2")
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--training.device", "cpu",
           "--training.steps", "6", "--training.local_batch_size", "2", "--training.nonfinite", "rollback",
           "--checkpoint.enable", "--checkpoint.interval", "4", "--validation.enable", "false",
           "--data.path", corpus[0]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    # Both ranks meet it; one says so. Then torchrun's summary, and nothing else after the log.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: loss became nan at step 2"), out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out
    error, summary = proc.stderr.rstrip().splitlines()[-2:]
    assert error == errors[0]
    assert re.fullmatch(r"torchrun: worker rank [01] on \S+ stopped with exit code 2 \(1 more stopped after it\); "
                        r"its output above says why", summary), summary
