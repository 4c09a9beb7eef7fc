"""A scheduler's SIGTERM / SIGUSR1 to `run_train.sh` (bash mode, torchrun, 2 ranks): save, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from conftest import ROOT, _env


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1])
def test_launcher_signal_saves_and_exits_zero(tmp_path, corpus, sig):
    env = dict(_env(), NGPU="2")
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--training.device", "cpu",
           "--training.steps", "500", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
           "--checkpoint.enable", "--checkpoint.interval", "1000", "--data.path", corpus[0], "--data.val_path", corpus[1]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "train step      3" in line:
            proc.send_signal(sig)  # the launcher forwards it to torchrun, which forwards it to the workers
            break
    lines += proc.stdout.readlines()
    rc = proc.wait(timeout=300)
    out = "".join(lines)
    assert rc == 0, out[-3000:]
    assert "preempted: stopped after step" in out
    saved = [d for d in os.listdir(tmp_path / "checkpoint") if d.startswith("step-") and not d.endswith(".tmp")]
    assert len(saved) == 1 and 3 <= int(saved[0].split("-")[1]) < 500
    assert out.rstrip().endswith("run the same command to resume")
