"""No process outlives its run: torchrun follows the launcher and the workers follow torchrun
(titanlike/process/lifeline.py). A SIGKILL of the launcher's process group, or of torchrun alone, ends the
whole run with a save (the inner levels get SIGTERM, as in a preemption), and the run folder's lock
goes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, _env
from test_interrupt import complete_checkpoints, wait_for
from titanlike import fs
from titanlike.process import lifeline


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent (which is gone, or the test's Popen)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def start(dump: Path, corpus) -> tuple[subprocess.Popen, Path]:
    """`setsid ./run_train.sh` over two ranks, training far longer than the test waits."""
    log = dump.parent / f"{dump.name}.log"
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), "--training.device", "cpu",
           "--training.steps", "100000", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
           "--validation.enable", "false", "--checkpoint.interval", "100000", "--data.path", corpus[0]]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=dict(_env(), NGPU="2"), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["launcher group", "torchrun"])
def test_a_killed_launcher_or_torchrun_takes_the_run_with_it(tmp_path, corpus, killed):
    dump = tmp_path / "run"
    proc, log = start(dump, corpus)
    run: list[int] = []
    try:
        wait_for("train step      3", proc, log)
        (torchrun,) = children(proc.pid)
        workers = children(torchrun)
        run = [torchrun, *workers]
        assert len(workers) == 2, workers
        if killed == "launcher group":
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher; torchrun has a group of its own
        else:
            os.kill(torchrun, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 120
        while any(alive(p) for p in run):
            assert time.monotonic() < deadline, f"still running after the kill:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        for pid in [*run, *(descendants(proc.pid) if proc.poll() is None else [])]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    out = log.read_text()
    # The workers stopped as on a preemption: the step in flight finished and was saved.
    assert "preempted: stopped after step" in out, out[-3000:]
    assert complete_checkpoints(dump), out[-3000:]
    fs.FolderLock(str(dump), "job.dump_folder").check_free()  # the next run may take the folder


FOLLOWER = ("from titanlike.process import lifeline; import time; print(lifeline.follow_torchrun(), flush=True); "
            "time.sleep(60)")


def test_a_worker_ends_with_torchrun_and_a_top_level_run_does_not():
    """A worker (TORCHELASTIC_RUN_ID set) gets SIGTERM when its parent ends; a process outside torchrun
    (one process, or the launcher itself) follows nothing, so it outlives a closed terminal under nohup."""
    env = {k: v for k, v in _env().items() if k not in ("TORCHELASTIC_RUN_ID", lifeline.AGENT_PID_ENV)}
    # The parent: a shell that starts the follower in the background, says its pid and waits.
    for worker, expected in ((True, signal.SIGTERM), (False, None)):
        follower_env = dict(env, TORCHELASTIC_RUN_ID="test") if worker else env
        parent = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{FOLLOWER}" & echo $!; wait'],
                                  env=follower_env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert parent.stdout is not None
        follower = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == str(worker)  # it asked to follow (or not) by now
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + (10 if worker else 1)  # a top-level run: alive a second later
        while alive(follower) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            if expected is None:
                assert alive(follower), "a top-level run ended with its parent"
            else:
                assert not alive(follower), "a worker outlived its parent"
        finally:
            if alive(follower):
                os.kill(follower, signal.SIGKILL)


def test_a_worker_orphaned_before_it_asked_to_follow_stops_at_once():
    """The kernel only signals a parent's death after the request: a worker whose torchrun had already
    gone (its parent is not the pid torchrun exported) takes the SIGTERM at once."""
    env = dict(_env(), TORCHELASTIC_RUN_ID="test", **{lifeline.AGENT_PID_ENV: "1"})  # not its parent
    proc = subprocess.run([sys.executable, "-c", FOLLOWER], env=env, capture_output=True, text=True, timeout=30,
                          cwd=ROOT)
    assert proc.returncode == -signal.SIGTERM, proc


HELPER = ("import os, time; from titanlike.process import lifeline; print(lifeline.end_with({parent}), flush=True); "
          "time.sleep(60)")


def test_a_helper_process_ends_the_moment_its_parent_is_killed():
    """lifeline.end_with (data-loader and tokenizing workers): a SIGKILL of the parent takes the helper with it
    at once (torch's loader workers, left to their own check, outlived a killed trainer by about 6 s); a helper
    whose parent was gone before it asked ends at once too."""
    parent = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{HELPER.format(parent="os.getppid()")}" '
                               f'& echo $!; wait'], env=_env(), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert parent.stdout is not None
    helper = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "True"  # the kernel took the request
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 1
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(helper), "a helper outlived its killed parent"
    finally:
        if alive(helper):
            os.kill(helper, signal.SIGKILL)
    orphan = subprocess.run([sys.executable, "-c", HELPER.format(parent=1)], env=_env(), capture_output=True,
                            text=True, timeout=30, cwd=ROOT)
    assert orphan.returncode == -signal.SIGKILL, orphan


STOPPED_HELPER = """
import multiprocessing, os, sys, time
from titanlike.process import lifeline

def helper(parent):
    lifeline.ignore_stops(parent)
    print(os.getpid(), flush=True)
    time.sleep(60)

with lifeline.signals_held(lifeline.STOP_SIGNALS):
    process = multiprocessing.get_context("fork").Process(target=helper, args=(os.getpid(),), daemon=True)
    process.start()
sys.stdin.readline()
process.terminate()  # how multiprocessing (at exit) and torch end a worker that did not stop when told
process.join(10)
print(process.exitcode, flush=True)
"""


def test_a_helper_ignores_the_stops_of_others_and_ends_on_its_parents_sigterm():
    """lifeline.ignore_stops (data-loader workers): a stop from anyone but its parent (a group's signal, a
    scheduler's to every process) leaves the helper serving the trainer; its parent's SIGTERM ends it, exit
    0, as torch's own handler did (ignoring that too would hang the trainer's exit, which joins its workers)."""
    parent = subprocess.Popen([sys.executable, "-c", STOPPED_HELPER], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert parent.stdin is not None and parent.stdout is not None
    helper = int(parent.stdout.readline())
    try:
        for sig in lifeline.STOP_SIGNALS:
            os.kill(helper, sig)
        time.sleep(0.3)
        assert alive(helper), "a helper died of a stop meant for the trainer"
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "0"
        assert parent.wait(timeout=10) == 0
    finally:
        if alive(helper):
            os.kill(helper, signal.SIGKILL)
        parent.kill()


@pytest.mark.slow
def test_the_data_loaders_workers_end_with_a_killed_trainer(tmp_path, corpus):
    """One process with two loader workers, killed outright: its workers are gone within a second."""
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "titanlike.train", "--job.dump_folder", str(tmp_path / "run"), "--training.device",
           "cpu", "--training.steps", "100000", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
           "--validation.enable", "false", "--checkpoint.enable", "false", "--data.path", corpus[0],
           "--data.num_workers", "2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    workers: list[int] = []
    try:
        wait_for("train step      3", proc, log)
        workers = children(proc.pid)
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 1
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(alive(p) for p in workers), "loader workers outlived the killed trainer"
    finally:
        for pid in [*workers, proc.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
